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

from ..plan_report import StepMeasurement


class StepProbe:
    def __init__(self, device: torch.device):
        self.device = device
        self._forward = self._backward = None
        """Marks of the step in progress: its first forward, its last backward's end."""
        self._pending: tuple[int, object, object, float | None] | None = None
        """A step ended whose device marks may not have completed yet."""
        self._last_step_ns: int | None = None
        self._steps = 0
        self._last: StepMeasurement | None = None

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def forward_started(self) -> None:
        if self._forward is None:
            self._forward = self._mark()

    def backward_ended(self) -> None:
        if self._forward is not None:
            self._backward = self._mark()

    def step_taken(self) -> None:
        """``optimizer.step()``: the step in progress ends (measured if it ran a backward)."""
        now = time.perf_counter_ns()
        self._steps += 1
        self._resolve(wait=False)
        if self._backward is not None:
            step_s = None if self._last_step_ns is None else (now - self._last_step_ns) / 1e9
            self._pending = (self._steps, self._forward, self._backward, step_s)
        self._forward = self._backward = None
        self._last_step_ns = now

    def last(self) -> StepMeasurement | None:
        """The latest step measured (waiting for its device marks if they are still queued)."""
        self._resolve(wait=True)
        return self._last

    def _resolve(self, wait: bool) -> None:
        if self._pending is None:
            return
        step, start, end, step_s = self._pending
        if isinstance(end, int):
            compute_s = (end - start) / 1e9
        else:
            if not wait and not end.query():
                return
            end.synchronize()
            compute_s = start.elapsed_time(end) / 1e3
        peak = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                else None)
        self._last = StepMeasurement(step, compute_s, step_s, peak)
        self._pending = None
