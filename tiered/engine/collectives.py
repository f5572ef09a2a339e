"""The three collectives the engine needs, over torch.distributed or a single process.

torch renamed the tensor forms (``all_gather_into_tensor`` -> ``all_gather_single``, likewise
reduce-scatter) in 2.13; both names are accepted so the same code runs on every torch >= 2.4.

[Note: failed collectives]
A collective that raised may still be running: gloo's worker thread went on copying an
all-gather's result into its output after the call had raised in the training thread (a peer
gone at a stop signal), and a rank that had freed that output meanwhile crashed with SIGSEGV
in the gloo thread (seen here as a rank of a 2-rank job dying at Ctrl-C, its NVMe folder left
half-removed). So the tensors of a collective that raised are kept (``kept_after_failure``) for
the rest of the process, and a gathered unit whose all-gather raised keeps its storage
(FlatParam.abandon) instead of shrinking it: the process is leaving, or its group is broken.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_kept: list = []
"""Tensors and storages of collectives that raised: never freed (see [Note: failed
collectives])."""


def kept_after_failure(*objects) -> None:
    """Keep ``objects`` (tensors, storages) alive for the rest of the process."""
    _kept.extend(objects)


@contextlib.contextmanager
def _kept_if_raised(*tensors: torch.Tensor):
    try:
        yield
    except BaseException:
        kept_after_failure(*tensors)
        raise


@dataclass(frozen=True)
class ProcessGroup:
    """This rank's place in the data-parallel group (world size 1 without torch.distributed)."""

    rank: int
    world_size: int
    device: torch.device
    """Where small tensors for collectives live (the compute device: NCCL needs CUDA tensors)."""
    group: dist.ProcessGroup | None = None

    @classmethod
    def current(cls, device: torch.device) -> "ProcessGroup":
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), device, dist.group.WORLD)
        return cls(0, 1, device)

    def on_host(self) -> "ProcessGroup":
        """The same ranks over a gloo communicator of their own, on CPU tensors: for the few
        small collectives the CPU worker issues from its own thread. Their order there cannot
        interleave with this group's, and, unlike a second NCCL communicator, they launch no
        device kernels that could wait on the training thread's collectives in another
        order on another rank."""
        if self.world_size == 1:
            return ProcessGroup(self.rank, 1, torch.device("cpu"))
        return ProcessGroup(self.rank, self.world_size, torch.device("cpu"),
                            dist.new_group(list(range(self.world_size)), backend="gloo"))

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Fill ``full`` with every rank's ``shard``; ``shard`` may be this rank's slice of it."""
        if self.world_size == 1:
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return
        with _kept_if_raised(full, shard):
            _all_gather(full, shard, group=self.group)

    def reduce_scatter_mean(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """``shard`` = this rank's slice of the mean of ``full`` over ranks (DDP's average)."""
        full.div_(self.world_size)
        with _kept_if_raised(full, shard):
            _reduce_scatter(shard, full, group=self.group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            with _kept_if_raised(tensor):
                dist.all_reduce(tensor, group=self.group)

    def smallest(self, value: int) -> int:
        """The least of ``value`` over the ranks (a collective: every rank must call it)."""
        if self.world_size == 1:
            return value
        least = torch.tensor([value], dtype=torch.int64, device=self.device)
        with _kept_if_raised(least):
            dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.group)
        return int(least.item())

    def barrier(self) -> None:
        self.all_reduce_sum(torch.zeros(1, device=self.device))

    def agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a collective: every rank must call it)."""
        failures = torch.tensor([0.0 if ok else 1.0], device=self.device)
        self.all_reduce_sum(failures)
        return failures.item() == 0

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.world_size > 1:
            with _kept_if_raised(tensor):
                dist.broadcast(tensor, src=src, group=self.group)
