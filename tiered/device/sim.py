"""A simulated accelerator: CUDA's streams and events over CPU tensors, with CUDA's ordering rules
checked on every operator, so that what would race on a GPU fails a test on a CPU.

[Note: the simulated device's ordering model]
Work on a GPU runs on streams, each in its own order; two streams are ordered only by an event
(``stream.wait_event``, ``wait_stream``), and the host only by a synchronize (of the device, a
stream or an event). Here every operator runs at once, on the CPU, but is *attributed* to the
current stream of its thread (``SimAccelerator.stream``; a thread that is no stream's, such as
the CPU worker's, is the host). Each stream keeps a vector clock, what it has seen of every
stream: its own count of operators, and what waits gave it. An event records a copy of its
stream's clock; a wait merges one into the waiter's. Each storage remembers its last write and
the reads since, each with its stream, its count and where it was made. An access is ordered
after an earlier one when both are on one stream, or the accessing stream's clock has seen the
earlier one's count. Otherwise the access could run before, or beside, the earlier one on a GPU:
a write after an unordered read or write, or a read after an unordered write, is reported with
both sites, as PyTorch's CUDA sanitizer reports (``torch/cuda/_sanitizer.py``, which does the
same over real CUDA streams).

Two more of CUDA's rules hold here:
- Memory freed by its last tensor goes back to the caching allocator at once, for the next
  allocation on the stream it was allocated on; another stream that used it must be ordered
  before that stream's clock at the free, or have been named with ``record_stream`` (then the
  allocator waits for it). Else the next allocation may overwrite what that stream still reads.
- Waiting on an event that was never recorded does not wait on a GPU (it completes at once);
  here it is an error, since no code means that.

An operator whose tensors are all host memory (registered as the DRAM tier's slabs are, or made
by such an operator) runs on the host, whatever thread's, as a GPU's host runs it at once; work
a stream is given sees what the host did before (it was queued after). The host sees what a
stream did only through a synchronize.

Reads and writes are those of each operator's schema: arguments it mutates (``add_``, ``copy_``,
``out=``) are writes, other tensor arguments reads, and its results new writes. What no operator
touches (a native kernel's pointer arithmetic) is declared with ``host_reads``/``host_writes``.
"""
from __future__ import annotations

import itertools
import os
import threading
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.errors import TieredError
from .seam import StreamLike


class OrderingError(TieredError):
    """What would race on a GPU; the message names both sites."""


@dataclass(frozen=True)
class Site:
    """Where an access, a free or a wait was made: a stream, an operator and the caller."""
    stream: str
    what: str
    stack: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.what} on {self.stream}\n" + "".join(self.stack)


@dataclass(frozen=True)
class Access:
    stream: int
    count: int
    site: Site


@dataclass
class _Region:
    """Accesses of one span of a storage's bytes."""
    write: Access | None = None
    reads: list[Access] = field(default_factory=list)


@dataclass
class _Storage:
    allocated_on: int
    regions: dict[tuple[int, int], _Region] = field(default_factory=dict)
    """By the span of bytes accessed (a view's): a slab holds many shards, and a write to one
    does not touch the others. Older accesses of spans that a later one overlapped stay: the
    clocks are transitive, so whatever is ordered after the later one is after them too."""
    kept_for: set[int] = field(default_factory=set)
    """Streams named by ``record_stream``: the allocator waits for them before reuse."""

    def overlapping(self, span: tuple[int, int]) -> list[_Region]:
        return [region for (start, end), region in self.regions.items()
                if start < span[1] and span[0] < end]

    def accesses(self) -> list[Access]:
        return [access for region in self.regions.values()
                for access in [region.write, *region.reads] if access is not None]


class SimStream:
    """A stream of the simulated device (``torch.cuda.Stream``'s interface, as tiered uses it)."""

    def __init__(self, sim: "SimAccelerator", name: str):
        self._sim = sim
        self.id = next(sim._ids)
        self.name = name
        self.count = 0
        self.clock: dict[int, int] = {self.id: 0}
        sim._streams[self.id] = self

    def wait_event(self, event: "SimEvent") -> None:
        self._sim._wait(self, event)

    def wait_stream(self, other: "SimStream") -> None:
        with self._sim._lock:
            _merge(self.clock, other.clock)

    def synchronize(self) -> None:
        with self._sim._lock:
            _merge(self._sim.host.clock, self.clock)

    def record_event(self, event: "SimEvent | None" = None) -> "SimEvent":
        event = event or SimEvent(self._sim)
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<simulated stream {self.name}>"


class SimEvent:
    """An event of the simulated device (``torch.cuda.Event``'s interface)."""

    def __init__(self, sim: "SimAccelerator"):
        self._sim = sim
        self.clock: dict[int, int] | None = None
        """What its stream had seen when it was recorded; None until then."""

    def record(self, stream: SimStream | None = None) -> None:
        stream = stream or self._sim.current_stream()
        with self._sim._lock:
            self.clock = dict(stream.clock)

    def query(self) -> bool:
        """Recorded work completes at once here; the host learns it, as from a query that
        returned True on a GPU."""
        self.synchronize()
        return True

    def synchronize(self) -> None:
        if self.clock is not None:
            with self._sim._lock:
                _merge(self._sim.host.clock, self.clock)

    def wait(self, stream: SimStream | None = None) -> None:
        self._sim._wait(stream or self._sim.current_stream(), self)


class SimAccelerator:
    """The simulated device: its streams, its events and the checks (see [Note: the simulated
    device's ordering model]). ``check()`` raises what was found; so does leaving ``tracking()``."""

    name = "simulated"
    has_streams = True

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._local = threading.local()
        self._streams: dict[int, SimStream] = {}
        self.host = SimStream(self, "the host")
        self.default = SimStream(self, "the default stream")
        self._storages: dict[tuple[int, int], _Storage] = {}
        self._host_memory: set[tuple[int, int]] = set()
        """Storages registered as host memory (the DRAM tier's slabs) and what host-only
        operators made: see [Note: the simulated device's ordering model]."""
        self.errors: list[str] = []

    # -- streams, as torch.cuda offers them ---------------------------------------------------

    def Stream(self, name: str | None = None) -> SimStream:  # noqa: N802 (torch.cuda's name)
        return SimStream(self, name or f"stream {next(self._ids)}")

    def Event(self) -> SimEvent:  # noqa: N802
        return SimEvent(self)

    def current_stream(self) -> SimStream:
        return getattr(self._local, "stream", None) or (
            self.default if getattr(self._local, "device_thread", False) else self.host)

    def stream(self, stream: StreamLike) -> "_OnStream":
        return _OnStream(self, _sim_stream(stream))

    def set_stream(self, stream: StreamLike) -> None:
        """This thread's current stream from here on (torch.cuda.set_stream)."""
        self._local.stream = _sim_stream(stream)

    def synchronize(self) -> None:
        with self._lock:
            for stream in self._streams.values():
                _merge(self.host.clock, stream.clock)

    def max_memory_allocated(self) -> None:
        return None  # the CPU's allocator keeps no statistics

    def record_stream(self, tensor: torch.Tensor, stream: StreamLike) -> None:
        stream = _sim_stream(stream)
        with self._lock:
            storage = self._storages.get(_key(tensor))
            if storage is not None:
                storage.kept_for.add(stream.id)

    def register_host_memory(self, slab: torch.Tensor) -> None:
        """``slab`` is host memory (cudaHostRegister's, on a GPU): its allocation, which a
        tracked thread may have seen as a stream's, was the host's."""
        with self._lock:
            self._host_memory.add(_key(slab))
            storage = self._storages.get(_key(slab))
            if storage is not None:
                storage.allocated_on, storage.regions = self.host.id, {}

    def unregister_host_memory(self, slab: torch.Tensor) -> None:
        with self._lock:
            self._host_memory.discard(_key(slab))

    def release_storage(self, tensor: torch.Tensor) -> None:
        """Give ``tensor``'s storage's memory back (``resize_(0)``, as a released unit's): to
        the caching allocator, checked as a free is (see the note)."""
        self._freed(_key(tensor))
        tensor.untyped_storage().resize_(0)

    # -- what the engine declares ---------------------------------------------------------------

    def host_reads(self, *tensors: torch.Tensor, what: str = "a host read") -> None:
        self._access(self.host, [], list(tensors), what)

    def host_writes(self, *tensors: torch.Tensor, what: str = "a host write") -> None:
        self._access(self.host, list(tensors), [], what)

    def tracking(self, drives_device: bool = True) -> "_Tracking":
        """Attribute every operator of this thread to its current stream while it lasts: the
        default stream's unless a ``stream()`` is entered, or with ``drives_device=False`` (a
        CPU worker's thread) the host's."""
        return _Tracking(self, drives_device)

    def check(self) -> None:
        if self.errors:
            errors, self.errors = self.errors, []
            raise OrderingError(f"{len(errors)} access(es) would race on a GPU:\n\n"
                                + "\n\n".join(errors))

    # -- the model ------------------------------------------------------------------------------

    def _wait(self, stream: SimStream, event: SimEvent) -> None:
        with self._lock:
            if event.clock is None:
                self.errors.append(f"an event was waited on before it was recorded (on a GPU the "
                                   f"wait does nothing):\n{_site(stream, 'wait_event').describe()}")
                return
            _merge(stream.clock, event.clock)

    def _access(self, stream: SimStream, writes: list[torch.Tensor],
                reads: list[torch.Tensor], what: str,
                results: Sequence[torch.Tensor] = ()) -> None:
        with self._lock:
            if stream is not self.host:  # the host's work so far is done when it queues this
                _merge(stream.clock, self.host.clock)
            stream.count += 1
            stream.clock[stream.id] = stream.count
            site = _site(stream, what)
            access = Access(stream.id, stream.count, site)
            for tensor in results:
                self._allocated(tensor, stream)
            for tensor in reads:
                storage, span = self._storage(tensor, stream), _span(tensor)
                for region in storage.overlapping(span):
                    if region.write is not None and not _ordered(stream, region.write):
                        self._report("read", access, "write", region.write)
                storage.regions.setdefault(span, _Region()).reads.append(access)
            for tensor in [*writes, *results]:
                storage, span = self._storage(tensor, stream), _span(tensor)
                for region in storage.overlapping(span):
                    for earlier in [region.write, *region.reads]:
                        if earlier is not None and not _ordered(stream, earlier):
                            kind = "write" if earlier is region.write else "read"
                            self._report("write", access, kind, earlier)
                storage.regions[span] = _Region(access)

    def _storage(self, tensor: torch.Tensor, stream: SimStream) -> _Storage:
        key = _key(tensor)
        storage = self._storages.get(key)
        if storage is None:  # made before tracking began: the host's or its first user's
            owner = self.host if key in self._host_memory else stream
            storage = self._storages[key] = _Storage(owner.id)
            self._watch(tensor, key)
        return storage

    def _allocated(self, tensor: torch.Tensor, stream: SimStream) -> None:
        key = _key(tensor)
        if key not in self._storages:
            self._storages[key] = _Storage(stream.id)
            self._watch(tensor, key)

    def _watch(self, tensor: torch.Tensor, key: tuple[int, int]) -> None:
        weakref.finalize(tensor.untyped_storage(), self._freed, key)

    def _freed(self, key: tuple[int, int]) -> None:
        """The storage's memory is the allocator's again (its last tensor is gone, or it was
        released), for the next allocation on the stream that made it (see the note)."""
        with self._lock:
            storage = self._storages.get(key)
            if storage is None:
                return
            del self._storages[key]
            self._host_memory.discard(key)
            owner = self._streams[storage.allocated_on]
            if owner is self.host:  # host memory: not the device allocator's
                return
            for earlier in storage.accesses():
                if (earlier.stream != owner.id and earlier.stream not in storage.kept_for
                        and not _ordered(owner, earlier)):
                    free = _site(self.current_stream(), "the free of its memory")
                    self.errors.append(
                        f"memory went back to the allocator for {owner.name} while "
                        f"{earlier.site.stream} may still use it (no event orders that use "
                        f"before the free, and no record_stream names it):\n"
                        f"freed: {free.describe()}\nstill in use by: {earlier.site.describe()}")
                    break

    def _report(self, kind: str, access: Access, earlier_kind: str, earlier: Access) -> None:
        self.errors.append(
            f"a {kind} on {access.site.stream} is not ordered after the {earlier_kind} of the "
            f"same memory on {earlier.site.stream} (no event between them):\n"
            f"{kind}: {access.site.describe()}\n{earlier_kind}: {earlier.site.describe()}")


def _sim_stream(stream: StreamLike) -> SimStream:
    """``stream`` as the simulator's: each accelerator takes only the streams it made."""
    assert isinstance(stream, SimStream), f"not a simulated stream: {stream!r}"
    return stream


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for stream, count in other.items():
        if into.get(stream, 0) < count:
            into[stream] = count


def _ordered(stream: SimStream, earlier: Access) -> bool:
    return earlier.stream == stream.id or stream.clock.get(earlier.stream, 0) >= earlier.count


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``tensor`` may touch: from its first element to past its last
    (all between, for a strided view)."""
    if tensor.numel() == 0:
        return (0, 0)
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape,
                                                                     tensor.stride()))
    start = tensor.storage_offset() * tensor.element_size()
    return (int(start), int(start + extent * tensor.element_size()))


def _key(tensor: torch.Tensor) -> tuple[int, int]:
    """A storage's memory: the storage (its ``_cdata``) and its address, which another storage
    may have by the time a finalizer runs, and which a storage resized by torch itself (no
    ``release_storage``) leaves for new memory."""
    storage = tensor.untyped_storage()
    return storage._cdata, storage.data_ptr()


_LIBRARIES = (os.path.dirname(threading.__file__) + os.sep,
              os.path.dirname(torch.__file__) + os.sep)
"""Python's own modules and torch's: no site of the caller's is in them."""


def _site(stream: SimStream, what: str) -> Site:
    """Where the caller is: the last frames outside torch, the libraries and this module."""
    frames = [frame for frame in traceback.extract_stack()
              if not frame.filename.startswith(_LIBRARIES) and "site-packages" not in frame.filename
              and frame.filename != __file__]
    return Site(stream.name, what, tuple(traceback.format_list(frames[-3:])))


class _OnStream:
    def __init__(self, sim: SimAccelerator, stream: SimStream):
        self._sim, self._stream = sim, stream

    def __enter__(self):
        self._previous = getattr(self._sim._local, "stream", None)
        self._sim._local.stream = self._stream
        return self._stream

    def __exit__(self, *exc):
        self._sim._local.stream = self._previous


class _Tracking(TorchDispatchMode):
    def __init__(self, sim: SimAccelerator, drives_device: bool):
        super().__init__()
        self._sim = sim
        self._drives_device = drives_device

    def __enter__(self):
        self._previous = getattr(self._sim._local, "device_thread", False)
        self._sim._local.device_thread = self._drives_device
        return super().__enter__()

    def __exit__(self, *exc):
        self._sim._local.device_thread = self._previous
        super().__exit__(*exc)
        if exc[0] is None:
            self._sim.check()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func.is_view:  # a view touches no bytes: its uses do
            return result
        writes, reads = [], []
        for argument, value in _arguments(func, args, kwargs):
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            mutated = argument.alias_info is not None and argument.alias_info.is_write
            (writes if mutated else reads).extend(tensors)
        # A result in an input's memory (a view, an in-place op's self) is no new memory.
        inputs = {_key(t) for t in [*writes, *reads]}
        results = _real([t for t in tree_flatten(result)[0]
                         if isinstance(t, torch.Tensor) and _key(t) not in inputs])
        writes, reads = _real(writes), _real(reads)
        sim = self._sim
        on_host = bool(writes or reads) and all(_key(t) in sim._host_memory
                                                for t in [*writes, *reads])
        if on_host:  # a GPU's host runs it itself, at once, on no stream
            sim._host_memory.update(_key(t) for t in results)
        stream = sim.host if on_host else sim.current_stream()
        sim._access(stream, writes, reads, str(func), results)
        if (not on_host and func in _COPIES and not _non_blocking(args, kwargs)
                and any(_key(t) in sim._host_memory for t in [*writes, *reads])):
            stream.synchronize()  # a blocking copy to or from the host: the host waits for it
        return result


_COPIES = (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default)


def _non_blocking(args, kwargs) -> bool:
    """A copy's ``non_blocking`` (copy_'s third argument, or the keyword)."""
    return bool(kwargs.get("non_blocking", len(args) > 2 and args[2] is True))


def _real(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors with memory of their own to order (not empty ones, whose address is shared)."""
    return [t for t in tensors if t.device.type == "cpu" and t.untyped_storage().nbytes() > 0]


def _arguments(func, args, kwargs):
    for index, argument in enumerate(func._schema.arguments):
        if argument.kwarg_only or index >= len(args):
            if argument.name in kwargs:
                yield argument, kwargs[argument.name]
        else:
            yield argument, args[index]
