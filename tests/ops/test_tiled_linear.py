"""TiledLinear: nn.Linear's function, tile by tile, and training when no whole weight fits."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tiered
from tiered.ops.tiled_linear import tile_shape
from tiered.policy.config import Policy
from tiered.policy.kinds import Tier

from helpers_models import assert_parity


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_splits,out_splits", [(1, 1), (2, 3), (3, 2), (5, 7), (13, 1)])
@pytest.mark.parametrize("shape", [(6,), (2, 3)], ids=["2d", "3d"])
def test_forward_and_backward_match_nn_linear(bias, in_splits, out_splits, shape):
    torch.manual_seed(0)
    linear = nn.Linear(13, 11, bias=bias)
    tiled = tiered.TiledLinear(13, 11, bias, in_splits, out_splits)
    tiled.load_state_dict(linear.state_dict(), strict=True)
    x = torch.randn(*shape, 13)
    x_linear, x_tiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    upstream = torch.randn(*shape, 11)
    out_linear, out_tiled = linear(x_linear), tiled(x_tiled)
    torch.testing.assert_close(out_tiled, out_linear, rtol=1e-5, atol=1e-6)
    out_linear.backward(upstream)
    out_tiled.backward(upstream)
    torch.testing.assert_close(x_tiled.grad, x_linear.grad, rtol=1e-5, atol=1e-6)
    weight_grad, bias_grad = tiled.merge([t.weight.grad for t in tiled.tiles],
                                         [t.bias.grad if t.bias is not None else None
                                          for t in tiled.tiles])
    torch.testing.assert_close(weight_grad, linear.weight.grad, rtol=1e-5, atol=1e-6)
    if bias:
        torch.testing.assert_close(bias_grad, linear.bias.grad, rtol=1e-5, atol=1e-6)
    assert len(tiled.tiles) == in_splits * out_splits
    assert sum(t.bias is not None for t in tiled.tiles) == (out_splits if bias else 0)


def test_state_dict_is_nn_linears():
    tiled = tiered.TiledLinear(10, 6, True, in_splits=3, out_splits=4)
    state = tiled.state_dict()
    assert list(state) == ["weight", "bias"]
    assert state["weight"].shape == (6, 10) and state["bias"].shape == (6,)
    linear = nn.Linear(10, 6)
    linear.load_state_dict(state, strict=True)
    assert torch.equal(linear.weight, state["weight"])


def test_tile_shape_keeps_every_tile_under_the_limit():
    for out_features, in_features, limit in [(32768, 65536, 2 << 30), (1000, 64, 1000),
                                            (7, 100_000, 4096), (50304, 2560, 64 << 20)]:
        in_splits, out_splits = tile_shape(out_features, in_features, 2, limit)
        rows = -(-out_features // out_splits)
        cols = -(-in_features // in_splits)
        assert rows * cols * 2 <= limit, (out_features, in_features, limit)
        assert in_splits == 1 or in_features * 2 > limit  # columns split only when rows are big


class Wide(nn.Module):
    """Two small layers around one wide layer (the one that will not fit)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 256)
        self.wide = nn.Linear(256, 1024)
        self.out = nn.Linear(1024, 8)

    def forward(self, x):
        return self.out(torch.tanh(self.wide(torch.tanh(self.inp(x)))))


def make_wide() -> Wide:
    torch.manual_seed(0)
    return Wide()


# The tiled backward sums the input gradient over tiles in another order than one matmul does;
# lr 1e-3 keeps Adam from magnifying that rounding (in elements whose gradient is near zero)
# past the tolerance within the test's few steps.
LR = 1e-3


def cpu_policy(**extra) -> Policy:
    return Policy.from_dict(dict(device="cpu", compute_dtype="fp32",
                                 optimizer={"lr": LR, "weight_decay": 0.1}, **extra))


def hbm_needed(policy: Policy) -> int:
    engine, _ = tiered.initialize(make_wide(), policy)
    needed = engine.runtime.manager.plan.needed(Tier.HBM)
    engine.close()
    return needed


def test_a_layer_larger_than_the_hbm_budget_trains_tiled_with_parity():
    wide_bytes = 256 * 1024 * 4
    tiled_policy = cpu_policy(tiling={"max_unit_bytes": wide_bytes // 32})
    budget = hbm_needed(tiled_policy)
    assert budget < wide_bytes, "the budget should hold no whole weight of the wide layer"
    with pytest.raises(tiered.BudgetError, match="hbm"):
        tiered.initialize(make_wide(), cpu_policy(hbm={"budget": budget}))

    model = make_wide()
    reference = copy.deepcopy(model)
    engine, optimizer = tiered.initialize(model, tiled_policy.replace(hbm={"budget": budget}))
    assert isinstance(model.wide, tiered.TiledLinear) and len(model.wide.tiles) >= 32
    assert isinstance(model.inp, nn.Linear)  # small layers stay whole
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        nn.functional.mse_loss(engine(x), y).backward()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step(), ref_optimizer.step()
        optimizer.zero_grad(), ref_optimizer.zero_grad()
    state = engine.full_state_dict()
    assert_parity(state, reference.state_dict())
    assert engine.memory_report()["hbm"]["peak"] <= budget

    # Exported weights load into the untiled model, which computes what the tiled engine does.
    untiled = Wide()
    untiled.load_state_dict(state, strict=True)
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(untiled(x), engine(x), rtol=1e-6, atol=1e-7)
    engine.close()


def test_tiling_a_model_built_under_init_materializes_nothing_whole():
    policy = cpu_policy(tiling={"max_unit_bytes": 64 << 10})
    with tiered.init(policy):
        model = Wide()
    engine, _ = tiered.initialize(model)
    assert isinstance(model.wide, tiered.TiledLinear)
    state = engine.full_state_dict()
    bound = 1 / 256 ** 0.5  # nn.Linear's initialization, from the whole layer's fan-in
    assert state["wide.weight"].shape == (1024, 256)
    assert 0 < state["wide.weight"].abs().max() <= bound
    assert state["wide.weight"].std() > bound / 3
    engine.close()


def test_tied_layers_are_not_tiled():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(512, 64)
            self.head = nn.Linear(64, 512, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(self.emb(idx))

    model = Tied()
    engine, _ = tiered.initialize(model, cpu_policy(tiling={"max_unit_bytes": 4096}))
    assert type(model.head) is nn.Linear
    engine.close()


@pytest.mark.parametrize("refusal", ["budget", "param group"])
def test_a_refused_model_is_handed_back_untiled(refusal):
    # initialize() tiles the wide layer first; when it then refuses the model, the model must
    # come back as it was, and train under a policy that fits.
    model = make_wide()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    tiling = {"max_unit_bytes": 256 * 1024 * 4 // 32}
    refused = (cpu_policy(tiling=tiling, hbm={"budget": 4096}) if refusal == "budget" else
               cpu_policy(tiling=tiling).replace(optimizer={"param_groups": [{"match": "x"}]}))
    with pytest.raises((tiered.BudgetError, tiered.PolicyError)):
        tiered.initialize(model, refused)
    assert type(model.wide) is nn.Linear
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    engine, optimizer = tiered.initialize(model, cpu_policy(tiling=tiling))
    assert isinstance(model.wide, tiered.TiledLinear)
    engine(torch.randn(2, 32)).sum().backward()
    optimizer.step()
    engine.close()
