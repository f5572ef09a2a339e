"""The host's side of an update: each unit stepped where its optimizer states live, its new
weights written to the weights' tier, its gradient buffer handed back.

States in HBM or DRAM are stepped in place; a run of units whose states are on NVMe streams
through DRAM (stream.py). Either way the kernel sees one piece at a time (a whole resident shard
is one piece), reading that piece's gradient and writing that piece's new weights, once per run
of one param group in it (groups.py); a unit's step count advances once, before its first piece.
Compact states (optimizer.moments, optimizer.master: optim/compact.py) are stepped a piece at a
time with all its runs at once, with the unit's random stream of that step; where the bf16
weights are the master, the kernel reads them from the unit's current weights.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..core.timeline import SpanTimer
from ..device import Accelerator
from ..placement.manager import TierManager
from ..placement.plan import OPTIMIZER_STATES, StateKind
from ..policy.config import OptimizerPolicy
from ..policy.kinds import MasterDtype, MomentsDtype
from .adamw import AdamWHyper, OnePassAdamW, _one_pass_scalars, adamw_step
from .compact import Run, compact_step, stream_key
from .groups import FROZEN, GroupRange
from .stream import Piece, StateStream


class UnitStepper:
    def __init__(self, manager: TierManager, gradients, names: list[str],
                 ranges: list[tuple[GroupRange, ...]], one_pass: OnePassAdamW | None,
                 optimizer: OptimizerPolicy, timeline: SpanTimer, accelerator: Accelerator):
        self.manager = manager
        self.accelerator = accelerator
        self.gradients = gradients
        """What holds the gradients it reads: the host (``read``, and ``consumed`` once read)."""
        self.names = names
        self.ranges = ranges
        """Per unit: its shard's runs of one param group (groups.shard_ranges)."""
        self.one_pass = one_pass
        """Mixed precision on the CPU (see adamw.OnePassAdamW); else torch's fused kernel."""
        self.timeline = timeline
        self.compact = (optimizer.moments is not MomentsDtype.FP32
                        or optimizer.master is MasterDtype.BF16)
        """Compact states: stepped by compact.compact_step."""
        self.rounding_seed = optimizer.rounding_seed
        self.steps = [torch.zeros((), dtype=torch.float32,
                                  device="cpu" if self.compact else self.device(unit))
                      for unit in range(len(names))]
        """Per unit: the number of its last step (what AdamW's bias correction reads), where
        the fused kernel reads it: where the unit is stepped (it follows the unit there when a
        re-plan moves it). The compact step makes its scalars on the host, so its counts stay
        there: reading one on a GPU would wait for the device once a unit."""
        # A frozen unit's masters may be on NVMe too, but only trained units are streamed.
        has_nvme_states = any(manager.nvme_file(i, StateKind.EXP_AVG) is not None
                              for i in range(len(names)))
        self.stream = (StateStream(manager, optimizer.sub_group_size) if has_nvme_states
                       else None)

    def step(self, units: list[int], hypers: tuple[AdamWHyper, ...], divisor: float,
             into_next: bool, on_unit: Callable[[int], None] = lambda unit: None) -> None:
        """Step ``units`` in this order, each run of param group g with ``hypers[g]``;
        ``on_unit(unit)`` after each one's weights are written."""
        kind = StateKind.PARAM_NEXT if into_next else StateKind.PARAM
        divisors: dict[torch.device, torch.Tensor | None] = {}

        def divisor_on(device: torch.device) -> torch.Tensor | None:
            """The fused kernel's divisor, made once per device and step."""
            if device not in divisors:
                divisors[device] = (None if divisor == 1.0 else
                                    torch.tensor(divisor, dtype=torch.float32, device=device))
            return divisors[device]

        def step_piece(piece: Piece, master, exp_avg, exp_avg_sq) -> None:
            if piece.start == 0:
                if not self.compact and self.steps[piece.unit].device != exp_avg.device:
                    # the unit was moved by a re-plan
                    self.steps[piece.unit] = self.steps[piece.unit].to(exp_avg.device)
                self.steps[piece.unit] += 1
            with self.timeline.span(f"adamw {self.names[piece.unit]}", "cpu",
                                    {"params": piece.numel}):
                self._kernel(piece, master, exp_avg, exp_avg_sq, hypers, divisor, divisor_on,
                             kind)

        def unit_done(unit: int) -> None:
            on_device = self.on_device(unit)
            if not on_device:  # read: the next gradient may be copied in while we write back
                self.gradients.consumed(unit)
            with self.timeline.span(f"write back {self.names[unit]}", "cpu"):
                self.manager.store(unit, kind, self._weights(unit, kind))
            if on_device:
                # Its kernels were queued on this thread's own stream (host.py): its weights
                # count as written, and its gradient buffer as read, once they have run (a
                # gather reads the weights on another stream, the next gradient is copied in
                # on another).
                self.accelerator.current_stream().synchronize()
                self.gradients.consumed(unit)
            on_unit(unit)

        streamed: list[int] = []
        for unit in [*units, None]:
            if unit is not None and self.manager.nvme_file(unit, StateKind.EXP_AVG):
                streamed.append(unit)
                continue
            if streamed:
                assert self.stream is not None  # made where any unit's states are on NVMe
                self.stream.run(streamed, step_piece, unit_done)
                streamed = []
            if unit is not None:
                numel = self.manager.shards[(unit, StateKind.PARAM)].numel
                states = [self.manager.load(unit, state) if self.manager.has(unit, state)
                          else None for state in OPTIMIZER_STATES]
                step_piece(Piece(unit, 0, numel, last=True), *states)  # in place: nothing moves
                unit_done(unit)

    def _kernel(self, piece: Piece, master, exp_avg, exp_avg_sq,
                hypers: tuple[AdamWHyper, ...], divisor: float, divisor_on,
                kind: StateKind) -> None:
        grads = self.gradients.read(piece.unit)
        weights = self._weights(piece.unit, kind)
        if self.compact:
            self._compact_kernel(piece, master, exp_avg, exp_avg_sq, grads, weights, hypers,
                                 divisor)
            return
        one_pass = self._one_pass_for(piece.unit)
        # Frozen runs are never stepped, and weights written in place keep them; a staging
        # buffer holds another unit's values there, so they are filled from the masters.
        fill_frozen = not self.manager.param_in_place(piece.unit, kind, one_pass is not None)
        step = self.steps[piece.unit]
        end = piece.start + piece.numel
        for part in self.ranges[piece.unit]:
            start, stop = max(part.start, piece.start), min(part.stop, end)
            if start >= stop:
                continue
            here = slice(start - piece.start, stop - piece.start)  # the piece's own buffers
            grad, new = grads[start:stop], weights[start:stop]
            if part.group is FROZEN:
                if fill_frozen:
                    new.copy_(master[here])
                continue
            hyper = hypers[part.group]
            if one_pass is not None:
                one_pass.step(master[here], grad, exp_avg[here], exp_avg_sq[here], new, step,
                              hyper, divisor)
            else:
                adamw_step(master[here], grad.float(), exp_avg[here], exp_avg_sq[here], step,
                           hyper, divisor_on(master.device))
                new.copy_(master[here])

    def _compact_kernel(self, piece: Piece, master, exp_avg, exp_avg_sq, grads, weights,
                        hypers: tuple[AdamWHyper, ...], divisor: float) -> None:
        """Step the piece's compact states, all its runs in one call."""
        unit, end = piece.unit, piece.start + piece.numel
        step = float(self.steps[unit])
        runs = [Run(max(part.start, piece.start) - piece.start,
                    min(part.stop, end) - piece.start,
                    None if part.group is FROZEN
                    else _one_pass_scalars(hypers[part.group], step, divisor))
                for part in self.ranges[unit] if max(part.start, piece.start) < min(part.stop, end)]
        here = slice(piece.start, end)
        # Without masters the current weights are read (PARAM: made current before an update
        # is sent, also a delayed one, which writes PARAM_NEXT).
        weights_in = (weights[here] if master is not None
                      else self.manager.load(unit, StateKind.PARAM)[here])
        compact_step(master, weights_in, grads[here], exp_avg, exp_avg_sq, weights[here],
                     piece.start, runs, stream_key(self.rounding_seed, unit, int(step)))

    def _one_pass_for(self, unit: int) -> OnePassAdamW | None:
        """The one-pass kernel for a unit stepped on the CPU under mixed precision, else None
        (torch's fused kernel)."""
        return self.one_pass if self.device(unit).type == "cpu" else None

    def on_device(self, unit: int) -> bool:
        """Whether ``unit`` is stepped in device memory, by work queued on this thread's
        stream (under ``tier: auto``, a unit the plan keeps in HBM, on a device with streams)."""
        return self.accelerator.has_streams and self.manager.optimizer_in_hbm(unit)

    def device(self, unit: int) -> torch.device:
        """Where ``unit`` is stepped: the CPU, or under ``tier: auto`` perhaps the GPU."""
        return self.manager.optimizer_device(unit)

    def _weights(self, unit: int, kind: StateKind) -> torch.Tensor:
        """Where this unit's new weights are written (then stored to their tier); the one-pass
        and compact kernels write them where they step. Weights that are the master beside
        moments streamed from NVMe wait in staging until the moments' new versions commit, so
        that a failed write leaves weights and moments of the same step."""
        on_cpu = self.device(unit).type == "cpu"
        staged = (self.compact and not self.manager.has(unit, StateKind.MASTER)
                  and self.manager.nvme_file(unit, StateKind.EXP_AVG) is not None)
        return self.manager.param_target(unit, kind, on_cpu and (
            self.compact or self._one_pass_for(unit) is not None), staged)
