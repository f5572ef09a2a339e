"""``tiered plan``'s answer: the plan of what was asked, its verdict, and for a plan that does
not fit, the changes that make it fit, each found by planning it (issue 33, item 1).

The changes tried are the ones a user can make without another machine. Placements: the
states DRAM cannot hold moved to NVMe (``dram.spill: nvme`` with ``--nvme PATH``; under ``tier:
auto`` the path alone), 8-bit moments (``optimizer.moments: int8``), a LoRA question's frozen
base kept in nf4 (``params.frozen_dtype``), the host placement of ``configs/cpu.yaml`` for a
policy that keeps states on the device. Changes of what is run: LoRA
adapters of rank 16 in place of training every weight, a smaller batch, activation
checkpointing. Each is tried alone; the placements also by twos and threes where none fits
alone, even if LoRA or a smaller batch does (a run as asked is worth more than another run);
where still nothing fits, any two or three together. A combination holding one that fits
already is not tried. Each is planned as the question itself is (the model built once per LoRA
rank and checkpointing, its units cut once, the activations counted once per batch), and only
those whose plan fits are offered, with the step the node's rates predict for them.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..core import progress
from ..core.errors import TieredError, UsageError
from ..engine.build import flat_units
from ..engine.flat import FlatParam
from ..placement.plan import activation_slots
from ..planning.longest import Growth, NvmeRoom, SequenceFit, longest_sequences
from ..planning.node import NodeMemory, NodeRates, cached_node_rates
from ..planning.report import PlanReport
from ..planning.verdict import Suggestion
from ..policy.config import Policy, resolve
from ..policy.kinds import FrozenDtype, MomentsDtype, Tier
from .plan_model import (batch_activations, device_room, forward_bytes, model_on_meta,
                         node_memory, plan_model, planned_on_gpu, read_node)

LORA_RANK = 16
"""The LoRA rank suggested for a full fine-tune that does not fit (a common choice)."""


@dataclass(frozen=True)
class PlanQuestion:
    """What ``tiered plan`` is asked, its arguments read (see plan_model's module note)."""

    spec: str
    policy: Policy
    """With ``compute_dtype`` made concrete for the planned device, as initialize makes it."""
    ranks: int
    rates: NodeRates | None
    memory: NodeMemory
    batch: int | None = None
    seq: int | None = None
    lora: int | None = None
    checkpointing: bool = False
    tile: int | None = None
    """Tokens a tile of the MLPs and the loss (tiered.ops.long_sequence), or None."""


def question_of(spec: str, policy_file: str | None, nvme: str | None, ranks: int,
                node: str | None, batch: int | None, seq: int | None, lora: int | None,
                checkpointing: bool,
                concrete: Callable[[Policy], tuple[Policy, str]],
                tile: int | None = None, frozen_dtype: str | None = None) -> PlanQuestion:
    """The question the command's arguments ask; a bad one is refused by name.
    ``concrete(policy)``: the policy with ``compute_dtype: auto`` made concrete as the command
    decides it (the node file does not say what its device computes natively).
    ``frozen_dtype``: sets params.frozen_dtype over the policy's, as --nvme sets nvme.path."""
    for flag, value in (("--ranks", ranks), ("--batch", batch), ("--seq", seq),
                        ("--lora", lora), ("--tile", tile)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if (batch is None) != (seq is None):
        raise UsageError("--batch and --seq go together: the sequences and their tokens")
    for flag, given in (("--checkpointing", checkpointing), ("--tile", tile is not None)):
        if given and batch is None:
            raise UsageError(f"{flag} changes the activations only: give --batch and --seq too")
    path = os.path.abspath(os.path.expanduser(nvme)) if nvme else None
    overrides: dict = {"nvme": {"path": path}} if path else {}
    if frozen_dtype is not None:
        overrides["params"] = {"frozen_dtype": frozen_dtype}
    policy = resolve(policy_file, overrides)
    rates = read_node(node) if node else cached_node_rates(policy.nvme.path)
    memory = node_memory(rates, from_file=node is not None)
    policy, _ = concrete(policy)
    return PlanQuestion(spec, policy, ranks, rates, memory, batch, seq, lora, checkpointing,
                        tile)


class _Planner:
    """Plans of one model under several changes, sharing what they can: the model built once
    per LoRA rank and checkpointing, its units cut once per cut, the activations counted once
    per batch."""

    def __init__(self) -> None:
        self._models: dict[tuple, nn.Module] = {}
        self._flats: dict[tuple, list[FlatParam]] = {}
        self._activations: dict[tuple, tuple[int, int]] = {}

    def _model(self, question: PlanQuestion, checkpointing: bool) -> nn.Module:
        key = (question.lora, checkpointing, question.tile)
        if key not in self._models:
            self._models[key] = model_on_meta(question.spec, question.lora, checkpointing,
                                              question.tile)
        return self._models[key]

    def report(self, question: PlanQuestion) -> PlanReport:
        model_key = (question.lora, question.checkpointing, question.tile)
        model, policy = self._model(question, question.checkpointing), question.policy
        batch = None
        if question.batch is not None and question.seq is not None:
            for_gpu = planned_on_gpu(policy, question.memory)
            key = (*model_key, question.batch, question.seq, policy.compute_dtype, for_gpu)
            if key not in self._activations:
                self._activations[key] = batch_activations(
                    model, question.spec, policy, question.batch, question.seq, for_gpu)
            batch = (question.batch, question.seq, *self._activations[key])
        return plan_model(model, policy, question.ranks, question.rates, batch,
                          question.memory, self._units(question))

    def _units(self, question: PlanQuestion) -> list[FlatParam]:
        """The question's model cut into units under its policy (once per cut)."""
        policy = question.policy
        cut = (question.lora, question.checkpointing, question.tile, policy.units,
               policy.compute_dtype, policy.params.frozen_dtype, question.ranks)
        if cut not in self._flats:
            self._flats[cut] = flat_units(self._model(question, question.checkpointing),
                                          policy, 0, question.ranks, torch.device("cpu"))
        return self._flats[cut]

    def longest(self, question: PlanQuestion, report: PlanReport) -> SequenceFit | None:
        """The longest sequence at the question's batch for each activation tier (see [Note:
        the longest sequence]): for a GPU, with --batch and --seq."""
        policy, batch, seq = question.policy, question.batch, question.seq
        if (batch is None or seq is None or report.batch is None
                or not planned_on_gpu(policy, question.memory)
                or report.budgets.get(Tier.HBM) is None):
            return None

        def growth(checkpointing: bool, at_seq: int | None = None) -> Growth:
            model = self._model(question, checkpointing)
            at = at_seq if at_seq is not None else forward_bytes(
                model, question.spec, policy, batch, seq, True)
            return Growth.through(seq, at, forward_bytes(model, question.spec, policy, batch,
                                                         2 * seq, True))

        saved = growth(question.checkpointing, report.batch.activations)
        whole = saved if not question.checkpointing else growth(False)
        units = max(1, len(self._units(question)) - 1)  # the root's are not a block's
        hbm_room = device_room(report.needed[Tier.HBM], report.budgets[Tier.HBM])
        assert hbm_room is not None  # an HBM budget, checked above
        dram_budget = report.budgets.get(Tier.DRAM)
        dram_room = (None if dram_budget is None  # the block planned already is theirs too
                     else dram_budget - report.needed[Tier.DRAM]
                     + policy.activations.block_bytes)
        rates = question.rates
        pinned = (None if rates is None or not rates.d2h_gbps or not rates.h2d_gbps
                  else (rates.d2h_gbps, rates.h2d_gbps))
        nvme = None
        if policy.nvme.path:  # the file and slots planned already are theirs too
            slots, slot_bytes = activation_slots(policy)
            nvme = NvmeRoom(
                None if policy.nvme.budget is None
                else policy.nvme.budget - report.needed.get(Tier.NVME, 0)
                + policy.activations.file_bytes,
                None if rates is None or not rates.nvme_write_gbps or not rates.nvme_read_gbps
                else (rates.nvme_write_gbps, rates.nvme_read_gbps),
                0 if policy.activations.file_bytes else slots * slot_bytes)
        return longest_sequences(batch, saved, whole.shared(units), hbm_room, dram_room, pinned,
                                 nvme)


Change = tuple[str, Callable[[PlanQuestion], "PlanQuestion | None"]]
"""A change to try: what the user would change, and the question it makes of another (None
where that question's policy refuses it)."""


def answer(question: PlanQuestion) -> PlanReport:
    """The plan of ``question`` with its verdict and, when it does not fit, the changes that
    make it fit (see the module note): each alone; then the placements together, where none
    fits alone (a run as asked, every weight trained at this batch, is worth more than a
    change of what is run, so they are tried even where LoRA or a smaller batch fits); then,
    where still nothing fits, any two or three together."""
    planner = _Planner()
    report = planner.report(question)
    report = dataclasses.replace(report, sequences=planner.longest(question, report))
    assert report.verdict is not None  # plan_model gives one
    if report.verdict.fits:
        return report
    placements, others = _placement_changes(question), _task_changes(question, report)
    suggestions: list[Suggestion] = []
    fitting: list[set[str]] = []

    def attempt(together: tuple[Change, ...]) -> None:
        names = {change for change, _ in together}
        if any(fit <= names for fit in fitting):  # more than what fits already: not offered
            return
        suggestion = _try(planner, question, together)
        if suggestion is not None:
            suggestions.append(suggestion)
            fitting.append(names)

    for change in progress.counted(placements + others, "planning each change that could make "
                                   "it fit", "change"):
        attempt((change,))
    if not any(names <= set(dict(placements)) for names in fitting):
        for size in (2, 3):
            for together in itertools.combinations(placements, size):
                attempt(together)
    if not suggestions:
        for size in (2, 3):
            for together in itertools.combinations(placements + others, size):
                if any(change in others for change in together):  # the rest were tried
                    attempt(together)
    # Said as the changes tried, alone and together: every combination is in the count.
    verdict = dataclasses.replace(
        report.verdict, suggestions=tuple(suggestions),
        tried=tuple(change for change, _ in placements + others))
    return dataclasses.replace(report, verdict=verdict)


def _try(planner: _Planner, question: PlanQuestion,
         together: tuple[Change, ...]) -> Suggestion | None:
    """``question`` with the changes ``together``, planned: a suggestion when it fits."""
    changed: PlanQuestion | None = question
    for _, make in together:
        changed = None if changed is None else make(changed)
    if changed is None:  # a policy that refuses the changes together: not offered
        return None
    try:
        report = planner.report(changed)
    except TieredError:  # a change this model cannot take: not offered
        return None
    if report.verdict is None or not report.verdict.fits:
        return None
    step = bound = None
    nvme_unmeasured = (Tier.NVME in report.needed and changed.rates is not None
                       and changed.rates.nvme_read_gbps is None)
    if report.terms is not None and not nvme_unmeasured:
        bound, step = report.terms.bound
    return Suggestion(" and ".join(change for change, _ in together), step, bound)


def _replaced(question: PlanQuestion, **overrides) -> PlanQuestion | None:
    """``question`` with its policy's keys ``overrides`` (None where the policy refuses them
    beside the keys it sets)."""
    try:
        return dataclasses.replace(question, policy=question.policy.replace(**overrides))
    except TieredError:
        return None


def _placement_changes(question: PlanQuestion) -> list[Change]:
    """The changes of where the states are kept (see the module note)."""
    policy = question.policy
    changes: list[Change] = []
    path = policy.nvme.path or (question.rates.nvme_path if question.rates else None)
    flag = f"--nvme {path or 'PATH'}"
    on_nvme = {"path": path or os.path.join(os.sep, "PATH")}  # planned, never opened
    if policy.placed_by_planner and not policy.nvme.path:
        changes.append((flag, lambda q: _replaced(q, nvme=on_nvme)))
    elif not policy.placed_by_planner and not policy.uses_nvme:
        changes.append((f"dram.spill: nvme with {flag}",
                        lambda q: _replaced(q, dram={"spill": "nvme"}, nvme=on_nvme)))
    if question.lora is not None and policy.params.frozen_dtype is FrozenDtype.COMPUTE:
        changes.append(("the frozen base in nf4 (--frozen-dtype nf4)",
                        lambda q: _replaced(q, params={"frozen_dtype": "nf4"})))
    if policy.optimizer.moments is not MomentsDtype.INT8:
        changes.append(("optimizer.moments: int8",
                        lambda q: _replaced(q, optimizer={"moments": "int8"})))
    if Tier.HBM in (policy.params.tier, policy.grads.tier, policy.optimizer.tier):
        changes.append(("params, grads and optimizer on tier dram (configs/cpu.yaml)",
                        lambda q: _replaced(q, params={"tier": "dram"}, grads={"tier": "dram"},
                                            optimizer={"tier": "dram"})))
    return changes


def _task_changes(question: PlanQuestion, report: PlanReport) -> list[Change]:
    """The changes of what is run: LoRA in place of every weight, the batch, checkpointing."""
    changes: list[Change] = []
    if question.lora is None:
        changes.append((f"LoRA r{LORA_RANK} (--lora {LORA_RANK})",
                        lambda q: dataclasses.replace(q, lora=LORA_RANK)))
    fit = report.batch
    if fit is not None and question.batch is not None:
        largest = fit.largest
        if largest is not None and 0 < largest < question.batch:
            changes.append((f"batch {largest} (--batch {largest})",
                            lambda q: dataclasses.replace(q, batch=largest)))
        if not question.checkpointing and os.path.exists(question.spec):
            changes.append(("activation checkpointing (--checkpointing)",
                            lambda q: dataclasses.replace(q, checkpointing=True)))
    return changes
