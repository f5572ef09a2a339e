"""The side streams units arrive and gradients leave on, and the events that order them (nothing
on the CPU).

[Note: gather stream]
A unit's flat buffer is allocated and filled on the gather stream (host-to-device copy of this
rank's shard, then the all-gather), and an event is recorded after it. At the unit's need the
compute stream waits on that event, and ``record_stream`` marks the buffer as read by the compute
stream, so that once it is released the caching allocator does not hand its memory to the gather
stream's next allocation before the compute stream has finished reading it. New weights that the
CPU worker wrote on the device are waited for the same way (the event after the update).

[Note: offload stream]
A unit's gradient is produced on the compute stream. Reducing it and copying this rank's shard
to pinned DRAM run on the offload stream, after an event that marks the gradient complete, so
the next unit's backward kernels do not wait behind the copy. The tensors involved were allocated
on the compute stream; ``record_stream`` keeps the caching allocator from handing their memory to
the compute stream's next allocation until the offload stream is done with them. The CPU worker
waits on the event recorded after the copy before it reads the landed shard.
"""
from __future__ import annotations

import contextlib

import torch


class Streams:
    def __init__(self, device: torch.device):
        self.device = device
        cuda = device.type == "cuda"
        self.gather = torch.cuda.Stream(device) if cuda else None
        self.offload = torch.cuda.Stream(device) if cuda else None

    @contextlib.contextmanager
    def on_gather(self):
        """Run the body on the gather stream (see [Note: gather stream])."""
        if self.gather is None:
            yield
            return
        with torch.cuda.stream(self.gather):
            yield

    def gather_after(self, event: torch.cuda.Event | None) -> None:
        """Later gathers wait for ``event`` (device work that wrote the weights they read)."""
        if event is not None:
            self.gather.wait_event(event)

    @contextlib.contextmanager
    def on_offload(self):
        """Run the body on the offload stream, after all work queued so far on the current one."""
        if self.offload is None:
            yield
            return
        self.offload.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.offload):
            yield

    def keep_for_offload(self, *tensors: torch.Tensor) -> None:
        if self.offload is not None:
            for tensor in tensors:
                tensor.record_stream(self.offload)

    def record(self) -> torch.cuda.Event | None:
        """An event after the work queued so far on the current stream (None on the CPU)."""
        if self.offload is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event
