"""Moving one unit's state: gather its weights into HBM, release them, reduce its gradient.

Everything here runs on the current CUDA stream (or the CPU), in program order, so each copy and
collective is ordered after what produced its input and before what consumes its output, and a
buffer freed by ``resize_(0)`` is reused by the caching allocator only by later work on that same
stream. The side streams and prefetch of the overlap work will need events in these places.
"""
from __future__ import annotations

import torch

from ..manager import TierManager
from ..plan import StateKind, reduce_dtype
from ..policy import Policy
from .collectives import ProcessGroup
from .flat import FlatParam, Residency


class UnitRuntime:
    def __init__(self, flats: list[FlatParam], manager: TierManager, group: ProcessGroup,
                 policy: Policy):
        self.flats = flats
        self.manager = manager
        self.group = group
        self.reduce_dtype = reduce_dtype(policy, group.world_size)
        self.has_grad = [False] * len(flats)
        """Whether unit i's gradient shard holds a sum since the last ``zero_grad``."""
        self._gathered: dict[int, FlatParam] = {}
        """Storage address of each gathered unit's ``full``, to recognise views of it."""

    @property
    def hbm_usage(self):
        return self.manager.hbm.usage

    def gather(self, flat: FlatParam) -> None:
        """Fill ``flat.full`` from this rank's weight shard (wherever it lives) and the others'."""
        if flat.residency is Residency.GATHERED:
            return
        self.hbm_usage.acquire(flat.gathered_bytes, f"gathered unit {flat.name}")
        full = flat.allocate()
        mine = flat.own_shard(full)
        mine.copy_(self.manager.load(flat.spec.index, StateKind.PARAM))
        self.group.all_gather(full, mine)
        self._gathered[full.untyped_storage().data_ptr()] = flat

    def release(self, flat: FlatParam) -> None:
        if flat.residency is Residency.GATHERED:
            del self._gathered[flat.full.untyped_storage().data_ptr()]
            flat.free()
            self.hbm_usage.release(flat.gathered_bytes)

    def owner_of(self, tensor: torch.Tensor) -> FlatParam | None:
        """The gathered unit whose weights ``tensor`` is a view of, if any."""
        if tensor.layout is not torch.strided:
            return None
        return self._gathered.get(tensor.untyped_storage().data_ptr())

    def release_all(self) -> None:
        for flat in self.flats:
            self.release(flat)

    def reduce_grad(self, flat: FlatParam) -> None:
        """Average the unit's full gradient over ranks into this rank's shard, add it to the grads
        tier, and drop the full gradient and the gathered weights."""
        grad = flat.full.grad
        flat.full.grad = None
        transient = grad.numel() * grad.element_size()
        self.hbm_usage.acquire(transient, f"gradient of unit {flat.name}")
        if self.group.world_size > 1:
            full32 = grad.to(self.reduce_dtype)
            shard = torch.empty(flat.shard_numel, dtype=self.reduce_dtype, device=grad.device)
            extra = (full32.numel() * 4 if full32 is not grad else 0) + shard.numel() * 4
            self.hbm_usage.acquire(extra, f"fp32 gradient reduction of unit {flat.name}")
            transient += extra
            self.group.reduce_scatter_mean(shard, full32)
            del full32
        else:
            shard = grad
        index = flat.spec.index
        self.manager.accumulate_grad(index, shard, overwrite=not self.has_grad[index])
        self.has_grad[index] = True
        del grad, shard
        self.hbm_usage.release(transient)
        self.release(flat)

    def zero_grad(self, set_to_none: bool) -> None:
        """``set_to_none`` only forgets the sums (the next backward overwrites); otherwise the
        shards are zeroed and count as gradients of zero, as in PyTorch."""
        for i in range(len(self.flats)):
            if not set_to_none:
                self.manager.zero_grad(i)
            self.has_grad[i] = not set_to_none

    def write_weights(self, index: int, master: torch.Tensor) -> None:
        """After an optimizer step: the new compute-dtype weights, cast from ``master``."""
        self.manager.store(index, StateKind.PARAM, master)
