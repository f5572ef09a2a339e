"""A Chrome-trace timeline of a run (open it in Perfetto or chrome://tracing).

``TIERED_TRACE=trace.json`` (or the policy's ``trace.path``) records spans for each unit's
forward and backward compute, host-to-device gathers, gradient reduce and device-to-host copies,
NVMe reads and writes and the CPU worker's gradient adds and AdamW steps, on one track per thread
(host work) or stream (device work). Device spans are timed with CUDA events, read back one
iteration later (when they have long completed), so tracing adds no synchronisation to the step.
With several ranks each writes ``trace.rank<r>.json``. Each iteration's end (:meth:`Timeline.flush`)
appends its spans to the file, which is a whole trace after every append: memory holds one
iteration's spans, not the run's, and a run killed mid-way leaves its timeline up to then.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import BinaryIO, Iterator, Protocol

import torch

from .errors import PolicyError

TRACE_ENV = "TIERED_TRACE"
_HEAD = b'{"displayTimeUnit": "ms", "traceEvents": [\n'
_TAIL = b'\n]}\n'
"""The file is _HEAD, the events so far, _TAIL; an append overwrites _TAIL and writes it anew."""


class SpanTimer(Protocol):
    """What a rank's host times its work with: the trainer's Timeline, or in the node's service
    a sender of each span to the trainer's (service/hosting.py)."""

    def span(self, name: str, category: str, args: dict | None = None
             ) -> contextlib.AbstractContextManager[None]: ...


class Timeline:
    """Records spans; a disabled timeline (no path) records nothing and costs a branch."""

    def __init__(self, path: str | None, device: torch.device):
        self.path = path
        self.enabled = path is not None
        self._events: list[dict] = []
        self._device_spans: list[tuple[str, str, str, torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._file: BinaryIO | None = None
        """Open from the first flush to close; ``_end`` is where its events end (_TAIL's
        offset), ``_written`` how many it holds."""
        self._end = self._written = 0
        self._t0 = time.perf_counter_ns()
        self._reference: torch.cuda.Event | None = None
        if self.enabled and device.type == "cuda":
            # Device times are offsets from this event, placed at the host time it was recorded.
            torch.cuda.synchronize(device)
            self._reference = torch.cuda.Event(enable_timing=True)
            self._reference.record()
            torch.cuda.synchronize(device)
            self._reference_us = (time.perf_counter_ns() - self._t0) / 1e3

    @classmethod
    def for_rank(cls, policy_path: str | None, device: torch.device, rank: int,
                 world_size: int) -> "Timeline":
        path = os.environ.get(TRACE_ENV) or policy_path
        if path:
            source = TRACE_ENV if os.environ.get(TRACE_ENV) else "trace.path"
            folder = os.path.dirname(os.path.abspath(path))
            if os.path.isdir(path):
                raise PolicyError(f"{source} {path!r} is a folder; name the file to write "
                                  f"the timeline to, e.g. {os.path.join(path, 'trace.json')}")
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
                raise PolicyError(f"{source} {path!r}: the folder {folder} does not exist or is "
                                  f"not writable; the timeline is written there when the engine "
                                  f"closes")
        if path and world_size > 1:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{rank}{ext or '.json'}"
        return cls(path, device)

    @contextlib.contextmanager
    def span(self, name: str, category: str, args: dict | None = None) -> Iterator[None]:
        """Time the body on this thread's track; ``args`` (plain values) go with the span."""
        if not self.enabled:
            yield
            return
        with timed(self.record, name, category, args):
            yield

    def record(self, name: str, category: str, track: str, start_ns: int, duration_ns: int,
               args: dict | None = None) -> None:
        """A span another process timed on this host's monotonic clock (``perf_counter_ns``,
        which every process of a Linux host shares): the node's service's host work."""
        if self.enabled:
            self._add(name, category, track, start_ns - self._t0, duration_ns, args)

    def mark(self):
        """A point in time (:func:`mark_now`) when tracing, else None. Two marks make a span
        (:meth:`between`)."""
        if not self.enabled:
            return None
        return mark_now(self._reference is not None)

    def between(self, name: str, category: str, track: str, start, end) -> None:
        """A span from one :meth:`mark` to another, on ``track`` (a stream's name for device
        work; on the CPU, host time); nothing when disabled (the marks may be another's:
        engine/probe.py measures every step)."""
        if not self.enabled or start is None or end is None:
            return
        if isinstance(start, int):
            self._add(name, category, track, start - self._t0, end - start)
            return
        with self._lock:
            self._device_spans.append((name, category, track, start, end))

    def flush(self, wait: bool = False) -> None:
        """Turn completed device spans into events (all of them, waiting, when ``wait``) and
        append the events to the file."""
        if not self.enabled:
            return
        self._read_device_spans(wait)
        self._append()

    def close(self) -> None:
        if not self.enabled:
            return
        self.flush(wait=True)
        if self._file is not None:
            self._file.close()
        self.enabled = False

    def _read_device_spans(self, wait: bool) -> None:
        if not self._device_spans:
            return
        with self._lock:
            spans, self._device_spans = self._device_spans, []
        reference = self._reference
        assert reference is not None  # device spans are recorded only against it
        pending = []
        for span in spans:
            name, category, track, start, end = span
            if not wait and not end.query():
                pending.append(span)
                continue
            end.synchronize()
            begin_us = self._reference_us + reference.elapsed_time(start) * 1e3
            length_us = start.elapsed_time(end) * 1e3
            self._add(name, category, track, int(begin_us * 1e3), int(length_us * 1e3))
        with self._lock:
            self._device_spans[:0] = pending

    def _append(self) -> None:
        """The events recorded since the last append go to the file; other threads go on
        adding meanwhile (``_lock`` is held only to take the list)."""
        with self._write_lock:  # flush runs on the training thread, close maybe at exit
            with self._lock:
                events, self._events = self._events, []
            self._write(events)

    def _write(self, events: list[dict]) -> None:
        file = self._file
        if file is None:
            assert self.path is not None  # an enabled timeline has one
            file = self._file = open(self.path, "wb")
            file.write(_HEAD)
            self._end = file.tell()
        elif not events:
            return
        body = b",\n".join(json.dumps(event).encode() for event in events)
        file.seek(self._end)
        if body:
            file.write(b",\n" + body if self._written else body)
        self._written += len(events)
        self._end = file.tell()
        file.write(_TAIL)
        file.truncate()
        file.flush()

    def _add(self, name: str, category: str, track: str, offset_ns: int, length_ns: int,
             args: dict | None = None) -> None:
        event = {"name": name, "cat": category, "ph": "X", "pid": os.getpid(), "tid": track,
                 "ts": offset_ns / 1e3, "dur": length_ns / 1e3}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)


def mark_now(on_gpu: bool):
    """A point in time on the current stream: a timing event on a GPU, else the host clock
    (``perf_counter_ns``)."""
    if not on_gpu:
        return time.perf_counter_ns()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@contextlib.contextmanager
def timed(record, name: str, category: str, args: dict | None = None):
    """Time the body on this thread's track and hand the span to ``record(name, category,
    track, start_ns, duration_ns, args)``, in ``perf_counter_ns`` (a host's monotonic clock)."""
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        record(name, category, threading.current_thread().name, start,
               time.perf_counter_ns() - start, args)
