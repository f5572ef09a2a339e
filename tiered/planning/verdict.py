"""Whether a plan fits its node, said in one line: ``tiered plan``'s last (issue 33, item 1).

A plan fits when every tier holds what it needs within its budget: on a GPU, the HBM tier its
plan and, with a batch counted, the batch's activations and the re-plan's margin (1/16 of the
budget: what a backward allocates on its way, BatchFit's rule); the DRAM tier its plan within
its share of the node's memory. On a CPU device the two tiers are the same RAM, so what they
need together is held against it (and each against a budget the policy sets). The NVMe tier
has a budget only where the policy sets one: the drive's free space changes from one moment to
the next, and the same question must get the same answer. A plan that does not fit says which
tier and by how much; what would make it fit is found by planning each change
(launch/plan_model.py) and only the changes that fit are offered.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.sizes import format_size


@dataclass(frozen=True)
class TierRoom:
    """What a tier (or, on a CPU device, the RAM its two tiers share) needs and may hold."""

    name: str
    needed: int
    budget: int | None
    """None: not known, so not checked."""

    @property
    def over(self) -> int:
        """Bytes past the budget (0 within it, or without one)."""
        return 0 if self.budget is None else max(0, self.needed - self.budget)

    @property
    def headroom(self) -> int | None:
        return None if self.budget is None else self.budget - self.needed

    def said(self) -> str:
        if self.budget is None:
            return f"{self.name} {format_size(self.needed)}, no budget known"
        if self.over:
            return (f"{self.name} needs {format_size(self.needed)} of "
                    f"{format_size(self.budget)}, {format_size(self.over)} over")
        return f"{self.name} {format_size(self.headroom or 0)} free"

    def to_dict(self) -> dict:
        return {"tier": self.name, "needed": self.needed, "budget": self.budget,
                "over": self.over, "headroom": self.headroom}


@dataclass(frozen=True)
class Suggestion:
    """A change that makes the plan fit, as planned with it."""

    change: str
    """What to change, as the user would: a policy key and value, or the command's flags."""
    step_s: float | None
    """The step the node's rates predict for it, at least (None without rates)."""
    bound: str | None = None
    """What bounds that step."""

    def line(self) -> str:
        step = ("" if self.step_s is None
                else f", at least {self.step_s:.3g} s/step (bound by {self.bound})")
        return f"{self.change}: fits{step}"

    def to_dict(self) -> dict:
        return {"change": self.change, "fits": True, "step_s": self.step_s,
                "bound": self.bound}


@dataclass(frozen=True)
class Verdict:
    rooms: tuple[TierRoom, ...]
    suggestions: tuple[Suggestion, ...] = ()
    """For a plan that does not fit: the changes that, planned, fit."""
    tried: tuple[str, ...] = ()
    """The changes planned, alone and up to three together (said when none fits)."""
    note: str | None = None
    """What the budgets are, or what the verdict leaves out (activations without --batch)."""

    @property
    def fits(self) -> bool:
        return not any(room.over for room in self.rooms)

    def lines(self) -> list[str]:
        if self.fits:
            lines = ["verdict: fits (" + "; ".join(room.said() for room in self.rooms) + ")"]
        else:
            over = [room for room in self.rooms if room.over]
            lines = ["verdict: does not fit: " + "; ".join(room.said() for room in over)]
            if self.suggestions:
                lines.append("what makes it fit (each planned):")
                lines += [f"  {suggestion.line()}" for suggestion in self.suggestions]
            elif self.tried:
                lines.append("nothing tried fits, alone or together: "
                             + "; ".join(self.tried))
        if self.note:
            lines.insert(0, self.note)
        return lines

    def to_dict(self) -> dict:
        return {"fits": self.fits, "tiers": [room.to_dict() for room in self.rooms],
                "over": [room.to_dict() for room in self.rooms if room.over],
                "suggestions": [suggestion.to_dict() for suggestion in self.suggestions],
                "tried": list(self.tried), "note": self.note}
