"""The side streams units arrive and gradients leave on, and the events that order them: the
device's (tiered/device), so CUDA's on a GPU, none on the plain CPU, and the simulated
accelerator's under ``TIERED_DEVICE=sim``, where the CPU takes every branch a GPU takes.

[Note: gather stream]
A unit's flat buffer is allocated and filled on the gather stream (host-to-device copy of this
rank's shard, then the all-gather), and an event is recorded after it. At the unit's need the
compute stream waits on that event, and ``record_stream`` marks the buffer as read by the compute
stream, so that once it is released the caching allocator does not hand its memory to the gather
stream's next allocation before the compute stream has finished reading it. New weights that the
CPU worker wrote on the device are waited for too: once the optimizer has drained the worker,
the gather stream waits for the work the worker queued on its own stream (optim/host.py).

[Note: offload stream]
A unit's gradient is produced on the compute stream. Reducing it and copying this rank's shard
to pinned DRAM run on the offload stream, after an event that marks the gradient complete, so
the next unit's backward kernels do not wait behind the copy. The tensors involved were allocated
on the compute stream; ``record_stream`` keeps the caching allocator from handing their memory to
the compute stream's next allocation until the offload stream is done with them. The CPU worker
waits on the event recorded after the copy before it reads the landed shard; for a host in the
node's service, which never touches the device, the trainer's sender thread waits on it before
the gradient's command leaves (service/remote.py).
"""
from __future__ import annotations

import contextlib

import torch

from ..device import Accelerator, EventLike, StreamLike


class Streams:
    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.gather: StreamLike | None = None
        self.offload: StreamLike | None = None
        if accelerator.has_streams:
            self.gather = gather = accelerator.Stream("the gather stream")
            self.offload = offload = accelerator.Stream("the offload stream")
            # What initialize queued on the compute stream (the weights it stored in HBM) comes
            # first: side streams wait on no stream unless told (torch makes them
            # non-blocking), and the first gather reads those weights.
            gather.wait_stream(accelerator.current_stream())
            offload.wait_stream(accelerator.current_stream())

    @contextlib.contextmanager
    def on_gather(self):
        """Run the body on the gather stream (see [Note: gather stream])."""
        if self.gather is None:
            yield
            return
        with self.accelerator.stream(self.gather):
            yield

    def gather_after(self, stream: StreamLike | None) -> None:
        """Later gathers wait for the work queued so far on ``stream`` (device work that wrote
        the weights they read; None: there is none)."""
        if stream is not None:
            assert self.gather is not None  # device work exists only where streams do
            self.gather.wait_stream(stream)

    @contextlib.contextmanager
    def on_offload(self):
        """Run the body on the offload stream, after all work queued so far on the current one."""
        if self.offload is None:
            yield
            return
        self.offload.wait_stream(self.accelerator.current_stream())
        with self.accelerator.stream(self.offload):
            yield

    def keep_for_offload(self, *tensors: torch.Tensor) -> None:
        if self.offload is not None:
            for tensor in tensors:
                self.accelerator.record_stream(tensor, self.offload)

    def record(self) -> EventLike | None:
        """An event after the work queued so far on the current stream (None on the CPU)."""
        if self.offload is None:
            return None
        event = self.accelerator.Event()
        event.record()
        return event
