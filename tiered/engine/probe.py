"""What each step measured, for the plan report's predicted-against-measured line (issue 20).

A step's compute is timed from its first forward (with grad) to the end of its last backward,
on the compute stream: CUDA events on a GPU, read one step later when they have long completed
(no synchronisation is added to the step), the host clock on the CPU. It includes the waits for
gathers, which are what the step sees. The step itself is host time from one
``optimizer.step()`` to the next.
"""
from __future__ import annotations

import time

import torch

from ..core.timeline import mark_now
from ..planning.activations import SavedBytes
from ..planning.report import StepMeasurement

SPANS_PER_UNIT = 64
"""A step with more spans than this per unit (32 forward-backward passes or more: backwards
without an optimizer.step(), or that many micro-batches) is not measured; its marks are dropped
rather than kept growing."""


class StepProbe:
    def __init__(self, device: torch.device, units: int):
        self.device = device
        self.units = units
        self._skipped = False
        """The step in progress outgrew SPANS_PER_UNIT: it is not measured."""
        self._forward = self._backward = None
        """Marks of the step in progress: its first forward, its last backward's end."""
        self._backwards = 0
        self._spans: list[tuple[int, int, object, object]] = []
        """The step in progress's unit spans: (unit, 0 forward or 1 backward, start, end)."""
        self._pending: tuple | None = None
        """A step ended whose device marks may not have completed yet."""
        self._last_step_ns: int | None = None
        self._steps = 0
        self._last: StepMeasurement | None = None
        self.saved = SavedBytes()
        """What the step's forwards keep for backward (the hooks count it: activations.py)."""
        self.saved_in_dram = SavedBytes()
        """What they saved into DRAM instead (activations.tier: dram, nvme or auto)."""
        self.saved_on_nvme = SavedBytes()
        """What they saved on the drive (activations.tier: nvme, past the DRAM block)."""
        self._backed = False
        """Whether a backward ended in the step in progress (measured or not)."""
        self.last_activations: int | None = None
        """What the forwards of the last step that ran a backward kept at most, also where the
        step was not measured (SPANS_PER_UNIT); None before one."""

    def mark(self):
        """A point in time on the current stream (timeline.mark_now: the timeline's marks
        too)."""
        return mark_now(self.device.type == "cuda")

    def forward_started(self) -> None:
        """A forward with grad starts (each of the step's: their activations count apart)."""
        for counter in (self.saved, self.saved_in_dram, self.saved_on_nvme):
            counter.start()
        if self._forward is None and not self._skipped:
            self._forward = self.mark()

    def backward_ended(self) -> None:
        self._backed = True
        if self._forward is not None:
            self._backward = self.mark()
            self._backwards += 1

    def unit_span(self, unit: int, backward: bool, start, end) -> None:
        """Unit ``unit``'s forward (or backward) ran from mark ``start`` to ``end`` (a unit's
        span holds the units nested in it)."""
        if start is None or self._forward is None or (not backward
                                                       and not torch.is_grad_enabled()):
            return  # an evaluation forward is no part of the training step
        if len(self._spans) >= SPANS_PER_UNIT * self.units:
            self._skipped, self._forward, self._backward, self._spans = True, None, None, []
            return
        self._spans.append((unit, int(backward), start, end))

    def step_taken(self) -> None:
        """``optimizer.step()``: the step in progress ends (measured if it ran a backward)."""
        now = time.perf_counter_ns()
        self._steps += 1
        self._resolve(wait=False)
        activations = self.saved.take_peak()
        in_dram = self.saved_in_dram.take_peak()
        on_nvme = self.saved_on_nvme.take_peak()
        if self._backed:
            self.last_activations = activations
        if self._backward is not None:
            step_s = None if self._last_step_ns is None else (now - self._last_step_ns) / 1e9
            self._pending = (self._steps, self._forward, self._backward, step_s, self._spans,
                             self._backwards, activations, in_dram, on_nvme)
        self._forward = self._backward = None
        self._backwards = 0
        self._spans = []
        self._skipped = False
        self._backed = False
        self._last_step_ns = now

    def last(self) -> StepMeasurement | None:
        """The latest step measured (waiting for its device marks if they are still queued)."""
        self._resolve(wait=True)
        return self._last

    def _resolve(self, wait: bool) -> None:
        if self._pending is None:
            return
        step, start, end, step_s, spans, backwards, saved, in_dram, on_nvme = self._pending
        ends = [end, *(span[3] for span in spans)]
        if not isinstance(end, int):
            if not wait and not all(event.query() for event in ends):
                return
            for event in ends:
                event.synchronize()
        seconds = [[0.0, 0.0] for _ in range(self.units)]
        for unit, backward, begin, finish in spans:
            seconds[unit][backward] += _elapsed(begin, finish)
        peak = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                else None)
        self._last = StepMeasurement(step, _elapsed(start, end), step_s, peak, backwards,
                                     tuple((f, b) for f, b in seconds), saved, in_dram,
                                     on_nvme)
        self._pending = None


def _elapsed(start, end) -> float:
    """Seconds from mark ``start`` to mark ``end`` (both completed)."""
    if isinstance(start, int):
        return (end - start) / 1e9
    return start.elapsed_time(end) / 1e3
