"""NVMe run folders outliving their runs (issue 17, items 2 and 3), as real processes and signals
on a real small file system: a run killed with SIGKILL leaves its folder and extents, which the
next run on the path removes (saying so), while a live run's folder, a folder of another
naming and a user's file stay; a budget refused for want of space names what live runs hold
there; a SIGTERM in the middle of ``initialize`` leaves no run folder."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from torch import nn

import tiered
from tiered.core.liveness import LOCK_NAME, MAKING_PREFIX
from tiered.core.sizes import format_size
from tiered.engine.engine import LAUNCHED_ENV
from tiered.tiers import NvmeTier
from tiered.tiers.aio import IoSettings

from helpers import REPO, dead_pid, mounted

MIB = 1 << 20
IO = IoSettings(block_size=4096, queue_depth=2)

HOLDER = textwrap.dedent("""
    import sys, time, warnings
    warnings.simplefilter("ignore")  # a tmpfs without O_DIRECT: buffered, and said so
    from tiered.tiers import NvmeTier
    from tiered.tiers.aio import IoSettings
    tier = NvmeTier(sys.argv[1], budget=None, rank=0, io=IoSettings(4096, 2))
    tier.create("held", int(sys.argv[2]))  # its extent and three spares
    print(tier.run_dir, flush=True)
    time.sleep(600)
""")
"""A run that holds four extents of argv[2] bytes in a run folder of argv[1] until killed."""


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.path.join(REPO, "examples")]),
                CUDA_VISIBLE_DEVICES="")


def start_holders(root: str, *extents: int) -> list[tuple[subprocess.Popen, str]]:
    """Live runs (started side by side) each holding 4 * its extent's bytes under ``root``,
    and their run folders."""
    processes = [subprocess.Popen([sys.executable, "-c", HOLDER, root, str(extent)], env=env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for extent in extents]
    started = []
    for process in processes:
        run_dir = process.stdout.readline().strip()
        assert run_dir, process.communicate(timeout=60)[1]
        started.append((process, run_dir))
    return started


def stop(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if process.poll() is None:
        process.send_signal(sig)
    process.communicate(timeout=60)


def du(folder: str) -> int:
    """Bytes of disk the files under ``folder`` take, as ``du`` counts them."""
    return sum(os.lstat(os.path.join(parent, name)).st_blocks * 512
               for parent, _, names in os.walk(folder) for name in names)


def nvme_model() -> nn.Module:
    """Four units of about 64 K fp32 parameters: about 5 MiB of extents under nvme.yaml in
    fp32 (weights, master weights, moments and spares)."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))


def init_on(root: str):
    return tiered.initialize(nvme_model(), os.path.join(REPO, "configs", "nvme.yaml"),
                             device="cpu", compute_dtype="fp32", nvme={"path": root})


# -- item 2: folders of dead runs ---------------------------------------------------------------

def test_a_killed_runs_folder_is_removed_by_the_next_run_and_a_live_ones_kept(tmp_path):
    with mounted(tmp_path, "tmpfs", "size=16m") as root:
        # The live run is set up before the other dies: its own start would remove the folder.
        (live, live_dir), (killed, killed_dir) = start_holders(root, 64 << 10, 3 * MIB)
        try:
            stop(killed)  # SIGKILL: no exit handler runs; 12 MiB of a 16 MiB disk stay held
            assert len(os.listdir(killed_dir)) == 5  # its extents and its lock file
            host = socket.gethostname()
            # The older layout (no lock file) of a dead pid of this host, and of a live one.
            old_dead = os.path.join(root, f"tiered-{host}-{dead_pid()}-abcdef-rank1")
            old_live = os.path.join(root, f"tiered-{host}-{os.getpid()}-abcdef-rank2")
            # A folder whose maker died between making and putting it in place (its lock file
            # made, no one holding it).
            making = os.path.join(root, f"{MAKING_PREFIX}tiered-{host}-{dead_pid()}-"
                                        f"012345-rank0")
            for folder in (old_dead, old_live, making):
                os.mkdir(folder)
            with open(os.path.join(old_dead, "extent-00000.bin"), "wb") as f:
                f.write(b"x" * (256 << 10))
            open(os.path.join(making, LOCK_NAME), "w").close()
            # What is not a run folder, whatever it holds.
            os.mkdir(os.path.join(root, "tiered-notes"))
            with open(os.path.join(root, "user.bin"), "wb") as f:
                f.write(b"u" * 100)

            held = {folder: du(folder) for folder in (killed_dir, old_dead, making)}
            assert held[killed_dir] >= 12 * MIB and held[making] == 0
            # Needs about 5 MiB: only 4 MiB are free until the killed run's folder goes.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine, optimizer = init_on(root)
            try:
                engine(torch.ones(2, 256)).square().mean().backward()
                optimizer.step()
                ours = engine.manager.nvme.run_dir
            finally:
                engine.close()
            said = [str(w.message) for w in caught if "removed" in str(w.message)]
            assert len(said) == 3, said
            for folder, freed in held.items():
                line = next((s for s in said if folder in s), None)
                assert line is not None and "\n" not in line, (folder, said)
                assert f"freeing {format_size(freed)}" in line, line
            assert sorted(os.listdir(root)) == sorted(
                os.path.basename(p) for p in (live_dir, old_live, f"{root}/tiered-notes",
                                              f"{root}/user.bin"))
            assert not os.path.exists(ours)
            assert len(os.listdir(live_dir)) == 5  # untouched: its extents and its lock
        finally:
            stop(live)


def test_short_of_space_names_what_live_runs_hold_there(tmp_path):
    with mounted(tmp_path, "tmpfs", "size=16m") as root:
        [(live, live_dir)] = start_holders(root, 3 * MIB)  # 12 MiB of a 16 MiB disk, alive
        try:
            with pytest.raises(tiered.BudgetError) as info:
                init_on(root)
            message = str(info.value)
            assert re.search(r"nvme: needs [\d.]+ MiB", message), message
            assert f"1 folder of live tiered runs there (tiered-*) holds {format_size(12 * MIB)}" \
                in message, message
            assert os.listdir(root) == [os.path.basename(live_dir)]
            # A budget past the free space names them too.
            with pytest.raises(tiered.BudgetError, match=r"nvme\.budget 8\.00 MiB is more than "
                                                         r"this rank may use.*live tiered runs"):
                tiered.initialize(nvme_model(), os.path.join(REPO, "configs", "nvme.yaml"),
                                  device="cpu", compute_dtype="fp32",
                                  nvme={"path": root, "budget": "8MiB"})
            assert len(os.listdir(live_dir)) == 5
        finally:
            stop(live)


def test_a_tier_closed_leaves_nothing_and_two_tiers_of_one_process_keep_each_other(tmp_path):
    """Within one process each tier's lock holds against the other's sweep (an flock belongs
    to its open file), and close removes the folder with its lock file."""
    first = NvmeTier(str(tmp_path), budget=None, rank=0, io=IO)
    second = NvmeTier(str(tmp_path), budget=None, rank=1, io=IO)
    assert os.path.isdir(first.run_dir) and os.path.isdir(second.run_dir)
    second.close()
    first.close()
    assert os.listdir(tmp_path) == []


# -- item 3: SIGTERM during set-up --------------------------------------------------------------

SETTING_UP = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    import tiered
    # 400 units of fp32 on NVMe: their extents and builds take a while after the run folder
    # appears, which is when the test sends SIGTERM.
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(400)))
    engine, _ = tiered.initialize(model, sys.argv[2], device="cpu", compute_dtype="fp32",
                                  nvme={"path": sys.argv[1]})
    print("INITIALIZED", flush=True)
""")


def test_a_sigterm_during_setup_leaves_no_run_folder(tmp_path):
    """torchrun stops the other ranks with SIGTERM when one fails, often while they are still
    in ``initialize``: the handler that unwinds through its cleanup must be there already."""
    root = tmp_path / "nvme"
    root.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-c", SETTING_UP, str(root), os.path.join(REPO, "configs", "nvme.yaml")],
        env={**env(), LAUNCHED_ENV: "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(name.startswith("tiered-") for name in os.listdir(root)):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no run folder appeared"
            time.sleep(0.001)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "INITIALIZED" not in out, "the signal came after set-up: make set-up longer"
    assert process.returncode == 128 + signal.SIGTERM, (process.returncode, err[-2000:])
    assert os.listdir(root) == []


ENDS_MID_UPDATE = textwrap.dedent("""
    import os, signal, sys, torch, tiered
    from gpt import GPT, next_token_loss
    with tiered.init("configs/nvme.yaml", nvme={"path": sys.argv[1]},
                     optimizer={"delayed_update": {"enabled": True, "warmup_steps": 0}}):
        model = GPT(64, 32, 2, 2, max_seq=16)
    engine, optimizer = tiered.initialize(model)
    idx = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        engine.backward(next_token_loss(engine(idx), idx))
        optimizer.step()  # returns at once: the update runs on as the script ends
        optimizer.zero_grad()
    if sys.argv[2] == "sigterm-twice":
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pause()
        except SystemExit as stop:
            print("stopped", stop.code, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM must not cut clean-up short
    print("ended", flush=True)
""")


@pytest.mark.parametrize("how", ["plain", "sigterm-twice"])
def test_a_script_ending_mid_update_finishes_it_and_removes_its_folder(tmp_path, how):
    """The delayed update's last step is still running as the script ends; Python stops its
    thread pools before atexit, so the update's NVMe I/O used to be refused ("cannot schedule
    new futures after shutdown", printed at the end of every such run). See [Note: exit
    order]. The launched rank's SIGTERM handler raises once; a second SIGTERM is ignored."""
    out = subprocess.run([sys.executable, "-c", ENDS_MID_UPDATE, str(tmp_path), how], cwd=REPO,
                         env=dict(env(), **{LAUNCHED_ENV: "1"}), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    expected = ["stopped 143", "ended"] if how == "sigterm-twice" else ["ended"]
    assert out.stdout.split("\n")[:-1] == expected
    assert "CPU worker failed" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert os.listdir(tmp_path) == [], "the run folder outlived the run"
