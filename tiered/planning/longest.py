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
- ``nvme`` (where the policy has an NVMe path): the DRAM room as a block (less the slots the
  file's bytes pass through), the rest in the file (``activations.nvme_bytes``) within the NVMe
  budget beside the plan's files, and on the device one unit's share as with ``dram``. Without ``nvme.budget`` the drive's space is not
  known (plan_model's note): the device's share alone bounds it, and the line says so. Its
  seconds are the file written and read back once a step at the node's NVMe rates.
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
    on_nvme: int | None = None
    """Tokens a sequence with ``activations.tier: nvme``; None without an NVMe path."""
    nvme_bytes: int | None = None
    """The activations' file that length needs (``activations.nvme_bytes``), beside a DRAM
    block of ``nvme_block``."""
    nvme_block: int | None = None
    """The DRAM block beside the file (``activations.dram_bytes``: the DRAM room less the
    slots, or what the length keeps where that is less)."""
    nvme_s: float | None = None
    """Seconds a step of writing the file and reading it back at the node's NVMe rates; None
    without rates."""
    nvme_budgeted: bool = False
    """Whether ``nvme.budget`` bounded the file (else the device's share alone did)."""

    def line(self) -> str:
        line = (f"longest sequence at batch {self.batch}: {self.on_device:,} tokens with "
                f"activations in hbm")
        if self.in_dram is not None and self.dram_bytes is not None:
            line += (f", {self.in_dram:,} in dram (activations.dram_bytes: "
                     f"{format_size(self.dram_bytes)}")
            if self.copies_s is not None:
                line += f"; {self.copies_s:.3g} s a step of copies beside the compute"
            line += ")"
        if self.on_nvme is not None and self.nvme_bytes is not None:
            line += (f", {self.on_nvme:,} in nvme (activations.dram_bytes: "
                     f"{format_size(self.nvme_block or 0)}, nvme_bytes: "
                     f"{format_size(self.nvme_bytes)}")
            if not self.nvme_budgeted:
                line += "; the drive's space not counted without nvme.budget"
            if self.nvme_s is not None:
                line += f"; {self.nvme_s:.3g} s a step of NVMe writes and reads"
            line += ")"
        return line


@dataclass(frozen=True)
class NvmeRoom:
    """What the drive offers the activations (see [Note: the longest sequence])."""

    room: int | None
    """The NVMe budget less the plan's files; None: the drive's space is not known."""
    gbps: tuple[float, float] | None
    """The node's NVMe write and read rates, GB/s (None: not measured)."""
    slots: int
    """The DRAM the slots the file's bytes pass through take (plan.activation_slots), which
    the block leaves them."""


def longest_sequences(batch: int, saved: Growth, one_unit: Growth, hbm_room: int,
                      dram_room: int | None, pinned_gbps: tuple[float, float] | None,
                      nvme: NvmeRoom | None = None) -> SequenceFit:
    """``saved``: what the batch's forward keeps, as its tokens grow; ``one_unit``: what the
    device holds of one unit in backward; ``hbm_room``: the HBM budget less the plan's HBM and
    the margin; ``dram_room``: the DRAM budget less the plan's DRAM (None: no budget);
    ``pinned_gbps``: the node's device-to-host and host-to-device rates, GB/s; ``nvme``: the
    drive's room, where the policy has an NVMe path."""
    on_device = saved.most_tokens_within(hbm_room)
    device_share = one_unit.most_tokens_within(hbm_room)
    in_dram = dram_bytes = copies = None
    if dram_room is not None:
        in_dram = min(saved.most_tokens_within(dram_room), device_share)
        dram_bytes = saved.at(in_dram)
        if pinned_gbps is not None:
            out_gbps, back_gbps = pinned_gbps
            copies = dram_bytes / (out_gbps * 1e9) + dram_bytes / (back_gbps * 1e9)
    if nvme is None:
        return SequenceFit(batch, on_device, in_dram, dram_bytes, copies)
    block = max(0, (dram_room or 0) - nvme.slots)
    on_nvme = (device_share if nvme.room is None
               else min(device_share, saved.most_tokens_within(block + nvme.room)))
    block = min(block, saved.at(on_nvme))  # what the length fills of the room
    file = saved.at(on_nvme) - block
    seconds = (None if nvme.gbps is None
               else file / (nvme.gbps[0] * 1e9) + file / (nvme.gbps[1] * 1e9))
    return SequenceFit(batch, on_device, in_dram, dram_bytes, copies, on_nvme, file, block,
                       seconds, nvme.room is not None)
