"""Which checkpoints a folder keeps (issue 30, items 9 and 10): a load without ``latest`` passes
over a newest checkpoint cut short or missing a part, a tag that is a link out of the folder is
refused, and ``save_checkpoint(keep_last=N)`` removes the older ones, at one rank and at two.
Real files on disk, a tiny model."""
from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import tiered

from distributed import run_ranks
from helpers import EXAMPLE, REPO, SMALL, assert_same, refused
from helpers_checkpoint import copy_of, small_engine, train_small

LOCK = ".owner.lock"
RANK0 = "rank00000.safetensors"


def _cut_short(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return "bytes, the manifest says"


def _missing(path):
    os.remove(path)
    return "missing from the checkpoint"


# --- item 9: the fallback passes over a broken newest checkpoint ------------------------------

@pytest.mark.parametrize("damage", [_cut_short, _missing], ids=lambda d: d.__name__[1:])
def test_a_load_without_latest_skips_a_broken_newest_checkpoint(damage, saved, engine, tmp_path):
    # 'alpha' is the newest (2 steps) but its rank file is cut short or gone (a copy that
    # stopped part way): the load takes 'zeta', the newest intact one, and says why.
    ck = copy_of(saved, tmp_path)
    os.remove(ck / "latest")
    path = ck / "alpha" / RANK0
    words = damage(path)
    with pytest.warns(UserWarning) as caught:
        assert engine.load_checkpoint(str(ck)) == "zeta"
    assert_same(engine.full_state_dict(), saved.first)
    said = [str(w.message) for w in caught]
    assert len(said) == 2, said
    assert said[0].startswith(f"tiered: skipping the checkpoint 'alpha' in {ck}: {path}: ")
    assert words in said[0] and "\n" not in said[0]
    assert said[1] == (f"tiered: {ck / 'latest'} is missing; loading the newest complete "
                       f"checkpoint there, 'zeta' (1 optimizer steps)")


def test_a_broken_checkpoint_asked_for_still_fails(saved, engine, tmp_path):
    # Named by the load or by 'latest', a broken checkpoint is what the user asked for: it
    # fails in one line, and no other is loaded instead.
    ck = copy_of(saved, tmp_path)
    path = ck / "alpha" / RANK0
    _cut_short(path)
    for load in (lambda: engine.load_checkpoint(str(ck)),
                 lambda: engine.load_checkpoint(str(ck), "alpha")):
        refused(engine, load, f"{path}: ", "(truncated?)", one_line=True)
    # With every checkpoint broken and no 'latest', there is none to fall back to.
    os.remove(ck / "latest")
    _missing(ck / "zeta" / RANK0)
    with pytest.warns(UserWarning, match="skipping the checkpoint"):
        refused(engine, lambda: engine.load_checkpoint(str(ck)),
                f"no intact checkpoint in {ck} (no 'latest' file; 2 skipped: 'alpha', 'zeta')",
                one_line=True)


def test_a_tag_that_is_a_link_out_of_the_folder_is_refused(saved, engine, tmp_path):
    ck = copy_of(saved, tmp_path)
    elsewhere = copy_of(saved, tmp_path, "elsewhere")
    os.symlink(elsewhere / "alpha", ck / "outside")
    os.symlink("zeta", ck / "best")  # a link within the folder is another name of its own
    refused(engine, lambda: engine.load_checkpoint(str(ck), "outside"),
            f"checkpoint 'outside' in {ck} is a symbolic link to {elsewhere / 'alpha'}, "
            f"outside the folder", one_line=True)
    (ck / "latest").write_text("outside")
    refused(engine, lambda: engine.load_checkpoint(str(ck)), "'outside'", "symbolic link",
            one_line=True)
    # Without 'latest', the fallback passes over it (it has the most steps of them all).
    os.remove(ck / "latest")
    with pytest.warns(UserWarning) as caught:
        assert engine.load_checkpoint(str(ck)) == "alpha"
    assert f"skipping the checkpoint 'outside' in {ck}: checkpoint 'outside'" in \
        str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine.load_checkpoint(str(ck), "best") == "best"
    assert_same(engine.full_state_dict(), saved.first)


# --- item 10: keep_last -----------------------------------------------------------------------

def test_keep_last_keeps_the_newest_and_they_load_exactly(tmp_path):
    ck = tmp_path / "ck"
    engine, optimizer = small_engine()
    states = {}
    for step in range(1, 5):
        train_small(engine, optimizer, 1)
        if step == 3:  # a folder whose copy stopped part way is no checkpoint to remove
            shutil.copytree(ck / "step00000001", ck / "copying")
            _cut_short(ck / "copying" / RANK0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine.save_checkpoint(str(ck), keep_last=2)
        states[step] = engine.full_state_dict()
    engine.close()
    assert sorted(os.listdir(ck)) == [LOCK, "copying", "latest", "step00000003", "step00000004"]
    assert (ck / "latest").read_text() == "step00000004"
    # Each loads to the state it was saved at, bit for bit; and the older one's optimizer
    # state is exact too: one more step from it is the newer one.
    engine, optimizer = small_engine()
    assert engine.load_checkpoint(str(ck)) == "step00000004"
    assert_same(engine.full_state_dict(), states[4])
    assert engine.load_checkpoint(str(ck), "step00000003") == "step00000003"
    assert_same(engine.full_state_dict(), states[3])
    train_small(engine, optimizer, 1)
    assert_same(engine.full_state_dict(), states[4])
    # The one just written is kept, though two others have more steps; an incomplete one is
    # left as it is.
    fresh, fresh_optimizer = small_engine()
    train_small(fresh, fresh_optimizer, 1)
    fresh.save_checkpoint(str(ck), "fresh", keep_last=1)
    assert sorted(os.listdir(ck)) == [LOCK, "copying", "fresh", "latest"]
    fresh.close()
    engine.close()


@pytest.mark.parametrize("value", [0, -1, 2.0, "2", True])
def test_a_bad_keep_last_is_refused_before_anything_is_written(value, tmp_path):
    engine, _ = small_engine()
    with pytest.raises(tiered.CheckpointError) as error:
        engine.save_checkpoint(str(tmp_path / "ck"), keep_last=value)
    engine.close()
    assert str(error.value) == (f"keep_last={value!r}: expected None (keep every checkpoint) "
                                f"or an integer >= 1 (how many of the newest to keep)")
    assert not (tmp_path / "ck").exists()


def _save_four_keeping_two(rank: int, world: int, root: str) -> None:
    from tiered.checkpoint import retention

    removed = []
    remove = retention.remove_checkpoint

    def spied(directory, tag):
        removed.append(tag)
        remove(directory, tag)

    retention.remove_checkpoint = spied
    ck = os.path.join(root, "ck")
    engine, optimizer = small_engine()
    states = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            train_small(engine, optimizer, 1, rank, world)
            engine.save_checkpoint(ck, keep_last=2)
            states.append(engine.full_state_dict())
        listing = sorted(os.listdir(ck))  # every rank: the save returned after the removal
        engine.close()
        engine, _ = small_engine()
        loaded = {}
        for tag in ("step00000003", "step00000004"):
            engine.load_checkpoint(ck, tag)
            loaded[tag] = engine.full_state_dict()
        engine.close()
    torch.save({"removed": removed, "listing": listing, "states": states, "loaded": loaded,
                "warnings": [str(w.message) for w in caught]},
               os.path.join(root, f"rank{rank}.pt"))


def test_keep_last_at_two_ranks_removes_on_rank_0_after_every_rank_wrote(tmp_path):
    run_ranks(2, _save_four_keeping_two, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert [r["removed"] for r in results] == [["step00000001", "step00000002"], []]
    for result in results:
        assert result["warnings"] == []
        assert result["listing"] == [LOCK, "latest", "step00000003", "step00000004"]
        assert_same(result["loaded"]["step00000003"], result["states"][2])
        assert_same(result["loaded"]["step00000004"], result["states"][3])
    assert sorted(os.listdir(tmp_path / "ck")) == [LOCK, "latest", "step00000003",
                                                   "step00000004"]


def test_the_example_keeps_the_last_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    flags = [*SMALL, "--steps", "4", "--checkpoint", str(ck), "--save-every", "1"]
    done = subprocess.run([sys.executable, EXAMPLE, *flags, "--keep-last", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(ck)) == [LOCK, "latest", "step00000003", "step00000004"]


def test_the_example_refuses_a_bad_keep_last(monkeypatch, capsys):
    # Refused as the flags are parsed, before any model is built: run in this process.
    monkeypatch.setattr(sys, "argv", ["train_gpt.py", "--checkpoint", "ck", "--save-every", "1",
                                      "--keep-last", "0"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(os.path.join(REPO, EXAMPLE), run_name="__main__")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "train_gpt.py: error: --keep-last must be >= 1, got 0"
