"""Compact optimizer states through the engine (issue 21): ``optimizer.moments`` and
``optimizer.master`` against plain PyTorch with the compact step's reference, resident states
against states streamed from NVMe, and the bytes the plan holds."""
from __future__ import annotations

import errno
import math
import os
from fnmatch import fnmatchcase

import pytest
import torch

import tiered
from tiered.core.errors import PolicyError
from tiered.core.sizes import align_up
from tiered.optim.adamw import AdamWHyper, _one_pass_scalars
from tiered.optim.compact import Run, random_bits, reference_step, stream_key
from tiered.placement.plan import StateKind
from tiered.policy.kinds import Tier
from tiered.tiers.dram import BLOCK_ALIGN
from tiered.tiers.moments import INT8, PACKED, SECOND_MOMENT, format_of, stored_numel

from distributed import run_ranks
from gpt import GPT, add_lora, next_token_loss
from helpers import update_failing_with
from helpers_models import (BATCH, CODE_MAPS, MICRO, OPTIM, assert_parity, batches, lora_model,
                            make_model, run_engine, shard_states, states_by_name, token_batches)

HYPER = AdamWHyper(OPTIM["lr"], *OPTIM["betas"], OPTIM["eps"], OPTIM["weight_decay"])
MOMENTS = {"bf16": torch.bfloat16, "int8": torch.uint8}


def policy(moments: str = "fp32", master: str = "fp32", compute: str = "fp32", **optimizer):
    return {"compute_dtype": compute, "device": "cpu",
            "optimizer": {"lr": OPTIM["lr"], "betas": list(OPTIM["betas"]), "eps": OPTIM["eps"],
                          "weight_decay": OPTIM["weight_decay"], "moments": moments,
                          "master": master, **optimizer}}


GROUPS = [{"match": ["*ln*", "*.bias"], "weight_decay": 0.0, "lr": OPTIM["lr"] / 2}]
"""A second param group, norms and biases, as fine-tunes set one up."""


def group_hypers() -> list[AdamWHyper]:
    return [HYPER, AdamWHyper(OPTIM["lr"] / 2, *OPTIM["betas"], OPTIM["eps"], 0.0)]


def reference_training(units, moments: str, max_grad_norm: float | None = None,
                       grouped: bool = False) -> dict:
    """Plain PyTorch with compact.reference_step as the optimizer: each unit's parameters as
    one flat (the engine's layout, padding included, which goes with the last parameter's
    group), its moments compact, stepped with that unit's random stream (the engine's
    rounding_seed, 0); the gradient clipped as clip_grad_norm_ does, by a divisor."""
    model = make_model()
    named = dict(model.named_parameters())
    flats = [[(name, named[name]) for name in names] for names, _ in units]
    dtype = MOMENTS[moments]
    states = []
    for (_, padded), params in zip(units, flats):
        size = stored_numel(PACKED, padded) if dtype is torch.uint8 else padded
        states.append((torch.zeros(size, dtype=dtype), torch.zeros(size, dtype=dtype)))
    for step, micro_batches in enumerate(batches(), start=1):
        for idx in micro_batches:
            (next_token_loss(model(idx), idx) / MICRO).backward()
        divisor = 1.0
        if max_grad_norm is not None:
            norm = math.sqrt(sum(float(p.grad.double().square().sum())
                                 for p in model.parameters()))
            clip = max_grad_norm / (norm + 1e-6)
            divisor = 1.0 / clip if clip < 1.0 else 1.0
        hypers = group_hypers()
        with torch.no_grad():
            for unit, ((_, padded), params, (exp_avg, exp_avg_sq)) in enumerate(
                    zip(units, flats, states)):
                numel = sum(p.numel() for _, p in params)
                grad, master = torch.zeros(padded), torch.zeros(padded)  # padding: zeros
                grad[:numel] = torch.cat([p.grad.flatten() for _, p in params])
                master[:numel] = torch.cat([p.flatten() for _, p in params])
                runs, offset = [], 0
                for k, (name, p) in enumerate(params):
                    group = int(grouped and any(fnmatchcase(name, pattern)
                                                for pattern in GROUPS[0]["match"]))
                    stop = padded if k == len(params) - 1 else offset + p.numel()
                    runs.append(Run(offset, stop, _one_pass_scalars(hypers[group], step,
                                                                    divisor)))
                    offset += p.numel()
                weights = torch.empty(padded)
                reference_step(master, weights, grad, exp_avg, exp_avg_sq, weights, 0, runs,
                               stream_key(0, unit, step))
                offset = 0
                for _, p in params:
                    p.copy_(master[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        model.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("moments", ["bf16", "int8"])
@pytest.mark.parametrize("clipped_and_grouped", [False, True], ids=["plain", "clip+groups"])
def test_compact_moments_train_as_plain_pytorch_with_the_reference_step(moments,
                                                                        clipped_and_grouped):
    extra = dict(max_grad_norm=0.5, param_groups=GROUPS) if clipped_and_grouped else {}
    engine, optimizer = tiered.initialize(make_model(), policy(moments, **extra))
    units = [([param.names[0] for param in flat.spec.params], flat.padded_numel)
             for flat in engine.runtime.flats]
    assert all(engine.manager.shards[(i, StateKind.EXP_AVG)].dtype is MOMENTS[moments]
               for i in range(len(units)))
    state = run_engine(engine, optimizer)
    clipped = optimizer.last_grad_norm
    engine.close()
    if clipped_and_grouped:
        assert clipped > 0.5  # it did clip
    assert_parity(state, reference_training(units, moments, extra.get("max_grad_norm"),
                                            clipped_and_grouped))


def big_model() -> GPT:
    """Blocks of 790 K parameters: four pieces each when streamed in pieces of 262144."""
    torch.manual_seed(0)
    return GPT(64, 256, 2, 4, max_seq=16, tied=True, qkv_bias=False)


def train_big(engine, optimizer, steps: int = 3) -> dict:
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        idx = torch.randint(0, 64, (4, 16), generator=g)
        next_token_loss(engine(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()
    return engine.full_state_dict()


@pytest.mark.parametrize("moments,master", [("int8", "bf16"), ("bf16", "fp32"),
                                            ("int8", "fp32")])
def test_states_streamed_from_nvme_step_as_resident_ones(tmp_path, moments, master):
    """Pieces of a unit's states (four here) give the bits of stepping it whole: blocks and
    random bits follow the element's place in its unit."""
    settings = dict(moments=moments, master=master, compute="bf16", sub_group_size=1 << 18)
    resident = tiered.initialize(big_model(), policy(**settings))
    expected = train_big(*resident)
    resident[0].close()
    streamed = dict(policy(**settings), nvme={"path": str(tmp_path)})
    streamed["optimizer"]["tier"] = "nvme"
    engine, optimizer = tiered.initialize(big_model(), streamed)
    assert engine.manager.nvme_file(1, StateKind.EXP_AVG) is not None
    assert engine.manager.has(1, StateKind.MASTER) is (master == "fp32")
    assert len(engine.runtime.host.rank_host.stepper.stream.pieces(1)) == 4
    got = train_big(engine, optimizer)
    engine.close()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_the_plan_holds_the_compact_bytes():
    """int8 moments: 260 bytes per 256 parameters (in whole 4 KiB blocks); bf16 master: no
    fp32 copy at all."""
    engine, _ = tiered.initialize(big_model(), policy("int8", "bf16", compute="bf16"))
    plan = engine.manager.plan
    for i, flat in enumerate(engine.runtime.flats):
        assert (i, StateKind.MASTER) not in plan.shards
        for kind in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ):
            buffer = plan.shards[(i, kind)]
            assert buffer.dtype is torch.uint8
            assert buffer.nbytes == align_up(stored_numel(PACKED, flat.shard_numel), BLOCK_ALIGN)
    fp32_engine, _ = tiered.initialize(big_model(), policy(compute="bf16"))
    saved = sum(flat.shard_numel * 4 + 2 * (flat.shard_numel * 4 - stored_numel(PACKED, 
        flat.shard_numel)) for flat in engine.runtime.flats)
    gap = fp32_engine.manager.plan.needed(Tier.DRAM) - plan.needed(Tier.DRAM)
    assert abs(gap - saved) <= 3 * BLOCK_ALIGN * len(engine.runtime.flats)
    engine.close()
    fp32_engine.close()


@pytest.mark.parametrize("settings,message", [
    ({"optimizer": {"master": "bf16"}, "compute_dtype": "fp16"}, "needs compute_dtype: bf16"),
    ({"optimizer": {"master": "bf16"}}, "got auto \\(auto computes in fp32 where"),
    ({"optimizer": {"master": "bf16"}, "compute_dtype": "bf16", "params": {"tier": "nvme"},
      "nvme": {"path": "/x"}}, "params.tier must be dram"),
    ({"optimizer": {"moments": "int8", "sub_group_size": 1 << 16}}, "multiple of 262144"),
    ({"optimizer": {"moments": "bf16", "sub_group_size": 3 * 1024}}, "multiple of 2048"),
    ({"optimizer": {"moments": "fp8"}}, "allowed: fp32 | bf16 | int8"),
])
def test_compact_settings_that_cannot_work_are_refused_by_name(settings, message):
    with pytest.raises(PolicyError, match=message):
        tiered.Policy.from_dict(settings, "policy.yaml")


def train_small(engine, optimizer, batches_of: list[torch.Tensor]) -> list[float]:
    losses = []
    for idx in batches_of:
        loss = next_token_loss(engine(idx), idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("delayed", [False, True], ids=["ordinary", "delayed-update"])
def test_a_resume_of_compact_states_repeats_the_run_bit_for_bit(tmp_path, delayed):
    """Saved as they are (int8 codes, bf16 weights as the master; under the delayed update the
    pending next weights too), loaded, and stepped with the same random streams."""
    settings = policy("int8", "bf16", compute="bf16",
                      delayed_update={"enabled": delayed, "warmup_steps": 1})
    data = token_batches(6)
    engine, optimizer = tiered.initialize(make_model(), settings)
    expected = train_small(engine, optimizer, data)
    final = engine.full_state_dict()
    engine.close()

    engine, optimizer = tiered.initialize(make_model(), settings)
    train_small(engine, optimizer, data[:3])
    engine.save_checkpoint(str(tmp_path), tag="mid")
    engine.close()
    engine, optimizer = tiered.initialize(make_model(), settings)
    engine.load_checkpoint(str(tmp_path), tag="mid")
    assert train_small(engine, optimizer, data[3:]) == expected[3:]
    got = engine.full_state_dict()
    engine.close()
    for name in final:
        assert torch.equal(got[name], final[name]), name


@pytest.mark.parametrize("saved,loaded", [(("fp32", "fp32"), ("int8", "bf16")),
                                          (("int8", "bf16"), ("fp32", "fp32")),
                                          (("bf16", "fp32"), ("int8", "fp32"))])
def test_a_checkpoint_loads_under_other_state_dtypes_and_trains_on(tmp_path, caplog, saved,
                                                                   loaded):
    data = token_batches(8)
    engine, optimizer = tiered.initialize(make_model(), policy(*saved, compute="bf16"))
    before = train_small(engine, optimizer, data[:4])
    engine.save_checkpoint(str(tmp_path), tag="t")
    moments = [engine.manager.load(i, StateKind.EXP_AVG_SQ).clone()
               for i in range(len(engine.runtime.flats))]
    engine.close()
    engine, optimizer = tiered.initialize(make_model(), policy(*loaded, compute="bf16"))
    with caplog.at_level("INFO", logger="tiered"):
        engine.load_checkpoint(str(tmp_path), tag="t")
    said = [r.getMessage() for r in caplog.records if "converted on load" in r.getMessage()]
    assert any("second Adam moment" in line for line in said), said
    if saved[1] != loaded[1]:
        assert any("master weights" in line for line in said), said
    # The second moments came across (to their new dtype's precision).
    for i in range(len(engine.runtime.flats)):
        held = engine.manager.load(i, StateKind.EXP_AVG_SQ)
        numel = engine.runtime.flats[i].shard_numel
        values = format_of(held.dtype).decode(held, numel, SECOND_MOMENT)
        original = format_of(moments[i].dtype).decode(moments[i], numel, SECOND_MOMENT)
        torch.testing.assert_close(values, original, rtol=1 / 8, atol=1e-12)
    after = train_small(engine, optimizer, data[4:])
    engine.close()
    assert all(torch.isfinite(torch.tensor(after)))
    assert after[-1] < before[0]  # the loss goes on down from where it was


def test_bf16_masters_beside_moments_on_nvme_keep_their_step_when_a_write_fails(tmp_path):
    """The weights are the master: a unit's new ones wait in staging until its moments' new
    versions are on the drive, so a failed write leaves weights and moments of one step."""
    settings = dict(policy("int8", "bf16", compute="bf16"), nvme={"path": str(tmp_path)})
    settings["optimizer"]["tier"] = "nvme"
    engine, optimizer = tiered.initialize(big_model(), settings)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    train_big(engine, optimizer, steps=1)
    manager = engine.manager
    first = engine.runtime.forward_order(list(range(len(engine.runtime.flats))))[0]
    before = manager.load(first, StateKind.PARAM).clone()

    def fault(verb, path, offset, size):  # the update's first write: its first unit's moments
        if verb == "write":
            raise OSError(errno.EIO, "injected EIO")

    update_failing_with(engine, optimizer, idx, fault, "injected EIO")
    assert torch.equal(manager.load(first, StateKind.PARAM), before)
    engine.close()


def test_frozen_fp32_weights_keep_fp32_masters_under_bf16_masters():
    """LoRA on fp32 weights computed in bf16: the trained adapters keep no fp32 copy, the frozen
    weights keep theirs, so that full_state_dict (and exports, checkpoints) give them back
    exactly, as under fp32 masters."""
    torch.manual_seed(0)
    model = add_lora(GPT(64, 32, 2, 2), 4)
    original = {name: value.clone() for name, value in model.state_dict().items()}
    engine, optimizer = tiered.initialize(model, policy("int8", "bf16", compute="bf16"))
    manager = engine.manager
    for flat in engine.runtime.flats:
        trained = flat.has_trainable
        assert manager.has(flat.spec.index, StateKind.MASTER) is not trained
        assert manager.has(flat.spec.index, StateKind.EXP_AVG) is trained
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    train_small(engine, optimizer, [idx, idx])
    state = engine.full_state_dict()
    engine.close()
    frozen = [name for name in original if "lora_" not in name]
    assert all(torch.equal(state[name], original[name]) for name in frozen)
    assert not all(torch.equal(state[name], original[name]) for name in original
                   if "lora_" in name)  # the adapters trained


def test_units_stepped_as_their_gradients_arrive_step_as_at_the_optimizer_step():
    """``accumulation_steps: 1`` steps each unit during backward, as its gradient lands: the
    same kernel, key and bits as stepping them all at ``optimizer.step()``."""
    data = token_batches(3)
    states = []
    for accumulation in (None, 1):
        engine, optimizer = tiered.initialize(
            make_model(), policy("int8", "bf16", compute="bf16", accumulation_steps=accumulation))
        train_small(engine, optimizer, data)
        states.append(engine.full_state_dict())
        engine.close()
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name


def test_compact_moments_load_into_another_cut_of_units(tmp_path):
    """Saved with LoRA's frozen and trained halves as units of their own, loaded with one unit
    per block: each adapter's 8-bit moments are decoded from the middle of a saved unit's
    blocks and encoded into new blocks, to within a code's step of what was saved."""
    settings = policy("int8", "bf16", compute="bf16")
    data = token_batches(5)
    engine, optimizer = tiered.initialize(lora_model(), settings)
    train_small(engine, optimizer, data[:3])
    saved = states_by_name(engine)
    units_saved = len(engine.runtime.flats)
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.close()
    engine, optimizer = tiered.initialize(lora_model(), dict(settings,
                                                             units={"split_frozen": False}))
    assert len(engine.runtime.flats) < units_saved  # another cut
    engine.load_checkpoint(str(tmp_path), tag="t")
    loaded = states_by_name(engine)
    moments = [key for key in saved if key[1] in ("exp_avg", "exp_avg_sq")]
    assert moments and all(key in loaded for key in moments)
    for key in moments:
        (_, was), (_, now) = saved[key], loaded[key]
        torch.testing.assert_close(now, was, rtol=1 / 8, atol=1e-9, msg=lambda m: f"{key}: {m}")
    after = train_small(engine, optimizer, data[3:])
    engine.close()
    assert all(math.isfinite(loss) for loss in after)


def _shard_states(engine) -> dict[tuple[int, str], tuple[int, torch.Tensor]]:
    """This rank's shard of each unit's weights and moments: (unit, state) -> (the shard's
    first element in the unit's flat, its values as fp32, moments decoded)."""
    first = {flat.spec.index: flat.shard_range[0] for flat in engine.runtime.flats}
    return {(unit, kind.value): (first[unit], values) for (unit, kind), values in shard_states(
        engine, (StateKind.PARAM, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)).items()}


def _train_ranks(rank: int, world: int, folder: str, load: bool, steps: slice) -> None:
    """Train ``steps`` of token_batches at this world size with int8 moments and bf16 masters
    (from the checkpoint in ``folder`` if ``load``, saving one there if not); this rank's
    states as loaded (or as saved) and its losses go to a file."""
    engine, optimizer = tiered.initialize(make_model(), policy("int8", "bf16", compute="bf16"))
    if load:
        engine.load_checkpoint(folder, tag="t")
    states = _shard_states(engine)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    losses = []
    for idx in token_batches(5)[steps]:
        loss = next_token_loss(engine(idx[rows]), idx[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if not load:
        engine.save_checkpoint(folder, tag="t")
        states = _shard_states(engine)
    torch.save((states, losses), os.path.join(folder, f"{'loaded' if load else 'saved'}{rank}.pt"))
    engine.close()


@pytest.mark.parametrize("saved_world,loaded_world", [(2, 1), (1, 2)])
def test_compact_states_reshard_to_another_world_size(saved_world, loaded_world, tmp_path):
    """int8 moments and bf16 masters saved by two ranks load at one, and the other way. A
    loading rank's shard begins or ends inside the saved 8-bit blocks, so it decodes the saved
    elements and encodes blocks of its own, rounded with the stream of key 0 (layout.Read):
    exactly that, against the reference's quantize_into. The weights (the masters) load bit for
    bit, and training goes on."""
    def run(world, *args):
        if world == 1:
            _train_ranks(0, 1, *args)
        else:
            run_ranks(world, _train_ranks, *args)

    run(saved_world, str(tmp_path), False, slice(0, 3))
    run(loaded_world, str(tmp_path), True, slice(3, 5))
    saved: dict[tuple[int, str], torch.Tensor] = {}
    for rank in range(saved_world):  # the whole flats, as saved
        for key, (start, values) in torch.load(tmp_path / f"saved{rank}.pt",
                                               weights_only=True)[0].items():
            whole = saved.setdefault(key, torch.zeros(saved_world * len(values)))
            whole[start:start + len(values)] = values
    for rank in range(loaded_world):
        loaded, losses = torch.load(tmp_path / f"loaded{rank}.pt", weights_only=True)
        assert loaded.keys() == saved.keys()
        for (unit, kind), (start, values) in loaded.items():
            was = torch.nn.functional.pad(saved[(unit, kind)], (0, len(values)))
            was = was[start:start + len(values)]
            if kind == "param":
                assert torch.equal(values, was), (unit, kind, rank)
                continue
            code_map = CODE_MAPS[StateKind(kind)]
            expected = torch.empty(stored_numel(PACKED, len(values)), dtype=torch.uint8)
            rounding = random_bits(torch.arange(len(values)), 0) >> 24
            INT8.encode_into(expected, was, code_map, rounding)
            assert torch.equal(values, INT8.decode(expected, len(values), code_map)), (unit, kind)
        assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_a_skipped_fp16_step_leaves_compact_states_as_if_it_never_ran():
    """fp16 compute with int8 moments: a step whose scaled gradients overflow is skipped, so
    that the run then goes on as one that never met it: the same weights and 8-bit moments bit
    for bit, the random streams included (the unit's step count did not advance)."""
    def run(initial_scale: float, steps: list[torch.Tensor]):
        engine, optimizer = tiered.initialize(
            make_model(), dict(policy("int8", compute="fp16"),
                               loss_scale={"initial_scale": initial_scale}))
        for idx in steps:
            engine.backward(next_token_loss(engine(idx), idx))
            optimizer.step()
            optimizer.zero_grad()
            engine.scaler.scale = min(engine.scaler.scale, 2.0**10)  # after the overflow
        result = (optimizer.skipped_steps, engine.full_state_dict(), states_by_name(engine))
        engine.close()
        return result

    data = token_batches(3)
    skipped, weights, states = run(2.0**40, data)  # 2**40 overflows fp16 gradients
    never, weights_never, states_never = run(2.0**10, data[1:])
    assert (skipped, never) == (1, 0)
    assert all(torch.equal(weights[name], weights_never[name]) for name in weights)
    assert states.keys() == states_never.keys()
    for key, (first, values) in states.items():
        assert first == states_never[key][0] and torch.equal(values, states_never[key][1]), key
