"""NVMe: shard files opened with O_DIRECT in a folder of this run's own.

Layout: ``<nvme.path>/tiered-<host>-<pid>-<token>-rank<r>/`` (mode 0700) holds one file per shard
state (mode 0600), each preallocated to its full, block-aligned size when the engine starts, so a
full disk shows up then, before any training state exists, and not in the middle of a step. The
folder is removed when the engine closes (and at interpreter exit).

Reads and writes go between a file and a DRAM block (aligned, from the DRAM tier) with
``os.preadv``/``os.pwritev``, which release the GIL. File systems without O_DIRECT (tmpfs) fall
back to buffered I/O with a warning.
"""
from __future__ import annotations

import ctypes
import errno as errno_codes
import os
import secrets
import shutil
import socket
import warnings

import torch

from ..errors import NvmeError
from ..sizes import align_up, format_size
from .dram import BLOCK_ALIGN
from .usage import TierUsage

IO_CHUNK_BYTES = 64 << 20
"""Largest single request: big enough to stream, small enough to keep the kernel's work bounded."""


def check_nvme_path(path: str) -> None:
    """Raise NvmeError unless ``path`` is an existing, writable folder."""
    if not os.path.exists(path):
        raise NvmeError(f"NVMe path {path} does not exist; create it or pass another --nvme PATH",
                        path=path, errno=errno_codes.ENOENT)
    if not os.path.isdir(path):
        raise NvmeError(f"NVMe path {path} is not a folder", path=path, errno=errno_codes.ENOTDIR)
    if not os.access(path, os.W_OK | os.X_OK):
        raise NvmeError(f"NVMe path {path} is not writable by this user", path=path,
                        errno=errno_codes.EACCES)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _buffer(block: torch.Tensor, nbytes: int) -> memoryview:
    """A writable view of the first ``nbytes`` of a CPU block, for preadv/pwritev (no numpy)."""
    assert block.device.type == "cpu" and block.is_contiguous()
    assert nbytes <= block.numel() * block.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(block.data_ptr())).cast("B")


class NvmeFile:
    """One shard state's file: ``nbytes`` (a multiple of BLOCK_ALIGN) preallocated bytes."""

    def __init__(self, path: str, nbytes: int, direct: bool):
        self.path = path
        self.nbytes = nbytes
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
        try:
            self._fd = os.open(path, flags, 0o600)
        except OSError as e:
            # Wrapped so that it is a tiered error naming the file (EMFILE is the likely one: every
            # NVMe shard state keeps its file open).
            hint = ("; each NVMe shard state keeps a file open: raise the open-file limit "
                    "(ulimit -n)" if e.errno == errno_codes.EMFILE else "")
            raise NvmeError(f"NVMe file {path}: cannot create it: {e.strerror}{hint}",
                            errno=e.errno, path=path) from None
        try:
            os.posix_fallocate(self._fd, 0, nbytes)
        except OSError as e:
            os.close(self._fd)
            self._fd = -1
            # Leave no empty or partly reserved file behind for the failed request.
            try:
                os.unlink(path)
            except OSError:
                pass
            raise NvmeError(
                f"NVMe file {path}: cannot reserve {format_size(nbytes)}: {e.strerror}",
                errno=e.errno, path=path, offset=0, size=nbytes) from None

    def read_into(self, block: torch.Tensor) -> None:
        """Fill ``block`` (at least ``nbytes`` of aligned DRAM) with the file's contents."""
        self._transfer(block, os.preadv, "read")

    def write_from(self, block: torch.Tensor) -> None:
        """Write the first ``nbytes`` of ``block`` over the file's contents."""
        self._transfer(block, os.pwritev, "write")

    def _transfer(self, block: torch.Tensor, syscall, verb: str) -> None:
        view = _buffer(block, self.nbytes)
        offset = 0
        while offset < self.nbytes:
            size = min(IO_CHUNK_BYTES, self.nbytes - offset)
            try:
                done = syscall(self._fd, [view[offset:offset + size]], offset)
            except OSError as e:
                raise NvmeError(f"NVMe {verb} failed on {self.path} at offset {offset}, "
                                f"size {size}: {e.strerror}", errno=e.errno, path=self.path,
                                offset=offset, size=size) from None
            if done <= 0:
                raise NvmeError(f"NVMe {verb} on {self.path} at offset {offset}, size {size} "
                                f"moved {done} bytes", errno=errno_codes.EIO, path=self.path,
                                offset=offset, size=size)
            offset += done

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class NvmeTier:
    def __init__(self, root: str, budget: int | None, rank: int):
        check_nvme_path(root)
        self.root = root
        self.usage = TierUsage("nvme", free_bytes(root) if budget is None else budget)
        name = f"tiered-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}-rank{rank}"
        self.run_dir = os.path.join(root, name)
        try:
            os.mkdir(self.run_dir, 0o700)
        except OSError as e:
            raise NvmeError(f"NVMe path {root}: cannot create {name}: {e.strerror}",
                            errno=e.errno, path=self.run_dir) from None
        try:
            self.direct = self._supports_direct_io()
        except BaseException:
            # The folder is this tier's, and no tier object will exist to remove it at close.
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        if not self.direct:
            warnings.warn(f"{root} does not support O_DIRECT; the NVMe tier uses buffered I/O "
                          f"there (the page cache will hold copies of what it writes)")
        self._files: list[NvmeFile] = []

    def _supports_direct_io(self) -> bool:
        probe = os.path.join(self.run_dir, ".direct-probe")
        try:
            os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
            return True
        except OSError as e:
            if e.errno != errno_codes.EINVAL:
                raise NvmeError(f"NVMe path {self.root}: cannot create files: {e.strerror}",
                                errno=e.errno, path=probe) from None
            return False
        finally:
            if os.path.exists(probe):
                os.unlink(probe)

    def create(self, name: str, nbytes: int) -> NvmeFile:
        size = align_up(max(nbytes, 1), BLOCK_ALIGN)
        self.usage.acquire(size, f"NVMe file {name}")
        try:
            f = NvmeFile(os.path.join(self.run_dir, name), size, self.direct)
        except BaseException:
            self.usage.release(size)
            raise
        self._files.append(f)
        return f

    def close(self) -> None:
        """Close every file and remove this run's folder; safe to call more than once."""
        for f in self._files:
            f.close()
        self._files.clear()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.usage.release(self.usage.current)
