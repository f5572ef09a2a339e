"""A checkpoint mapped onto an engine cut otherwise (layout.py): other world sizes, unit cuts,
tilings, compute dtypes and tiers. Every leg's loaded fp32 masters and Adam moments must be
the saved ones element for element, and training on must match a run that never stopped."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import tiered
from tiered.ops.tiled_linear import TiledLinear

from distributed import run_ranks
from gpt import next_token_loss
from helpers import REPO
from helpers_models import (OPTIM, assert_parity, lora_model, make_model, states_by_name,
                            token_batches)

STATES = ("master", "exp_avg", "exp_avg_sq")  # fp32 whatever the compute dtype
GROUPS = [{"match": ["*.bias"], "lr": 3e-2, "weight_decay": 0.0},  # parts of most units
          {"match": ["blocks.1.*"], "betas": [0.8, 0.9]}]


def build(cfg: dict, folder: str):
    """An engine of the parity GPT (with LoRA adapters, the rest frozen: ``lora``) as ``cfg``
    says: policy, dtype, delayed, units, tiling."""
    model = lora_model() if cfg.get("lora") else make_model()
    return tiered.initialize(
        model, os.path.join(REPO, "configs", f"{cfg.get('policy', 'cpu')}.yaml"),
        compute_dtype=cfg.get("dtype", "fp32"), device="cpu",
        nvme={"path": os.path.join(folder, "nvme")},
        optimizer=dict(OPTIM, max_grad_norm=0.5, param_groups=GROUPS, delayed_update={
            "enabled": cfg.get("delayed", False), "warmup_steps": 1}),
        units=cfg.get("units", {}), tiling=cfg.get("tiling", {}))


def train(engine, optimizer, steps: tuple, rank: int, world: int) -> None:
    """Batches ``steps`` of six rows, which 1, 2 and 3 ranks split evenly: DDP's mean of the
    ranks' means is then the mean over the batch at every world size."""
    for idx in token_batches(5)[slice(*steps)]:
        rows = idx[:6].chunk(world)[rank]
        next_token_loss(engine(rows), rows).backward()
        optimizer.step()
        optimizer.zero_grad()


def _leg(rank: int, world: int, folder: str, cfg: dict, load: str | None, steps: tuple,
         save: str | None, final: str) -> None:
    """Load ``load`` (if any), train ``steps`` (a range of batches), save ``save``; the states
    by name after the load and at the save, and the final weights, go to files."""
    os.makedirs(os.path.join(folder, "nvme"), exist_ok=True)
    engine, optimizer = build(cfg, folder)
    ckpt = os.path.join(folder, "ckpt")
    try:
        if load:
            engine.load_checkpoint(ckpt, load)
            # full_state_dict would make a pending delayed update current (synchronize).
            full = {} if cfg.get("delayed") else engine.full_state_dict()
            loaded = states_by_name(engine), full
            torch.save(loaded, os.path.join(folder, f"{load}-loaded{rank}.pt"))
        train(engine, optimizer, steps, rank, world)
        if save:
            engine.save_checkpoint(ckpt, save)
            saved = states_by_name(engine), engine.full_state_dict()
            torch.save(saved, os.path.join(folder, f"{save}-saved{rank}.pt"))
        state = engine.full_state_dict()
        if rank == 0:
            torch.save(state, os.path.join(folder, f"{final}.pt"))
    finally:
        engine.close()


def joined(folder: str, prefix: str, world: int) -> tuple[dict, dict]:
    """Every state of every parameter (name, kind) over the ranks, and full_state_dict."""
    parts = [torch.load(os.path.join(folder, f"{prefix}{rank}.pt")) for rank in range(world)]
    states: dict[tuple[str, str], list] = {}
    for by_name, _ in parts:
        for key, piece in by_name.items():
            states.setdefault(key, []).append(piece)
    return ({key: torch.cat([values for _, values in sorted(pieces, key=lambda p: p[0])])
             for key, pieces in states.items()}, parts[0][1])


def assert_loaded_as_saved(folder: str, tag: str, saved_world: int, loaded_world: int,
                           same_names: bool = True) -> None:
    """The loaded masters and moments are the saved ones, by parameter name; under another
    tiling a tile's name is another block of its layer: full_state_dict, and training on, tell
    whether the tiles' states moved with their elements."""
    saved, saved_full = joined(folder, f"{tag}-saved", saved_world)
    loaded, loaded_full = joined(folder, f"{tag}-loaded", loaded_world)
    for name in loaded_full:
        assert torch.equal(loaded_full[name], saved_full[name]), name
    for (name, kind), values in saved.items():
        if kind not in STATES or not same_names and (".tiles." in name
                                                     or (name, "param") not in loaded):
            continue
        if (name, kind) in loaded:
            assert torch.equal(loaded[(name, kind)], values), (name, kind)
        elif kind == "master":  # frozen now, kept as its weights alone (fp32 here)
            assert torch.equal(loaded[(name, "param")], values), name
        else:  # frozen now: never stepped, so its moments were zeros
            assert not values.any(), (name, kind)


FP32, BF16, NVME = {}, {"dtype": "bf16"}, {"policy": "nvme"}
DELAYED = {"delayed": True}
LORA = {"lora": True, "delayed": True}
ROOT, LINEAR = {"units": {"classes": ["GPT"]}}, {"units": {"classes": ["Linear"]}}
CHAINS = {
    "worlds": [(1, FP32), (2, FP32), (3, FP32), (1, FP32)],
    "cuts": [(1, FP32), (2, ROOT), (3, LINEAR), (1, {"units": {"split_large": False}})],
    "tiers": [(2, NVME), (3, FP32), (1, NVME), (2, FP32)],
    "delayed": [(1, DELAYED), (2, DELAYED), (3, dict(DELAYED, **NVME)), (1, DELAYED)],
    "dtypes": [(1, BF16), (2, FP32), (3, BF16), (1, FP32)],
    # Adapters trained, the rest frozen: frozen halves of their own, then in one unit with
    # the adapters (with masters and moments), with a delayed update pending at every save.
    "lora": [(2, LORA), (3, dict(LORA, units={"split_frozen": False})), (1, LORA),
             (2, dict(LORA, units={"split_frozen": False}))],
}
TILED = {
    # Another limit, no tiling, and fp32 against bf16 (the limit is in compute-dtype bytes)
    # cut the blocks' linear layers into other tiles: other units and other parameter names.
    "tiled": [(2, {"tiling": {"max_unit_bytes": 2048}}), (3, {"tiling": {"max_unit_bytes": 4096}}),
              (1, FP32), (2, {"tiling": {"max_unit_bytes": 2048}})],
    "tiled-dtypes": [(1, {"tiling": {"max_unit_bytes": 2048}}),
                     (2, dict(BF16, tiling={"max_unit_bytes": 2048})), (1, FP32),
                     (3, dict(BF16, tiling={"max_unit_bytes": 512}))],
}


CHAINED = {**CHAINS, **TILED}


def _fp32(legs: list) -> bool:
    return all(cfg.get("dtype", "fp32") == "fp32" for _, cfg in legs)


def _legs(rank: int, world: int, legs: list) -> None:
    """Legs of several chains at this world size, one after another in these processes."""
    for leg in legs:
        _leg(rank, world, *leg)


def run_chains(chains: dict[str, list], root: str) -> None:
    """Each chain (in a folder of its own under ``root``) trains two steps, then each further
    leg loads the last save and trains one step; with fp32 throughout, a run that never
    stopped follows. Unit sizes here are not multiples of 2 or 3: each leg pads the last shard.

    The chains are independent of each other, so whenever each chain's next leg is ready,
    those of one world size run together: one after another in the same rank processes (or
    here, at one rank), each leg an engine of its own. A rank process's start (importing
    dynamo for the CPU worker) costs seconds on the CI machine, a leg's own work a fraction of
    one: all eight chains take three starts of rank processes, not nineteen."""
    queues = {}
    for name, legs in chains.items():
        folder = os.path.join(root, name)
        os.makedirs(folder)
        queue = [(legs[0][0], (folder, legs[0][1], None, (0, 2), "a", "final"))]
        for index, (tag, steps) in enumerate(zip("abc", [(2, 3), (3, 4), (4, 5)])):
            world, cfg = legs[index + 1]
            save = "bc"[index] if index < 2 else None
            queue.append((world, (folder, cfg, tag, steps, save, "final")))
        if _fp32(legs):
            queue.append((1, (folder, legs[0][1], None, (0, 5), None, "continued")))
        queues[name] = queue
    while any(queues.values()):
        ready = [queue[0][0] for queue in queues.values() if queue]
        # One rank first (no process to start), else the world size most chains wait for.
        world = 1 if 1 in ready else max(sorted(set(ready)), key=ready.count)
        legs = [queue.pop(0)[1] for queue in queues.values() if queue and queue[0][0] == world]
        if world == 1:
            _legs(0, 1, legs)
        else:
            run_ranks(world, _legs, legs)


def check_chain(legs: list, folder: str) -> None:
    """Every leg's loaded states are what the leg before saved; with fp32 throughout, the end
    is the run that never stopped."""
    for index, tag in enumerate("abc"):
        (saved_world, saved_cfg), (world, cfg) = legs[index], legs[index + 1]
        assert_loaded_as_saved(folder, tag, saved_world, world,
                               "tiling" not in saved_cfg and "tiling" not in cfg)
    if _fp32(legs):
        assert_parity(torch.load(os.path.join(folder, "final.pt")),
                      torch.load(os.path.join(folder, "continued.pt")))


@pytest.fixture(scope="module")
def chained(request, tmp_path_factory) -> str:
    """The folder of each chain that this session's selected tests here check, every one of
    them run (run_chains)."""
    names = {item.callspec.params["chain"] for item in request.session.items
             if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
             and "chain" in item.callspec.params}
    root = str(tmp_path_factory.mktemp("chains"))
    run_chains({name: legs for name, legs in CHAINED.items() if name in names}, root)
    return root


@pytest.mark.parametrize("chain", CHAINS)
def test_a_chain_of_resharded_loads_keeps_every_state_and_trains_on(chain, chained):
    check_chain(CHAINS[chain], os.path.join(chained, chain))


@pytest.mark.parametrize("chain", TILED)
def test_a_checkpoint_loads_into_tiles_cut_otherwise(chain, chained):
    # README: a load may be under another policy, with the model cut into other units. The
    # tiles' parameters were mapped by name, so "blocks.0.qkv.tiles.0.weight" of 512 elements
    # was refused as "another model" (1024 elements under the load's limit), and a tiled
    # checkpoint could not load untiled (or at another compute dtype) at all.
    check_chain(TILED[chain], os.path.join(chained, chain))


def test_a_hand_tiled_layer_loads_into_the_untiled_layer_by_its_recorded_cut(tmp_path):
    """2 x 2 tiles of a bias-free 8 x 8 layer have the sizes of 4 x 1 tiles: the sizes alone
    cannot say which (an inference would take 4 x 1, the automatic tiling's, and load the
    blocks to the wrong places). The manifest records each tiled layer's cut."""
    torch.manual_seed(0)
    tiled = nn.Sequential(TiledLinear.from_linear(nn.Linear(8, 8, bias=False), in_splits=2,
                                                  out_splits=2))
    policy = os.path.join(REPO, "configs", "cpu.yaml")
    engine, _ = tiered.initialize(tiled, policy, compute_dtype="fp32", device="cpu")
    saved = engine.full_state_dict()
    engine.save_checkpoint(str(tmp_path))
    engine.close()
    engine, _ = tiered.initialize(nn.Sequential(nn.Linear(8, 8, bias=False)), policy,
                                  compute_dtype="fp32", device="cpu")
    engine.load_checkpoint(str(tmp_path))
    assert list(saved) == ["0.weight"]
    assert torch.equal(engine.full_state_dict()["0.weight"], saved["0.weight"])
    engine.close()
