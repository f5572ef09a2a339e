"""TieredEngine and ``tiered.initialize``: a model partitioned across ranks and tiers."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from functools import partial

import torch
from torch import nn

from ..checkpoint import checkpoint, export, pretrained
from ..checkpoint.format import CheckpointError
from ..core import progress
from ..core.errors import TieredError
from ..ops.tiled_linear import merge_tiles, tile_large_linears, tiled_layers, untile
from ..optim.adamw import one_pass_for
from ..optim.groups import shard_ranges
from ..optim.host import HostWorker
from ..optim.workers import CpuWorker, optimizer_threads
from ..placement.manager import TierManager
from ..placement.plan import grad_dtypes, state_kinds
from ..planning.node import cached_node_rates
from ..planning.planner import hbm_reserve, place_units
from ..planning.report import PlanReport, plan_report
from ..policy.config import Policy, resolve, resolve_compute_dtype
from ..policy.kinds import Tier
from ..service.client import ServiceSlabSource
from ..service.remote_nvme import ServiceNvme
from ..tiers import NvmeTier, SlabSource
from . import process_exit, reattach
from .assemble import InService, assemble, host_request, hostable_in_service
from .build import (bend_to_fit, building_bytes, built_together, drop_parameters, flat_units,
                    forward_order, memory_plan, partition, place_buffers, restore_parameters)
from .collectives import ProcessGroup
from .hooks import UnitHooks
from .init import Materializer, init_context_of
from .loss_scale import LossScaler
from .optimizer import TieredAdamW
from .quantized import consolidated, consolidated_bytes
from .runtime import UnitRuntime
from .setup import (compute_device, rank_timeline, ranks_on_this_node, service_source,
                    warn_unmatched)
from .step_state import Phase

LAUNCHED_ENV = "TIERED_LAUNCHED"
"""Set by ``tiered-launch`` in each rank's environment."""

_log = logging.getLogger("tiered")

_managed: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
"""Models whose parameters an engine has taken over."""


class TieredEngine:
    """Runs the model with each unit gathered just in time; see ``tiered.initialize``."""

    def __init__(self, module: nn.Module, policy: Policy, runtime: UnitRuntime,
                 optimizer: TieredAdamW, scaler: LossScaler | None, state_dict_keys: list[str]):
        self.module = module
        self.policy = policy
        self.runtime = runtime
        self.optimizer = optimizer
        self.scaler = scaler
        self.state_dict_keys = state_dict_keys
        """The names of the original ``model.state_dict()``, in its order."""
        self._closed = False
        self._half_loaded: str | None = None
        """Why the tiers hold a mix of loaded and older states (see :meth:`replacing_states`)."""
        self._hooks = UnitHooks(module, runtime, policy.compute_dtype.torch_dtype,
                                on_backward_start=self._start_backward)
        self._finalizer = weakref.finalize(self, _shut_down, runtime)
        process_exit.shut_down_at_exit(self)
        # The model has no parameters left: its own zero_grad(), state_dict() and
        # load_state_dict() would clear, save and load no weights (torch.save of its state
        # dict would keep only the buffers). They act on the engine's instead, until close()
        # takes them off this instance (the checker takes any method assignment for a mistake).
        module.zero_grad = optimizer.zero_grad  # type: ignore[method-assign]
        module.state_dict = self._model_state_dict  # type: ignore[method-assign]
        module.load_state_dict = self.load_state_dict  # type: ignore[method-assign]
        # Its modules' parameters() would be empty: counting gave 0 (peft divided by it),
        # generate() found no device, and clip_grad_norm_ over them clipped nothing, silently.
        # They are the placeholders instead, whose gradient a torch-level clip reads and is
        # refused. Every module's: a peft model generates through its inner model.
        for path, submodule in module.named_modules():
            submodule.named_parameters = partial(self._model_named_parameters,
                                                 f"{path}." if path else "")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad``, as ``model.zero_grad`` is in PyTorch."""
        self.optimizer.zero_grad(set_to_none)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has freed the tiers."""
        return self._closed

    @property
    def device(self) -> torch.device:
        return self.runtime.group.device

    @property
    def manager(self) -> TierManager:
        return self.runtime.manager

    @property
    def reattached(self) -> bool:
        """Whether ``initialize`` took this rank's state over from the node's service, where a
        trainer of the same job had died (see [Note: reattach] in service/commits.py): then
        ``optimizer.steps_taken`` is the last step every rank completed, as after
        ``load_checkpoint``."""
        source = self.manager.dram.source
        return isinstance(source, ServiceSlabSource) and source.kept is not None

    @property
    def service_job(self) -> str | None:
        """The job under which the node's tiered service holds this rank's DRAM, or None when
        this process holds it itself (no service: ``tiered-launch --no-daemon``, a plain
        ``python train.py``)."""
        source = self.manager.dram.source
        return source.job if isinstance(source, ServiceSlabSource) else None

    def __call__(self, *args, **kwargs):
        self._refuse_unless_whole()
        # An update that failed part-way may have written some of its new weights (those
        # written in place, or before another state's write failed): compute on none of them.
        self.runtime.worker.raise_if_failed()
        try:
            return self.module(*args, **kwargs)
        except BaseException:
            self._hooks.unwind_forward()  # a KeyboardInterrupt skips torch's always_call hooks
            raise

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward(**kwargs)``, multiplied by the loss scale under fp16 compute."""
        try:
            self.scaled_loss(loss).backward(**kwargs)
        finally:
            self.runtime.step_state.scaled_backward_over()

    def scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale under fp16 compute, for a caller that runs the backward
        itself (Hugging Face's accelerate: ``scaled_loss(loss).backward()``); the next backward
        counts as scaled. Without fp16, ``loss`` as it is."""
        self._refuse_if_closed()
        if self.scaler is None:
            return loss
        self.runtime.step_state.loss_scale_noted(self.scaler.scale)
        return loss.float() * self.scaler.scale

    def _start_backward(self) -> None:
        """The first gradient of a backward (hooks.py): counted towards the step, with the
        optimizer's hyperparameters as they are now for the units it steps on arrival."""
        self.runtime.start_backward(self.optimizer.hypers)

    def train(self, mode: bool = True) -> "TieredEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "TieredEngine":
        """Evaluation mode, on the latest weights (a pending delayed update is finished)."""
        self.optimizer.synchronize()
        return self.train(False)

    def named_parameters(self, prefix: str = "", remove_duplicate: bool = True):
        """The model's parameters by ``model.named_parameters()`` name, as placeholders: each has
        the parameter's shape, compute dtype and ``requires_grad``, but no values, which live in
        the tiers ([Note: released weights]); for counting (``num_parameters``, Hugging Face's
        Trainer) and inspection. A tied parameter comes once, under its first name, unless
        ``remove_duplicate`` is False."""
        for flat in self.runtime.flats:
            for spec, placeholder in zip(flat.spec.params, flat.placeholders):
                for name in spec.names[:1] if remove_duplicate else spec.names:
                    yield prefix + name, placeholder

    def _model_named_parameters(self, path: str, prefix: str = "", recurse: bool = True,
                                remove_duplicate: bool = True):
        """``module.named_parameters()`` after initialize, for the module at ``path`` (its
        state-dict prefix, "" for the model): the placeholders under it (with ``recurse=False``,
        its own only), named as torch names them."""
        seen: set[int] = set()  # by identity within the module: a tied parameter's second
        for name, placeholder in self.named_parameters(remove_duplicate=False):  # holder too
            if not name.startswith(path) or not (recurse or "." not in name[len(path):]):
                continue
            if remove_duplicate and id(placeholder) in seen:
                continue
            seen.add(id(placeholder))
            yield prefix + name[len(path):], placeholder

    def parameters(self):
        """The placeholders of :meth:`named_parameters`."""
        for _, placeholder in self.named_parameters():
            yield placeholder

    def num_parameters(self, trainable_only: bool = False) -> int:
        """How many elements the model's parameters hold (tied ones counted once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def memory_report(self) -> dict[str, Mapping[str, int | None]]:
        """Bytes each tier holds now, the most it has held, and its budget (on a CPU device the
        hbm and dram budgets split the same RAM: TierManager.budgets_for)."""
        return self.manager.memory_report()

    def plan_report(self) -> PlanReport:
        """This rank's plan: bytes per tier against the budgets, how many units hold each
        state in each tier, and the step it predicts on this node from the rates ``tiered
        node`` measured here (cached; none measured: no prediction), and once a step has run,
        what it measured and the step predicted with its forward and backward. ``.table()`` is
        what ``initialize`` logs (logger "tiered", INFO, rank 0)."""
        plan, replan = self.manager.current_plan, self.runtime.replan
        decided = [outcome for outcome in (replan.outcome if replan is not None else None,
                                           self.runtime.activations.outcome) if outcome]
        return plan_report(plan, self.manager.budgets_for(plan), self.policy,
                           self.runtime.group.world_size, cached_node_rates(self.policy.nvme.path),
                           self.device.type == "cpu", self.runtime.probe.last(),
                           self.manager.hbm.usage.peak,
                           tuple(flat.name for flat in self.runtime.flats),
                           "\n".join(decided) or None)

    def placement(self) -> dict[str, dict[str, str]]:
        """For every unit (by name: its module path, "<root>" for the root, with " (frozen)"
        for the frozen half of a split module): the tier of each state it has."""
        return {flat.name: {kind.value: self.manager.tier_of(flat.spec.index, kind).value
                            for kind in state_kinds(self.policy)
                            if self.manager.has(flat.spec.index, kind)}
                for flat in self.runtime.flats}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights (and buffers) as CPU tensors under the keys of the original
        ``model.state_dict()``, on every rank; tied parameters share one tensor, as in torch.
        A module's extra state is there as its ``get_extra_state()`` gives it."""
        self._refuse_unless_whole()
        values = {name: value.detach().cpu() if isinstance(value, torch.Tensor) else value
                  for name, value in nn.Module.state_dict(self.module).items()}
        for flat, full in self.consolidated_units():
            values.update(flat.by_name(full))
        merge_tiles(self.module, values)
        return {key: values[key] for key in self.state_dict_keys}

    def _model_state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        """``model.state_dict()`` after initialize: :meth:`full_state_dict` (so every rank must
        call it, as FSDP's full state dict), put under ``prefix`` into ``destination`` as
        ``nn.Module.state_dict`` puts them when the model is a submodule of another."""
        if destination is None:
            destination = OrderedDict()
        for key, value in self.full_state_dict().items():
            destination[prefix + key] = value
        return destination

    def consolidated_units(self):
        """Each unit's fp32 master weights (a frozen unit's weights, where it keeps no masters)
        gathered from every rank, one unit at a time, as a CPU tensor on every rank (the device
        copy is counted against the HBM budget while it exists), after any pending update.
        Every rank must iterate to the end: each unit is a collective."""
        self._refuse_unless_whole()
        self.optimizer.synchronize()
        group, usage = self.runtime.group, self.manager.hbm.usage
        for flat in self.runtime.flats:
            nbytes = consolidated_bytes(flat)
            usage.acquire(nbytes, f"consolidating unit {flat.name}")
            try:  # a quantized unit's, dequantized ([Note: quantized frozen weights])
                host = consolidated(flat, self.manager, group).cpu()
            finally:
                usage.release(nbytes)
            yield flat, host

    def save_checkpoint(self, directory: str, tag: str | None = None, *,
                        keep_last: int | None = None) -> str:
        """Save every tier's state under ``directory/tag`` (default tag: ``step<N>``), atomically,
        each rank its own part; returns the folder. ``keep_last``: once it is complete, remove
        the older checkpoints there beyond the newest ``keep_last`` (None keeps all). Call it
        on every rank."""
        self._refuse_unless_whole()
        return checkpoint.save(self, directory, tag, keep_last)

    def load_checkpoint(self, directory: str, tag: str | None = None) -> str:
        """Load ``directory/tag`` (default: the latest complete one), also one saved at another
        world size or with another policy; returns the tag. Call it on every rank."""
        self._refuse_if_closed()
        return checkpoint.load(self, directory, tag)

    def save_pretrained(self, directory: str, dtype: torch.dtype = torch.float32,
                        max_shard_bytes: int = 5 << 30) -> list[str]:
        """Consolidated weights as (sharded) safetensors with an index, in the layout Hugging
        Face's ``from_pretrained`` reads, streamed unit by unit; ``dtype`` is fp32 (the master
        weights) or the dtype to cast them to. Call it on every rank; rank 0 writes."""
        self._refuse_unless_whole()
        return export.save_pretrained(self, directory, dtype, max_shard_bytes)

    def load_state_dict(self, state_dict, strict: bool = True,
                        assign: bool = False) -> pretrained.LoadResult:
        """Replace the weights and persistent buffers with ``state_dict``'s (the keys
        ``full_state_dict`` gives; any floating dtype); returns the missing and unexpected keys
        as ``nn.Module.load_state_dict`` does, which ``strict`` refuses. The optimizer's moments
        and step counts stay (see [Note: what a load replaces] in checkpoint/pretrained.py).
        Call it on every rank, each with the whole state dict: each reads its own shards."""
        if assign:
            raise TieredError("load_state_dict(assign=True) would make the given tensors the "
                              "parameters; the engine's weights live in its tiers, so a load "
                              "copies into them: call it without assign")
        self._refuse_load_mid_iteration()
        return pretrained.load(self, state_dict, strict)

    def load_pretrained(self, path: str, strict: bool = True) -> pretrained.LoadResult:
        """:meth:`load_state_dict` from safetensors files: a folder as :meth:`save_pretrained`
        writes it (or as Hugging Face publishes: ``model.safetensors``, or shards listed by
        ``model.safetensors.index.json``), or one ``.safetensors`` file. Each rank reads only
        its shards' bytes. Call it on every rank."""
        self._refuse_load_mid_iteration()
        return pretrained.load(self, path, strict)

    def _refuse_load_mid_iteration(self) -> None:
        phase = self.runtime.step_state.phase
        if phase is not Phase.IDLE:
            raise CheckpointError(
                f"cannot load weights in a step's {phase.value} phase, between a forward run "
                f"with grad enabled and its backward's end (the backward would use the old "
                f"weights' activations): load before the forward or after the backward, and run "
                f"forwards that have no backward under torch.no_grad()")

    def _refuse_if_closed(self) -> None:
        """Every call that reads or moves the tiers' state refuses by name after ``close()``:
        the shards are gone, and otherwise it fails with a KeyError deep in the tier manager."""
        if self._closed:
            raise TieredError("this engine is closed; its weights were freed by close()")

    @contextlib.contextmanager
    def replacing_states(self, what: str):
        """Around the part of a load that writes the tiers' states (and the model's buffers),
        once every check has passed. If it fails there, the engine holds some loaded states
        and some older ones (a unit's master weights from one, its moments from the other):
        computing on them, or saving them, is refused until a load succeeds."""
        self._half_loaded = None
        try:
            yield
        except BaseException as error:
            self._half_loaded = f"{what} failed part-way ({error})"
            raise

    def _refuse_unless_whole(self) -> None:
        """What computes on, reads or saves the states refuses after ``close()`` and after a
        load that failed part-way (a new load is what may follow that)."""
        self._refuse_if_closed()
        if self._half_loaded is not None:
            raise TieredError(f"{self._half_loaded}: this engine holds some loaded states and "
                              f"some older ones; load a checkpoint or weights again")

    def close(self, restore_weights: bool = False) -> None:
        """Free every tier and remove this run's NVMe folder (also done at interpreter exit).

        Dropping the engine is not enough: the model's hooks keep it alive. With
        ``restore_weights`` the trained weights go back into the model's modules as ordinary
        parameters first (the whole model on every rank, as CPU tensors in the dtypes the model
        gave them, a frozen unit's as its compute-dtype weights held them: it must fit in
        memory), its buffers moved to the CPU too, so it is a plain PyTorch model again (peft's
        ``merge_and_unload``, ``save_pretrained``, another ``initialize``). Every rank must
        call it so (each unit is gathered)."""
        if self._closed:
            return
        values = None
        if restore_weights:  # before anything is freed: a refusal or failure keeps the engine
            if tiled_layers(self.module):
                raise TieredError("close(restore_weights=True) cannot give back the layers "
                                  "tiling split (policy tiling); save_pretrained exports them")
            values = {name: value.clone() for flat, full in self.consolidated_units()
                      for name, value in flat.by_name(full).items()}
        clean = False
        try:
            # An update still running may fail; one that failed after the last call that could
            # say so (step() returns while it runs) is raised here, after cleaning up.
            if not self.runtime.worker.failure_reported:
                self.optimizer.synchronize()
            clean = not self.runtime.worker.failed
        finally:  # the tiers go and the engine counts as closed whatever happened above
            self._hooks.remove()
            for name in ("zero_grad", "state_dict", "load_state_dict"):
                self.module.__dict__.pop(name, None)
            for submodule in self.module.modules():
                submodule.__dict__.pop("named_parameters", None)
            if self._finalizer.detach() is not None:  # not shut down at exit meanwhile
                _shut_down(self.runtime, clean)
            self._closed = True
            checkpoint.release_folders(self)  # the checkpoint folders it owns, for other jobs
            if values is not None:
                restore_parameters(self.runtime.flats, values)
                self.module.to("cpu")  # its buffers too, where the parameters are
                _managed.discard(self.module)


def initialize(model: nn.Module, policy=None, *, weights=None, strict: bool = True,
               dram_source: SlabSource | None = None,
               **overrides) -> tuple[TieredEngine, TieredAdamW]:
    """Partition ``model`` across ranks and tiers; returns ``(engine, optimizer)``.

    ``weights`` (a folder or file of safetensors, as ``save_pretrained`` writes them or Hugging
    Face publishes them, or a state dict) gives the model's starting weights by state-dict
    name: each rank reads its own shards straight into the tiers. A unit the weights hold
    whole, none of whose modules also holds a parameter they lack, is never initialized (nor,
    under ``tiered.init``, materialized); any other unit is built as without weights, then
    takes the weights it holds (a block with LoRA adapters: a layer's init touches its frozen
    weight too). With ``strict`` every parameter, persistent buffer and extra state must be
    there and nothing else; with ``strict=False`` the ones missing start as the model
    initializes them, and a warning names what did not match.

    ``policy`` is a YAML path, a dict of the same schema, or a ``tiered.Policy``; ``None`` takes
    the one ``tiered.init`` was given for this model, else the policy ``tiered-launch`` passed,
    else built-in defaults equal to ``configs/cpu.yaml``. ``overrides`` are schema keys merged on top
    (``compute_dtype="fp32"``, ``optimizer={"lr": 1e-3}``).

    The model's parameters are removed from its modules and live as shards in the tiers; a
    budget that cannot hold what the policy places fails here, before anything large is
    allocated, naming needed and available bytes per tier.
    """
    context = init_context_of(model)
    if policy is None and context is not None:
        policy = context.policy  # resolved when the model was built, from the same sources
    policy = resolve(policy, overrides)
    if model in _managed:
        raise TieredError("this model is already managed by a tiered engine: its parameters "
                          "live in that engine's tiers; call tiered.initialize once per model")
    if os.environ.get(LAUNCHED_ENV):
        # Before anything is made on disk: a SIGTERM during set-up (torchrun's, when another
        # rank fails) must unwind through the cleanup below, not kill the process past it.
        process_exit.exit_cleanly_on_sigterm()
    device = compute_device(policy)
    process_exit.init_distributed(device)
    group = ProcessGroup.current(device)
    policy, compute_dtype = resolve_compute_dtype(policy, device, group.agree)
    timeline = rank_timeline(policy, device, group)

    state_dict_keys = list(model.state_dict().keys())
    tiled = (tile_large_linears(model, policy.tiling.max_unit_bytes,
                                policy.compute_dtype.torch_dtype.itemsize)
             if policy.tiling.max_unit_bytes is not None else [])
    manager = start_weights = None
    # Closed if initialize fails: this process's CPU worker, then the runtime's (a hosted
    # rank's closes its link to the service).
    worker: HostWorker | None = None
    try:
        flats = flat_units(model, policy, group.rank, group.world_size, device)
        if not flats:
            raise TieredError("the model has no parameters to train")
        ranges = shard_ranges(flats, policy.optimizer.param_groups)  # one matching nothing fails
        source = dram_source or service_source(policy, device, group)
        # The node's service, where it holds this rank's DRAM.
        service = source if isinstance(source, ServiceSlabSource) else None
        kept = service.kept if service is not None else None
        if weights is not None and kept is None:  # checked before anything large is allocated
            start_weights = pretrained.open_weights(weights, flats, model, state_dict_keys,
                                                    strict, group)
        local_ranks = ranks_on_this_node(group)
        # The node's service, where it runs this rank's CPU work (service/hosting.py).
        hosted_by = (service if service is not None
                     and hostable_in_service(policy, local_ranks, group.world_size) else None)
        # A hosted rank's NVMe files are the service's too (service/files.py).
        manager = TierManager(policy, device, group.rank, source, local_ranks, group.smallest,
                              partial(ServiceNvme, hosted_by) if hosted_by is not None
                              else NvmeTier)
        # Before the plan: what building a unit materializes counts in it (hbm_working_set).
        materializer = Materializer(model, [flat.spec for flat in flats], device,
                                    context.param_init_fn if context is not None else None)
        building = max(building_bytes(built, materializer) for built in built_together(flats))
        def plan_with(policy: Policy, on_device: frozenset[int] = frozenset()):
            dram_room = manager.available()[Tier.DRAM]
            if device.type == "cpu":  # the HBM tier is the same RAM: DRAM may fill the rest
                hbm_needed = memory_plan(policy, device, flats, None, building,
                                         on_device=on_device).needed(Tier.HBM)
                dram_room = manager.dram_room_beside(hbm_needed)
            return memory_plan(policy, device, flats, dram_room, building,
                               lands_every_gradient=hosted_by is not None,
                               on_device=on_device)

        def plan_for(policy: Policy):
            if not policy.placed_by_planner:
                return plan_with(policy)
            return place_units(forward_order(flats), partial(plan_with, policy),
                               manager.hbm_room, hbm_reserve(policy, manager.hbm.usage.budget))

        # Checked before paying for a compile the budget forbids.
        policy, plan = bend_to_fit(policy, plan_for, manager)
        threads = optimizer_threads(policy.cpu.optimizer_threads,
                                    drives_gpu=device.type == "cuda", ranks_on_node=local_ranks)
        if service is not None and kept is not None:
            # The same model and policy as the kept state's, before any use.
            reattach.check_kept(kept, host_request(policy, plan, flats, ranges, {}, 0,
                                                   False).fingerprint(), service.job)
        one_pass = None
        cpu_worker: CpuWorker | None = None
        if hosted_by is None:  # the service compiles its own
            cpu_worker = worker = CpuWorker(threads)
            # Setup spans: on the GPU box a setup took 75-103 s, and the timeline says where.
            with timeline.span("compile one-pass AdamW", "setup"), progress.phase(
                    "the CPU AdamW kernel (built at first use, then cached)"):
                one_pass = one_pass_for(policy.compute_dtype.torch_dtype,
                                        grad_dtypes(policy, group.world_size),
                                        torch.device("cpu") if plan.steps_on_host()
                                        else device, cpu_worker)
        with timeline.span("allocate tiers (pin DRAM, create NVMe extents)", "setup"), \
                progress.phase("allocating the tiers (pinning DRAM, creating NVMe files)"):
            manager.allocate(plan, kept=kept is not None)
        if kept is not None:  # the units' states are the kept segments' already
            drop_parameters(flats)
        what = "building units" + (" from the weights" if start_weights is not None else "")
        for built in progress.counted(built_together(flats), what, "unit") if kept is None else []:
            with timeline.span(f"build unit {built[-1].name}", "setup"):
                partition(built, materializer, manager, group, start_weights)
        place_buffers(model, policy.compute_dtype.torch_dtype, group)
        if start_weights is not None:
            start_weights.load_buffers(model)
            warn_unmatched(start_weights.result, start_weights.source.where)
        runtime, optimizer, scaler = assemble(
            flats, manager, group, policy, cpu_worker, timeline, ranges, one_pass,
            InService(hosted_by, threads, reattach.StepRecorder(model, state_dict_keys, device))
            if hosted_by is not None else None)
        worker = runtime.worker
        engine = TieredEngine(model, policy, runtime, optimizer, scaler, state_dict_keys)
        if kept is not None:
            reattach.restore(engine, kept)
        if group.rank == 0 and _log.isEnabledFor(logging.INFO):
            _log.info("tiered: device %s (%s), compute dtype %s; the plan of rank 0 (of %d)\n%s",
                      device, runtime.streams.accelerator.name, compute_dtype, group.world_size,
                      engine.plan_report().table())
    except BaseException:
        if worker is not None:
            worker.close()
        if manager is not None:
            manager.close()
        timeline.close()  # its setup spans show how far initialize got
        untile(tiled)  # a refused model goes back as it came (the tiles only viewed its layers)
        raise
    finally:
        if start_weights is not None:
            start_weights.close()
    _managed.add(model)
    return engine, optimizer


def _shut_down(runtime: UnitRuntime, clean: bool = False) -> bool:
    """Free what the engine holds: at ``close()`` (``clean`` when its update ended well: a
    service then frees this rank's part of the job at once, see SlabSource.close), when the
    engine is collected, or at exit.

    The worker finishes the tasks it was given first. A script may end right after
    ``optimizer.step()``, which returns while the update runs, and a worker thread stopped by
    the interpreter's exit inside the compiled kernel aborts the process ("terminate called
    without an active exception", 2 exits in 3 here); the timeline is written then too.

    Returns whether the last update failed with nothing left to raise it (the script had
    ended): said here on standard error; the process's exit status is its caller's to set.
    """
    runtime.worker.close()
    unreported = runtime.worker.failed and not runtime.worker.failure_reported
    if unreported:
        print(f"tiered: the CPU worker failed in the last update, which did not complete: "
              f"{runtime.worker.error}", file=sys.stderr)
    if runtime.readahead is not None:
        runtime.readahead.close()
    runtime.activations.close()  # its I/O reads and writes the pinned slabs freed below
    runtime.timeline.close()
    # A prefetch or a gradient's copy off the device may still read or write the units' storage
    # and the pinned slabs freed below.
    runtime.streams.accelerator.synchronize()
    # Units a forward left gathered for a backward that never came: their storage is the HBM
    # tier's, and the model's attributes would keep it as long as the model lives.
    runtime.gatherer.release_all()
    runtime.manager.close(clean)
    return unreported
