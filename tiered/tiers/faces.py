"""What a TierManager asks of its NVMe tier and of each shard state on it, met by the tier in
this process (nvme.py: NvmeTier, NvmeShard, NextVersion), by the rank's kept files a host in the
node's service adopts (service/files.py) and by a hosted rank's view of them
(service/remote_nvme.py)."""
from __future__ import annotations

from typing import Protocol

import torch

from .usage import TierUsage


class ShardTransfer(Protocol):
    """A read or write under way: an aio Transfer, or one the node's service carries out."""

    def wait(self) -> None: ...


class ShardVersion(Protocol):
    """A shard's next version, written in pieces and switched to on commit: a NextVersion, or
    the same made in the node's service (service/remote_nvme.RemoteVersion)."""

    def write(self, block: torch.Tensor, offset: int = 0,
              nbytes: int | None = None) -> ShardTransfer: ...

    def commit(self) -> None: ...

    def abandon(self) -> None: ...

    def wait(self) -> None: ...


class ShardFile(Protocol):
    """One shard state on NVMe as a TierManager uses it: an NvmeShard, or a trainer's view of
    one the node's service holds (service/remote_nvme.RemoteShard)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def path(self) -> str: ...

    def start_read(self, block: torch.Tensor, offset: int = 0,
                   nbytes: int | None = None) -> ShardTransfer: ...

    def read_into(self, block: torch.Tensor) -> None: ...

    def next_version(self) -> ShardVersion: ...


class NvmeFace(Protocol):
    """What a TierManager asks of its NVMe tier: an NvmeTier; in the node's service the rank's
    kept files, which a host adopting the rank's plan takes over (service/files.AdoptedFiles);
    in a rank the service hosts, its view of those files (service/remote_nvme.ServiceNvme)."""

    usage: TierUsage

    def create(self, what: str, nbytes: int) -> ShardFile: ...

    def remove(self, shard: ShardFile) -> None: ...

    def close(self) -> None: ...

    def live_runs_hint(self) -> str: ...
