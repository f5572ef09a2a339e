"""DRAM: page-locked host memory, allocated once in large slabs and carved into fixed blocks.

Pinning is slow (about 0.6 s per GiB on the reference box) and pinned memory is what DMA engines
can read at full PCIe speed, so the tier pins everything it will ever need when the engine starts
and hands out views of those slabs; nothing is pinned or freed per step. Without CUDA the slabs are
ordinary memory. Where slabs come from is a seam: with the per-node service, slabs are carved
out of its shared memory and registered with CUDA by the trainer (service/client.py's
``ServiceSlabSource``) instead of :class:`PinnedSlabSource`'s own memory.
"""
from __future__ import annotations

import mmap
import warnings
from typing import Hashable, Protocol, TypeVar

import torch

from ..core.limits import available_memory
from ..core.sizes import align_up
from ..device import Accelerator, host_device
from .usage import TierUsage

BLOCK_ALIGN = 4096
"""Every block starts and ends on this boundary, so any block can be an O_DIRECT buffer."""
HUGE_PAGE = 2 << 20
"""A transparent huge page on x86-64 and (with 4 KiB base pages) arm64."""
SLAB_BYTES = 1 << 30
"""Blocks are packed into slabs of about this size (a larger block gets a slab of its own)."""

Key = TypeVar("Key", bound=Hashable)
"""What a reservation names its blocks by."""

class SlabSource(Protocol):
    def __call__(self, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of ``nbytes`` whose address is a multiple of BLOCK_ALIGN."""

    def release(self, slab: torch.Tensor) -> None:
        """Give back a slab this source made (the tier drops its last reference after)."""

    def close(self, clean: bool) -> None:
        """The tier is done with the source: ``clean`` when the run ended well
        (``engine.close()``; every slab was released first); otherwise (before the slabs are
        released) a service keeps the job's state for a while, and a release after the close
        frees nothing there."""


class PinnedSlabSource:
    """Ordinary host memory, registered with the device whose copies read and write it (CUDA
    page-locks it with ``cudaHostRegister``).

    Not ``pin_memory=True``: torch's pinned allocator rounds every request up to a power of two
    and keeps freed blocks cached, so a slab of 1 GiB + 4 KiB would hold 2 GiB until the process
    exits. Registering memory allocated here pins exactly the bytes the plan counts and gives
    them back at :meth:`release`.

    With ``huge_pages`` a slab is an anonymous mapping advised to use transparent huge pages
    before anything touches it (the kernel decides the page size at the first fault), aligned
    to a huge page; its tensor keeps the mapping alive, so the memory goes with the last view.
    """

    def __init__(self, device: Accelerator | None = None, huge_pages: bool = False):
        """``device``: the one whose copies use the slabs (None: device.host_device())."""
        self.device = device or host_device()
        self.huge_pages = huge_pages
        if huge_pages:
            _warn_if_no_huge_pages()

    def __call__(self, nbytes: int) -> torch.Tensor:
        slab = self._huge(nbytes) if self.huge_pages else self._plain(nbytes)
        self.device.register_host_memory(slab)
        return slab

    @staticmethod
    def _plain(nbytes: int) -> torch.Tensor:
        return _aligned(torch.empty(nbytes + BLOCK_ALIGN, dtype=torch.uint8), nbytes,
                        BLOCK_ALIGN)

    @staticmethod
    def _huge(nbytes: int) -> torch.Tensor:
        # Private: a shared anonymous mapping is shmem, whose huge pages are a separate
        # setting (shmem_enabled) that is off by default.
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without them (EINVAL): warned of at construction
            pass
        # frombuffer's tensor holds a reference to the mapping.
        return _aligned(torch.frombuffer(mapping, dtype=torch.uint8), nbytes, HUGE_PAGE)

    def release(self, slab: torch.Tensor) -> None:
        self.device.unregister_host_memory(slab)

    def close(self, clean: bool) -> None:
        pass  # the memory went with the slabs


def _aligned(raw: torch.Tensor, nbytes: int, alignment: int) -> torch.Tensor:
    """The first ``nbytes`` of ``raw`` (which has ``alignment`` bytes to spare) that start on a
    multiple of ``alignment``."""
    skew = (-raw.data_ptr()) % alignment
    return raw[skew:skew + nbytes]


THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory the kernel backs with transparent huge pages
    (what ``huge_pages`` actually got); None where Linux does not say."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _warn_if_no_huge_pages() -> None:
    """madvise succeeds wherever the kernel knows the advice, even with huge pages turned off;
    say so rather than let a policy's huge_pages silently mean nothing."""
    try:
        with open(THP_MODE) as modes:
            mode = modes.read()
    except OSError:
        mode = ""
    if "[always]" not in mode and "[madvise]" not in mode:
        warnings.warn(f"tiered: dram.huge_pages is set, but transparent huge pages are off here "
                      f"({THP_MODE}: {mode.strip() or 'missing'}); the slabs use ordinary pages")


def default_budget(ranks: int) -> int:
    """One of ``ranks`` equal shares (the ranks on this node) of the memory this process could
    take now (limits.available_memory: the host's, capped by its cgroups'), less an eighth left
    to the processes themselves (their own tensors, CUDA's, the page cache): what the tier can
    pin without the machine swapping or killing a process, and what ``dram.spill`` keeps in
    DRAM."""
    return available_memory() * 7 // 8 // max(1, ranks)


class DramTier:
    def __init__(self, budget: int | None, source: SlabSource | None = None, ranks: int = 1):
        self.usage = TierUsage("dram", default_budget(ranks) if budget is None else budget)
        self.source = source or PinnedSlabSource()
        """Where the slabs come from (this process's own memory, or a service's)."""
        self._slabs: list[torch.Tensor] = []

    def reserve(self, requests: dict[Key, int]) -> dict[Key, torch.Tensor]:
        """Pin slabs for all ``requests`` (key -> bytes) at once; return a uint8 block per key.

        Blocks are packed first-fit by decreasing size and each slab is cut to what it holds,
        so the bytes pinned equal the sum of the aligned block sizes exactly. The budget is
        checked for the whole reservation before anything is pinned.
        """
        sizes = {key: align_up(max(nbytes, 1), BLOCK_ALIGN) for key, nbytes in requests.items()}
        total = sum(sizes.values())
        self.usage.acquire(total, f"{len(sizes)} DRAM blocks")
        bins: list[list[Key]] = []
        fill: list[int] = []
        for key in sorted(sizes, key=lambda key: sizes[key], reverse=True):
            for i, used in enumerate(fill):
                if used + sizes[key] <= max(SLAB_BYTES, sizes[bins[i][0]]):
                    bins[i].append(key)
                    fill[i] += sizes[key]
                    break
            else:
                bins.append([key])
                fill.append(sizes[key])
        blocks = {}
        slabs = []
        try:
            for keys, nbytes in zip(bins, fill):
                slab = self.source(nbytes)
                slabs.append(slab)
                offset = 0
                for key in keys:
                    blocks[key] = slab[offset:offset + sizes[key]]
                    offset += sizes[key]
        except BaseException:
            # A slab could not be had (pinning or allocation failed): the reservation is all or
            # nothing, so neither its bytes nor the slabs already made stay held.
            for slab in slabs:
                self.source.release(slab)
            self.usage.release(total)
            raise
        self._slabs.extend(slabs)
        return blocks

    def close(self, clean: bool = False) -> None:
        """Give every slab back, then the source (``clean``: see SlabSource.close). After an
        unclean end the source is closed first: a service then keeps what the slabs hold as
        the job's state, and giving them back only unmaps them here."""
        if not clean:
            self.source.close(clean)
        for slab in self._slabs:
            self.source.release(slab)
        self._slabs.clear()
        self.usage.release(self.usage.current)
        if clean:
            self.source.close(clean)
