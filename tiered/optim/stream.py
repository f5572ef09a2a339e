"""Optimizer states on NVMe, streamed through pinned DRAM in sub-groups.

[Note: state stream]
A unit's master weights (where it has them) and Adam moments on NVMe are cut into pieces of at
most ``optimizer.sub_group_size`` parameters, each starting where every state's file has a
4 KiB block (and, for packed 8-bit moments, a block of codes: tiers/moments.py's piece_granule).
Pieces go round three sets of pinned staging buffers: while piece i is stepped in set i % 3,
piece i+1 is being read into the next set and piece i-1 written back from the previous one.
Before a set is read into again, the writes from it (piece i-2) must have finished. A unit's
pieces are written into the next versions of its states (spare extents, see [Note: atomic shard
writes]), committed together after its last piece: they switch together once all is written,
or, if any piece failed, none does, so a unit's master weights and moments never come from
different steps. The stream ends when every version is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..core.sizes import align_up, even_pieces
from ..placement.manager import TierManager
from ..placement.plan import OPTIMIZER_STATES, STAGING_SETS, StateKind
from ..tiers.aio import Transfer
from ..tiers.dram import BLOCK_ALIGN
from ..tiers.moments import piece_granule, stored_span
from ..tiers.nvme import NvmeShard, VersionGroup, own_shard


@dataclass(frozen=True)
class Piece:
    unit: int
    start: int
    numel: int
    last: bool
    """The unit's last piece."""


StepPiece = Callable[[Piece, torch.Tensor | None, torch.Tensor, torch.Tensor], None]
"""Steps one piece, given its master weights (None where the unit keeps none) and two moments
(views into a staging set)."""


def unit_pieces(unit: int, numel: int, most: int, granule: int) -> list[Piece]:
    """A unit's ``numel`` parameters in as few pieces of at most ``most`` as there can be, of
    nearly equal size: a remainder of a few elements would be a pipeline stage of its own (and
    a shape the compiled kernel has not seen). Pieces start on multiples of ``granule``, where
    each state's file has a 4 KiB block, as O_DIRECT needs (tiers/moments.py's piece_granule)."""
    pieces = even_pieces(numel, most, granule)
    return [Piece(unit, start, count, k == len(pieces) - 1)
            for k, (start, count) in enumerate(pieces)]


class StateStream:
    def __init__(self, manager: TierManager, sub_group_size: int):
        self.manager = manager
        streamed = [unit for unit, kind in manager.shards if kind is StateKind.EXP_AVG
                    and manager.nvme_file(unit, kind) is not None]
        self.kinds = [kind for kind in OPTIMIZER_STATES if manager.has(streamed[0], kind)]
        """The states a streamed unit has (trained units all have the same)."""
        self.dtypes = {kind: manager.shards[(streamed[0], kind)].dtype for kind in self.kinds}
        # As the plan sized the staging sets (plan.staging_buffers).
        self.piece_numel = min(sub_group_size, max(self._numel(unit) for unit in streamed))
        self.granule = piece_granule(list(self.dtypes.values()))

    def _numel(self, unit: int) -> int:
        return self.manager.shards[(unit, StateKind.PARAM)].numel

    def pieces(self, unit: int) -> list[Piece]:
        return unit_pieces(unit, self._numel(unit), self.piece_numel, self.granule)

    def run(self, units: list[int], step_piece: StepPiece,
            unit_done: Callable[[int], None]) -> None:
        """Step every piece of ``units`` (whose optimizer states are on NVMe) in order; call
        ``unit_done(unit)`` after a unit's last piece has been stepped."""
        per_unit = [self.pieces(unit) for unit in units]
        for unit, its_pieces in zip(units, per_unit):
            if not its_pieces:  # no elements (a zero-size shard): nothing to step
                unit_done(unit)
        pieces = [piece for its_pieces in per_unit for piece in its_pieces]
        reads: dict[int, Transfer] = {}
        writes: dict[int, Transfer] = {}
        versions: dict[int, VersionGroup] = {}

        def start_read(i: int) -> None:
            slot = i % STAGING_SETS
            if slot in writes:
                writes.pop(slot).wait()  # the set still holds piece i-3's data on its way out
            piece = pieces[i]
            reads[i] = Transfer.joined([self._shard(piece.unit, kind).start_read(
                self._block(kind, slot), *self._span(piece, kind)) for kind in self.kinds])

        try:
            if pieces:
                start_read(0)
            for i, piece in enumerate(pieces):
                if i + 1 < len(pieces):
                    start_read(i + 1)
                reads.pop(i).wait()
                slot = i % STAGING_SETS
                views = {kind: self._view(kind, slot, piece) for kind in self.kinds}
                step_piece(piece, views.get(StateKind.MASTER), views[StateKind.EXP_AVG],
                           views[StateKind.EXP_AVG_SQ])
                if piece.unit not in versions:
                    versions[piece.unit] = VersionGroup(
                        [self._shard(piece.unit, kind).next_version()
                         for kind in self.kinds])
                writes[slot] = Transfer.joined(
                    [version.write(self._block(kind, slot), *self._span(piece, kind))
                     for version, kind in zip(versions[piece.unit].versions, self.kinds)])
                if piece.last:
                    group = versions.pop(piece.unit)
                    group.commit()
                    # unit_done announces the unit's new weights to readers (the next
                    # forward may overlap this update): only once its states are written, so
                    # a failed write leaves no reader computing on weights it did not keep.
                    # The next piece's read is already in flight meanwhile.
                    group.wait()
                    unit_done(piece.unit)
        finally:
            # On a failure, unfinished units keep their old versions: their spares go back.
            for group in versions.values():
                group.abandon()
            for transfer in (*reads.values(), *writes.values()):
                transfer.settle()  # no I/O thread may still use a staging set after this

    def _shard(self, unit: int, kind: StateKind) -> NvmeShard:
        return own_shard(self.manager.nvme_shard(unit, kind))

    def _span(self, piece: Piece, kind: StateKind) -> tuple[int, int]:
        """The byte offset and (whole 4 KiB blocks of) bytes of the piece in ``kind``'s file."""
        dtype = self.dtypes[kind]
        first, count = stored_span(dtype, piece.start, piece.numel)
        return first * dtype.itemsize, align_up(count * dtype.itemsize, BLOCK_ALIGN)

    def _view(self, kind: StateKind, slot: int, piece: Piece) -> torch.Tensor:
        dtype = self.dtypes[kind]
        return self._block(kind, slot).view(dtype)[:stored_span(dtype, 0, piece.numel)[1]]

    def _block(self, kind, slot: int) -> torch.Tensor:
        return self.manager.staging_block(f"{kind.value}{slot}")

