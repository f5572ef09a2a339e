"""A unit's parameters as one flat, partitioned buffer (ZeRO-3).

The unit's parameters are laid end to end and padded to a multiple of the world size W; rank r
owns elements ``[r*S, (r+1)*S)`` with ``S = padded / W``. While the unit is gathered, ``full``
holds all of them in the compute dtype on the device, and each module attribute that held an
original parameter is bound to a view of it.

[Note: gathered storage]
``full`` is one autograd leaf that lives as long as the engine. Gathering allocates its storage
(``untyped_storage().resize_``) and fills it; releasing shrinks the storage to zero bytes. The
views handed to modules, and the ones autograd saves for backward, share that storage, so after
the unit is gathered again for backward they see the same values without autograd knowing
anything happened. Writes go through ``_writer`` (``full.data``), whose version counter is its
own: filling the buffer does not bump the version autograd checks on saved tensors.

[Note: one gradient per unit]
Views come from a single ``split`` of ``full``, so autograd sums every view's gradient (zeros for
views that were not used, and for the padding) into ``full.grad`` in one node, and the
post-accumulate-grad hook on ``full`` fires once per backward with the whole unit's gradient.
A frozen parameter's view is detached: autograd computes no gradient for it (a frozen linear
layer's backward computes its input's gradient only), and its part of ``full.grad`` is zeros.
A unit with only frozen parameters never gets a gradient; see [Note: frozen units] in hooks.py.
"""
from __future__ import annotations

import enum
from typing import Sequence

import torch

from ..device import accelerator_for
from ..placement.units import UnitSpec
from ..tiers.quantized import QuantizedUnit
from .collectives import kept_after_failure
from .released import ReleasedWeight


class Residency(enum.Enum):
    RELEASED = "released"  # storage of ``full`` is zero bytes
    GATHERED = "gathered"  # ``full`` holds the unit's current compute-dtype weights


class FlatParam:
    def __init__(self, spec: UnitSpec, rank: int, world_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.numels = [p.numel for p in spec.params]
        self.has_trainable = any(p.trainable for p in spec.params)
        """Whether any of its parameters requires grad (else its backward gives no gradient)."""
        self.numel = sum(self.numels)
        self.padded_numel = -(-self.numel // world_size) * world_size
        self.shard_numel = self.padded_numel // world_size
        # Born released: shaped like the whole unit over a zero-byte storage. ``set_`` grows
        # the storage to fit the shape, so it is shrunk again at once: left at full size, the
        # units held a whole model's weights on the device until each was first gathered.
        self._accelerator = accelerator_for(device)
        """Who takes the storage's memory back at each release (the caching allocator)."""
        self.full = torch.empty(0, dtype=dtype, device=device).set_(
            torch.UntypedStorage(0, device=device), 0, (self.padded_numel,), (1,))
        self._accelerator.release_storage(self.full)
        self.full.requires_grad_()
        self._writer = self.full.data  # see [Note: gathered storage]
        self._storage_bytes = self.padded_numel * dtype.itemsize
        self.residency = Residency.RELEASED
        self._placeholders = [ReleasedWeight(p.shape, dtype, p.names[0], self.name, p.trainable,
                                             device) for p in spec.params]
        """What the modules hold while the unit is released ([Note: released weights])."""
        self.views_bound = False
        """Whether the modules hold views of ``full`` (else the placeholders)."""
        self.record: QuantizedUnit | None = None
        """The layout of the quantized record its frozen weights are kept as, if they are
        (engine/quantized.py; [Note: quantized frozen weights] in tiers/quantized.py)."""

    @property
    def placeholders(self) -> list[ReleasedWeight]:
        """What the modules hold for each parameter (in spec order) while the unit is released."""
        return self._placeholders

    @property
    def name(self) -> str:
        name = self.spec.path or "<root>"
        return f"{name} (frozen)" if self.spec.frozen_part else name

    @property
    def gathered_bytes(self) -> int:
        """Device bytes while gathered: ``full``, and a record's bytes all-gathered beside it
        to be dequantized into it with the temporaries of its largest chunk ([Note: quantized
        frozen weights] in tiers/quantized.py)."""
        record = self.record
        return self._storage_bytes + (record.nbytes + record.scratch_bytes
                                      if record is not None else 0)

    @property
    def shard_range(self) -> tuple[int, int]:
        start = self.rank * self.shard_numel
        return start, start + self.shard_numel

    def allocate(self) -> torch.Tensor:
        """Give ``full`` its storage back; returns the tensor to fill (``_writer``)."""
        assert self.residency is Residency.RELEASED, f"unit {self.name} is already gathered"
        self.full.untyped_storage().resize_(self._storage_bytes)
        self.residency = Residency.GATHERED
        return self._writer

    def free(self) -> None:
        assert self.residency is Residency.GATHERED, f"unit {self.name} is not gathered"
        self._accelerator.release_storage(self.full)
        self.bind_placeholders()
        self.residency = Residency.RELEASED

    def abandon(self) -> None:
        """Release the unit after a collective into ``full`` raised: that collective may still
        write into its storage, so the storage is kept for the rest of the process, never
        shrunk, and ``full`` takes a new, zero-byte one (see [Note: failed collectives] in
        collectives.py)."""
        assert self.residency is Residency.GATHERED, f"unit {self.name} is not gathered"
        kept_after_failure(self.full.untyped_storage())
        fresh = torch.UntypedStorage(self._storage_bytes, device=self.full.device)
        with torch.no_grad():  # a leaf that requires grad takes a new storage only so
            self.full.set_(fresh, 0, (self.padded_numel,), (1,))
        fresh.resize_(0)
        self._writer = self.full.data
        self.bind_placeholders()
        self.residency = Residency.RELEASED

    def bind_placeholders(self) -> None:
        """Point every holder at its parameter's placeholder (the unit is released)."""
        self._bind(self._placeholders)
        self.views_bound = False

    def own_shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded flat tensor."""
        start, end = self.shard_range
        return full[start:end]

    def bind_views(self) -> None:
        """Point every holder of every parameter at its view of ``full``.

        Called at each forward of the unit, so that under grad mode the views are linked to
        ``full`` in this forward's autograd graph (see [Note: one gradient per unit]).
        """
        pad = self.padded_numel - self.numel
        pieces = self.full.split(self.numels + [pad] if pad else self.numels)
        self._bind([piece.view(param.shape) if param.trainable
                    else piece.detach().view(param.shape)
                    for param, piece in zip(self.spec.params, pieces)])
        self.views_bound = True

    def _bind(self, tensors: Sequence[torch.Tensor]) -> None:
        """Point every holder of each parameter at its tensor (one per parameter)."""
        for param, tensor in zip(self.spec.params, tensors):
            for module, attr in param.holders:
                module.__dict__[attr] = tensor

    def flatten(self, tensors: list[torch.Tensor], out: torch.Tensor) -> None:
        """Copy original-layout tensors (one per parameter) into a padded flat ``out``."""
        offset = 0
        for tensor, numel in zip(tensors, self.numels):
            out[offset:offset + numel].copy_(tensor.reshape(-1))
            offset += numel
        out[offset:].zero_()

    def by_name(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a flat tensor in the original parameters' shapes, under their state-dict
        names (a tied parameter's one view under each of its names)."""
        views = [piece.view(spec.shape) for piece, spec in
                 zip(flat[:self.numel].split(self.numels), self.spec.params)]
        return {name: view for view, spec in zip(views, self.spec.params) for name in spec.names}
