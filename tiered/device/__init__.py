"""What the engine asks of its compute device, behind one seam: streams and events and their
ordering, ``record_stream``, synchronizing, memory statistics and host-memory registration.

Three devices answer it: CUDA (``CudaAccelerator``), the plain CPU (``CpuAccelerator``: no
streams, nothing to order) and a simulated accelerator (``sim.SimAccelerator``: CUDA's streams
and ordering rules over CPU tensors, checked on every operator), so that every branch a GPU
takes runs, and is checked, where there is no GPU. ``TIERED_DEVICE=sim`` chooses it.

[Note: what the simulated device does not run]
Under ``TIERED_DEVICE=sim`` the engine takes a GPU's branches (tests/device/test_sim_engine.py) and
the simulator checks every operator of the training thread. What stays CUDA's alone, and what
covers it instead:
- ``CudaAccelerator.register_host_memory`` (cudaHostRegister: the driver's, nothing to
  simulate); the box's ``-m gpu`` tests run it with every DRAM slab.
- The CPU worker's own thread is not tracked: the CPU plays device and host memory at once,
  and only what the tiers register tells them apart, which the worker's temporaries are not.
  Its device work is ordered by ``synchronize()`` waiting on its stream
  (tests/service/test_service_streams.py, on the simulator by hand) and its reads of landed gradients
  by ``wait_for``; the box's sanitizer stage (bench/gpu_check.sh) checks both on a GPU.
- Timing: the step probe's and the timeline's device events (``enable_timing``), and the
  re-plan's predicted step, which needs the node's PCIe rates (``tiered node`` on a GPU); the
  simulator's events carry no time. tests/device/test_gpu.py's re-plan test runs them.
- Memory statistics (``max_memory_allocated``, the device's capacity): the CPU's allocator
  keeps none; the simulated device answers None as the CPU does.
- NCCL, device selection from LOCAL_RANK, CUDA's RNG state in checkpoints, and the one copy
  each way of weights built on a GPU (engine/build.py): tests/device/test_gpu.py,
  test_resume_rng.py's cuda case and test_pretrained.py's ``test_weights_into_states_on_cuda``.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from ..core.errors import PolicyError
from .seam import Accelerator, EventLike, StreamLike
from .sim import SimAccelerator

DEVICE_ENV = "TIERED_DEVICE"
"""``sim``: train on the simulated accelerator (the CPU computes; streams are checked)."""

__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "EventLike", "StreamLike",
           "accelerator_for", "host_device", "simulated_device", "wait_for"]


def wait_for(accelerator: Accelerator, event: EventLike | None, tensor: torch.Tensor,
             on_device: bool) -> None:
    """Make ``tensor``, finished by the work before ``event``, safe to use on this thread: for
    device memory the current stream waits (and is named as a user of it, for the caching
    allocator), for host memory the thread itself waits. The one rule every thread follows
    before it uses what work queued on another stream finishes (a gradient's copy off the
    device, a gathered unit)."""
    if event is None:
        return
    if on_device:
        stream = accelerator.current_stream()
        stream.wait_event(event)
        accelerator.record_stream(tensor, stream)
    else:
        event.synchronize()


class CudaAccelerator:
    name = "cuda"
    has_streams = True

    def __init__(self, device: torch.device):
        self.device = device

    def Stream(self, name: str = "") -> torch.cuda.Stream:  # noqa: N802
        """A new stream (``name`` names it in the simulated device's reports only)."""
        return torch.cuda.Stream(self.device)

    def Event(self) -> torch.cuda.Event:  # noqa: N802
        return torch.cuda.Event()

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def stream(self, stream: StreamLike) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(_cuda_stream(stream))

    def set_stream(self, stream: StreamLike) -> None:
        """This thread's current device and stream from here on."""
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(_cuda_stream(stream))

    def release_storage(self, tensor: torch.Tensor) -> None:
        """Give the memory of ``tensor``'s storage back to the caching allocator (it waits
        for the streams ``record_stream`` named)."""
        tensor.untyped_storage().resize_(0)

    def record_stream(self, tensor: torch.Tensor, stream: StreamLike) -> None:
        tensor.record_stream(_cuda_stream(stream))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def register_host_memory(self, slab: torch.Tensor) -> None:
        """Page-lock ``slab`` (host memory) for the device's copies: what the driver alone can
        do, so the one call no simulation runs (the box's tests cover it). Raises MemoryError
        where the driver refuses."""
        status = int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.nbytes, 0))
        if status != 0:
            raise MemoryError(f"cudaHostRegister could not pin {slab.nbytes} bytes of host "
                              f"memory (CUDA error {status}); lower dram.budget")

    def unregister_host_memory(self, slab: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())


def _cuda_stream(stream: StreamLike) -> torch.cuda.Stream:
    """``stream`` as CUDA's: each accelerator takes only the streams it made."""
    assert isinstance(stream, torch.cuda.Stream), f"not a CUDA stream: {stream!r}"
    return stream


class CpuAccelerator:
    """The CPU playing the device: every operator completes before the next, so there is
    nothing to order; the engine takes its stream-less branches."""
    name = "cpu"
    has_streams = False

    def Stream(self, name: str = ""):  # noqa: N802
        raise TypeError("the CPU has no streams (has_streams is False)")

    def Event(self):  # noqa: N802
        raise TypeError("the CPU has no events (has_streams is False)")

    def current_stream(self):
        raise TypeError("the CPU has no streams (has_streams is False)")

    def stream(self, stream):
        return contextlib.nullcontext()

    def set_stream(self, stream) -> None:
        pass

    def release_storage(self, tensor: torch.Tensor) -> None:
        tensor.untyped_storage().resize_(0)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def max_memory_allocated(self) -> None:
        return None

    def register_host_memory(self, slab: torch.Tensor) -> None:
        pass  # the device's memory is the host's

    unregister_host_memory = register_host_memory


def host_device() -> Accelerator:
    """What pins host memory where no engine says: CUDA's current device where there is CUDA
    (a tool that copies to it: ``tiered node``, the benchmarks), else the plain CPU."""
    if torch.cuda.is_available():
        return CudaAccelerator(torch.device("cuda", torch.cuda.current_device()))
    return CpuAccelerator()


def accelerator_for(device: torch.device) -> Accelerator:
    """The device's accelerator: CUDA's for a CUDA device; for the CPU, the simulated one when
    ``TIERED_DEVICE=sim`` (one a process, as a GPU is one device however many engines use
    it), else the plain CPU."""
    if device.type == "cuda":
        return CudaAccelerator(device)
    chosen = os.environ.get(DEVICE_ENV, "")
    if chosen == "sim":
        return simulated_device()
    if chosen not in ("", "cpu", "cuda", "auto"):
        raise PolicyError(f"{DEVICE_ENV}={chosen!r} is not a device: use sim (the simulated "
                          f"accelerator), cpu or cuda, or leave it unset")
    return CpuAccelerator()


@functools.cache
def simulated_device() -> SimAccelerator:
    """This process's simulated accelerator."""
    return SimAccelerator()
