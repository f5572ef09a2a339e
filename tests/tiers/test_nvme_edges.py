"""The NVMe tier and the DRAM spill at the edges: shard sizes that are no multiple of 4 KiB or
of ``sub_group_size`` (pieces cut inside param-group runs and frozen runs), units of one
element, the delayed update's second weights on NVMe, the spill of weights beside it; and
faults: a read error in a forward, a write error in an update the next forward overlaps, a
load that fails part-way, the run folder removed mid-run, a disk that fills while the extents
are made, a file system without fallocate, and a relative NVMe path. Everything runs on real
O_DIRECT files; faults come through ``aio.inject_faults``, the I/O engine's seam."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import tiered
from tiered.device import CpuAccelerator
from tiered.placement.plan import StateKind
from tiered.policy.kinds import Tier
from tiered.tiers import DramTier, NvmeTier, PinnedSlabSource
from tiered.tiers.aio import IoSettings, inject_faults

from gpt import GPT, next_token_loss
from helpers import REPO, run_with_deadline

BLOCK = 4096


# -- models and policies --------------------------------------------------------------------------

class OddBlock(nn.Module):
    """3111 parameters (no multiple of 1024 or of 4 KiB of fp32): with sub_group_size 1024 its
    shard streams in pieces of 1024, 1024, 1024 and 39 elements, whose boundaries fall inside
    ``a.weight`` (a run of group 0) and ``b.weight``; its biases and norm form runs of group 1,
    and frozen parameters (``freeze``) runs of their own inside the same unit."""

    def __init__(self, dim: int):
        super().__init__()
        self.a = nn.Linear(dim, dim + 3)
        self.b = nn.Linear(dim + 3, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(self.norm(x))))


class OddNet(nn.Module):
    def __init__(self, dim: int = 37, blocks: int = 3):
        super().__init__()
        self.inp = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(OddBlock(dim) for _ in range(blocks))
        self.out = nn.Linear(dim, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def odd_net(freeze: bool) -> OddNet:
    torch.manual_seed(0)
    model = OddNet()
    if freeze:  # a frozen bias between two trained runs, and the norm's weight
        for block in model.blocks:
            block.a.bias.requires_grad_(False)
            block.norm.weight.requires_grad_(False)
    return model


GROUPS = [{"match": ["*.bias", "*norm*"], "weight_decay": 0.0, "lr": 3e-3}]


def odd_policy(root, params: str, optimizer: str, delayed: bool = False, **more) -> dict:
    policy = dict(device="cpu", compute_dtype="fp32", params={"tier": params},
                  optimizer={"tier": optimizer, "lr": 1e-2, "weight_decay": 0.1,
                             "sub_group_size": 1024, "param_groups": GROUPS,
                             "delayed_update": {"enabled": delayed, "warmup_steps": 1}},
                  nvme={"path": str(root), "block_size": BLOCK, "queue_depth": 2},
                  units={"split_frozen": False})  # frozen runs inside trained units
    policy.update(more)
    return policy


def train_odd(engine, optimizer, steps: int = 3) -> dict:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 5, generator=g)
        engine(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return engine.full_state_dict()


def odd_run(model, policy: dict, steps: int = 3) -> tuple[dict, dict]:
    engine, optimizer = tiered.initialize(model, policy)
    try:
        placement = engine.placement()
        return train_odd(engine, optimizer, steps), placement
    finally:
        engine.close()


def assert_equal_states(state: dict, reference: dict) -> None:
    assert list(state) == list(reference)
    different = [name for name in reference if not torch.equal(state[name], reference[name])]
    assert not different, f"not bit for bit equal: {different}"


def nvme_policy(root, **more) -> dict:
    policy = dict(device="cpu", compute_dtype="fp32", params={"tier": "nvme"},
                  optimizer={"tier": "nvme", "lr": 1e-2, "weight_decay": 0.1},
                  nvme={"path": str(root)})
    for key, value in more.items():
        policy[key] = {**policy.get(key, {}), **value} if isinstance(value, dict) else value
    return policy


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(64, 32, 2, 2)


def token_batches(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (4, 16), generator=g) for _ in range(count)]


def train_step(engine, optimizer, idx) -> None:
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.synchronize()


def trained_in_dram(root, batches: list[torch.Tensor]) -> dict:
    """The weights after ``batches`` with every state in DRAM: what NVMe must match."""
    engine, optimizer = tiered.initialize(
        gpt(), nvme_policy(root, params={"tier": "dram"}, optimizer={"tier": "dram"}))
    for idx in batches:
        train_step(engine, optimizer, idx)
    weights = engine.full_state_dict()
    engine.close()
    return weights


def close_quietly(engine) -> None:
    """close(), which re-raises a worker failure nobody was told of yet."""
    try:
        engine.close()
    except tiered.TieredError as error:
        assert "CPU worker failed" in str(error)


def all_states(engine) -> dict:
    """Every state of every unit, wherever it lives, as CPU tensors."""
    manager, out = engine.manager, {}
    for (unit, kind), shard in manager.shards.items():
        if kind is StateKind.GRAD:
            continue
        value = torch.empty(shard.numel, dtype=shard.dtype)
        manager.copy_out(unit, kind, value)
        out[(unit, kind)] = value
    return out


# -- edge sizes: bit for bit what the same engine computes in DRAM ------------------------------

@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
@pytest.mark.parametrize("freeze", [False, True], ids=["trained", "frozen_runs"])
def test_pieces_cut_inside_group_and_frozen_runs_match_dram_and_torch(tmp_path, freeze,
                                                                      delayed):
    """Shards of 3111 and 298 elements stream in sub-groups of 1024 whose boundaries fall
    inside runs of one param group and next to frozen runs; weights, the delayed update's
    next weights (PARAM_NEXT) and the optimizer on NVMe, or only one of the two, give what
    the engine gives with everything in DRAM, bit for bit; and (no delayed update) what
    torch.optim.AdamW gives."""
    reference, placement = odd_run(odd_net(freeze), odd_policy(tmp_path, "dram", "dram", delayed))
    for params, optimizer in (("nvme", "nvme"), ("dram", "nvme"), ("nvme", "dram")):
        state, placement = odd_run(odd_net(freeze),
                                   odd_policy(tmp_path, params, optimizer, delayed))
        blocks = placement["blocks.0"]
        assert blocks["master"] == optimizer and blocks["param"] == params
        if delayed:
            assert blocks["param_next"] == params
        assert_equal_states(state, reference)
        assert os.listdir(tmp_path) == []
    if delayed:
        return
    model = odd_net(freeze)
    trained = [p for n, p in model.named_parameters() if p.requires_grad]
    grouped = [p for n, p in model.named_parameters()
               if p.requires_grad and (n.endswith(".bias") or "norm" in n)]
    rest = [p for p in trained if all(p is not q for q in grouped)]
    torch_optimizer = torch.optim.AdamW([{"params": rest},
                                         {"params": grouped, "weight_decay": 0.0, "lr": 3e-3}],
                                        lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(4, 5, generator=g)).square().mean().backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(reference[name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


class Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(()))

    def forward(self, x):
        return x * self.w


class Scalars(nn.Module):
    """Units of one element each: three blocks and the root."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Scalar() for _ in range(3))
        self.s = nn.Parameter(torch.randn(1))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x * self.s


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_units_of_one_element_on_nvme(tmp_path, delayed):
    """A one-element shard is a 4 KiB extent, a one-element piece and a read-ahead of 4 KiB
    for 4 bytes: the same steps as in DRAM, bit for bit."""
    states = {}
    for tier in ("dram", "nvme"):
        torch.manual_seed(0)
        policy = odd_policy(tmp_path, tier, tier)
        policy["optimizer"].update(param_groups=[],
                                   delayed_update={"enabled": delayed, "warmup_steps": 0})
        engine, optimizer = tiered.initialize(Scalars(), policy)
        assert [flat.shard_numel for flat in engine.runtime.flats] == [1, 1, 1, 1]
        if tier == "nvme":
            sizes = {os.path.getsize(shard.file.path) for shard in engine.manager.shards.values()
                     if shard.file is not None}
            assert sizes == {BLOCK}
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            engine(torch.randn(4, generator=g)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        states[tier] = engine.full_state_dict()
        engine.close()
    assert_equal_states(states["nvme"], states["dram"])


def test_weights_spilled_with_the_delayed_update_match_dram(tmp_path):
    """dram.spill moves the optimizer states, then both of the delayed update's weight buffers
    (PARAM and PARAM_NEXT) of the largest units to NVMe; training is bit for bit what it is
    with everything in DRAM, and DRAM never holds more than its budget."""
    reference, _ = odd_run(odd_net(True), odd_policy(tmp_path, "dram", "dram", delayed=True))
    engine, _ = tiered.initialize(odd_net(True), odd_policy(tmp_path, "dram", "dram", True))
    everything = engine.memory_report()["dram"]["current"]
    engine.close()
    budget = int(everything * 0.6)
    policy = odd_policy(tmp_path, "dram", "dram", delayed=True,
                        dram={"budget": budget, "spill": "nvme"})
    engine, optimizer = tiered.initialize(odd_net(True), policy)
    try:
        manager = engine.manager
        units = range(len(engine.runtime.flats))
        spilled = [u for u in units if manager.tier_of(u, StateKind.PARAM) is Tier.NVME]
        assert spilled and all(manager.tier_of(u, StateKind.PARAM_NEXT) is Tier.NVME
                               for u in spilled)
        assert all(manager.tier_of(u, StateKind.MASTER) is Tier.NVME for u in spilled)
        state = train_odd(engine, optimizer)
        assert engine.memory_report()["dram"]["peak"] <= budget
    finally:
        engine.close()
    assert_equal_states(state, reference)
    assert os.listdir(tmp_path) == []


# -- faults ---------------------------------------------------------------------------------------

def test_a_read_error_in_a_forward_leaves_the_engine_usable(tmp_path):
    """A unit's weights fail to read in a forward: that forward raises the NvmeError, nothing
    is changed, and the run goes on exactly as a run that never saw the error."""
    batches = token_batches(3)
    reference = trained_in_dram(tmp_path, batches)

    engine, optimizer = tiered.initialize(gpt(), nvme_policy(tmp_path))
    try:
        train_step(engine, optimizer, batches[0])
        unit = engine.runtime.forward_order(list(range(len(engine.runtime.flats))))[-1]
        bad = engine.manager.shards[(unit, StateKind.PARAM)].file.path

        def fault(verb, path, offset, size):
            if verb == "read" and path == bad:
                raise OSError(errno.EIO, "injected EIO")

        with inject_faults(fault), pytest.raises(tiered.NvmeError, match="injected EIO"):
            next_token_loss(engine(batches[1]), batches[1]).backward()
        for idx in batches[1:]:
            train_step(engine, optimizer, idx)
        assert_equal_states(engine.full_state_dict(), reference)
    finally:
        engine.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("params", ["nvme", "dram"])
def test_a_forward_overlapping_an_update_whose_state_write_fails_computes_nothing(tmp_path,
                                                                                  params):
    """``optimizer.step()`` returns while the update runs, and the next forward reads each
    unit once the update has written it. The write of the last unit's exp_avg fails: that
    unit's master weights and moments stay as they were, so the forward must not compute on
    its new weights (engine.__call__: "compute on none of them"); it must raise the update's
    error, as it does when any earlier unit's write fails."""
    engine, optimizer = tiered.initialize(
        gpt(), nvme_policy(tmp_path, params={"tier": params},
                           nvme={"block_size": BLOCK, "queue_depth": 1}))
    try:
        idx = token_batches(1)[0]
        train_step(engine, optimizer, idx)
        units = list(range(len(engine.runtime.flats)))
        order = engine.runtime.forward_order(units)  # the update's order, too
        last = order[-1]
        before = all_states(engine)
        # One write thread: requests run in order. Per unit the update writes master,
        # exp_avg, exp_avg_sq, then (on NVMe) its new weights, each from offset 0 first.
        per_unit = 4 if params == "nvme" else 3
        target = per_unit * (len(units) - 1) + 2  # the last unit's exp_avg
        started: list[str] = []
        failed: list[str] = []

        def fault(verb, path, offset, size):
            if verb != "write":
                return None
            if offset == 0:
                started.append(path)
            if len(started) == target:
                if not failed:
                    time.sleep(0.3)  # the forward is well under way by now
                failed.append(path)
                raise OSError(errno.EIO, "injected EIO")
            return None

        next_token_loss(engine(idx), idx).backward()
        with inject_faults(fault):
            optimizer.step()  # returns at once; the forward below overlaps the update
            with torch.no_grad():
                outcome = {}
                try:
                    run_with_deadline(lambda: engine(idx))
                    outcome["forward"] = "returned"
                except tiered.TieredError as error:
                    outcome["forward"] = error
            with pytest.raises(tiered.TieredError, match="injected EIO"):
                optimizer.synchronize()
        assert failed, "the fault never fired"
        after = all_states(engine)
        for kind in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ):
            assert torch.equal(after[(last, kind)], before[(last, kind)]), kind
        assert outcome["forward"] != "returned", (
            "the forward computed on the new weights of a unit whose update failed (its "
            "master weights and moments were not saved)")
        assert "injected EIO" in str(outcome["forward"])
    finally:
        close_quietly(engine)
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_load_that_fails_part_way_is_never_trained_on(tmp_path):
    """A write to NVMe fails while ``load_checkpoint`` stores the saved states: the load
    raises. Either nothing changed, or the engine (holding some units from the checkpoint and
    some from before, a unit's master weights from one and its moments from the other, step
    counts from neither) refuses to run until a load succeeds; a second load then resumes
    exactly."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    batches = token_batches(3)
    engine, optimizer = tiered.initialize(gpt(), nvme_policy(nvme))
    try:
        train_step(engine, optimizer, batches[0])
        engine.save_checkpoint(str(tmp_path / "checkpoint"), "one")
        saved = all_states(engine)
        train_step(engine, optimizer, batches[1])
        before = all_states(engine)
        writes = []

        def fault(verb, path, offset, size):
            if verb == "write" and offset == 0:
                writes.append(path)
                if len(writes) == 6:  # the second unit's exp_avg
                    raise OSError(errno.EIO, "injected EIO")

        with inject_faults(fault), pytest.raises(tiered.TieredError, match="injected EIO"):
            engine.load_checkpoint(str(tmp_path / "checkpoint"), "one")
        after = all_states(engine)
        mixed = sorted({unit for unit, kind in after
                        if not torch.equal(after[(unit, kind)], before[(unit, kind)])})
        if mixed:
            assert any(not torch.equal(after[key], saved[key]) for key in after)
            with torch.no_grad(), pytest.raises(tiered.TieredError):
                engine(batches[2])
        engine.load_checkpoint(str(tmp_path / "checkpoint"), "one")
        assert all(torch.equal(all_states(engine)[key], value) for key, value in saved.items())
        train_step(engine, optimizer, batches[1])
        assert all(torch.equal(all_states(engine)[key], value) for key, value in before.items())
    finally:
        engine.close()
    assert os.listdir(nvme) == []


def test_weights_loaded_part_way_are_neither_trained_on_nor_saved(tmp_path):
    """``load_state_dict`` whose write of the second unit's weights fails: the first unit holds
    the new weights and the rest the old ones. Forward, ``full_state_dict`` and saves refuse
    until a load succeeds; after one, the engine holds exactly the weights loaded."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    torch.manual_seed(5)
    wanted = GPT(64, 32, 2, 2).state_dict()
    engine, optimizer = tiered.initialize(gpt(), nvme_policy(nvme))
    try:
        writes = []

        def fault(verb, path, offset, size):
            if verb == "write" and offset == 0:
                writes.append(path)
                if len(writes) == 2:
                    raise OSError(errno.EIO, "injected EIO")

        with inject_faults(fault), pytest.raises(tiered.TieredError, match="injected EIO"):
            engine.load_state_dict(wanted)
        refused = "loading weights failed part-way"
        with torch.no_grad(), pytest.raises(tiered.TieredError, match=refused):
            engine(token_batches(1)[0])
        with pytest.raises(tiered.TieredError, match=refused):
            engine.full_state_dict()
        with pytest.raises(tiered.TieredError, match=refused):
            engine.save_checkpoint(str(tmp_path / "checkpoint"))
        assert not (tmp_path / "checkpoint").exists()
        engine.load_state_dict(wanted)
        assert_equal_states(engine.full_state_dict(), wanted)
        train_step(engine, optimizer, token_batches(1)[0])
    finally:
        engine.close()


def test_the_run_folder_removed_mid_run_changes_nothing_and_close_spares_user_files(tmp_path):
    """Extents stay open for the run: with the run folder deleted under it, training goes on
    bit for bit; close() (twice) removes only what is its own, never the user's file beside
    it."""
    batches = token_batches(3)
    reference = trained_in_dram(tmp_path, batches)

    user = tmp_path / "user.bin"
    user.write_bytes(b"the user's")
    engine, optimizer = tiered.initialize(gpt(), nvme_policy(tmp_path))
    run_dir = engine.manager.nvme.run_dir
    train_step(engine, optimizer, batches[0])
    shutil.rmtree(run_dir)
    for idx in batches[1:]:
        train_step(engine, optimizer, idx)
    assert_equal_states(engine.full_state_dict(), reference)
    engine.close()
    engine.close()
    assert sorted(os.listdir(tmp_path)) == ["user.bin"]
    assert user.read_bytes() == b"the user's"


def test_a_relative_nvme_path_is_removed_on_close_after_a_chdir(tmp_path, monkeypatch):
    """nvme.path given relative (in a policy file or dict; tiered-launch --nvme makes its path
    absolute): the run folder must still be removed when the engine closes after the process
    changed its working directory (Hydra, a library, the script), not looked for under the
    new one and left behind with its preallocated extents."""
    (tmp_path / "start" / "nvme").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "start")
    engine, optimizer = tiered.initialize(gpt(), nvme_policy("nvme"))
    try:
        train_step(engine, optimizer, token_batches(1)[0])
        monkeypatch.chdir(tmp_path / "elsewhere")
    finally:
        engine.close()
    assert os.listdir(tmp_path / "elsewhere") == []
    assert os.listdir(tmp_path / "start" / "nvme") == [], "the run folder was left behind"


FILLING_DISK = textwrap.dedent("""
    import os, resource, sys
    import torch, tiered
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            return x + self.fc(x)

    class Net(nn.Module):  # blocks of 1056 parameters (8 KiB extents), a root of 16632
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(32, 504)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    root = sys.argv[1]
    # Files of at most 32 KiB: every block's extents fit, the root's do not (a disk that
    # fills up while the extents are made, after the plan was checked against its space).
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, resource.RLIM_INFINITY))
    try:
        tiered.initialize(Net(), dict(device="cpu", compute_dtype="fp32",
                                      params={"tier": "nvme"}, optimizer={"tier": "nvme"},
                                      nvme={"path": root}, units={"split_large": False}))
    except tiered.NvmeError as error:
        print("ERRNO", error.errno, "PATH", error.path, "SIZE", error.size)
        print("MESSAGE", error)
    else:
        print("INITIALIZED")
    print("LEFT", sorted(os.listdir(root)))
""")


def test_a_disk_that_fills_while_extents_are_made_fails_initialize_cleanly(tmp_path):
    """posix_fallocate fails part-way through the allocation (EFBIG under RLIMIT_FSIZE, in a
    child process): initialize raises an NvmeError naming the extent and its size, and
    leaves neither the extents already made nor the run folder, and the user's file."""
    (tmp_path / "user.bin").write_bytes(b"x" * 100)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.path.join(REPO, "examples")]))
    result = subprocess.run([sys.executable, "-c", FILLING_DISK, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert "INITIALIZED" not in result.stdout, result.stdout
    assert lines["ERRNO"].split()[0] == str(errno.EFBIG)
    path = lines["ERRNO"].split("PATH ")[1].split(" SIZE")[0]
    assert os.path.basename(path).startswith("extent-") and path.startswith(str(tmp_path))
    assert int(os.path.basename(path)[len("extent-"):-len(".bin")]) > 0  # midway: others made
    assert int(lines["ERRNO"].split("SIZE ")[1]) > 32 << 10
    assert "cannot reserve" in lines["MESSAGE"]
    assert lines["LEFT"] == "['user.bin']"
    assert (tmp_path / "user.bin").read_bytes() == b"x" * 100


# -- a file system with O_DIRECT but no fallocate ------------------------------------------------

def _fallocate_unsupported(folder: str) -> bool:
    """Whether the fallocate system call itself is refused there (EOPNOTSUPP): glibc's
    posix_fallocate then falls back to writing one byte per block."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    probe = os.path.join(folder, ".fallocate-probe")
    fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        return libc.fallocate(fd, 0, 0, BLOCK) != 0 and ctypes.get_errno() == errno.EOPNOTSUPP
    finally:
        os.close(fd)
        os.unlink(probe)


@contextlib.contextmanager
def ext2_mount(tmp_path):
    """A 16 MiB ext2 file system on a loop device: O_DIRECT works there, fallocate does not
    (ext2 and ext3 files have no extents), as on NFSv3 and some FUSE file systems."""
    image, where = tmp_path / "ext2.img", tmp_path / "ext2"
    where.mkdir()
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    try:
        made = subprocess.run(["mkfs.ext2", "-q", "-F", str(image)], capture_output=True,
                              text=True)
        mounted = made.returncode == 0 and subprocess.run(
            ["mount", "-o", "loop", str(image), str(where)], capture_output=True).returncode == 0
    except OSError as e:
        pytest.skip(f"cannot make an ext2 file system here: {e}")
    if not mounted:
        pytest.skip("cannot mount a loop device here")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_extents_on_a_file_system_with_o_direct_but_without_fallocate(tmp_path):
    with ext2_mount(tmp_path) as root:
        if not _fallocate_unsupported(root):
            pytest.skip("this kernel's ext2 supports fallocate")
        tier = NvmeTier(root, budget=None, rank=0, io=IoSettings(block_size=BLOCK,
                                                                   queue_depth=2))
        try:
            assert tier.direct  # O_DIRECT is there: no buffered fallback, no warning
            shard = tier.create("a state", 10_000)  # 3 spares and its extent, 12 KiB each
            assert shard.nbytes == 3 * BLOCK
            blocks = DramTier(None, PinnedSlabSource(CpuAccelerator())).reserve(
                {"out": shard.nbytes, "back": shard.nbytes})
            blocks["out"].copy_(torch.randint(0, 256, (shard.nbytes,), dtype=torch.uint8,
                                              generator=torch.Generator().manual_seed(3)))
            shard.write_from(blocks["out"])
            shard.read_into(blocks["back"])
            assert torch.equal(blocks["back"], blocks["out"])
        finally:
            tier.close()
        assert sorted(os.listdir(root)) == ["lost+found"]
