"""The rules of [Note: reattach] (tiered/service/commits.py) and of what a relaunch takes over
(jobs.py), against the registry itself: a step commits only with every rank's record, a rank
that goes stops every step not committed, every rank of a relaunch takes over the same step
however its hosts interleave, and a restart that cannot take over starts with no old record.
The processes around them are tests/service/test_reattach.py's."""
from __future__ import annotations

import threading

import pytest

from tiered.service.commits import NotCommitted, StepCommits
from tiered.service.jobs import Registry

from helpers import dead_pid

FINAL = {"unit_steps": [1.0], "last_update": None}
REQUEST = {"plan": "as the trainer asked"}
"""What a host was asked to run, as the registry keeps it (HostRequest.fingerprint): only
compared with what a relaunch asks."""


def test_a_step_commits_with_every_ranks_record_and_not_before():
    commits = StepCommits(world=2)
    round_ = commits.new_round()
    commits.arrived(round_, 0, 1, {"rank": 0})
    assert commits.step == 0
    waited = threading.Thread(target=commits.wait, args=(round_, 1))
    waited.start()
    waited.join(0.2)
    assert waited.is_alive(), "an update ran before every rank's record of its step was in"
    commits.arrived(round_, 1, 1, {"rank": 1})
    waited.join(5)
    assert not waited.is_alive() and commits.step == 1
    assert commits.records == {0: {"rank": 0}, 1: {"rank": 1}}


def test_a_rank_that_goes_stops_every_step_not_committed_on_every_rank():
    commits = StepCommits(world=2)
    round_ = commits.new_round()
    for rank in (0, 1):
        commits.arrived(round_, rank, 1, {})
    commits.arrived(round_, 0, 2, {})  # rank 1 dies before its record of step 2
    commits.broken()
    with pytest.raises(NotCommitted, match="the job resumes from step 1"):
        commits.wait(round_, 2)
    commits.arrived(round_, 1, 2, {})  # a record still in flight changes nothing
    assert commits.step == 1 and not commits.open
    commits.wait(round_, 1)  # a committed step runs
    # A relaunch's round takes the steps after 1 again, from records of its own.
    relaunch = commits.new_round()
    assert relaunch != round_ and commits.open
    commits.arrived(relaunch, 0, 2, {"new": 0})
    assert commits.step == 1, "a record of the broken round counted in the new one"
    commits.arrived(relaunch, 1, 2, {"new": 1})
    assert commits.step == 2 and commits.records == {0: {"new": 0}, 1: {"new": 1}}


def test_ranks_closing_together_stop_waiting_for_a_step_one_of_them_never_recorded():
    """Ctrl-C stops every rank of a job at once: rank 0 had sent step 2's record, rank 1 only
    its update. Each closing host waited for its queued update's commit, and the round broke
    only once a host ended: both waited for ever (the launcher SIGKILLed them after 30 s)."""
    commits = StepCommits(world=2)
    round_ = commits.new_round()
    for rank in (0, 1):
        commits.arrived(round_, rank, 1, {})
    commits.arrived(round_, 0, 2, {})
    refused = []

    def wait() -> None:
        with pytest.raises(NotCommitted):
            commits.wait(round_, 2)
        refused.append(True)

    waiters = [threading.Thread(target=wait) for _ in range(2)]
    for waiter in waiters:
        waiter.start()
    commits.ending(0)  # its record of step 2 is in: its end alone decides nothing
    waiters[0].join(0.2)
    assert waiters[0].is_alive()
    # (Had rank 1 sent its record instead, the step would commit, rank 0's end or not.)
    late = StepCommits(world=2)
    late_round = late.new_round()
    late.arrived(late_round, 0, 1, {})
    late.ending(0)
    late.arrived(late_round, 1, 1, {})
    late.wait(late_round, 1)
    assert late.step == 1
    commits.ending(1)  # it will never send one
    for waiter in waiters:
        waiter.join(5)
    assert refused == [True, True]
    commits.wait(round_, 1)  # a committed step still runs
    commits.broken()
    relaunch = commits.new_round()  # nobody is ending in a new round
    for rank in (0, 1):
        commits.arrived(relaunch, rank, 2, {})
    assert commits.step == 2


GONE = dead_pid()
"""The pid of every trainer and launcher here: the registry refuses a rank or job that a live
process holds, and these stand for processes that have died."""


def _run_and_die(registry: Registry, job: str, steps: int, finals=(FINAL, FINAL)) -> None:
    """Two ranks attach, reserve, host, commit ``steps`` steps, and their trainers die; their
    hosts end leaving ``finals`` (None: the host failed)."""
    pid = GONE
    for rank in (0, 1):
        registry.attach(job, rank, 2, pid)
        segment = registry.reserve(job, rank, 4096)
        _, _, _, commits, round_ = registry.host_started(job, rank, pid, [segment.id],
                                                      REQUEST, nvme=False)
    for step in range(1, steps + 1):
        for rank in (0, 1):
            commits.arrived(round_, rank, step, {"rank": rank, "step": step})
    for rank in (0, 1):
        registry.detach(job, rank, clean=False)
        commits.broken()
        registry.host_ended(job, rank, finals[rank])


def test_every_rank_of_a_relaunch_takes_over_the_same_step_however_its_hosts_interleave():
    registry = Registry(1 << 30, keep_seconds=600)
    _run_and_die(registry, "j", steps=3)
    _, note, kept0 = registry.attach("j", 0, 2, GONE)
    assert "goes on from its kept state at step 3" in note
    # Rank 0's new host opens a round before rank 1 attaches: rank 1 still takes over step 3.
    _, _, _, commits, round_ = registry.host_started("j", 0, GONE, kept0["segments"], REQUEST,
                                                  nvme=False)
    assert commits.open
    _, _, kept1 = registry.attach("j", 1, 2, GONE)
    assert kept0["step"] == kept1["step"] == 3
    assert (kept0["record"], kept1["record"]) == ({"rank": 0, "step": 3}, {"rank": 1, "step": 3})
    assert kept1["final"] == FINAL and kept1["host"] == REQUEST


def test_fresh_frees_the_kept_state_and_another_world_size_is_refused_by_name():
    registry = Registry(1 << 30, keep_seconds=600)
    _run_and_die(registry, "j", steps=2)
    with pytest.raises(Exception, match="ran at world size 2 .* relaunch it at 2, or with "
                                        "--fresh"):
        registry.hold("j", GONE, world=1)
    note = registry.hold("j", GONE, fresh=True, world=1)
    assert "kept state was freed: a new run of it starts afresh (--fresh)" in note
    assert registry.dram_used == 0


def test_a_restart_that_cannot_take_over_starts_with_no_old_record():
    """A held job (its launcher restarts it) whose rank 1 never left what its host ended with:
    the restart starts afresh, and its steps 1, 2, ... are committed anew, not taken for the
    old run's."""
    registry = Registry(1 << 30, keep_seconds=600)
    registry.hold("j", GONE, world=2)
    _run_and_die(registry, "j", steps=3, finals=(FINAL, None))
    _, _, kept = registry.attach("j", 0, 2, GONE)
    assert kept is None
    segment = registry.reserve("j", 0, 4096)
    _, _, _, commits, round_ = registry.host_started("j", 0, GONE, [segment.id], REQUEST,
                                                  nvme=False)
    assert commits.step == 0
    commits.arrived(round_, 0, 1, {})
    outcome = []

    def update_of_step_1():
        try:
            commits.wait(round_, 1)
            outcome.append("ran")
        except NotCommitted:
            outcome.append("not run")
    waited = threading.Thread(target=update_of_step_1)
    waited.start()
    waited.join(0.2)
    assert waited.is_alive(), "step 1 ran as if the old run's commit covered it"
    commits.broken()  # rank 1 never came: the step is not run
    waited.join(5)
    assert outcome == ["not run"]


def test_a_relaunch_whose_rank_died_before_its_host_started_is_taken_over_again():
    """Relaunch 1's rank 0 attaches (taking its part over) and dies before its host starts;
    relaunch 2 takes the same state over, every rank of it."""
    registry = Registry(1 << 30, keep_seconds=600)
    _run_and_die(registry, "j", steps=3)
    _, _, first = registry.attach("j", 0, 2, GONE)
    registry.detach("j", 0, clean=False)
    _, _, kept0 = registry.attach("j", 0, 2, GONE)
    _, _, kept1 = registry.attach("j", 1, 2, GONE)
    assert kept0 == first and kept0["step"] == kept1["step"] == 3
    assert registry.dram_used == 2 * 4096, "a kept segment was freed"


def test_a_host_that_could_not_be_built_leaves_the_kept_state_as_it_was():
    registry = Registry(1 << 30, keep_seconds=600)
    _run_and_die(registry, "j", steps=2)
    _, _, kept = registry.attach("j", 0, 2, GONE)
    registry.host_started("j", 0, GONE, kept["segments"], REQUEST, nvme=False)
    registry.host_ended("j", 0, None, ran=False)  # its compile failed: nothing ran
    registry.detach("j", 0, clean=False)
    assert [j["resumable_step"] for j in registry.status()["jobs"]] == [2]
