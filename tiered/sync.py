"""Waiting for device work: the one rule every thread follows before it uses a tensor that work
queued on another stream finishes (a gradient's copy off the device, a gathered unit)."""
from __future__ import annotations

import torch


def wait_for(event: torch.cuda.Event | None, tensor: torch.Tensor) -> None:
    """Make ``tensor``, finished by the work before ``event``, safe to use on this thread: the
    current stream waits for device tensors, the thread itself waits for host ones."""
    if event is None:
        return
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).wait_event(event)
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
    else:
        event.synchronize()
