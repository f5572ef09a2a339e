"""Optimizer states on NVMe, streamed through pinned DRAM in sub-groups.

[Note: state stream]
A unit's master weights and Adam moments on NVMe are cut into pieces of at most
``optimizer.sub_group_size`` elements. Pieces go round three sets of pinned staging buffers:
while piece i is stepped in set i % 3, piece i+1 is being read into the next set and piece i-1
written back from the previous one. Before a set is read into again, the writes from it (piece
i-2) must have finished. A unit's pieces are written into the next versions of its three states
(spare extents, see [Note: atomic shard writes]), committed together after its last piece: the
three switch together once all is written, or, if any piece failed, none does, so a unit's
master weights and moments never come from different steps. The stream ends when every version
is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..manager import TierManager
from ..plan import OPTIMIZER_STATES, STAGING_SETS
from ..sizes import align_up, even_pieces
from ..tiers.aio import Transfer
from ..tiers.dram import BLOCK_ALIGN
from ..tiers.nvme import VersionGroup


@dataclass(frozen=True)
class Piece:
    unit: int
    start: int
    numel: int
    last: bool
    """The unit's last piece."""


StepPiece = Callable[[Piece, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""Steps one piece, given its master weights and two moments (views into a staging set)."""


class StateStream:
    def __init__(self, manager: TierManager, sub_group_size: int):
        self.manager = manager
        block = manager.staging_block(f"{OPTIMIZER_STATES[0].value}0")
        self.piece_numel = min(sub_group_size, block.numel() // 4)

    def pieces(self, unit: int) -> list[Piece]:
        """The unit's states in as few pieces as fit the staging buffers, of nearly equal size:
        a remainder of a few elements would be a pipeline stage of its own (and a shape the
        compiled kernel has not seen). Pieces start on 4 KiB of fp32, as O_DIRECT needs."""
        numel = self.manager.shards[(unit, OPTIMIZER_STATES[0])].numel
        pieces = even_pieces(numel, self.piece_numel, BLOCK_ALIGN // 4)
        return [Piece(unit, start, count, k == len(pieces) - 1)
                for k, (start, count) in enumerate(pieces)]

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
        versions: dict[int, list] = {}

        def start_read(i: int) -> None:
            slot = i % STAGING_SETS
            if slot in writes:
                writes.pop(slot).wait()  # the set still holds piece i-3's data on its way out
            piece = pieces[i]
            offset, nbytes = self._span(piece)
            reads[i] = Transfer.joined([self.manager.nvme_file(piece.unit, kind).start_read(
                self._block(kind, slot), offset, nbytes) for kind in OPTIMIZER_STATES])

        try:
            if pieces:
                start_read(0)
            for i, piece in enumerate(pieces):
                if i + 1 < len(pieces):
                    start_read(i + 1)
                reads.pop(i).wait()
                slot = i % STAGING_SETS
                views = [self._block(kind, slot).view(torch.float32)[:piece.numel]
                         for kind in OPTIMIZER_STATES]
                step_piece(piece, *views)
                if piece.unit not in versions:
                    versions[piece.unit] = VersionGroup(
                        [self.manager.nvme_file(piece.unit, kind).next_version()
                         for kind in OPTIMIZER_STATES])
                offset, nbytes = self._span(piece)
                writes[slot] = Transfer.joined(
                    [version.write(self._block(kind, slot), offset, nbytes)
                     for version, kind in zip(versions[piece.unit].versions, OPTIMIZER_STATES)])
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

    def _span(self, piece: Piece) -> tuple[int, int]:
        return piece.start * 4, align_up(piece.numel * 4, BLOCK_ALIGN)

    def _block(self, kind, slot: int) -> torch.Tensor:
        return self.manager.staging_block(f"{kind.value}{slot}")

