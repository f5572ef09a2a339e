"""Edges of the gradient path and of the engine's life, against plain PyTorch +
torch.optim.AdamW (fp32 on the CPU, bit for bit): ``zero_grad(set_to_none=False)`` and units
without a gradient, units of zero-size parameters, an input gradient that is not a backward of
the step, a refused fp16 backward, integer parameters, and a closed engine."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tiered

from helpers import CONFIGS

OPTIM = dict(lr=1e-2, weight_decay=0.1)
CPU_YAML = str(CONFIGS / "cpu.yaml")


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    """Three blocks (three units) and a root unit; ``skip`` leaves blocks out of a forward."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(3))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = ()) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i not in skip:
                h = block(h)
        return self.out(h)


def engine_and_reference(model: nn.Module, **optimizer):
    """An fp32 engine on the CPU and plain PyTorch with torch's fused AdamW (the kernel the
    engine runs in fp32), from the same weights."""
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    engine, opt = tiered.initialize(model, CPU_YAML, compute_dtype="fp32",
                                    device="cpu", optimizer=dict(OPTIM, **optimizer))
    return engine, opt, reference, torch.optim.AdamW(reference.parameters(), fused=True, **OPTIM)


def inputs(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 4, generator=g) for _ in range(count)]


def assert_bit_for_bit(state: dict, reference: dict) -> None:
    assert list(state) == list(reference)
    for name in reference:
        assert torch.equal(state[name], reference[name]), \
            f"{name}: max |diff| {(state[name] - reference[name]).abs().max().item()}"


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("accumulation_steps", [None, 1])
def test_zero_grad_without_set_to_none_gives_no_gradient_to_an_unused_unit(accumulation_steps):
    """torch.optim's zero_grad(set_to_none=False) zeroes the .grad that exist and leaves None
    where there is none, so a parameter no backward has reached is never stepped. The engine
    counted every unit as having a zero gradient, and stepped a block the model never uses
    (weight decay and the moments moved it)."""
    engine, optimizer, reference, ref_optimizer = engine_and_reference(
        make_net(), accumulation_steps=accumulation_steps)
    for x in inputs(3):
        optimizer.zero_grad(set_to_none=False), ref_optimizer.zero_grad(set_to_none=False)
        engine(x, skip=(1,)).pow(2).sum().backward()
        reference(x, skip=(1,)).pow(2).sum().backward()
        optimizer.step(), ref_optimizer.step()
    assert_bit_for_bit(engine.full_state_dict(), reference.state_dict())
    engine.close()


def test_a_closed_engine_refuses_reads_of_its_state_by_name(tmp_path):
    """After close() the shards are gone: full_state_dict, checkpoints, exports and
    engine.backward of a loss computed before must say so, not fail with a KeyError deep in the
    tier manager. (test_failures covers the forward and zero_grad.)"""
    engine, _, _, _ = engine_and_reference(make_net())
    loss = engine(inputs(1)[0]).sum()
    engine.close()
    calls = {
        "full_state_dict": engine.full_state_dict,
        "consolidated_units": lambda: next(engine.consolidated_units()),
        "save_checkpoint": lambda: engine.save_checkpoint(str(tmp_path / "ckpt")),
        "load_checkpoint": lambda: engine.load_checkpoint(str(tmp_path / "ckpt")),
        "save_pretrained": lambda: engine.save_pretrained(str(tmp_path / "export")),
        "backward": lambda: engine.backward(loss),
    }
    for name, call in calls.items():
        with pytest.raises(tiered.TieredError, match="closed"):
            call()


class EmptyBlocks(nn.Module):
    """Blocks whose parameters are all of size 0 (a configuration with zero extra outputs):
    repeated blocks with parameters, so units, each of zero elements."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 0), nn.Linear(4, 0)])
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) + sum(block(x).sum() for block in self.blocks)


def test_units_of_zero_size_parameters_train_like_pytorch():
    """Two gathered units of zero bytes shared one storage address (data_ptr 0), by which the
    gatherer tells units apart: releasing the second failed with KeyError 0."""
    torch.manual_seed(0)
    engine, optimizer, reference, ref_optimizer = engine_and_reference(EmptyBlocks())
    assert [flat.numel for flat in engine.runtime.flats] == [0, 0, 5]
    for x in inputs(3):
        engine(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
        optimizer.step(), ref_optimizer.step()
        optimizer.zero_grad(), ref_optimizer.zero_grad()
    assert_bit_for_bit(engine.full_state_dict(), reference.state_dict())
    assert engine.memory_report()["hbm"]["current"] == 0
    engine.close()


def test_an_input_gradient_is_not_a_backward_of_the_step():
    """Adversarial training (FGSM) and input-gradient penalties take torch.autograd.grad of the
    loss with respect to the input, then run the real backward. With accumulation_steps: 1 the
    engine counted the input gradient as the step's backward and refused the real one
    ("units were already stepped with the gradients of backward 1", though none was)."""
    engine, optimizer, reference, ref_optimizer = engine_and_reference(
        make_net(), accumulation_steps=1)
    for x in inputs(3):
        x.requires_grad_()
        (gx,) = torch.autograd.grad(engine(x).pow(2).sum(), x)
        (ref_gx,) = torch.autograd.grad(reference(x).pow(2).sum(), x)
        assert torch.equal(gx, ref_gx)
        adversarial = (x + 0.1 * gx.sign()).detach()
        engine(adversarial).pow(2).sum().backward()
        reference(adversarial).pow(2).sum().backward()
        optimizer.step(), ref_optimizer.step()
        optimizer.zero_grad(), ref_optimizer.zero_grad()
    assert_bit_for_bit(engine.full_state_dict(), reference.state_dict())
    engine.close()


def test_close_frees_the_units_a_forward_left_gathered():
    """A forward with grad enabled whose backward never comes keeps the units the trace holds
    for that backward gathered; close() frees every tier, and left their storage (HBM on a
    GPU) alive as long as the model."""
    engine, optimizer, _, _ = engine_and_reference(make_net())
    for x in inputs(2):  # the second iteration follows the recorded trace
        engine(x).sum().backward()
        optimizer.step(), optimizer.zero_grad()
    engine(inputs(1)[0]).sum()  # no backward: e.g. a validation loss computed with grad on
    assert any(flat.full.untyped_storage().nbytes() for flat in engine.runtime.flats), \
        "nothing stayed gathered; the test would not exercise close()"
    engine.close()
    assert [flat.full.untyped_storage().nbytes() for flat in engine.runtime.flats] == \
        [0] * len(engine.runtime.flats)


class IndexedNet(Net):
    """A frozen integer parameter (a permutation table): legal in torch, which allows
    requires_grad=False parameters of any dtype."""

    def __init__(self):
        super().__init__()
        self.order = nn.Parameter(torch.tensor([3, 1, 2, 0]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x[:, self.order])


def test_an_integer_parameter_is_refused_at_initialize_by_name():
    """It went into the unit's flat buffer in the compute dtype and came back as floats: the
    forward failed far away ("tensors used as indices must be long"), and arithmetic on it
    would round silently in bf16."""
    torch.manual_seed(0)
    with pytest.raises(tiered.TieredError, match=r"order \(torch.int64\).*register_buffer"):
        tiered.initialize(IndexedNet(), CPU_YAML, compute_dtype="fp32", device="cpu")


def test_a_refused_fp16_backward_leaves_no_gradient_behind():
    """fp16 compute needs engine.backward (the loss scaled); loss.backward() is refused at its
    first gradient, which autograd has accumulated by then. Left in place, it would be added into
    the next backward's: the run must go on exactly as one that never made the mistake."""
    def run(mistake: bool) -> dict:
        torch.manual_seed(0)
        engine, optimizer = tiered.initialize(Net(), CPU_YAML, compute_dtype="fp16",
                                              device="cpu", optimizer=OPTIM)
        for i, x in enumerate(inputs(3)):
            if mistake and i == 1:
                with pytest.raises(tiered.TieredError, match=r"engine\.backward\(loss\)"):
                    # Unscaled, a gradient would vanish beside a scaled one in fp16 rounding:
                    # this one is of the size of the scaled ones.
                    (engine(x).float().pow(2).mean() * 1e4).backward()
            engine.backward(engine(x).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        state = engine.full_state_dict()
        engine.close()
        return state

    assert_bit_for_bit(run(mistake=True), run(mistake=False))
