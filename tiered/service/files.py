"""A rank's NVMe files, held by the node's service: the rank's run folder of extents
(tiers/nvme.py), moved by the node's I/O queue between those files and the rank's DRAM segments.

[Note: NVMe in the service]
A shard on NVMe lives in one of several extents, the one holding its current version, and that
changes with every write (see [Note: atomic shard writes] in tiers/nvme.py). So one process must
own the mapping from shards to extents, and it must outlive the trainer for a relaunch to find
its weights and moments: the service. The trainer's NVMe tier (service/remote_nvme.py) holds
no file: each read or write is a request naming the shard (its number in the order the plan
made them, the same on both sides) and a place in one of the rank's segments, which the
service maps too; the service moves the bytes and answers when they have moved. The rank's
host here uses the same shards, in the same process, for the optimizer states it streams.

The run folder is made, and locked, by the service: while it lives no one removes it, and a
service that is killed leaves it to the next NVMe tier that starts on that path (a service's or
a trainer's), which removes it and says so ([Note: run folders of dead runs]). The files are
the job's: kept with its segments while the job is kept, removed when it is freed.

A trainer that goes leaves its transfers to finish here (they write into the kept segments) and
its versions not committed are abandoned: a shard never switches to a version half written.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..core.errors import NvmeError, TieredError
from ..tiers.aio import IoQueue, IoSettings, Transfer
from ..tiers.faces import ShardFile
from ..tiers.nvme import NextVersion, NvmeShard, NvmeTier, extent_bytes
from .segments import SegmentViews
from .wire import refusal_fields

class RankFiles:
    """One rank's NVMe tier in the service: its extents and shards, and the segments its
    transfers move bytes to and from (see [Note: NVMe in the service])."""

    def __init__(self, root: str, rank: int, io: IoSettings,
                 segment_of: Callable[[int], tuple[int, int]], queue: IoQueue):
        """``segment_of``: one of the rank's segments' descriptor and size (the registry's);
        ``queue``: the node's I/O queue, which every rank's files share."""
        # Its budget is the trainer's, sent with each shard it makes (the trainer agrees it
        # with the job's other ranks).
        self.tier = NvmeTier(root, None, rank, io, queue=queue)
        self.shards: list[NvmeShard] = []
        """In the order the rank's plan made them: the number a request names a shard by."""
        self.segments = SegmentViews(segment_of)
        """The rank's segments, which its transfers move bytes to and from."""

    def shard(self, number: int) -> NvmeShard:
        if not 0 <= number < len(self.shards):
            raise TieredError(f"the rank has no NVMe shard {number} (it has {len(self.shards)})")
        return self.shards[number]

    def kept_shard(self, number: int, what: str, nbytes: int) -> NvmeShard:
        """The rank's shard ``number``, which a plan taking the files over makes as ``what`` of
        ``nbytes``: refused unless it is there, of that size."""
        if number >= len(self.shards):
            raise TieredError(f"the plan's NVMe shard {number} ({what}) is not among the rank's "
                              f"{len(self.shards)} kept ones")
        shard = self.shards[number]
        if shard.nbytes != extent_bytes(nbytes):
            raise TieredError(f"the rank's NVMe shard {number} has {shard.nbytes} bytes, the "
                              f"plan makes {what} of {nbytes}: another plan")
        return shard

    def adopted(self) -> "AdoptedFiles":
        """The shards as a tier a TierManager adopting the rank's plan takes them from."""
        return AdoptedFiles(self)

    def status(self) -> dict:
        """What ``tiered daemon status`` shows of the rank's files and I/O queue (the trainer's
        transfers and its host's together)."""
        moved = self.tier.bytes_moved()
        return {"nvme_bytes": self.tier.usage.current, "folder": self.tier.run_dir,
                "io_in_flight": self.tier.io.in_flight(), "read_bytes": moved["read"],
                "written_bytes": moved["write"]}

    def close(self) -> None:
        """Remove the rank's files (the job is freed)."""
        self.tier.close()
        self.segments.close()


class AdoptedFiles:
    """What a TierManager that adopts a rank's plan takes as its NVMe tier (hosting.py): the
    rank's shards, handed out in the order the plan makes them, each checked for its size;
    closing it leaves the files, which are the job's."""

    def __init__(self, files: RankFiles):
        self._files = files
        self._taken = 0
        self.usage = files.tier.usage

    def create(self, what: str, nbytes: int) -> NvmeShard:
        number, self._taken = self._taken, self._taken + 1
        return self._files.kept_shard(number, what, nbytes)

    def remove(self, shard: ShardFile) -> None:
        raise TieredError("a host in the service never moves a state off NVMe (only a "
                          "trainer's re-plan does, to its GPU): the rank's files are its job's")

    def close(self) -> None:
        pass

    def live_runs_hint(self) -> str:
        return ""


class FileStream:
    """The requests of one trainer's NVMe tier, on its own connection (remote_nvme.py speaks the
    other end), routed here by the service's table (FILE_OPS): each answered once it is carried
    out, a transfer's from the I/O thread that finished it, so that many move at once."""

    def __init__(self, files: RankFiles, kept: bool, reply: Callable[[int, dict], None],
                 refuse: Callable[..., None]):
        """``reply(call, fields)`` answers a call, ``refuse(call, error, **fields)`` refuses it
        (the conversation's: conversation.py)."""
        self._files = files
        self._kept = kept
        """The rank's shards are a kept state's: ``create`` hands them out again in order."""
        self._created = 0
        self._reply = reply
        self._refuse = refuse
        self._versions: dict[int, NextVersion] = {}
        self._next_version = 0
        self._transfers: list[Transfer] = []

    def settle(self) -> None:
        """The trainer went, or ended its stream: what it left settles (see the Note)."""
        for transfer in self._transfers:
            transfer.settle()
        for version in self._versions.values():
            version.abandon()
            with contextlib.suppress(NvmeError):
                version.wait()
        self._versions.clear()

    def _answer_when(self, call: int, transfer: Transfer) -> None:
        self._transfers = [t for t in self._transfers if not t.done()]
        self._transfers.append(transfer)

        def finished(failure: BaseException | None) -> None:
            if failure is None:
                self._reply(call, {})
            else:
                self._refuse(call, str(failure), **refusal_fields(failure))
        transfer.on_done(finished)

    def _block(self, message: dict, nbytes_there: int) -> torch.Tensor:
        """The block a request names, whose bytes must fit the ``nbytes_there`` of its shard
        from the request's offset."""
        offset, nbytes = int(message["offset"]), int(message["nbytes"])
        if not 0 <= offset <= offset + nbytes <= nbytes_there:
            raise TieredError(f"bytes {offset}..{offset + nbytes} are outside the shard's "
                              f"{nbytes_there}")
        return self._files.segments.view(int(message["segment"]), int(message["at"]), nbytes)

    # -- the requests --------------------------------------------------------------------------

    def create(self, message: dict) -> tuple[dict, list[int]]:
        what, nbytes = str(message["what"]), int(message["nbytes"])
        if self._kept:
            shard = self._files.kept_shard(self._created, what, nbytes)
        else:
            tier = self._files.tier
            tier.usage.budget = int(message["budget"])
            shard = tier.create(what, nbytes)
            self._files.shards.append(shard)
        self._created += 1
        return {"shard": self._created - 1, "path": shard.path,
                "held": self._files.tier.usage.current}, []

    def read(self, message: dict) -> None:
        shard = self._files.shard(int(message["shard"]))
        block = self._block(message, shard.nbytes)
        self._answer_when(message["id"], shard.start_read(block, int(message["offset"]),
                                                    block.numel()))

    def moved(self, message: dict) -> tuple[dict, list[int]]:
        return {"moved": self._files.tier.bytes_moved()}, []

    def version(self, message: dict) -> tuple[dict, list[int]]:
        number, self._next_version = self._next_version, self._next_version + 1
        self._versions[number] = self._files.shard(int(message["shard"])).next_version()
        return {"version": number}, []

    def write(self, message: dict) -> None:
        version = self._version_of(message)
        block = self._block(message, version.nbytes)
        self._answer_when(message["id"], version.write(block, int(message["offset"]),
                                                       block.numel()))

    def commit(self, message: dict) -> tuple[dict, list[int]]:
        version = self._version_of(message, take=True)
        if message.get("abandon"):
            version.abandon()
        else:
            version.commit()
        version.wait()  # a failed write is this request's answer (the service's dispatch)
        return {}, []

    def _version_of(self, message: dict, take: bool = False) -> NextVersion:
        number = int(message["version"])
        version = self._versions.pop(number, None) if take else self._versions.get(number)
        if version is None:
            raise TieredError(f"no open NVMe version {number}")
        return version


FILE_OPS = {"create": FileStream.create, "read": FileStream.read,
            "version": FileStream.version, "write": FileStream.write,
            "commit": FileStream.commit, "moved": FileStream.moved}
"""A rank's NVMe tier's requests, routed by the service's table (server.ROUTES)."""
