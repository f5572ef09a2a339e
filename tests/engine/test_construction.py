"""Building under tiered.init and cutting into units: each test compares with the model built
eagerly (deterministic inits, so values are comparable bit for bit) or checks one invariant."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tiered
from tiered.placement.units import find_units

CPU_FP32 = dict(device="cpu", compute_dtype="fp32")


def built(make, **overrides) -> dict[str, torch.Tensor]:
    """``make()`` under tiered.init, initialized by the engine: its full state dict."""
    with tiered.init(**CPU_FP32, **overrides):
        model = make()
    engine, _ = tiered.initialize(model)
    try:
        return engine.full_state_dict()
    finally:
        engine.close()


def assert_as_eager(make, **overrides) -> None:
    expected = make().state_dict()
    state = built(make, **overrides)
    assert list(state) == list(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


class Emb(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0)


class Head(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 2.0)
        nn.init.constant_(self.bias, 3.0)


class Lin(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 0.5)
        nn.init.constant_(self.bias, -0.5)


class Block(nn.Module):
    def __init__(self, dim: int = 4):
        super().__init__()
        self.lin = Lin(dim, dim)

    def forward(self, x):
        return self.lin(x)


class TiedLM(nn.Module):
    """An embedding tied to a head that has a bias of its own; ``head_first`` registers the
    head before the embedding it is tied to."""

    def __init__(self, vocab: int = 64, dim: int = 4, head_first: bool = False):
        super().__init__()
        if head_first:
            self.head = Head(dim, vocab)
        self.emb = Emb(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        if not head_first:
            self.head = Head(dim, vocab)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("split_large", [False, True])
@pytest.mark.parametrize("head_first", [False, True])
def test_a_tied_weight_keeps_its_creators_init(split_large, head_first):
    # Eager: the head's own weight is initialized then dropped by the tying, so the tied
    # weight holds the embedding's init. Under tiered.init the head (holding the weight and a
    # bias not yet initialized) ran after the embedding, or alone in its split_large unit.
    assert_as_eager(lambda: TiedLM(head_first=head_first), units={"split_large": split_large})


class Holder(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x @ self.weight


class SharedAtConstruction(nn.Module):
    """One parameter object handed to two modules in ``__init__`` (not tied afterwards)."""

    def __init__(self):
        super().__init__()
        shared = nn.Parameter(torch.empty(4, 4))
        self.a, self.b = Holder(shared), Holder(shared)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def reset_parameters(self) -> None:
        nn.init.constant_(self.a.weight, 0.25)


def test_a_parameter_registered_on_two_modules_stays_one_parameter():
    with tiered.init(**CPU_FP32):
        model = SharedAtConstruction()
    assert model.a.weight is model.b.weight
    units = find_units(model, None)
    assert [p.names for p in units[-1].params] == [("a.weight", "b.weight")]


class Scaled(nn.Linear):
    """A subclass adding a parameter its inherited reset_parameters does not write."""

    def __init__(self, dim: int):
        super().__init__(dim, dim)
        self.scale = nn.Parameter(torch.full((dim,), 5.0))


def test_a_parameter_no_init_writes_is_refused_by_name():
    # Its constructor value (5.0) is never allocated under tiered.init: it used to train from
    # whatever torch.empty held.
    with tiered.init(**CPU_FP32):
        model = nn.Sequential(Scaled(4), Scaled(4))
    with pytest.raises(tiered.TieredError, match=r"0\.scale \(Scaled\).*reset_parameters"):
        tiered.initialize(model)


class FromWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = Lin(4, 4)
        self.register_buffer("start", self.lin.weight.detach().clone())


def test_a_buffer_computed_from_a_parameter_is_refused_when_built():
    # It used to be a meta buffer, failing at initialize with "Cannot copy out of meta tensor".
    before = nn.Module.register_buffer
    with pytest.raises(tiered.TieredError, match="FromWeight registers buffer 'start'"):
        with tiered.init(**CPU_FP32):
            nn.Sequential(FromWeight(), FromWeight())
    assert nn.Module.register_buffer is before


def test_the_context_restores_torch_when_reentered_or_failing():
    originals = (nn.Module.register_parameter, nn.Module.register_buffer)
    context = tiered.init(**CPU_FP32)
    with context:
        with context:
            pass
        assert nn.Linear(2, 2).weight.is_meta  # still inside the outer entry
    assert (nn.Module.register_parameter, nn.Module.register_buffer) == originals
    with pytest.raises(ZeroDivisionError):
        with context:
            nn.Linear(2, 2)
            1 / 0
    assert (nn.Module.register_parameter, nn.Module.register_buffer) == originals
    assert not nn.Linear(2, 2).weight.is_meta


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))


def test_blocks_inside_a_lone_module_beside_blocks_are_units():
    # Stage's blocks were left in the root, gathered through the whole forward.
    units = find_units(nn.Sequential(Block(), Block(), Stage()), None)
    assert [u.path for u in units] == ["0", "1", "2.blocks.0", "2.blocks.1"]  # no root params
