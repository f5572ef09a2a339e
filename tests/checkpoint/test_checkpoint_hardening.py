"""Checkpoint folders attacked as issue 17 found them: a second job writing into a live job's
folder, a load without ``latest``, damaged manifests and rank files, paths out of the folder,
staging left by a killed job, and a checkpoint path that cannot be a folder. Real files, real
processes and signals; two real gloo ranks where the ranks must agree."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest

import tiered

from distributed import run_ranks
from helpers import REPO, assert_same, mounted, refused
from helpers_checkpoint import copy_of, small_engine, train_small

TESTS = os.path.join(REPO, "tests")
EXAMPLES = os.path.join(REPO, "examples")
LOCK = ".owner.lock"


# --- item 1 and 8: one job per folder; what a killed job staged -----------------------------

JOB = r"""
import sys, time
sys.path[:0] = [{tests!r}, {examples!r}]
from tiered.checkpoint import format as fmt
from helpers_checkpoint import small_engine, train_small
engine, optimizer = small_engine()
train_small(engine, optimizer, 1)
engine.save_checkpoint({ck!r}, "first")
write = fmt.Writer.write
def stuck(self, tensor):  # the next save stops in its first write, where it is killed
    write(self, tensor)
    self._file.flush()
    time.sleep(600)
fmt.Writer.write = stuck
print("saving", flush=True)
engine.save_checkpoint({ck!r}, "second")
"""


def test_a_live_job_s_folder_is_refused_and_a_killed_job_s_is_taken_and_cleaned(engine,
                                                                                 tmp_path):
    ck = tmp_path / "ck"
    script = JOB.format(tests=TESTS, examples=EXAMPLES, ck=str(ck))
    job = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                           text=True)
    try:
        assert job.stdout.readline().strip() == "saving"
        staged = ck / ".second.tmp" / "rank00000.safetensors"
        deadline = time.time() + 30
        while not (staged.exists() and staged.stat().st_size > 0):
            assert time.time() < deadline, "the job's second save never started writing"
            time.sleep(0.02)
        # The job lives, mid-save: a second job may neither save nor load there, and its
        # staging folder stays.
        for attempt in (lambda: engine.save_checkpoint(str(ck), "mine"),
                        lambda: engine.load_checkpoint(str(ck))):
            refused(engine, attempt, f"checkpoint folder {ck} is in use by a live job",
                    f"pid {job.pid} on host", one_line=True)
        assert sorted(os.listdir(ck)) == [LOCK, ".second.tmp", "first", "latest"]
    finally:
        job.kill()
        job.wait()
    assert job.returncode == -signal.SIGKILL
    # Dead: its lock is free, so the folder is taken, and what it staged is removed.
    with pytest.warns(UserWarning, match=r"removed what saves of dead jobs left in .*: "
                                         r"\.second\.tmp$"):
        assert engine.load_checkpoint(str(ck)) == "first"
    engine.save_checkpoint(str(ck), "mine")
    assert sorted(os.listdir(ck)) == [LOCK, "first", "latest", "mine"]


def _ranks_meet_held_and_damaged_folders(rank: int, world: int, root: str) -> None:
    engine, optimizer = small_engine()
    train_small(engine, optimizer, 1, rank, world)
    outcomes = {}
    for name in ("held", "released"):
        try:
            engine.save_checkpoint(os.path.join(root, name), "two")
            outcomes[name] = "saved"
        except tiered.CheckpointError as error:
            outcomes[name] = str(error)
    engine.save_checkpoint(os.path.join(root, "own"), "two")
    engine.runtime.group.barrier()
    if rank == 1:  # only rank 1's file is damaged: rank 0's checks pass
        path = os.path.join(root, "own", "two", "rank00001.safetensors")
        os.remove(path)
        os.mkdir(path)
    engine.runtime.group.barrier()
    try:
        engine.load_checkpoint(os.path.join(root, "own"))
        outcomes["folder"] = "loaded"
    except tiered.CheckpointError as error:
        outcomes["folder"] = str(error)
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(outcomes, f)
    engine.close()


def test_two_ranks_raise_alike_on_a_held_folder_and_a_rank_file_that_is_a_folder(tmp_path):
    # This process holds 'held' (its engine saved there and lives), and gave 'released' back
    # when its engine there closed. At two ranks, rank 0 alone takes a folder's lock: both
    # ranks must raise the same refusal (none waits for the other). Rank 1's file being a
    # folder must be an agreed CheckpointError on both, not gloo's "Connection closed by
    # peer" on rank 0 once rank 1 leaves with an IsADirectoryError.
    holder, optimizer = small_engine()
    holder.save_checkpoint(str(tmp_path / "held"), "one")
    done, _ = small_engine()
    done.save_checkpoint(str(tmp_path / "released"), "one")
    done.close()
    try:
        run_ranks(2, _ranks_meet_held_and_damaged_folders, str(tmp_path))
    finally:
        holder.close()
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert outcomes[0]["held"] == outcomes[1]["held"]
    assert f"{tmp_path / 'held'} is in use by a live job, pid {os.getpid()}" in \
        outcomes[0]["held"]
    assert [o["released"] for o in outcomes] == ["saved", "saved"]
    for outcome in outcomes:
        assert "rank00001.safetensors: is a folder, not a regular file" in outcome["folder"]
    assert "another rank cannot use the checkpoint" in outcomes[0]["folder"]


# --- item 4: a load without 'latest' ----------------------------------------------------------

@pytest.mark.parametrize("latest", ["missing", "empty"])
def test_a_load_without_latest_takes_the_newest_complete_checkpoint(latest, saved, engine,
                                                                    tmp_path):
    # A save that ran out of space writing 'latest' leaves its checkpoint complete, an empty
    # .latest.tmp and no 'latest'. Newest is by steps: 'zeta' (1 step) sorts after 'alpha'
    # (2), and its manifest is made the later written too.
    ck = copy_of(saved, tmp_path)
    os.remove(ck / "latest")
    if latest == "empty":
        (ck / "latest").write_text("\n")
    (ck / ".latest.tmp").write_bytes(b"")
    future = time.time() + 3600
    os.utime(ck / "zeta" / "manifest.json", (future, future))
    with pytest.warns(UserWarning) as caught:
        assert engine.load_checkpoint(str(ck)) == "alpha"
    assert_same(engine.full_state_dict(), saved.second)
    assert [str(w.message) for w in caught] == [
        f"tiered: removed what saves of dead jobs left in {ck}: .latest.tmp",
        f"tiered: {ck / 'latest'} is {latest}; loading the newest complete checkpoint there, "
        f"'alpha' (2 optimizer steps)"]
    assert not (ck / ".latest.tmp").exists()


def test_a_load_without_latest_or_a_complete_checkpoint_says_so(engine, tmp_path):
    (tmp_path / "ck" / ".step1.tmp").mkdir(parents=True)  # a staging folder is no checkpoint
    with pytest.warns(UserWarning, match=r"left in .*: \.step1\.tmp$"):
        refused(engine, lambda: engine.load_checkpoint(str(tmp_path / "ck")),
                f"no checkpoint in {tmp_path / 'ck'} (no 'latest' file, and no folder with a "
                f"manifest.json)", one_line=True)


# --- item 5: damaged files, each a CheckpointError naming it ----------------------------------

def _manifest_not_utf8(ck):
    path = ck / "alpha" / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"tiered"', b'"ti\xffred"', 1))
    return path, "not UTF-8 text (byte 0xff"


def _manifest_a_list(ck):
    (ck / "alpha" / "manifest.json").write_text("[1, 2]")
    return ck / "alpha" / "manifest.json", "the manifest is [1, 2]; expected a JSON object"


def _manifest_without(key):
    def damage(ck):
        path = ck / "alpha" / "manifest.json"
        manifest = json.loads(path.read_text())
        del manifest[key]
        path.write_text(json.dumps(manifest))
        return path, f"no '{key}'"
    damage.__name__ = f"_manifest_without_{key}"
    return damage


def _latest_not_utf8(ck):
    (ck / "latest").write_bytes(b"alph\xe9")
    return ck / "latest", "not UTF-8 text (byte 0xe9 at offset 4)"


def _rank_file_a_folder(ck):
    path = ck / "alpha" / "rank00000.safetensors"
    os.remove(path)
    path.mkdir()
    return path, "is a folder, not a regular file"


def _manifest_a_folder(ck):
    path = ck / "alpha" / "manifest.json"
    os.remove(path)
    path.mkdir()
    return path, "is a folder, not a regular file"


@pytest.mark.parametrize("damage", [_manifest_not_utf8, _manifest_a_list,
                                    _manifest_without("files"), _manifest_without("units"),
                                    _latest_not_utf8, _rank_file_a_folder, _manifest_a_folder],
                         ids=lambda damage: damage.__name__[1:])
def test_a_damaged_file_is_a_checkpoint_error_naming_it(damage, saved, engine, tmp_path):
    ck = copy_of(saved, tmp_path)
    path, words = damage(ck)
    refused(engine, lambda: engine.load_checkpoint(str(ck)), f"{path}: ", words, one_line=True)


# --- item 6: a rank file that is no regular file, or of another size --------------------------

def _link_to_dev_zero(path):
    os.remove(path)
    os.symlink("/dev/zero", path)
    return "is a device, FIFO or socket, not a regular file"


def _fifo(path):
    os.remove(path)
    os.mkfifo(path)  # opening it would wait for a writer for ever
    return "is a device, FIFO or socket, not a regular file"


def _grown(path):
    with open(path, "ab") as f:
        f.write(b"\0" * 64)
    return "bytes, the manifest says"


@pytest.mark.parametrize("damage", [_link_to_dev_zero, _fifo, _grown],
                         ids=lambda damage: damage.__name__[1:])
def test_a_rank_file_of_another_kind_or_size_is_refused_before_it_is_read(damage, saved, engine,
                                                                          tmp_path):
    # A link to /dev/zero was hashed for ever: the whole file was read before its size was
    # compared. An alarm fails the test instead of hanging it.
    ck = copy_of(saved, tmp_path)
    path = ck / "alpha" / "rank00000.safetensors"
    words = damage(path)

    def hung(signum, frame):
        raise TimeoutError("the load hangs on the rank file")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        refused(engine, lambda: engine.load_checkpoint(str(ck)), f"{path}: ", words, one_line=True)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --- item 7: paths out of the folder; manifest fields of the wrong type or range ------------

@pytest.mark.parametrize("where", ["../elsewhere/alpha", "absolute", "..", ".alpha.old"])
def test_latest_leading_out_of_the_folder_is_refused(where, saved, engine, tmp_path):
    # A complete checkpoint lies where latest points: before the check it loaded.
    ck = copy_of(saved, tmp_path)
    elsewhere = copy_of(saved, tmp_path, "elsewhere")
    (ck / "latest").write_text(str(elsewhere / "alpha") if where == "absolute" else where)
    refused(engine, lambda: engine.load_checkpoint(str(ck)), f"{ck / 'latest'} names",
            "use a plain folder name", one_line=True)


@pytest.mark.parametrize("tag", ["../elsewhere/alpha", "/abs/alpha", ".."])
def test_a_tag_given_to_a_load_must_be_a_plain_folder_name(tag, saved, engine, tmp_path):
    ck = copy_of(saved, tmp_path)
    copy_of(saved, tmp_path, "elsewhere")
    refused(engine, lambda: engine.load_checkpoint(str(ck), tag), f"checkpoint tag {tag!r}",
            "use a plain folder name", one_line=True)


def _set(key_path: str, value):
    def change(manifest):
        *outer, last = key_path.split(".")
        for key in outer:
            manifest = manifest[int(key)] if key.isdigit() else manifest[key]
        manifest[last] = value
    return change


MANIFEST_FIELDS = {
    "world_size two": (_set("world_size", "two"), "world_size is 'two'; expected an integer >= 1"),
    "steps_called -5": (_set("optimizer.steps_called", -5),
                        "optimizer.steps_called is -5; expected an integer >= 0"),
    "lr as text": (_set("optimizer.hyper.lr", "1e-2"),
                   "optimizer.hyper.lr is '1e-2'; expected a finite number >= 0"),
    "unit_steps short": (_set("optimizer.unit_steps", []),
                         "optimizer.unit_steps is '0 counts'; expected one per unit"),
    "a shard of nothing": (_set("units.0.shard_numel", 0),
                           "units[0].shard_numel is 0; expected numel"),
    "a file outside": (_set("files", {"../../rank00000.safetensors": {"size": 1, "sha256": ""}}),
                       "files is ['../../rank00000.safetensors']; expected the rank files of "
                       "world_size 1"),
    "pending of no unit": (_set("optimizer.pending", {"written": [99], "norm": None,
                                                      "overflowed": False, "loss_scale": None}),
                           "optimizer.pending.written[0] is 99; expected a unit's index"),
}


@pytest.mark.parametrize("case", list(MANIFEST_FIELDS))
def test_a_manifest_field_of_the_wrong_type_or_range_is_refused(case, saved, engine, tmp_path):
    ck = copy_of(saved, tmp_path)
    path = ck / "alpha" / "manifest.json"
    manifest = json.loads(path.read_text())
    change, words = MANIFEST_FIELDS[case]
    change(manifest)
    path.write_text(json.dumps(manifest))
    refused(engine, lambda: engine.load_checkpoint(str(ck)), f"{path}: ", words, one_line=True)


def test_the_unspoiled_copy_loads(saved, engine, tmp_path):
    # The control of the refusals above: the copy they spoil loads, with no warning.
    ck = copy_of(saved, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine.load_checkpoint(str(ck)) == "alpha"
    assert_same(engine.full_state_dict(), saved.second)
    assert engine.load_checkpoint(str(ck), "zeta") == "zeta"
    assert_same(engine.full_state_dict(), saved.first)


# --- item 9: a checkpoint path that cannot be a folder ---------------------------------------

def test_check_folder_refuses_what_cannot_hold_checkpoints(engine, tmp_path):
    from tiered.checkpoint import check_folder

    afile = tmp_path / "afile"
    afile.write_text("mine")
    cases = {str(afile): "exists and is a regular file, not a folder",
             "/dev/null": "exists and is a character device, not a folder",
             str(tmp_path / "no" / "ck"): f"its parent {tmp_path / 'no'} does not exist",
             str(afile / "ck"): f"its parent {afile} does not exist as a folder"}
    for path, words in cases.items():
        with pytest.raises(tiered.CheckpointError) as error:
            check_folder(path)
        assert str(error.value) == f"checkpoint folder {path}: {words}"
    check_folder(str(tmp_path / "new"))  # to be made: its parent is there
    check_folder(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["afile"]
    # A save refuses it before anything is made (it failed at its staging folder's creation).
    refused(engine, lambda: engine.save_checkpoint(str(afile)), "exists and is a regular file",
            one_line=True)
    assert afile.read_text() == "mine"


def test_check_folder_refuses_a_read_only_file_system(tmp_path):
    from tiered.checkpoint import check_folder

    disk = tmp_path / "ro"
    with mounted(tmp_path, "tmpfs", "ro,size=1m", name=disk.name):
        for path in (disk, disk / "ck"):
            with pytest.raises(tiered.CheckpointError, match=rf"^checkpoint folder {path}: "
                                                             rf"{disk} is not writable \(a "
                                                             rf"read-only file system\)$"):
                check_folder(str(path))
