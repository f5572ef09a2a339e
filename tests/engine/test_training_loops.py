"""Training loops as PyTorch users write them, on an fp32 CPU engine against plain PyTorch +
torch.optim.AdamW: forwards under no_grad and inference_mode between steps, two forwards or two
backwards per step, step(closure), schedulers that cycle betas and step hooks, outputs holding
tensors without grad, units the loss does not reach, weights reused, buffers updated by
forwards without grad, a forward that raised, two engines in one loop (a GAN), a double
backward (gradient penalty), a KeyboardInterrupt in forward or a stop signal in a release,
BatchNorm under bf16, and a frozen model's forward with grad enabled."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tiered
from tiered.engine.flat import Residency
from tiered.engine.step_state import Phase

from gpt import GPT
from helpers import CONFIGS, run_script
from helpers_models import (SEQ, Block, Stack, assert_engine_matches, batch, engine_and_reference,
                            lm_loss, make_gpt, vectors)

CPU_YAML = str(CONFIGS / "cpu.yaml")
OPTIM = dict(lr=1e-2, weight_decay=0.1)


def all_released(engine) -> bool:
    return all(f.residency is Residency.RELEASED for f in engine.runtime.flats)


# --- what already works, covered nowhere else -------------------------------------------------


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_forwards_without_grad_between_steps_match_pytorch(context):
    engine, optimizer, reference, ref_optimizer = engine_and_reference(
        make_gpt(2, qkv_bias=False))
    for step in range(3):
        with context():
            out, ref_out = engine(batch(100 + step)), reference(batch(100 + step))
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        assert all_released(engine)
        for model, opt in ((engine, optimizer), (reference, ref_optimizer)):
            lm_loss(model, step).backward()
            opt.step()
            opt.zero_grad()
    assert_engine_matches(engine, reference)
    engine.close()


def step_both(pairs, body, steps: int = 3) -> None:
    for step in range(steps):
        for model, opt in pairs:
            body(model, opt, step)


def retain_graph_twice(model, opt, step):
    loss = lm_loss(model, step)
    loss.backward(retain_graph=True)
    loss.backward()  # the units are gathered again for the second pass; gradients add
    opt.step()
    opt.zero_grad()


def two_forwards_one_backward(model, opt, step):
    (lm_loss(model, step) + lm_loss(model, step + 50)).backward()
    opt.step()
    opt.zero_grad()


def two_forwards_backwards_in_reverse(model, opt, step):
    first, second = lm_loss(model, step), lm_loss(model, step + 50)
    second.backward()
    first.backward()
    opt.step()
    opt.zero_grad()


def forwards_between_forward_and_backward(model, opt, step):
    loss = lm_loss(model, step)
    with torch.no_grad():
        model(batch(99))  # a metric under no_grad: ends an iteration in the engine
    model(batch(98))  # and one with grad whose backward never comes
    loss.backward()
    opt.step()
    opt.zero_grad()


def step_twice_then_accumulate(model, opt, step):
    lm_loss(model, step).backward()
    opt.step()
    opt.step()  # the same gradients again, as torch does
    lm_loss(model, step + 7).backward()  # into the gradients kept (no zero_grad)
    opt.step()
    opt.zero_grad(set_to_none=False)
    opt.step()  # zeros are gradients: momentum and decay act


def closure_steps(model, opt, step):
    def closure():
        opt.zero_grad()
        loss = lm_loss(model, step)
        loss.backward()
        return loss

    assert torch.isfinite(opt.step(closure))


@pytest.mark.parametrize("body", [retain_graph_twice, two_forwards_one_backward,
                                  two_forwards_backwards_in_reverse,
                                  forwards_between_forward_and_backward,
                                  step_twice_then_accumulate, closure_steps],
                         ids=lambda f: f.__name__)
def test_training_loop_shapes_match_pytorch(body):
    engine, optimizer, reference, ref_optimizer = engine_and_reference(
        make_gpt(2, qkv_bias=False))
    step_both(((engine, optimizer), (reference, ref_optimizer)), body)
    assert_engine_matches(engine, reference)
    assert all_released(engine)
    engine.close()


def test_one_cycle_schedule_cycling_lr_and_betas_and_step_hooks():
    """OneCycleLR writes each group's ``lr`` and ``betas`` (cycle_momentum): both are read at
    every step. Optimizer step hooks run as on any torch optimizer."""
    engine, optimizer, reference, ref_optimizer = engine_and_reference(
        make_gpt(2, qkv_bias=False))
    schedules = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10)
                 for o in (optimizer, ref_optimizer)]
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    for step in range(4):
        for (model, opt), schedule in zip(((engine, optimizer), (reference, ref_optimizer)),
                                          schedules):
            lm_loss(model, step).backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
    assert optimizer.param_groups[0]["betas"] == ref_optimizer.param_groups[0]["betas"] != \
        (0.9, 0.999)
    assert calls == ["pre", "post"] * 4
    assert_engine_matches(engine, reference)
    engine.close()


@dataclass
class Output:
    logits: torch.Tensor
    aux: torch.Tensor
    positive: torch.Tensor


class DataclassOut(Stack):
    """Keyword-only input; a dataclass output with an aux head on a detached input and a bool
    tensor; the loss uses the first block's output too (a side head)."""

    def __init__(self):
        super().__init__()
        self.aux = nn.Linear(8, 1)

    def forward(self, x, *, scale: float):
        first = None
        for block in self.blocks:
            x = block(x, scale=scale)
            first = x if first is None else first
        return Output(self.head(x), self.aux(first.detach()), x > 0)


def test_dataclass_outputs_keyword_only_inputs_and_tensors_without_grad():
    torch.manual_seed(0)
    engine, optimizer, reference, ref_optimizer = engine_and_reference(DataclassOut())
    for x in vectors(3):
        for model, opt in ((engine, optimizer), (reference, ref_optimizer)):
            out = model(x, scale=0.5)
            assert not out.positive.requires_grad
            (out.logits.pow(2).mean() + out.aux.mean()).backward()
            opt.step()
            opt.zero_grad()
    assert_engine_matches(engine, reference)
    engine.close()


class HiddenToo(GPT):
    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        hidden = self.ln(x)
        return {"logits": self.head(hidden), "hidden": hidden}


def test_a_unit_the_loss_does_not_reach_is_not_stepped():
    """Untied, the head is a unit of its own (units.split_large); a loss on the hidden states
    gives it no gradient: PyTorch leaves it (grad None), and so must the engine."""
    torch.manual_seed(0)
    model = HiddenToo(512, 16, 2, 2, max_seq=SEQ, tied=False, qkv_bias=False)
    engine, optimizer, reference, ref_optimizer = engine_and_reference(model)
    assert "head" in [f.name for f in engine.runtime.flats]
    weights = torch.linspace(-1, 1, 16)  # not LayerNorm's own invariant (mean square 1)
    for step in range(3):
        for m, opt in ((engine, optimizer), (reference, ref_optimizer)):
            (m(batch(step))["hidden"] * weights).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert_engine_matches(engine, reference)
    engine.close()


class ReusedSublayer(Block):
    def forward(self, x):
        return x + torch.tanh(self.fc(torch.tanh(self.fc(self.ln(x)))))


class ReusingStack(Stack):
    """Each block calls its linear layer twice; block 0 runs again after block 1."""

    def __init__(self):
        super().__init__(blocks=0)
        self.blocks = nn.ModuleList(ReusedSublayer() for _ in range(2))

    def forward(self, x):
        x = self.blocks[1](self.blocks[0](x))
        return self.head(self.blocks[0](x))


def test_weights_reused_within_a_unit_and_a_unit_run_twice():
    torch.manual_seed(0)
    engine, optimizer, reference, ref_optimizer = engine_and_reference(ReusingStack())
    for x in vectors(3):
        for model, opt in ((engine, optimizer), (reference, ref_optimizer)):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert_engine_matches(engine, reference)
    engine.close()


class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)  # a bias before BatchNorm has no true gradient
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return x + torch.relu(self.bn(self.fc(x)))


class BNStack(Stack):
    def __init__(self):
        super().__init__(blocks=0)
        self.blocks = nn.ModuleList(BNBlock() for _ in range(2))


def test_running_stats_from_forwards_without_grad_in_train_mode():
    """A train-mode forward under no_grad or inference_mode updates BatchNorm's running stats
    (and num_batches_tracked) as in PyTorch; eval uses them; full_state_dict has them."""
    torch.manual_seed(0)
    engine, optimizer, reference, ref_optimizer = engine_and_reference(BNStack())
    x, y, z = vectors(3)
    for model, opt in ((engine, optimizer), (reference, ref_optimizer)):
        with torch.no_grad():
            model(x)
        with torch.inference_mode():
            model(y)
        model(z).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    engine.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(engine(x), reference(x), rtol=1e-5, atol=1e-6)
    engine.train(), reference.train()
    assert engine.full_state_dict()["blocks.1.bn.num_batches_tracked"].item() == 3
    assert_engine_matches(engine, reference)
    engine.close()


class FailingStack(Stack):
    fail = False

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.fail and i == 1:
                raise ValueError("a bad batch")
        return self.head(x)


def test_an_exception_in_forward_leaves_the_engine_training_like_pytorch():
    torch.manual_seed(0)
    model = FailingStack()
    engine, optimizer, reference, ref_optimizer = engine_and_reference(model)
    xs = vectors(4)
    for step, x in enumerate(xs):
        if step in (1, 2):  # after the trace is recorded, and again right after
            model.fail = True
            with pytest.raises(ValueError, match="a bad batch"):
                engine(xs[0])
            model.fail = False
        for m, opt in ((engine, optimizer), (reference, ref_optimizer)):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert_engine_matches(engine, reference)
    assert all_released(engine) and engine.memory_report()["hbm"]["current"] == 0
    engine.close()


def test_two_engines_train_a_gan_like_pytorch():
    """The discriminator's units get gradients from the generator's loss too, zeroed by its own
    zero_grad before its next backward, as in PyTorch."""
    torch.manual_seed(0)
    gen, dis = Stack(out=8), Stack(out=1)
    e_gen, o_gen, r_gen, ro_gen = engine_and_reference(gen)
    e_dis, o_dis, r_dis, ro_dis = engine_and_reference(dis)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        z, real = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        for gm, dm, go, do in ((e_gen, e_dis, o_gen, o_dis), (r_gen, r_dis, ro_gen, ro_dis)):
            fake = gm(z)
            d_loss = F.softplus(-dm(real)).mean() + F.softplus(dm(fake.detach())).mean()
            do.zero_grad()
            d_loss.backward()
            do.step()
            g_loss = F.softplus(-dm(fake)).mean()
            go.zero_grad()
            g_loss.backward()
            go.step()
    assert_engine_matches(e_gen, r_gen)
    assert_engine_matches(e_dis, r_dis)
    e_gen.close(), e_dis.close()


# --- bugs found -------------------------------------------------------------------------------


GRADIENT_PENALTY = f"""
import copy, torch, tiered
from helpers_models import Stack, vectors
CPU_YAML, OPTIM = {CPU_YAML!r}, {OPTIM!r}
torch.manual_seed(0)
model = Stack(out=1)
reference = copy.deepcopy(model)
engine, optimizer = tiered.initialize(model, CPU_YAML, compute_dtype="fp32", device="cpu",
                                      optimizer=dict(OPTIM))
ref_optimizer = torch.optim.AdamW(reference.parameters(), **OPTIM)
for x0 in vectors(3):
    for m, opt in ((engine, optimizer), (reference, ref_optimizer)):
        x = x0.clone().requires_grad_()
        out = m(x)
        grad, = torch.autograd.grad(out.sum(), x, create_graph=True)
        ((grad.norm(dim=1) - 1).pow(2).mean() + out.pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
state, expected = engine.full_state_dict(), reference.state_dict()
for name in expected:
    torch.testing.assert_close(state[name], expected[name], rtol=1e-5, atol=1e-6)
print("same")
"""


def test_a_gradient_penalty_double_backward_matches_pytorch():
    """``autograd.grad(..., create_graph=True)`` builds a graph whose nodes keep the weights
    the first backward unpacked, outside the units' saved-tensor hooks; its backward then read
    them after their unit was released: "out of bounds for storage of size 0", or SIGSEGV."""
    done = run_script(GRADIENT_PENALTY)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-1500:]}"
    assert done.stdout.splitlines()[-1] == "same"


class Interrupted(Stack):
    interrupt = False

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if self.interrupt and i == 1:
                raise KeyboardInterrupt  # Ctrl-C in a notebook, mid-forward
            x = block(x)
        return self.head(x)


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


@pytest.mark.skipif(_top_hooks is None, reason="this torch cannot say which hooks are in force")
def test_a_keyboard_interrupt_in_forward_leaves_no_saved_tensor_hooks_behind():
    """torch runs ``always_call`` forward hooks for an Exception only: after a
    KeyboardInterrupt inside a unit's forward, the saved-tensor hooks its pre-hook pushed stay
    in force for the whole process (every tensor autograd saves goes through tiered's pack,
    and torch.func.grad refuses to run), also after engine.close()."""
    torch.manual_seed(0)
    model = Interrupted()
    engine, optimizer = tiered.initialize(model, CPU_YAML, compute_dtype="fp32", device="cpu")
    try:
        model.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            engine(vectors(1)[0])
        model.interrupt = False
        engine(vectors(1)[0]).pow(2).mean().backward()  # training goes on
        optimizer.step()
        engine.close()
        assert _top_hooks(False) is None, "tiered's saved-tensor hooks are still in force"
        x = torch.randn(3)
        torch.testing.assert_close(torch.func.grad(lambda t: (t.sin() * t).sum())(x),
                                   x.cos() * x + x.sin())
    finally:  # never leave them to the tests after this one
        leftover = engine._hooks._saved_hooks
        while leftover:
            leftover.pop().__exit__(None, None, None)
        engine.close()


def test_a_stop_signal_inside_a_release_leaves_a_clean_shutdown():
    """Ctrl-C under tiered-launch raises KeyboardInterrupt wherever the rank is, also inside
    a unit's release, after its storage was shrunk and before it was marked released. The
    interrupted forward ends its iteration, releasing every unit, that one too (a release that
    fails on it, "KeyError: 0" from the storage index, would put a traceback in place of the
    one-line stop), and the engine closes cleanly after."""
    torch.manual_seed(0)
    engine, optimizer = tiered.initialize(Stack(), CPU_YAML, compute_dtype="fp32", device="cpu")
    flat = engine.runtime.flats[1]
    bind = flat.bind_placeholders

    def interrupted_once():
        flat.bind_placeholders = bind
        raise KeyboardInterrupt

    flat.bind_placeholders = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        engine(vectors(1)[0])
    assert [f.residency for f in engine.runtime.flats] == \
        [Residency.RELEASED] * len(engine.runtime.flats)
    assert engine.runtime.step_state.phase is Phase.IDLE
    engine.load_state_dict(engine.full_state_dict())  # nothing awaits a backward
    engine.close()
    assert [f.residency for f in engine.runtime.flats] == \
        [Residency.RELEASED] * len(engine.runtime.flats)


def bn_convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def test_batchnorm_trains_under_bf16_compute():
    """Under bf16 compute (the default's where the device computes bf16 natively) the weights
    become bf16 while the buffers stay fp32, a mix torch's batch_norm refuses ("expected scalar
    type BFloat16 but found Float"): any model with BatchNorm failed at its first forward."""
    torch.manual_seed(0)
    model = bn_convnet()
    reference = copy.deepcopy(model)
    engine, optimizer = tiered.initialize(model, CPU_YAML, device="cpu", compute_dtype="bf16",
                                          optimizer=dict(OPTIM))
    assert engine.policy.compute_dtype.torch_dtype is torch.bfloat16
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    refused = None
    try:
        out = engine(x)
    except RuntimeError as error:  # its traceback holds views of released weights, which
        refused = str(error)  # pytest's report would read: fail without it
    if refused is not None:
        pytest.fail(f"a BatchNorm model under bf16 compute: {refused}", pytrace=False)
    ref_out = reference(x)
    assert (out.float() - ref_out).norm() / ref_out.norm() <= 2e-2
    out.float().pow(2).mean().backward()
    optimizer.step()
    state, expected = engine.full_state_dict(), reference.state_dict()
    for name in ("1.running_mean", "1.running_var", "4.running_mean", "4.running_var"):
        torch.testing.assert_close(state[name].float(), expected[name], rtol=2e-2, atol=2e-3)
    assert state["1.num_batches_tracked"].item() == 1
    engine.close()


def test_a_frozen_models_forward_with_grad_enabled_ends_its_iteration():
    """A frozen teacher called without torch.no_grad (grad mode on, as a PyTorch user may):
    its output needs no gradient, so no backward can come. The iteration it started never
    ended: its needs piled up forever (no trace, so never a prefetch) and load_state_dict
    refused as if "between a forward run with grad enabled and its backward"."""
    model = make_gpt(2, qkv_bias=False)
    for param in model.parameters():
        param.requires_grad_(False)
    engine, _ = tiered.initialize(model, CPU_YAML, compute_dtype="fp32", device="cpu")
    for step in range(3):
        assert not engine(batch(step)).requires_grad
    assert engine.runtime.step_state.phase is Phase.IDLE
    assert not engine.runtime.prefetcher.recorded
    assert engine.runtime.prefetcher.trace, "the teacher's order is never recorded"
    engine.load_state_dict(engine.full_state_dict())
    engine.close()
