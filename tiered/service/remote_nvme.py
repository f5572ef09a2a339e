"""The trainer's NVMe tier when the node's service holds the rank's files (service/files.py, [Note:
NVMe in the service]): the face of tiers/nvme.py's NvmeTier that TierManager uses, every read and
write a request on a connection of its own. Blocks are named by where they lie in the rank's
segments (the DRAM tier's slabs are the service's memory), so no byte crosses the socket.

Requests are calls on the rank's channel (channel.py), answered in the order they finish, not the
order sent: the read-ahead ring's reads and a checkpoint's writes move at once, as they do
in-process.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from concurrent.futures import Future, wait

import torch

from ..core.errors import TieredError
from ..core.sizes import format_size
from ..tiers.aio import IoSettings
from ..tiers.faces import ShardFile
from ..tiers.nvme import check_nvme_path, extent_bytes, free_bytes, live_runs_hint
from ..tiers.usage import TierUsage
from .channel import Channel
from .client import ServiceSlabSource
from .paths import ServiceError


class ServiceNvme:
    """A rank's NVMe tier whose files the service holds (see the module's doc)."""

    def __init__(self, source: ServiceSlabSource, root: str, budget: int | None, rank: int,
                 io: IoSettings, ranks: int = 1):
        """The arguments of NvmeTier's, and the rank's DRAM source, whose segments the blocks
        lie in."""
        root = os.path.abspath(root)
        check_nvme_path(root)  # named here, in the trainer's words
        self.root = root
        self._source = source
        self._channel = Channel.connect(source.client.paths.folder)
        try:
            reply, _ = self._channel.request("files", job=source.job, rank=rank, root=root,
                                             block_size=io.block_size,
                                             queue_depth=io.queue_depth)
        except BaseException:
            self._channel.close()
            raise
        self.run_dir: str = reply["folder"]
        for folder, freed in reply["removed"]:
            warnings.warn(f"tiered: the node's service removed {folder}, the NVMe folder of a "
                          f"run that is gone, freeing {format_size(freed)}", stacklevel=2)
        # The kept shards' bytes are this rank's already: its share is what they leave free
        # and them.
        self.usage = TierUsage("nvme", free_bytes(root) // max(1, ranks) + reply["held"]
                               if budget is None else budget)
        self._unanswered: set[Future] = set()
        """Requests sent and not yet answered (close waits for their bytes to have moved)."""
        self._lock = threading.Lock()

    def create(self, what: str, nbytes: int) -> "RemoteShard":
        """A shard state of ``nbytes`` with its size's spares, made by the service (or, for a
        kept state, the kept one the plan makes next)."""
        reply, _ = self.call("create", what=what, nbytes=nbytes,
                             budget=self.usage.budget).result()
        self.usage.follow(int(reply["held"]))
        return RemoteShard(self, int(reply["shard"]), extent_bytes(nbytes), str(reply["path"]))

    def remove(self, shard: ShardFile) -> None:
        raise TieredError(f"{shard.path} cannot leave the drive: a rank the service hosts is "
                          f"never re-planned (tier: auto, which re-plans, is never hosted)")

    def call(self, op: str, **fields) -> Future:
        """Request ``op`` of the rank's files; the future is its reply's fields."""
        answer = self._channel.call(op, **fields)
        with self._lock:
            self._unanswered.add(answer)
        answer.add_done_callback(self._answered)
        return answer

    def _answered(self, answer: Future) -> None:
        with self._lock:
            self._unanswered.discard(answer)

    def bytes_moved(self) -> dict[str, int]:
        """Bytes the service read and wrote for this rank so far: the trainer's transfers and
        its host's (NvmeTier.bytes_moved)."""
        reply, _ = self.call("moved").result()
        return {verb: int(n) for verb, n in reply["moved"].items()}

    def place(self, block: torch.Tensor, nbytes: int) -> dict:
        """Where the first ``nbytes`` of ``block`` lie in the rank's segments, for a request."""
        segment, at = self._source.locate(block)
        return {"segment": segment, "at": at, "nbytes": nbytes}

    def live_runs_hint(self) -> str:
        return live_runs_hint(self.root, self.run_dir)

    def close(self) -> None:
        """Wait for every request's answer (a transfer may still move bytes of a slab about to
        go), then end the stream and wait until the service has (a clean end that follows frees
        the job at once): the files stay the job's."""
        with self._lock:
            unanswered = set(self._unanswered)
        wait(unanswered)
        with contextlib.suppress(ServiceError):  # a service that is gone ended it already
            self.call("end_files").result()
        self._channel.close()
        self.usage.follow(0)


class RemoteTransfer:
    """A read or write the service carries out; :meth:`wait` raises its failure."""

    def __init__(self, answer: Future):
        self._answer = answer

    def wait(self) -> None:
        self._answer.result()


class RemoteShard:
    """NvmeShard's face: one shard state in the rank's files, by its number."""

    def __init__(self, tier: ServiceNvme, number: int, nbytes: int, path: str):
        self._tier = tier
        self.number = number
        self.nbytes = nbytes
        self.path = path

    def start_read(self, block: torch.Tensor, offset: int = 0,
                   nbytes: int | None = None) -> RemoteTransfer:
        nbytes = self.nbytes - offset if nbytes is None else nbytes
        return RemoteTransfer(self._tier.call("read", shard=self.number, offset=offset,
                                              **self._tier.place(block, nbytes)))

    def read_into(self, block: torch.Tensor) -> None:
        self.start_read(block).wait()

    def next_version(self) -> "RemoteVersion":
        reply, _ = self._tier.call("version", shard=self.number).result()
        return RemoteVersion(self._tier, int(reply["version"]), self.nbytes)


class RemoteVersion:
    """NextVersion's face: a shard's next version, written in pieces, switched to on commit."""

    def __init__(self, tier: ServiceNvme, number: int, nbytes: int):
        self._tier = tier
        self._number = number
        self._nbytes = nbytes
        self._settled: Future | None = None

    def write(self, block: torch.Tensor, offset: int = 0,
              nbytes: int | None = None) -> RemoteTransfer:
        nbytes = self._nbytes - offset if nbytes is None else nbytes
        return RemoteTransfer(self._tier.call("write", version=self._number, offset=offset,
                                              **self._tier.place(block, nbytes)))

    def commit(self) -> None:
        self._settled = self._tier.call("commit", version=self._number)

    def abandon(self) -> None:
        """Called on a failure, which is the one to raise: a service that is gone abandons
        every open version by itself."""
        with contextlib.suppress(ServiceError):
            self._settled = self._tier.call("commit", version=self._number, abandon=True)

    def wait(self) -> None:
        assert self._settled is not None, "a version waited for before its commit"
        self._settled.result()
