"""The longest sequence a batch fits, for each tier the activations can take (``tiered plan
--batch B --seq S``'s line "longest sequence at batch B"; issue 34, item 3).

[Note: the longest sequence]
What a forward keeps for backward grows with its tokens linearly where attention runs as a
fused kernel (its inputs, output and a logsumexp a row are kept, not the S x S weights), as it
is counted for a GPU (activations.py): two counts, at S and 2S tokens a sequence, give the bytes
a token adds and the rest, and each tier's longest sequence solves a linear bound:
- ``hbm``: the plan's HBM, the activations and the re-plan's margin within the HBM budget.
- ``dram``: the activations within the DRAM tier's room beside the plan (the activations' block,
  ``activations.dram_bytes``, sized to hold them), and on the device what backward holds of one
  unit at a time: its saved tensors copied back, or under checkpointing its recomputation, at
  most its forward's without checkpointing (counted for the whole model and shared out evenly
  over its units, which for repeated blocks is each block's).
Each length is rounded down to a multiple of ``TOKEN_STEP``. On a CPU device both tiers are the
same memory, so the line is given for a GPU only.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.sizes import format_size

TOKEN_STEP = 256
"""Lengths are said in multiples of this many tokens."""


@dataclass(frozen=True)
class Growth:
    """Bytes that grow linearly with the tokens of a sequence: ``fixed + per_token * tokens``."""

    fixed: float
    per_token: float

    @classmethod
    def through(cls, tokens: int, at_tokens: int, at_twice: int) -> "Growth":
        """The line through the counts at ``tokens`` and ``2 * tokens`` tokens a sequence."""
        per_token = (at_twice - at_tokens) / tokens
        return cls(at_tokens - per_token * tokens, per_token)

    def shared(self, parts: int) -> "Growth":
        return Growth(self.fixed / parts, self.per_token / parts)

    def at(self, tokens: int) -> int:
        return int(self.fixed + self.per_token * tokens)

    def most_tokens_within(self, room: int) -> int:
        """The most tokens (a multiple of TOKEN_STEP) whose bytes fit ``room``; 0 if none."""
        if self.per_token <= 0:
            raise ValueError("activations that do not grow with the tokens have no longest "
                             "sequence")
        tokens = int((room - self.fixed) // self.per_token)
        return max(0, tokens - tokens % TOKEN_STEP)


@dataclass(frozen=True)
class SequenceFit:
    """The longest sequence of ``batch`` sequences whose activations fit, per activation tier
    (see [Note: the longest sequence])."""

    batch: int
    on_device: int
    """Tokens a sequence with ``activations.tier: hbm``."""
    in_dram: int | None
    """Tokens a sequence with ``activations.tier: dram``; None without a DRAM budget."""
    dram_bytes: int | None
    """The activations' DRAM block that length needs (``activations.dram_bytes``)."""
    copies_s: float | None
    """Seconds a step of copies out and back at that length, at the node's pinned rates (they
    overlap the compute); None without rates."""

    def line(self) -> str:
        line = (f"longest sequence at batch {self.batch}: {self.on_device:,} tokens with "
                f"activations in hbm")
        if self.in_dram is not None and self.dram_bytes is not None:
            line += (f", {self.in_dram:,} in dram (activations.dram_bytes: "
                     f"{format_size(self.dram_bytes)}")
            if self.copies_s is not None:
                line += f"; {self.copies_s:.3g} s a step of copies beside the compute"
            line += ")"
        return line


def longest_sequences(batch: int, saved: Growth, one_unit: Growth, hbm_room: int,
                      dram_room: int | None, pinned_gbps: tuple[float, float] | None
                      ) -> SequenceFit:
    """``saved``: what the batch's forward keeps, as its tokens grow; ``one_unit``: what the
    device holds of one unit in backward; ``hbm_room``: the HBM budget less the plan's HBM and
    the margin; ``dram_room``: the DRAM budget less the plan's DRAM (None: no budget);
    ``pinned_gbps``: the node's device-to-host and host-to-device rates, GB/s."""
    on_device = saved.most_tokens_within(hbm_room)
    if dram_room is None:
        return SequenceFit(batch, on_device, None, None, None)
    in_dram = min(saved.most_tokens_within(dram_room), one_unit.most_tokens_within(hbm_room))
    dram_bytes = saved.at(in_dram)
    copies = None
    if pinned_gbps is not None:
        out_gbps, back_gbps = pinned_gbps
        copies = dram_bytes / (out_gbps * 1e9) + dram_bytes / (back_gbps * 1e9)
    return SequenceFit(batch, on_device, in_dram, dram_bytes, copies)
