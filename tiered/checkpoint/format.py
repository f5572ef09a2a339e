"""Tensors in files in the safetensors layout, written as a stream and read by byte range.

The layout (the one Hugging Face's ``safetensors`` reads): an 8-byte little-endian header length,
a JSON header mapping each name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets from the end of the header), then the raw little-endian bytes. Because every tensor's
size is known before any is written, the header goes first and the data streams after it, a
tensor (or a piece of one) at a time, from whichever tier holds it; nothing is pickled.

Reading parses and checks the header (JSON only, bounds, sizes), so a truncated or foreign file is
an error naming the file and what is wrong.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass

import torch

from ..core.errors import TieredError
from ..tiers.aio import host_buffer

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16",
          torch.uint32: "U32", torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64"}
"""safetensors' names: a model's buffers may be any of these (a complex rotary table, fp8
scales), and a checkpoint or an export holds its buffers."""
NAMES = {name: dtype for dtype, name in DTYPES.items()}


class CheckpointError(TieredError):
    """A checkpoint file is missing, truncated, corrupted, or does not match the engine."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


class Writer:
    """Writes the header for ``entries`` at once; then :meth:`write` each entry's bytes, in
    order, in as many pieces as wanted. Hashes what it writes (sha256) on the way."""

    def __init__(self, path: str, entries: list[Entry], metadata: dict[str, str] | None = None):
        self.path = path
        header: dict[str, object] = {}
        offset = 0
        for entry in entries:
            if entry.dtype not in DTYPES:  # before the file is created
                raise CheckpointError(f"{path}: {entry.name} is {entry.dtype}, which the "
                                      f"safetensors layout does not hold")
            header[entry.name] = {"dtype": DTYPES[entry.dtype], "shape": list(entry.shape),
                                  "data_offsets": [offset, offset + entry.nbytes]}
            offset += entry.nbytes
        if metadata:
            header["__metadata__"] = metadata
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
        self.size = 8 + len(encoded) + offset
        self._hash = hashlib.sha256()
        try:
            self._file = open(path, "wb")
        except OSError as e:
            raise CheckpointError(f"cannot create {path}: {e.strerror}") from None
        self._emit(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, tensor: torch.Tensor) -> None:
        """The next bytes of the current entry (a CPU tensor)."""
        data = tensor.contiguous()  # kept alive here: host_buffer holds only its address
        self._emit(host_buffer(data, data.numel() * data.element_size()))

    def close(self) -> str:
        """Flush, fsync, close; returns the file's sha256."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            raise CheckpointError(f"cannot write {self.path}: {e.strerror}") from None
        finally:
            self._file.close()
        if os.path.getsize(self.path) != self.size:
            raise CheckpointError(f"{self.path}: wrote {os.path.getsize(self.path)} bytes, "
                                  f"expected {self.size}")
        return self._hash.hexdigest()

    def abort(self) -> None:
        """Close without finishing (the caller removes the partial file's folder)."""
        self._file.close()

    def _emit(self, data) -> None:
        try:
            self._file.write(data)
        except OSError as e:
            raise CheckpointError(f"cannot write {self.path}: {e.strerror}") from None
        self._hash.update(data)


class Reader:
    """Byte ranges of the tensors of one file, its header checked first."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._file = open(path, "rb")
        except OSError as e:
            raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
        try:
            self._data_start, self.metadata, self.entries = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> tuple[int, dict, dict[str, tuple[Entry, int]]]:
        """(where the data starts, the metadata, name -> (entry, its first data byte))."""
        path = self.path
        size = os.fstat(self._file.fileno()).st_size
        raw = self._file.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise CheckpointError(f"{path}: truncated or not a tensor file (header of "
                                  f"{header_len} bytes in a file of {size})")
        try:
            header = json.loads(self._file.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(f"{path}: corrupted header") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupted header (not a JSON object)")
        metadata = header.pop("__metadata__", {})
        data_start = 8 + header_len
        entries: dict[str, tuple[Entry, int]] = {}
        for name, spec in header.items():
            entry, begin, end = _parse_entry(path, name, spec)
            if end - begin != entry.nbytes or data_start + end > size:
                raise CheckpointError(f"{path}: tensor {name!r} runs past the end of the file "
                                      f"or does not match its shape (truncated?)")
            entries[name] = (entry, begin)
        return data_start, metadata, entries

    def entry(self, name: str) -> Entry:
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: has no tensor {name!r}")
        return self.entries[name][0]

    def read(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Fill ``out`` (contiguous, CPU, the entry's dtype) with elements ``start`` on."""
        entry, begin = self.entries[name]
        nbytes = out.numel() * out.element_size()
        self._file.seek(self._data_start + begin + start * entry.dtype.itemsize)
        if self._file.readinto(host_buffer(out, nbytes)) != nbytes:
            raise CheckpointError(f"{self.path}: {name!r} is truncated")

    def close(self) -> None:
        self._file.close()


def _parse_entry(path: str, name: str, spec) -> tuple[Entry, int, int]:
    """(entry, first byte, end byte) of one header entry, checked to be what the layout says."""
    corrupted = CheckpointError(f"{path}: corrupted header entry {name!r}")
    try:
        dtype, shape, (begin, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise corrupted from None
    if not isinstance(dtype, str) or not all(type(n) is int and n >= 0
                                             for n in (*shape, begin, end)):
        raise corrupted
    if dtype not in NAMES:
        raise CheckpointError(f"{path}: tensor {name!r} is {dtype}, which tiered does not read "
                              f"(it reads {', '.join(NAMES)})")
    return Entry(name, NAMES[dtype], shape), begin, end


def file_digest(path: str) -> tuple[int, str]:
    """(size, sha256) of a file, read in large pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return os.path.getsize(path), digest.hexdigest()
