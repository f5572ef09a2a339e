"""Module and autograd hooks that gather units before they run and release them after.

[Note: hook order in one training step]
forward:  unit pre-hook    -> a need (runtime.use): gather, or wait for the prefetched gather,
                              and prefetch along the trace; bind the modules' attributes to
                              fresh views of ``full``; push saved-tensor hooks for the unit
          saved-tensor pack -> a tensor autograd saves that is a view of a gathered unit is
                              remembered with its unit
          unit post-hook   -> pop the saved-tensor hooks; release, unless the trace needs the
                              unit again soon (runs even if forward raised)
backward: saved-tensor unpack -> the first use of a saved view in this backward queues the
                              end-of-backward callback; the first per unit is a need: the unit
                              is gathered again, into the same storage the view uses
          unit pre-hook    -> a forward recomputed by activation checkpointing: the same as
                              the first unpack (callback, need), then as in forward
          post-accumulate  -> ``full.grad`` is complete: reduce-scatter, hand to the CPU worker,
                              release (see [Note: one gradient per unit] in flat.py)
          end callback     -> the iteration is over (its needs are the next trace); release
                              whatever is still gathered

[Note: frozen units]
A unit whose parameters are all frozen (the frozen half of a split module among them: units.py)
has no gradient, so no post-accumulate hook says when its backward is over; yet a gradient
flowing through it to trainable parameters below gathers it again in backward (its input's
gradient needs its weights). Its forward pre-hook (also when activation checkpointing
recomputes the forward inside backward) hooks the module's tensor inputs that require grad,
positional, keyword or inside containers (``register_multi_grad_hook``): once their gradients
are all computed, the unit's own backward is done, and the unit is released. Without such an
input no gradient crosses the unit's own computation (its weights are not needed in backward).
The frozen half of a split module has a trainable half whose gradient is complete once every
gradient toward its parameters is, and those are what the frozen weights are read for when no
input needs a gradient: without a hooked input (none needs a gradient, or they come in an
object torch cannot look into) it is released then. Any later use gathers it again. A unit
whose weights are read outside its module's call is released at the end callback instead; one
called twice in a forward is released after the later call's backward and gathered again for
the earlier one's.

Gathering on unpack, rather than from hooks on a unit's outputs, covers every path by which a
gradient can reach a unit's weights (outputs hidden in dataclasses, auxiliary losses, activation
checkpointing that recomputes a forward inside backward: its post-hook does not release then).
The root unit is the model itself, so the root's own parameters (embeddings, final norm, head)
stay gathered through the whole forward; so do whole-forward units (units.py), gathered by the
model's pre-hook and released by its post-hook.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.hooks import RemovableHandle

from ..core.errors import TieredError
from .flat import FlatParam
from .runtime import UnitRuntime
from .step_state import BACKWARD_PHASES, Phase


class UnitHooks:
    """The hooks move the step's phase (runtime.step_state, see [Note: step phases]) and ask it
    where the step stands; what they keep themselves is per unit or per call."""

    def __init__(self, model: nn.Module, runtime: UnitRuntime, compute_dtype: torch.dtype,
                 on_backward_start: Callable[[], None]):
        self.runtime = runtime
        self.state = runtime.step_state
        self.compute_dtype = compute_dtype
        self.on_backward_start = on_backward_start
        """Called at the first gradient of a backward: the engine counts it (runtime)."""
        self._used_in_backward: set[int] = set()
        """Units the backward running has needed once (per unit: a later use only gathers)."""
        self._started: dict[int, object] = {}
        """Timeline marks of the units computing now (forward, or backward since first use)."""
        self._saved_hooks: list[torch.autograd.graph.saved_tensors_hooks] = []
        self._counter: _SavedHooks | None = None
        """The outermost saved-tensor hooks of the model forward running (one with grad,
        outside backward; None otherwise): they count what it keeps, and pass it on to the
        hooks the forward was called under."""
        self._input_hooks: list = []
        """Handles of the frozen units' input hooks since the last backward ended: removed
        then, or a leaf input the caller keeps across iterations would collect one a step."""
        self._forward_top: tuple[int, int] | None = None
        """The activations store's top as the outermost forward with grad started, where its
        backward's reads are copied back ahead (SavedActivations.copies_ahead)."""
        self._copies_ahead: RemovableHandle | None = None
        """The hook on the last such forward's outputs that starts them as its backward
        reaches it. One: a later forward's replaces it (it outlives a backward that ends
        before its own, another forward's), so that what it holds stays bounded."""
        self._frozen_half = {unit: runtime.flats[first]
                             for unit, first in enumerate(runtime.groups) if first != unit}
        """A split module's trainable half -> its frozen half, the module's first unit."""
        self._unhooked: set[int] = set()
        """Frozen halves whose forward since the last backward hooked no input: released with
        their trainable half's gradient (see [Note: frozen units]). Per unit, not a phase."""
        self._whole_forward = [flat for flat in runtime.flats if flat.spec.whole_forward]
        self._model = model
        self._inner_skipped: list[bool] = []
        """Per call of the inner entry running: whether its pre-hook left the forward to the
        model's own hooks, for its post-hook to do the same (a call record, not a phase)."""
        self.state.watch(self._phase_moved)
        self._handles = [model.register_forward_hook(self._end_forward, always_call=True)]
        self._end_forward_id = self._handles[0].id
        self._post_forward_ids: list[int] = []
        """Each unit's post-hook on its module: moved after hooks registered since at every
        forward, so that a user's forward hook sees the weights whenever it was registered."""
        for flat in runtime.flats:
            self._handles += [
                flat.spec.module.register_forward_hook(partial(self._post_forward, flat),
                                                       always_call=True),
                flat.full.register_post_accumulate_grad_hook(partial(self._post_backward, flat)),
            ]
            self._post_forward_ids.append(self._handles[-2].id)
        # Pre-hooks go before the model's own (prepended; in reverse, so that the halves of a
        # split module keep their order): those may read the weights (spectral_norm's, a
        # user's logging hook), which a unit binds in its pre-hook. The model's pre-hook goes
        # before them all: its recovery from a backward that raised comes first.
        for flat in reversed(runtime.flats):
            self._handles.append(flat.spec.module.register_forward_pre_hook(
                partial(self._pre_forward, flat), with_kwargs=True, prepend=True))
        self._handles.append(model.register_forward_pre_hook(self._start_forward,
                                                             with_kwargs=True, prepend=True))
        self._root_units = [flat for flat in runtime.flats if flat.spec.module is model]
        inner = _inner_entry(model, self._root_units + self._whole_forward)
        if inner is not None:
            self._handles += [
                inner.register_forward_pre_hook(self._enter_inner, with_kwargs=True,
                                                prepend=True),
                inner.register_forward_hook(self._leave_inner, always_call=True)]

    def unwind_forward(self) -> None:
        """Pop the saved-tensor hooks of unit forwards a BaseException other than an Exception
        left (torch runs ``always_call`` hooks for an Exception only: a KeyboardInterrupt)."""
        while self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)
        self.state.abandon_forward()
        self.runtime.end_iteration()  # no backward will come for what it gathered
        self._counter = None
        self._inner_skipped.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._copies_ahead is not None:
            self._copies_ahead.remove()
            self._copies_ahead = None

    def _start_forward(self, module, args, kwargs):
        """Model pre-hook: recover from a backward that raised, gather the units the whole
        forward may read, and cast floating inputs to the compute dtype, as the weights have."""
        module._forward_hooks.move_to_end(self._end_forward_id)  # after the user's
        if not self.state.autograd_running():
            # Ends a backward that raised before its end callback (StepState.recover) first.
            if self.state.start_forward() and torch.is_grad_enabled():
                self.runtime.probe.forward_started()
                activations = self.runtime.activations
                self._forward_top = activations.top() if activations.copies_ahead else None
                # Outermost: what any part of the forward keeps for backward passes through it
                # (a unit's own hooks hand it what is not the unit's weights, see [Note: outer
                # saved-tensor hooks]), and what checkpointing recomputes does not.
                outer = _outer_saved_hooks()  # the caller's (save_on_cpu around the model)
                self._counter = (partial(self._count_saved, outer),
                                 partial(self._unpack_saved, outer))
                counting = torch.autograd.graph.saved_tensors_hooks(*self._counter)
                counting.__enter__()
                self._saved_hooks.append(counting)
            for flat in self._whole_forward:
                self.runtime.use(flat)
                flat.bind_views()
        if self.compute_dtype is torch.float32:
            return None
        cast = partial(_cast_floating, dtype=self.compute_dtype)
        return tree_map_only(torch.Tensor, cast, (args, kwargs))

    def _enter_inner(self, module, args, kwargs):
        """Pre-hook of the inner entry: when it runs outside the model's forward, the model's
        forward starts here (its pre-hook, its own units' pre-hooks)."""
        skip = self.state.forward_depth > 0 or self.state.autograd_running()
        self._inner_skipped.append(skip)
        if skip:
            return None
        cast = self._start_forward(self._model, args, kwargs)
        args, kwargs = cast if cast is not None else (args, kwargs)
        for flat in self._root_units:
            self._pre_forward(flat, self._model, args, kwargs)
        return args, kwargs

    def _leave_inner(self, module, args, output) -> None:
        if self._inner_skipped.pop():
            return
        for flat in reversed(self._root_units):
            self._post_forward(flat, self._model, args, output)
        self._end_forward(self._model, args, output)

    def _end_forward(self, module, args, output) -> None:
        """Model post-hook: release what the whole forward held; a forward without grad has no
        backward to wait for."""
        if self.state.autograd_running() or self.state.forward_depth == 0:
            return
        ends = not torch.is_grad_enabled() or _no_backward_from(output)
        outermost = self.state.end_forward(backward_may_follow=not ends)
        if outermost and self._counter is not None:  # pushed first, popped last
            self._saved_hooks.pop().__exit__(None, None, None)
            self._counter = None
        for flat in self._whole_forward:
            self.runtime.done(flat)
        if ends:
            self.runtime.end_iteration()
        if outermost:
            started, self._forward_top = self._forward_top, None
            top = self.runtime.activations.top()
            if not ends and started is not None and top != started:  # it saved off the device
                self._copy_ahead_from(output, top)

    def _copy_ahead_from(self, output, top: tuple[int, int]) -> None:
        """[Note: activations in DRAM]'s copies ahead start as a backward reaches ``output``,
        from the store's ``top`` as the forward ended. One such hook is kept: with two
        forwards before a backward, the later one's outputs are what it reaches first."""
        outputs = [tensor for tensor in tree_leaves(output)
                   if isinstance(tensor, torch.Tensor) and tensor.requires_grad]
        if self._copies_ahead is not None:
            self._copies_ahead.remove()
            self._copies_ahead = None
        if outputs:
            store = self.runtime.activations
            self._copies_ahead = torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grads: store.backward_begins(top), mode="any")

    def _pre_forward(self, flat: FlatParam, module, args, kwargs) -> None:
        # Pushed first: the post-hook pops it even when what follows raises. Only the innermost
        # saved-tensor hooks run, so ours pass what is not a unit's weights on to the ones they
        # cover (see [Note: outer saved-tensor hooks]).
        module._forward_hooks.move_to_end(self._post_forward_ids[flat.spec.index])
        outer = _outer_saved_hooks()
        if _top_saved_hooks is None and self._counter is not None:  # see _top_saved_hooks
            outer = self._counter
        hooks = torch.autograd.graph.saved_tensors_hooks(partial(self._pack, outer),
                                                         partial(self._unpack, outer))
        hooks.__enter__()
        self._saved_hooks.append(hooks)
        if self.state.autograd_running():
            # A forward recomputed inside backward (activation checkpointing). Reentrant
            # checkpointing recomputes here, in the outer backward, then runs the block's
            # backward as a nested one: the end callback must be queued now, on the outer
            # backward, or the nested one's end would end the iteration mid-backward.
            self.state.start_recompute()
            self._use_in_backward(flat)
            flat.bind_views()
        elif not flat.spec.whole_forward:
            self.runtime.use(flat)
            flat.bind_views()
        self._started[flat.spec.index] = self.runtime.probe.mark()
        if not flat.has_trainable and torch.is_grad_enabled():
            inputs = [tensor for tensor in tree_leaves((args, kwargs))
                      if isinstance(tensor, torch.Tensor) and tensor.requires_grad]
            if inputs:  # see [Note: frozen units]
                self._input_hooks.append(torch.autograd.graph.register_multi_grad_hook(
                    inputs, partial(self._frozen_backward_done, flat)))
            elif flat.spec.frozen_part:
                self._unhooked.add(flat.spec.index)

    def _post_forward(self, flat: FlatParam, module, args, output) -> None:
        self._saved_hooks.pop().__exit__(None, None, None)
        self._span(flat, "forward")
        # A forward recomputed inside backward keeps its unit; a whole-forward unit is released
        # at the end of the model's forward.
        if self.state.phase is Phase.RECOMPUTE:
            self.state.end_recompute()
        elif not flat.spec.whole_forward:
            if _checkpoints_inside(module):
                self._gather_before_backward(flat, output)
            self.runtime.done(flat)

    def _gather_before_backward(self, flat: FlatParam, output) -> None:
        """[Note: checkpointing inside the hooks]
        Hugging Face's layers (GradientCheckpointingLayer) checkpoint their ``forward``, not
        their call, so that module hooks stay outside the checkpoint (FSDP2's do). Their
        forward then saves no view of the unit's weights for an unpack to gather by, and its
        recomputation in backward runs no pre-hook: it read the released placeholders. So the
        first gradient to reach such a unit's outputs gathers it (a need, as an unpack's) and
        binds its views, for the recomputation to read; its gradient releases it as usual."""
        outputs = [tensor for tensor in tree_leaves(output)
                   if isinstance(tensor, torch.Tensor) and tensor.requires_grad]
        if outputs:
            self._input_hooks.append(torch.autograd.graph.register_multi_grad_hook(
                outputs, partial(self._before_backward, flat), mode="any"))

    def _before_backward(self, flat: FlatParam, grad) -> None:
        self.state.enter_backward()
        self._use_in_backward(flat)
        with torch.enable_grad():  # off in a backward hook: the recomputation's views must
            flat.bind_views()      # reach ``full``, for its gradient

    def _pack(self, outer: _SavedHooks | None, tensor: torch.Tensor):
        flat = self.runtime.owner_of(tensor)
        if flat is not None:
            return _UnitView(flat, tensor, self.state.weights_epoch)
        return tensor if outer is None else outer[0](tensor)

    def _count_saved(self, outer: _SavedHooks | None, tensor: torch.Tensor):
        """The outermost pack: what the forward saves that is not a unit's weights is kept by
        the caller's hooks where there are any, else by the engine's store ([Note: activations
        in DRAM]), and counted where it stays on the device."""
        if outer is None:
            return self.runtime.activations.pack(tensor)
        self.runtime.probe.saved.add(tensor)
        return outer[0](tensor)

    def _unpack_saved(self, outer: _SavedHooks | None, packed):
        return self.runtime.activations.unpack(packed) if outer is None else outer[1](packed)

    def _unpack(self, outer: _SavedHooks | None, packed):
        if isinstance(packed, _UnitView):
            flat = packed.flat
            if packed.epoch != self.state.weights_epoch:
                raise TieredError(
                    f"this backward needs weights of unit {flat.name} as its forward read them, "
                    f"but optimizer.step() or a load changed them since; PyTorch "
                    f"refuses this too (a variable modified by an inplace operation): call "
                    f"backward before optimizer.step()")
            self.state.enter_backward()
            self._use_in_backward(flat)
            if not flat.views_bound:
                # A recomputation inside backward may read the weights from the modules, not
                # from what was saved (tiered.ops' tiles: [Note: weights a recomputation reads]).
                with torch.enable_grad():
                    flat.bind_views()
            self._started.setdefault(flat.spec.index, self.runtime.probe.mark())
            if torch.is_grad_enabled():
                # A backward with create_graph=True: the graph it builds keeps this tensor, and
                # reads it after the unit is released; a copy of its own (autograd links it to
                # the unit as it linked the view) stays valid.
                return packed.tensor.clone()
            return packed.tensor
        return packed if outer is None else outer[1](packed)

    def _use_in_backward(self, flat: FlatParam) -> None:
        """The unit's first use in this backward is a need; later ones only check it is
        gathered (the weights a recomputed forward read are the ones its backward reads)."""
        if flat.spec.index in self._used_in_backward:
            self.runtime.gather(flat)
        else:
            self._used_in_backward.add(flat.spec.index)
            self.runtime.use(flat)

    def _post_backward(self, flat: FlatParam, full: torch.Tensor) -> None:
        self.state.enter_backward()
        try:
            self._count_backward()
        except BaseException:
            full.grad = None  # a refused backward's gradient must not add into the next one's
            raise
        self._span(flat, "backward")
        self.runtime.reduce_grad(flat)
        frozen = self._frozen_half.get(flat.spec.index)
        if frozen is not None and frozen.spec.index in self._unhooked:
            self._unhooked.discard(frozen.spec.index)
            self._frozen_backward_done(frozen, None)

    def _frozen_backward_done(self, flat: FlatParam, grads) -> None:
        """A unit without trainable parameters is through its backward: release it (see
        [Note: frozen units])."""
        self._span(flat, "backward")
        self.runtime.backward_done(flat)

    def _span(self, flat: FlatParam, what: str) -> None:
        """The unit's ``what`` ("forward" or "backward") is over: measured (probe.py) and, when
        tracing, on the timeline."""
        started, ended = self._started.pop(flat.spec.index, None), self.runtime.probe.mark()
        self.runtime.probe.unit_span(flat.spec.index, what == "backward", started, ended)
        self.runtime.timeline.between(f"{what} {flat.name}", "compute", "compute stream",
                                      started, ended)

    def _count_backward(self) -> None:
        """The first gradient of an autograd pass: it is a backward of the step. Counted here,
        not where the pass first reads a unit's weights: ``torch.autograd.grad(loss, inputs)``
        (adversarial inputs, gradient penalties) reads them too, but gives no unit a gradient
        and must not use up ``accumulation_steps``."""
        if not self.state.counted:
            # May refuse (fp16 without engine.backward, a backward past accumulation_steps).
            self.on_backward_start()

    def _phase_moved(self, before: Phase, after: Phase) -> None:
        if before in BACKWARD_PHASES and after is Phase.IDLE:
            self._end_backward()

    def _end_backward(self) -> None:
        """The backward is over (autograd's end callback, or the next forward or step after
        one that raised): nothing of it stays gathered or hooked."""
        self.runtime.probe.backward_ended()
        self.runtime.end_iteration()
        self._used_in_backward.clear()
        for handle in self._input_hooks:
            handle.remove()
        self._input_hooks.clear()
        self._unhooked.clear()


_SavedHooks = tuple[Callable, Callable]
"""The (pack, unpack) pair of saved-tensor hooks."""


class _UnitView(NamedTuple):
    """A tensor autograd saved that is a view of a gathered unit's weights."""

    flat: FlatParam
    tensor: torch.Tensor
    epoch: int
    """``runtime.weights_epoch`` when it was saved: the weights it holds are the ones then."""


def _no_backward_from(output) -> bool:
    """Whether nothing in a forward's output can start a backward: every leaf is a tensor that
    needs no gradient, or a plain value (an object torch cannot look into may hide one)."""
    return all(not leaf.requires_grad if isinstance(leaf, torch.Tensor)
               else leaf is None or isinstance(leaf, (bool, int, float, str))
               for leaf in tree_leaves(output))


def _inner_entry(model: nn.Module, whole_forward: list[FlatParam]) -> nn.Module | None:
    """[Note: entering the model below its root]
    The root's own units (and any whole-forward unit) are gathered around the model's forward.
    A wrapper may also run the model it wraps without its own forward: a peft model generates
    through it (``base_model.model.generate``), whose forward then ran no root hook and read
    the embeddings' placeholders. So the innermost module holding all of those parameters (the
    wrapped model), when it is not the root, is an inner entry: called outside the model's
    forward, the model's forward starts and ends around it (its hooks run as the model's);
    called inside it (the wrapper's own forward), it does nothing."""
    path_of = {id(module): path for path, module in model.named_modules()}
    paths = [path_of[id(module)].split(".") for flat in whole_forward
             for spec in flat.spec.params for module, _ in spec.holders]
    common = ".".join(os.path.commonprefix(paths)) if paths else ""  # "" is the root
    return model.get_submodule(common) if common else None


def _checkpoints_inside(module: nn.Module) -> bool:
    """Whether the module checkpoints its own forward inside its call (see [Note:
    checkpointing inside the hooks]): a Hugging Face layer (GradientCheckpointingLayer, not a
    model that merely has the flag) with gradient checkpointing on. transformers is not
    imported for it: a module of its can exist only once it is."""
    layers = sys.modules.get("transformers.modeling_layers")
    layer = getattr(layers, "GradientCheckpointingLayer", None)
    return (layer is not None and isinstance(module, layer) and module.gradient_checkpointing
            and module.training and torch.is_grad_enabled())


def _outer_saved_hooks() -> _SavedHooks | None:
    """The saved-tensor hooks in force where a unit's forward starts (None: none, or a torch
    that cannot say).

    [Note: outer saved-tensor hooks]
    torch runs only the innermost pair of saved-tensor hooks. A unit's module called inside
    non-reentrant activation checkpointing (or ``save_on_cpu``, or a parent unit's forward)
    pushes ours inside theirs: ours must hand them every tensor that is not a view of a
    unit's weights, or checkpointing saves every activation and never recomputes. A unit's
    weights stay with us in both the forward and its recomputation (the unit is gathered then
    too), so the checkpoint sees the same tensors, in the same order, both times."""
    if _top_saved_hooks is None:
        return None
    try:
        return _top_saved_hooks(False)  # False: as autograd itself asks (its default)
    except TypeError:  # the torches whose getter takes no argument
        return _top_saved_hooks()


_top_saved_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
"""torch's only way to read the saved-tensor hooks in force: private, in torch since about 2.8
(2.13 has it). Without it the outer hooks go unseen, and non-reentrant checkpointing around a
unit keeps that unit's activations: still correct, but no memory saved; a unit then hands what
it keeps to the forward's counter directly."""


def _cast_floating(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor
