"""`moc train --recovery in-job`: a lost or hung rank's process is replaced in place by
its host, the survivors keep their processes and re-form the job with the newcomer, and
the run goes on exactly as if nothing had happened (every loss bitwise equal to a run
without faults). Real processes, real SIGKILLs and SIGSTOPs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.procs import moc_here
from tests.train.injob_runs import STEPS, assert_exact, events, train

pytestmark = pytest.mark.integration  # real processes: see README, Tests

@pytest.fixture
def reference(injob_reference):
    """The runs without faults the faulted ones must equal (`reference["one"]`, one
    node of 2 ranks; `["two"]`, 2 simulated nodes of one rank)."""
    return injob_reference


def assert_in_place(root: Path, replaced: list[int], source: str) -> dict:
    """One in-job recovery: only `replaced` got new processes, the others kept theirs."""
    (recovery,) = events(root, "recovery")
    before, after = (e["pids"] for e in events(root, "placement"))
    assert recovery["kind"] == "in-job" and recovery["replaced"] == replaced
    assert recovery["pids"] == after and recovery["source"] == source
    assert recovery["lost_tokens"] == 0 and recovery["downtime_s"] > 0
    for rank, (old, new) in enumerate(zip(before, after, strict=True)):
        assert (old != new) == (rank in replaced), (rank, before, after)
    return recovery


def test_by_default_a_killed_rank_is_replaced_and_the_survivor_keeps_its_process(
        tmp_path, reference):
    """No --recovery: a multi-rank `moc train` recovers in-job."""
    r = train(tmp_path, "--nproc", "2", "--fault-at", "12", "--fault-rank", "1")
    assert_exact(tmp_path, reference["one"])
    recovery = assert_in_place(tmp_path, [1], "memory")
    assert recovery["resumed_from"] == 10 and recovery["step"] == 11
    assert "rank 1: process" in r.stderr and "died (SIGKILL)" in r.stderr


def test_newcomers_started_as_new_interpreters_recover_the_same(tmp_path, reference):
    """MOC_INJOB_START=spawn: the way before forking (moc.checkpoint.twolevel.persist.forking),
    kept for a platform without fork."""
    train(tmp_path, "--nproc", "2", "--fault-at", "12", "--fault-rank", "1",
          env={"MOC_INJOB_START": "spawn"})
    assert_exact(tmp_path, reference["one"])
    assert_in_place(tmp_path, [1], "memory")


def test_a_lost_node_is_replaced_from_its_peer_and_the_other_node_keeps_its_process(
        tmp_path, reference):
    train(tmp_path, "--nodes", "2", "--nproc", "1", "--recovery", "in-job", "--spares", "1",
          "--fault-kind", "node", "--fault-node", "1", "--fault-at", "17")
    assert_exact(tmp_path, reference["two"])
    recovery = assert_in_place(tmp_path, [1], "peer")
    assert recovery["sources"] == {"memory": [0], "peer": [1]}


def test_a_stopped_rank_is_detected_killed_and_replaced(tmp_path, reference):
    # 10 s, not 2: on a loaded 2-core VM (a CI run beside other jobs, 2026-12-05) a
    # healthy rank's heartbeat once lapsed for over 2 s, both ranks were taken for hung
    # and replaced in a second recovery. The run stayed exact; the test's count did not.
    r = train(tmp_path, "--nproc", "2", "--recovery", "in-job", "--fault-kind", "hang",
              "--fault-at", "8", "--fault-rank", "1", "--hang-timeout", "10")
    assert_exact(tmp_path, reference["one"])
    assert_in_place(tmp_path, [1], "memory")
    assert "hung (no heartbeat for" in r.stderr, r.stderr[-2000:]


def test_a_fault_before_the_first_checkpoint_starts_every_rank_over(tmp_path, reference):
    """Nothing to restore: the survivor's weights are a few steps on, the newcomer's are
    the initial ones; both go back to the start, and the run is still exact."""
    r = train(tmp_path, "--nproc", "2", "--recovery", "in-job", "--fault-at", "3",
              "--fault-rank", "1")
    assert_exact(tmp_path, reference["one"])
    (recovery,) = events(tmp_path, "recovery")
    assert (recovery["source"], recovery["resumed_from"], recovery["step"]) == ("start", 0, 2)
    assert recovery["kind"] == "in-job" and recovery["replaced"] == [1]
    assert "nothing to restore: every rank starts over from step 0" in r.stderr


def test_rank_0_is_replaced_too_and_its_new_process_goes_on_logging(tmp_path, reference):
    """Rank 0 writes the metrics and its host serves the job's store across nodes: its
    loss must cost neither."""
    train(tmp_path, "--nodes", "2", "--nproc", "1", "--recovery", "in-job",
          "--fault-at", "13", "--fault-rank", "0")
    assert_exact(tmp_path, reference["two"])
    assert_in_place(tmp_path, [0], "memory")


@pytest.mark.slow  # long; CI time (make test-slow runs it)
def test_recurring_faults_each_replace_one_process(tmp_path, reference):
    train(tmp_path, "--nproc", "2", "--recovery", "in-job", "--spares", "1",
          "--fault-every", "9", "--fault-rank", "1")
    assert_exact(tmp_path, reference["one"])
    recoveries = events(tmp_path, "recovery")
    assert [e["resumed_from"] for e in recoveries] == [5, 15, 25]
    placements = events(tmp_path, "placement")
    assert len({p["pids"][0] for p in placements}) == 1  # rank 0: one process throughout
    assert len({p["pids"][1] for p in placements}) == 4
    assert [p["generation"] for p in placements] == [0, 1, 2, 3]


def test_a_restart_reports_its_downtime_and_every_rank_as_replaced(tmp_path, reference):
    train(tmp_path, "--nproc", "2", "--recovery", "restart", "--fault-at", "12",
          "--fault-rank", "1", "--max-restarts", "1")
    assert_exact(tmp_path, reference["one"])
    (recovery,) = events(tmp_path, "recovery")
    before, after = (e["pids"] for e in events(tmp_path, "placement"))
    assert recovery["kind"] == "restart" and recovery["replaced"] == [0, 1]
    assert recovery["downtime_s"] > 0 and not set(before) & set(after)


def test_a_process_that_fails_by_itself_is_not_replaced(tmp_path):
    """An error the worker meets by itself (here a bad setting only the engine reads)
    exits 2: replacing the process would only fail again. The job fails once, with the
    worker's own line."""
    r = train(tmp_path, "--nproc", "2", "--recovery", "in-job", ok=False,
              env={"MOC_CKPT_PRIORITY": "bogus"})
    assert r.returncode != 0
    assert "MOC_CKPT_PRIORITY='bogus': expected one of" in r.stderr
    assert "replaced by" not in r.stderr


def test_replacements_are_bounded_and_the_end_is_one_clear_line(tmp_path):
    r = train(tmp_path, "--nproc", "2", "--recovery", "in-job", "--max-replacements", "0",
              "--fault-at", "6", "--fault-rank", "1", ok=False)
    assert r.returncode != 0
    assert "0 replacements already (--max-replacements): giving up" in r.stderr


def test_options_of_in_job_recovery_are_checked_before_anything_starts(tmp_path, capsys):
    """In this process (moc.cli.main): nothing starts, so no interpreter per case."""
    for args, says in ((["--recovery", "restart", "--spares", "1"],
                        "--spares and --hang-timeout are for --recovery in-job"),
                       (["--recovery", "restart", "--fault-kind", "hang", "--fault-at", "3"],
                        "only --recovery in-job detects a hang"),
                       (["--ckpt-mode", "dcp-sync", "--spares", "1"],
                        "--recovery in-job needs a moc engine"),
                       (["--recovery", "in-job", "--spares", "2"], "--spares must be 0 or 1"),
                       (["--recovery", "in-job", "--hang-timeout", "0"],
                        "--hang-timeout must be > 0"),
                       (["--recovery", "in-job", "--ckpt-mode", "dcp-sync"],
                        "--recovery in-job needs a moc engine")):
        argv = ["train", "--config", "tiny", "--steps", str(STEPS), "--ckpt-dir",
                str(tmp_path / "ckpt"), "--device", "cpu", "--no-progress", *args]
        code, err = moc_here(capsys, *argv)
        assert code == 2 and says in err, (args, err[-1000:])
