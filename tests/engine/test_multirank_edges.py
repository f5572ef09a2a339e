"""Several real ranks (gloo) on edges of the partitioning: a world of 3 that divides no unit,
units smaller than the world (whole shards of padding), 0-d and 1-element parameters, a weight
tied across two blocks, frozen parameters inside some ranks' shards only, clipping whose norm
lies on one rank, fp16 overflow on one rank, and checkpoints loaded at other world sizes.
Every rank's ``full_state_dict()`` is compared with plain PyTorch + ``torch.optim.AdamW``."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch._dynamo
from torch import nn

import tiered

from distributed import run_ranks
from helpers import REPO
from helpers_models import torch_groups

CPU_YAML = os.path.join(REPO, "configs", "cpu.yaml")
DIM, IN, OUT, ROWS, MICRO, STEPS = 5, 4, 3, 6, 2, 4
OPTIM = dict(lr=2e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 0.05
GROUPS = [  # the first group's one element lies on rank 0 alone
    {"match": ["gains.0.g"], "lr": 5e-2, "betas": [0.8, 0.9]},
    {"match": ["*.temp", "*.bias"], "weight_decay": 0.0},
]


class Gain(nn.Module):
    """One element: a unit of its own (the children of a ModuleList), 1 real element in 3."""

    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x):
        return x * self.g


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.temp = nn.Parameter(torch.tensor(0.7))  # 0-d

    def forward(self, x):
        return x + torch.tanh(self.lin(x)) * self.temp


class Net(nn.Module):
    """Units: blocks.0 and blocks.2 (6 elements: the tied weight is the root's), blocks.1 (31),
    gains.0 and gains.1 (1 each) and the root (inp, out, the tied weight: 68)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.gains = nn.ModuleList(Gain() for _ in range(2))
        self.out = nn.Linear(DIM, OUT)
        self.blocks[2].lin.weight = self.blocks[0].lin.weight  # tied across two units

    def forward(self, x):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i < 2:
                h = self.gains[i](h)
        return self.out(h)


FROZEN = ("blocks.1.lin.weight", "gains.1.g", "inp.bias")


def make_net(frozen: bool = False, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    model = Net()
    if frozen:
        for name, param in model.named_parameters():
            if name in FROZEN:
                param.requires_grad_(False)
    return model


def data(steps: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g))
             for _ in range(MICRO)] for _ in range(steps)]


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean() / MICRO


def train_reference(frozen=False, max_grad_norm=CLIP, worlds=(3,) * STEPS, groups=None):
    """Plain PyTorch: DDP's gradient (each rank's mean over its rows, averaged over ranks),
    summed over the micro-batches, clipped, AdamW; step i split over ``worlds[i]`` ranks."""
    model = make_net(frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params if groups is None else torch_groups(model, groups),
                                  **OPTIM)
    for group in optimizer.param_groups:
        group["betas"] = tuple(group["betas"])
    norms = []
    for micro, world in zip(data(), worlds):
        for x, y in micro:
            for xr, yr in zip(x.chunk(world), y.chunk(world)):
                (loss_of(model, xr, yr) / world).backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), norms


def train_reference_delayed(warmup: int, max_grad_norm=CLIP, world=3):
    """The delayed update's rule (test_delayed_update.py) on plain PyTorch: the gradient of
    step t is computed at theta_{t-1} up to step warmup+1, at theta_{t-2} after."""
    master = make_net()
    compute = copy.deepcopy(master)
    optimizer = torch.optim.AdamW(master.parameters(), **OPTIM)
    thetas = [copy.deepcopy(master.state_dict())]
    for t, micro in enumerate(data(), start=1):
        compute.load_state_dict(thetas[t - 1] if t <= warmup + 1 else thetas[t - 2])
        for x, y in micro:
            for xr, yr in zip(x.chunk(world), y.chunk(world)):
                (loss_of(compute, xr, yr) / world).backward()
        for param, used in zip(master.parameters(), compute.parameters()):
            param.grad, used.grad = used.grad, None
        torch.nn.utils.clip_grad_norm_(master.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        thetas.append(copy.deepcopy(master.state_dict()))
    return thetas[-1]


def build(frozen=False, max_grad_norm=CLIP, accumulation_steps=None, split_frozen=True,
          policy="cpu", nvme=None, optimizer=None, **overrides):
    return tiered.initialize(
        make_net(frozen), os.path.join(REPO, "configs", f"{policy}.yaml"), compute_dtype="fp32",
        device="cpu", units={"split_frozen": split_frozen}, nvme={"path": nvme},
        optimizer=dict(OPTIM, max_grad_norm=max_grad_norm, accumulation_steps=accumulation_steps,
                       **(optimizer or {})), **overrides)


def train_engine(engine, optimizer, rank, world, steps=slice(None)):
    norms = []
    for micro in data()[steps]:
        for x, y in micro:
            loss_of(engine, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        optimizer.step()
        optimizer.zero_grad()
        norms.append(optimizer.last_grad_norm)
    return norms


def assert_close_state(state, reference, what=""):
    assert list(state) == list(reference)
    for name in reference:
        torch.testing.assert_close(state[name], reference[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} {name}: {m}")


# --- world 3: odd shards, padding-only shards, scalars, a tie, frozen parts, clipping --------

CONFIGS = {
    "clip": {},
    "clip, accumulation declared, param groups": {"accumulation_steps": MICRO,
                                                  "optimizer": {"param_groups": GROUPS}},
    "stepped on arrival": {"accumulation_steps": MICRO, "max_grad_norm": None},
    "frozen, unsplit": {"frozen": True, "split_frozen": False},
    "frozen, split": {"frozen": True, "split_frozen": True},
    # States of 1-element shards in O_DIRECT files; frozen and trainable runs in one shard.
    "nvme, frozen, unsplit, accumulation declared": {
        "policy": "nvme", "frozen": True, "split_frozen": False, "accumulation_steps": MICRO},
    "delayed": {"optimizer": {"delayed_update": {"enabled": True, "warmup_steps": 1}}},
}


def _three_ranks(rank, world, folder):
    out = {}
    for name in CONFIGS:
        engine, optimizer = build(**CONFIGS[name], nvme=folder)
        try:
            if name == "clip":
                sizes = {f.name: (f.numel, f.shard_numel) for f in engine.runtime.flats}
                out["sizes"] = sizes
                norms = train_engine(engine, optimizer, rank, world, slice(2))
                engine.save_checkpoint(os.path.join(folder, "ckpt"), "two")
                norms += train_engine(engine, optimizer, rank, world, slice(2, None))
            else:
                norms = train_engine(engine, optimizer, rank, world)
            out[name] = engine.full_state_dict(), norms
        finally:
            engine.close()
    torch.save(out, os.path.join(folder, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """Every config trained by three ranks (once for the module), and a checkpoint of "clip"
    after two steps."""
    folder = tmp_path_factory.mktemp("three_ranks")
    run_ranks(3, _three_ranks, str(folder))
    return folder


def test_three_ranks_odd_tiny_and_tied_units_train_as_torch(three_ranks):
    tmp_path = three_ranks
    references = {}
    for frozen in (False, True):
        for clip in (CLIP, None):
            references[frozen, clip, False] = train_reference(frozen, clip)
    references[False, CLIP, True] = train_reference(groups=GROUPS)
    delayed = train_reference_delayed(warmup=1)
    for rank in range(3):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        # What the test means to exercise: units smaller than the world (ranks 1 and 2 hold
        # padding only), and units that 3 does not divide.
        assert results["sizes"]["gains.0"] == (1, 1)
        assert results["sizes"]["blocks.1"] == (31, 11)
        for name, cfg in CONFIGS.items():
            state, norms = results[name]
            if name == "delayed":
                assert_close_state(state, delayed, f"rank {rank}, {name}:")
                continue
            clip = cfg.get("max_grad_norm", CLIP)
            reference, reference_norms = references[cfg.get("frozen", False), clip,
                                                    "param_groups" in cfg.get("optimizer", {})]
            assert_close_state(state, reference, f"rank {rank}, {name}:")
            if clip is not None:
                assert max(reference_norms) > clip, "clipping never triggered"
                torch.testing.assert_close(norms, reference_norms, rtol=1e-5, atol=0)
        initial = make_net().state_dict()
        for config in (name for name, cfg in CONFIGS.items() if cfg.get("frozen")):
            for name in FROZEN:  # never stepped: no weight decay, no moments
                assert torch.equal(results[config][0][name], initial[name]), (config, name)


def _resume(rank, world, folder):
    engine, optimizer = build()
    try:
        engine.load_checkpoint(os.path.join(folder, "ckpt"), "two")
        loaded = engine.full_state_dict()
        train_engine(engine, optimizer, rank, world, slice(2, None))
        torch.save((loaded, engine.full_state_dict()),
                   os.path.join(folder, f"resumed{world}-{rank}.pt"))
    finally:
        engine.close()


def test_a_checkpoint_of_three_ranks_resumes_on_two_and_one(three_ranks, tmp_path):
    """Saved by three ranks (units of 1 element: two ranks saved padding only), loaded by two
    and by one: each trains on as a run that never stopped would (the batches after the load
    split over its own ranks)."""
    (tmp_path / "ckpt").symlink_to(three_ranks / "ckpt")
    two_steps, _ = train_reference(worlds=(3, 3))
    for world in (2, 1):
        if world == 1:
            _resume(0, 1, str(tmp_path))
        else:
            run_ranks(world, _resume, str(tmp_path))
        reference, _ = train_reference(worlds=(3, 3) + (world,) * (STEPS - 2))
        for rank in range(world):
            loaded, final = torch.load(tmp_path / f"resumed{world}-{rank}.pt", weights_only=True)
            assert_close_state(loaded, two_steps, f"world {world}, rank {rank}, loaded:")
            assert_close_state(final, reference, f"world {world}, rank {rank}, trained on:")


# --- buffers: every rank must start from rank 0's model, buffers included (DDP, FSDP) -------

class Projected(Net):
    """A fixed random projection as a persistent buffer (random features) after the input
    layer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("proj", torch.randn(DIM, DIM) / DIM ** 0.5)

    def forward(self, x):
        h = self.inp(x) @ self.proj
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i < 2:
                h = self.gains[i](h)
        return self.out(h)


def _buffers(rank, world, folder):
    torch.manual_seed(100 + rank)  # each rank seeds its own (a script seeding seed + rank)
    engine, optimizer = tiered.initialize(Projected(), CPU_YAML, compute_dtype="fp32",
                                          device="cpu", optimizer=OPTIM)
    try:
        start = engine.full_state_dict()
        train_engine(engine, optimizer, rank, world, slice(2))
        torch.save((start, engine.full_state_dict()), os.path.join(folder, f"buffers{rank}.pt"))
    finally:
        engine.close()


def test_every_rank_starts_from_rank0s_buffers(tmp_path):
    """initialize broadcasts rank 0's parameters so that every rank starts from one model
    (DDP and FSDP's sync_module_states broadcast the buffers with them); a buffer left as
    each rank built it makes the ranks train different models, and DDP's reference (rank 0's
    model) is not what any of them computes."""
    run_ranks(2, _buffers, str(tmp_path))
    torch.manual_seed(100)
    model = Projected()
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    for micro in data()[:2]:
        for x, y in micro:
            for xr, yr in zip(x.chunk(2), y.chunk(2)):
                (loss_of(model, xr, yr) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    states = [torch.load(tmp_path / f"buffers{rank}.pt", weights_only=True) for rank in range(2)]
    assert torch.equal(states[1][0]["inp.weight"], states[0][0]["inp.weight"])  # broadcast
    assert torch.equal(states[1][0]["proj"], states[0][0]["proj"]), \
        "rank 1 starts with its own buffer, not rank 0's"
    for rank, (_, final) in enumerate(states):
        assert_close_state(final, model.state_dict(), f"rank {rank}:")


# --- fp16: an overflow on one rank skips the step on every rank ----------------------------

def _fp16(rank, world, folder, cases):
    # The one-pass AdamW runs as written, uncompiled: a compile costs ~10 s a process here.
    torch._dynamo.config.disable = True
    results = {}
    for case, overrides in cases.items():
        engine, optimizer = tiered.initialize(
            make_net(), CPU_YAML, compute_dtype="fp16", device="cpu",
            loss_scale={"initial_scale": 2.0**8, "growth_interval": 1000},
            optimizer=dict(OPTIM, **overrides))
        out = results[case] = {"start": engine.full_state_dict()}
        try:
            for step, micro in enumerate(data(3)):
                for x, y in micro:
                    loss = loss_of(engine, x.chunk(world)[rank], y.chunk(world)[rank])
                    # Rank 1's loss of the first step is far out of fp16's range: its
                    # gradients (only there) hold infs.
                    engine.backward(loss * 1e8 if step == 0 and rank == 1 else loss)
                optimizer.step()
                optimizer.zero_grad()
                optimizer.synchronize()
                out[step] = (engine.full_state_dict(), optimizer.skipped_steps,
                             engine.scaler.scale)
        finally:
            engine.close()
    torch.save(results, os.path.join(folder, f"fp16-{rank}.pt"))


FP16_CASES = {
    "plain": {},
    "clipped, accumulation declared": {"max_grad_norm": CLIP, "accumulation_steps": MICRO},
    # The update (and its overflow check, an all-reduce of the worker's) runs after step().
    "delayed": {"delayed_update": {"enabled": True, "warmup_steps": 0}},
}


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    run_ranks(2, _fp16, str(tmp_path), FP16_CASES)
    for case in FP16_CASES:
        results = [torch.load(tmp_path / f"fp16-{rank}.pt", weights_only=True)[case]
                   for rank in range(2)]
        for rank, out in enumerate(results):
            state, skipped, scale = out[0]
            assert (skipped, scale) == (1, 2.0**7), (case, rank)
            for name, value in out["start"].items():
                assert torch.equal(state[name], value), (case, rank, name)
            state, skipped, scale = out[2]
            assert (skipped, scale) == (1, 2.0**7), (case, rank)
            assert not torch.equal(state["out.weight"], out["start"]["out.weight"]), case
            for name, value in results[0][2][0].items():  # every rank holds the same model
                assert torch.equal(state[name], value), (case, rank, name)


def _peer_leaves(rank, world, folder):
    from tiered.engine import collectives

    from helpers_models import make_model

    engine, _ = tiered.initialize(make_model(), CPU_YAML, compute_dtype="fp32", device="cpu")
    engine.runtime.group.barrier()
    if rank == 1:
        os._exit(0)  # gone mid-job, as a rank stopped by a signal is: its peer's all-gather fails
    root = next(flat for flat in engine.runtime.flats if flat.spec.path == "")
    usage = engine.manager.hbm.usage.current
    try:
        engine(torch.zeros(2, 4, dtype=torch.long))
        raised = ""
    except Exception as error:  # the root's all-gather, the forward's first collective
        raised = str(error)
    kept = [s for s in collectives._kept if isinstance(s, torch.UntypedStorage)]
    torch.save({"raised": raised, "kept": [s.nbytes() for s in kept],
                "gathered_bytes": root.gathered_bytes, "now": root.full.untyped_storage().nbytes(),
                "released": root.residency.value, "usage": (usage, engine.manager.hbm.usage.current)},
               os.path.join(folder, "rank0.pt"))
    os._exit(0)  # its group is broken: nothing to shut down in order


def test_a_unit_whose_all_gather_raised_keeps_its_storage(tmp_path):
    """gloo's thread went on copying a failed all-gather's result into the unit's buffer after
    the training thread had freed it (SIGSEGV at a stop signal): the storage is kept instead,
    and the unit counts as released ([Note: failed collectives])."""
    run_ranks(2, _peer_leaves, str(tmp_path))
    seen = torch.load(tmp_path / "rank0.pt")
    assert seen["raised"], "the all-gather did not fail"
    assert seen["kept"] == [seen["gathered_bytes"]]  # not shrunk: gloo may still write into it
    assert seen["now"] == 0 and seen["released"] == "released"
    assert seen["usage"][1] == seen["usage"][0]
