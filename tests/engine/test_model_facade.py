"""What the engine's model and optimizer look like to PyTorch code that handles them: the
optimizer's param groups printed, a backward after optimizer.step() or after a weights load
refused as PyTorch refuses it, ``model.zero_grad()``, forward hooks registered after
initialize, freezing after initialize refused, the model's state_dict and load_state_dict,
its parameters as placeholders (a torch clip refused), and close() giving the weights back."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tiered

from gpt import GPT
from helpers import CONFIGS, run_script
from helpers_models import (SEQ, VOCAB, assert_engine_matches, batch, engine_and_reference, lm_loss,
                            make_gpt)

CPU_YAML = str(CONFIGS / "cpu.yaml")


PRINT_PARAM_GROUPS = f"""
import torch, tiered
from torch import nn
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
engine, optimizer = tiered.initialize(model, {CPU_YAML!r}, compute_dtype="fp32", device="cpu")
engine(torch.randn(2, 8)).sum().backward()
optimizer.step()
print(optimizer.param_groups[0]["lr"], flush=True)
print(optimizer.param_groups)  # what a user or a debugger does with an optimizer
print("printed")
"""


def test_printing_the_optimizers_param_groups_does_not_crash_the_process():
    """``optimizer.param_groups[0]["params"]`` are the units' ``full`` buffers, whose storage is
    zero bytes while released: printing them read freed memory (SIGSEGV), the crash that
    [Note: released weights] fixed for the modules' attributes."""
    done = run_script(PRINT_PARAM_GROUPS)
    assert done.returncode == 0, \
        f"exit {done.returncode}: {done.stdout[-500:]}{done.stderr[-1500:]}"
    assert done.stdout.splitlines()[-1] == "printed"


def test_a_backward_after_optimizer_step_is_refused_as_in_pytorch():
    """PyTorch refuses a backward whose forward saved weights that optimizer.step() changed
    since (their version moved); the engine gathered the new weights for that backward and
    computed a gradient mixing two sets of weights, silently."""
    engine, optimizer, reference, ref_optimizer = engine_and_reference(
        make_gpt(2, qkv_bias=False))
    for model, opt in ((engine, optimizer), (reference, ref_optimizer)):
        lm_loss(model, 0).backward()
        opt.step()
    ref_loss = lm_loss(reference, 1)
    ref_optimizer.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref_loss.backward()
    loss = lm_loss(engine, 1)
    optimizer.step()
    with pytest.raises(tiered.TieredError, match="changed them since"):
        loss.backward()
    for model, opt in ((engine, optimizer), (reference, ref_optimizer)):  # and it goes on
        opt.zero_grad()
        lm_loss(model, 2).backward()
        opt.step()
        opt.zero_grad()
    assert_engine_matches(engine, reference)
    engine.close()


def test_a_retained_graphs_backward_after_a_weights_load_is_refused_as_in_pytorch():
    """``load_state_dict`` between two backwards of a graph kept with ``retain_graph``: PyTorch
    refuses the second (the load copied into the saved weights); the engine gathered the loaded
    weights for it and mixed them with the first weights' activations."""
    engine, optimizer, reference, ref_optimizer = engine_and_reference(
        make_gpt(2, qkv_bias=False))
    wanted = {key: value + 0.01 for key, value in reference.state_dict().items()}
    ref_loss = lm_loss(reference, 0)
    ref_loss.backward(retain_graph=True)
    reference.load_state_dict(wanted)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref_loss.backward()
    loss = lm_loss(engine, 0)
    loss.backward(retain_graph=True)
    engine.load_state_dict(wanted)
    with pytest.raises(tiered.TieredError, match="changed them since"):
        loss.backward()
    engine.close()


def test_model_zero_grad_clears_the_gradients_as_optimizer_zero_grad_does():
    """``model.zero_grad()`` is PyTorch's other way to clear gradients (tutorials use it).
    The model has no parameters left after initialize, so it did nothing, and every step's
    gradient added to all earlier ones, silently."""
    engine, optimizer, reference, ref_optimizer = engine_and_reference(
        make_gpt(2, qkv_bias=False))
    for step in range(3):
        for model, module, opt in ((engine, engine.module, optimizer),
                                   (reference, reference, ref_optimizer)):
            module.zero_grad()
            lm_loss(model, step).backward()
            opt.step()
    assert_engine_matches(engine, reference)
    engine.close()


def test_forward_hooks_registered_after_initialize_see_the_weights():
    """A forward hook on a unit's module is part of its call; tiered's own post-hook releases
    the unit, and one registered before initialize runs before it, but one registered after
    ran after the release and was refused (TieredError: "used outside the forward of its
    unit"), where pre-hooks work in either order."""
    model = make_gpt(2, qkv_bias=False)
    engine, optimizer, reference, ref_optimizer = engine_and_reference(model)
    seen = {"engine": [], "torch": []}
    for key, m in (("engine", model), ("torch", reference)):
        m.blocks[0].register_forward_hook(
            lambda module, args, out, key=key: seen[key].append(module.qkv.weight.norm().item()))
        m.register_forward_hook(  # the root unit's weights, from a hook on the model
            lambda module, args, out, key=key: seen[key].append(module.head.weight.norm().item()))
    for step in range(3):
        for m, opt in ((engine, optimizer), (reference, ref_optimizer)):
            lm_loss(m, step).backward()
            opt.step()
            opt.zero_grad()
    assert seen["engine"] == pytest.approx(seen["torch"], rel=1e-5)
    assert_engine_matches(engine, reference)
    engine.close()


def test_freezing_after_initialize_is_refused_saying_to_freeze_before():
    """A released weight says ``requires_grad`` False for a trainable parameter, and freezing
    it was refused with the message for reading weights outside a unit's forward ("Call the
    module instead of reading its weights, or ... units.classes"), advice that does not
    apply: frozen parameters are fixed at initialize."""
    model = make_gpt(2, qkv_bias=False)
    model.blocks[1].fc.requires_grad_(False)
    engine, _ = tiered.initialize(model, CPU_YAML, compute_dtype="fp32", device="cpu")
    assert model.blocks[0].fc.weight.requires_grad
    assert not model.blocks[1].fc.weight.requires_grad
    with pytest.raises(tiered.TieredError, match=r"blocks\.0\.fc\.weight.*before.*initialize"):
        model.blocks[0].fc.weight.requires_grad_(False)
    with pytest.raises(tiered.TieredError, match=r"blocks\.0\.fc\.weight.*before.*initialize"):
        model.blocks[0].fc.weight.requires_grad = False
    engine.close()


def test_the_models_state_dict_and_load_state_dict_act_on_the_engines_weights(tmp_path):
    """``torch.save(model.state_dict(), path)`` is PyTorch's idiom for saving a model. The
    model has no parameters after initialize, so it saved the buffers alone, silently, and
    ``model.load_state_dict(sd, strict=False)`` loaded no weights. Both now act on the
    engine's weights (model.state_dict() is full_state_dict, as FSDP's full state dict), also
    for a model inside another module, until close()."""
    engine, optimizer, reference, ref_optimizer = engine_and_reference(
        make_gpt(2, qkv_bias=False))
    model = engine.module
    for step in range(2):
        for trained, opt in ((engine, optimizer), (reference, ref_optimizer)):
            lm_loss(trained, step).backward()
            opt.step()
            opt.zero_grad()
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    saved = torch.load(path)
    assert list(saved) == list(reference.state_dict())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-6)

    class Wrapper(nn.Module):  # a model inside another: its keys under the attribute's name
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    assert list(Wrapper(model).state_dict()) == [f"inner.{key}" for key in saved]

    torch.manual_seed(3)
    other = GPT(VOCAB, 32, 2, 2, max_seq=SEQ, tied=True, qkv_bias=False).state_dict()
    result = model.load_state_dict(other)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_equal_weights(engine.full_state_dict(), other)
    with pytest.raises(tiered.TieredError, match="assign"):
        model.load_state_dict(other, assign=True)
    loss = lm_loss(engine, 4)  # its backward would use the weights it was computed with
    with pytest.raises(tiered.TieredError, match="in a step's awaiting backward phase"):
        model.load_state_dict(other)
    loss.backward()
    model.load_state_dict(other)  # once the backward ended, the weights may change
    with torch.no_grad():
        reference.load_state_dict(other)
        torch.testing.assert_close(engine(batch(5)), reference(batch(5)), rtol=1e-5, atol=1e-6)

    engine.close()
    assert "state_dict" not in model.__dict__ and "zero_grad" not in model.__dict__
    assert all(not key.endswith("weight") for key in model.state_dict())  # torch's own again


def assert_equal_weights(state: dict, expected: dict) -> None:
    assert list(state) == list(expected)
    different = [name for name in expected if not torch.equal(state[name], expected[name])]
    assert not different, f"not bit for bit: {different}"


def test_model_parameters_are_placeholders_and_a_torch_clip_is_refused():
    """After initialize ``model.parameters()`` counts as before (its placeholders: shape,
    requires_grad, the compute device), while torch-level gradient code over them, which would
    find no gradient and clip or step nothing, is refused by name."""
    model = make_gpt(2, qkv_bias=False)
    count = sum(p.numel() for p in model.parameters())
    own = [name for name, _ in model.named_parameters(recurse=False)]
    engine, _ = tiered.initialize(model, CPU_YAML, compute_dtype="fp32", device="cpu")
    assert sum(p.numel() for p in model.parameters()) == engine.num_parameters() == count
    assert {p.device for p in model.parameters()} == {engine.device}
    assert [name for name, _ in model.named_parameters(recurse=False)] == own == ["pos"]
    assert [name for name, _ in model.head.named_parameters()] == ["weight"]  # tied to emb
    with pytest.raises(tiered.TieredError, match="clip with the policy's optimizer.max_grad_norm"):
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(tiered.TieredError, match="gradients live in the engine's shards"):
        torch.optim.AdamW(model.parameters()).zero_grad()
    engine.close()
    assert list(model.parameters()) == []


def test_close_can_give_the_trained_weights_back_to_the_model():
    """close(restore_weights=True): the model is a plain PyTorch one again, with the trained
    weights (tied ones still one parameter), and can be initialized anew. A model whose layers
    tiling split is refused before anything is freed."""
    model = make_gpt(2, qkv_bias=False)
    engine, optimizer = tiered.initialize(model, CPU_YAML, compute_dtype="fp32", device="cpu")
    engine(batch(0)).float().square().mean().backward()
    optimizer.step()
    trained = engine.full_state_dict()
    with torch.no_grad():
        expected = engine(batch(1))
    engine.close(restore_weights=True)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in trained.items())
    assert model.head.weight is model.emb.weight
    with torch.no_grad():
        torch.testing.assert_close(model(batch(1)), expected)
    tiered.initialize(model, CPU_YAML, compute_dtype="fp32", device="cpu")[0].close()

    tiled = make_gpt(1, qkv_bias=False)
    engine, _ = tiered.initialize(tiled, CPU_YAML, compute_dtype="fp32", device="cpu",
                                  tiling={"max_unit_bytes": 2048})
    with pytest.raises(tiered.TieredError, match="tiling split"):
        engine.close(restore_weights=True)
    assert not engine.closed
    engine.close()
