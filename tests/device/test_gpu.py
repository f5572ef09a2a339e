"""On a CUDA device: bf16 parity with autocast PyTorch, fp32 parity, memory accounting."""
from __future__ import annotations

import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import tiered

from gpt import GPT, next_token_loss
from helpers import REPO

pytestmark = pytest.mark.gpu
STEPS, BATCH, SEQ, VOCAB = 5, 8, 64, 256
OPTIM = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, 128, 3, 4, max_seq=SEQ, tied=True, qkv_bias=False)


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).cuda() for _ in range(STEPS)]


def train_engine(policy: str, compute_dtype: str, nvme: str):
    engine, optimizer = tiered.initialize(
        make_model(), os.path.join(REPO, "configs", f"{policy}.yaml"), device="cuda",
        compute_dtype=compute_dtype, nvme={"path": nvme}, optimizer=dict(OPTIM))
    losses = []
    for idx in batches():
        loss = next_token_loss(engine(idx), idx)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = engine.full_state_dict()
    report = engine.memory_report()
    engine.close()
    return state, losses, report


def train_reference(autocast: bool):
    model = make_model().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **OPTIM)
    losses = []
    for idx in batches():
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = next_token_loss(model(idx), idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {k: v.cpu() for k, v in model.state_dict().items()}, losses


@pytest.mark.parametrize("policy", ["cpu", "nvme", "gpu"])
def test_bf16_matches_autocast_pytorch(policy, tmp_path):
    state, losses, _ = train_engine(policy, "bf16", str(tmp_path))
    reference, ref_losses = train_reference(autocast=True)
    initial = make_model().state_dict()
    worst_delta = worst_update = 0.0
    for name, ref in reference.items():
        delta = ((state[name] - ref).norm() / ref.norm()).item()
        assert delta <= 1e-2, f"{name}: ||delta||/||ref|| = {delta:.2e}"
        # The update itself, not only the weights, must agree to bf16 accuracy.
        moved = (ref - initial[name]).norm()
        if moved > 0:
            update_error = ((state[name] - ref).norm() / moved).item()
            assert update_error <= 0.25, f"{name}: update differs by {update_error:.2%}"
            worst_update = max(worst_update, update_error)
        worst_delta = max(worst_delta, delta)
    print(f"{policy}: worst ||delta||/||ref|| {worst_delta:.2e}, worst update error "
          f"{worst_update:.2%}, losses {losses} vs {ref_losses}")
    assert losses[-1] < losses[0]
    for ours, ref in zip(losses, ref_losses):
        assert abs(ours - ref) <= 2e-2 * abs(ref)


@pytest.mark.parametrize("policy", ["cpu", "nvme", "gpu"])
def test_fp32_matches_pytorch(policy, tmp_path):
    # The math backend of attention is deterministic, so both runs see identical gradients.
    with sdpa_kernel(SDPBackend.MATH):
        state, _, _ = train_engine(policy, "fp32", str(tmp_path))
        reference, _ = train_reference(autocast=False)
    for name, ref in reference.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_fp16_trains_with_loss_scaling(tmp_path):
    state, losses, report = train_engine("cpu", "fp16", str(tmp_path))
    assert all(torch.isfinite(v).all() for v in state.values())
    assert losses[-1] < losses[0]


def test_memory_report_counts_device_shards():
    engine, optimizer = tiered.initialize(make_model(), os.path.join(REPO, "configs/gpu.yaml"),
                                          device="cuda", compute_dtype="bf16")
    shard_numel = sum(f.shard_numel for f in engine.runtime.flats)
    # bf16 weights + fp32 gradient + fp32 master and two moments, all on the device.
    assert engine.memory_report()["hbm"]["current"] == shard_numel * (2 + 4 + 12)
    idx = batches()[0]
    engine.backward(next_token_loss(engine(idx), idx))
    optimizer.step()
    report = engine.memory_report()["hbm"]
    assert report["current"] == shard_numel * (2 + 4 + 12)
    assert report["current"] < report["peak"] <= report["budget"]
    engine.close()


def test_auto_re_planned_on_the_device_matches_pytorch(tmp_path):
    """tier: auto on the GPU with a budget whose quarter reserve leaves the device the root
    unit only: the first step measures a small batch's activations, the re-plan moves the
    blocks to the device (stepped there by the fused kernel, their step counts with them), and
    fp32 training goes on as PyTorch's."""
    from tiered.engine.build import flat_units, forward_order, memory_plan
    from tiered.policy.config import Policy
    from tiered.policy.kinds import Tier

    torch.manual_seed(0)
    make = lambda: GPT(VOCAB, 512, 3, 8, max_seq=SEQ, tied=True, qkv_bias=False)  # noqa: E731
    auto = os.path.join(REPO, "configs", "auto.yaml")
    policy = Policy.from_yaml(auto, dict(device="cuda", compute_dtype="fp32"))
    flats = flat_units(make(), policy, 0, 1, torch.device("cpu"))  # sizes only
    order = forward_order(flats)
    needed = [memory_plan(policy, torch.device("cuda"), flats, None,
                          on_device=frozenset(order[:count])).needed(Tier.HBM)
              for count in (1, 2)]
    budget = needed[1] * 4 // 3 - 8  # a quarter free keeps one unit; the re-plan has room
    assert needed[0] + budget // 4 <= budget
    idx = [batch[:1] for batch in batches()]  # one sequence: activations small
    with sdpa_kernel(SDPBackend.MATH):
        torch.cuda.reset_peak_memory_stats()  # the tests before this one allocated too
        torch.manual_seed(0)
        engine, optimizer = tiered.initialize(make(), auto, device="cuda",
                                              compute_dtype="fp32", optimizer=dict(OPTIM),
                                              hbm={"budget": budget})
        for batch in idx:
            next_token_loss(engine(batch), batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        replanned = engine.plan_report().replanned
        state = engine.full_state_dict()
        engine.close()
        torch.manual_seed(0)
        model = make().cuda()
        reference = torch.optim.AdamW(model.parameters(), fused=True, **OPTIM)
        for batch in idx:
            next_token_loss(model(batch), batch).backward()
            reference.step()
            reference.zero_grad()
    assert "more units kept on the device" in replanned, replanned
    for name, ref in model.state_dict().items():
        torch.testing.assert_close(state[name], ref.cpu(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
