"""A scratch file on NVMe: one preallocated O_DIRECT extent, read and written in place at
block-aligned offsets, in a run folder of its own under the NVMe path (``activations.tier:
nvme``'s saved tensors, engine/activations_nvme.py).

Its bytes live within a step: a failed write loses only what the step that wrote it will read,
and that read fails, so there is nothing for versions and spares (nvme.py's [Note: atomic shard
writes]) to keep. The run folder is this process's own, made and removed as an NvmeTier's is
([Note: run folders of dead runs]), also where the node's service holds the rank's other files:
the tensors it holds never leave the trainer. It is reserved whole when it is made, so that a
drive without room for it says so before the first step.
"""
from __future__ import annotations

import torch

from ..core.errors import NvmeError
from ..core.sizes import format_size
from .aio import IoSettings, Transfer, host_buffer
from .nvme import NvmeTier, extent_bytes
from .usage import TierUsage


class ScratchFile:
    def __init__(self, root: str, nbytes: int, rank: int, io: IoSettings, what: str,
                 key: str):
        """``nbytes`` of ``what`` under ``root``; ``key``: the policy key that sized it, named
        when the drive cannot hold it."""
        size = extent_bytes(nbytes)
        self.tier = NvmeTier(root, size, rank, io)
        try:
            self.extent = self.tier.scratch(what, size)
        except NvmeError as error:
            self.tier.close()
            raise NvmeError(f"{key} ({format_size(size)}) cannot be reserved under {root}: "
                            f"{error}{self.tier.live_runs_hint()}", errno=error.errno,
                            path=error.path, size=size) from None
        except BaseException:
            self.tier.close()
            raise

    @property
    def path(self) -> str:
        return self.extent.path

    @property
    def nbytes(self) -> int:
        return self.extent.nbytes

    @property
    def usage(self) -> TierUsage:
        return self.tier.usage

    def write(self, offset: int, block: torch.Tensor, nbytes: int) -> Transfer:
        """Start writing the first ``nbytes`` of ``block`` at ``offset`` (both multiples of
        BLOCK_ALIGN, as ``block``'s address is)."""
        return self.tier.io.write(self.extent.fd, self.extent.path, offset,
                                  host_buffer(block, nbytes))

    def read(self, offset: int, block: torch.Tensor, nbytes: int) -> Transfer:
        """Start reading ``nbytes`` at ``offset`` into the start of ``block``."""
        return self.tier.io.read(self.extent.fd, self.extent.path, offset,
                                 host_buffer(block, nbytes))

    def close(self) -> None:
        """Wait for its I/O, close the file and remove the run folder; safe to call again."""
        self.tier.close()
