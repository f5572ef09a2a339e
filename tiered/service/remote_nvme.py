"""The trainer's NVMe tier when the node's service holds the rank's files (service/files.py, [Note:
NVMe in the service]): the face of tiers/nvme.py's NvmeTier that TierManager uses, every read and
write a request on a connection of its own. Blocks are named by where they lie in the rank's
segments (the DRAM tier's slabs are the service's memory), so no byte crosses the socket.

Requests carry an id and are answered in the order they finish, not the order sent: the
read-ahead ring's reads and a checkpoint's writes move at once, as they do in-process.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import warnings

import torch

from ..core.sizes import format_size
from ..tiers.aio import IoSettings
from ..tiers.nvme import check_nvme_path, extent_bytes, free_bytes, live_runs_hint
from ..tiers.usage import TierUsage
from . import wire
from .client import ServiceClient, ServiceSlabSource, refusal
from .paths import ServiceError


class _Answer:
    """One request's answer, once it comes."""

    def __init__(self, op: str):
        self.op = op
        self._came = threading.Event()
        self._reply: dict | None = None

    def settle(self, reply: dict) -> None:
        self._reply = reply
        self._came.set()

    def wait(self) -> dict:
        self._came.wait()
        if "error" in self._reply:
            raise refusal(self._reply, f"the tiered service could not {self.op} on NVMe")
        return self._reply


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
        self._client = ServiceClient.connect(source.client.paths.folder)
        try:
            reply, _ = self._client.request("files", job=source.job, rank=rank, root=root,
                                            block_size=io.block_size,
                                            queue_depth=io.queue_depth)
        except BaseException:
            self._client.close()
            raise
        self.run_dir: str = reply["folder"]
        for folder, freed in reply["removed"]:
            warnings.warn(f"tiered: the node's service removed {folder}, the NVMe folder of a "
                          f"run that is gone, freeing {format_size(freed)}", stacklevel=2)
        # The kept shards' bytes are this rank's already: its share is what they leave free
        # and them.
        self.usage = TierUsage("nvme", free_bytes(root) // max(1, ranks) + reply["held"]
                               if budget is None else budget)
        self._ids = itertools.count()
        self._answers: dict[int, _Answer] = {}
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        self._gone: str | None = None
        self._sock: socket.socket = self._client.socket
        self._sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, name="tiered-nvme-answers",
                                        daemon=True)
        self._reader.start()

    def create(self, what: str, nbytes: int) -> "RemoteShard":
        """A shard state of ``nbytes`` with its size's spares, made by the service (or, for a
        kept state, the kept one the plan makes next)."""
        reply = self.call("create", what=what, nbytes=nbytes, budget=self.usage.budget).wait()
        self.usage.follow(int(reply["held"]))
        return RemoteShard(self, int(reply["shard"]), extent_bytes(nbytes), str(reply["path"]))

    def call(self, op: str, **fields) -> _Answer:
        answer = _Answer(op)
        with self._lock:
            if self._gone is not None:
                raise ServiceError(f"the node's service is gone ({self._gone}): NVMe {op} "
                                   f"cannot run")
            number = next(self._ids)
            self._answers[number] = answer
        try:
            # Not under the answers' lock: the reader takes it to hand answers out, and a send
            # may wait for the service to read, which may wait for this side to read.
            with self._sending:
                wire.send(self._sock, {"op": op, "id": number, **fields})
        except OSError as e:
            with self._lock:
                self._answers.pop(number, None)
            raise ServiceError(f"the node's service is gone ({e}): NVMe {op} cannot "
                               f"run") from None
        return answer

    def bytes_moved(self) -> dict[str, int]:
        """Bytes the service read and wrote for this rank so far: the trainer's transfers and
        its host's (NvmeTier.bytes_moved)."""
        return {verb: int(n) for verb, n in self.call("moved").wait()["moved"].items()}

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
            waiting = list(self._answers.values())
        for answer in waiting:
            answer._came.wait()
        with contextlib.suppress(ServiceError):  # a service that is gone ended it already
            self.call("end").wait()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._client.close()
        self._reader.join()
        self.usage.follow(0)

    def _read(self) -> None:
        while True:
            try:
                message, fds = wire.receive(self._sock)
            except (wire.WireError, OSError) as e:
                with self._lock:
                    self._gone = str(e)
                    waiting, self._answers = self._answers, {}
                for answer in waiting.values():
                    answer.settle({"error": f"the node's service is gone ({e})"})
                return
            for fd in fds:
                os.close(fd)
            with self._lock:
                answer = self._answers.pop(message.get("id"), None)
            if answer is not None:
                answer.settle(message)


class RemoteTransfer:
    """A read or write the service carries out; :meth:`wait` raises its failure."""

    def __init__(self, answer: _Answer):
        self._answer = answer

    def wait(self) -> None:
        self._answer.wait()


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
        reply = self._tier.call("version", shard=self.number).wait()
        return RemoteVersion(self._tier, int(reply["version"]), self.nbytes)


class RemoteVersion:
    """NextVersion's face: a shard's next version, written in pieces, switched to on commit."""

    def __init__(self, tier: ServiceNvme, number: int, nbytes: int):
        self._tier = tier
        self._number = number
        self._nbytes = nbytes
        self._settled: _Answer | None = None

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
        self._settled.wait()
