"""End to end: `moc train` under torchrun, a real SIGKILL, an automatic restart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moc.checkpoint.recovery import CheckpointReader
from moc.checkpoint.store.manifest import Manifest
from moc.train.metrics import read_events
from tests.engines import losses_by_step
from tests.procs import moc_here

pytestmark = pytest.mark.integration  # real processes: see README, Tests


def moc(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moc", *args], capture_output=True,
                          text=True, timeout=timeout)


def _train(root: Path, *extra: str, interval: int = 10) -> list[dict]:
    r = moc("train", "--nproc", "2", "--ep", "2", "--config", "tiny", "--steps", "20",
            "--ckpt-dir", str(root / "ckpt"), "--ckpt-interval", str(interval),
            "--ckpt-mode", "moc",
            "--metrics", str(root / "metrics.jsonl"), *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_events(root / "metrics.jsonl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    fault = ("--fault-at", "15", "--fault-rank", "1", "--max-restarts", "1")
    dirs = {name: tmp_path_factory.mktemp(name)
            for name in ("straight", "faulted", "blocking", "pec_all", "pec_k1", "node")}
    return {
        # Every expert persisted: its step-20 files hold the final state.
        "straight": (dirs["straight"], _train(dirs["straight"], "--k-persist", "all")),
        "faulted": (dirs["faulted"], _train(dirs["faulted"], *fault)),
        "blocking": (dirs["blocking"], _train(dirs["blocking"], "--ckpt-mode", "blocking",
                                              *fault)),
        "node": (dirs["node"], _train(dirs["node"], "--k-persist", "1", "--fault-kind",
                                      "node", *fault, interval=3)),
        "pec_all": (dirs["pec_all"], _train(dirs["pec_all"], "--ckpt-mode", "pec",
                                            "--k-persist", "all", *fault)),
        "pec_k1": (dirs["pec_k1"], _train(dirs["pec_k1"], "--ckpt-mode", "pec",
                                          "--k-persist", "1", "--keep-last", "1", *fault,
                                          interval=3)),
    }


@pytest.mark.parametrize(("run", "source"), [("faulted", "memory"), ("blocking", "storage"),
                                             ("pec_all", "storage")])
def test_interrupted_run_equals_uninterrupted_bitwise(runs, run, source):
    """moc (the default; K_persist = 1 but a complete snapshot in memory) recovers a
    process crash from memory; full checkpoints recover from storage; all exactly."""
    (_, straight), (_, faulted) = runs["straight"], runs[run]
    recoveries = [e for e in faulted if e["event"] == "recovery"]
    assert len(recoveries) == 1 and recoveries[0]["resumed_from"] == 10
    assert recoveries[0]["source"] == source
    assert recoveries[0]["lost_tokens"] == 0 and recoveries[0]["plt"] == 0.0
    a, b = losses_by_step(straight), losses_by_step(faulted)
    # Steps 11-14 ran twice in the faulted run (before the kill and after the restart).
    assert [len(b[s]) for s in range(11, 15)] == [2, 2, 2, 2]
    for step in range(1, 21):
        assert all(loss == a[step][0] for loss in b[step]), f"step {step}: {a[step]} vs {b[step]}"


@pytest.mark.parametrize("run", ["blocking", "pec_all"])
def test_final_parameters_and_optimizer_state_are_bitwise_identical(runs, run):
    (ra, _), (rb, _) = runs["straight"], runs[run]
    ma, mb = Manifest.load(ra / "ckpt", 20), Manifest.load(rb / "ckpt", 20)
    assert ma.entries.keys() == mb.entries.keys()
    assert any(k.startswith("optim/") and "/expert=" in k for k in ma.entries)
    read_a, read_b = CheckpointReader(ra / "ckpt", ma), CheckpointReader(rb / "ckpt", mb)
    for key in ma.entries:
        if key.startswith("rng/"):
            continue
        assert torch.equal(read_a.get(key), read_b.get(key)), key


def test_pec_k1_recovery_reports_lost_tokens_and_keeps_referenced_steps(runs):
    root, events = runs["pec_k1"]
    ckpts = [e for e in events if e["event"] == "checkpoint"]
    # tiny: 2 MoE layers x 4 experts; the chain's first checkpoint saves all 8.
    assert ckpts[0]["experts_saved"] == 8 and ckpts[1]["experts_saved"] == 2
    assert all(e["k"] == 1 and e["mode"] == "pec" for e in ckpts)
    assert ckpts[1]["bytes"] < ckpts[0]["bytes"]
    (recovery,) = [e for e in events if e["event"] == "recovery"]
    assert recovery["resumed_from"] == 12
    assert recovery["lost_tokens"] > 0 and 0 < recovery["plt"] < 1
    assert recovery["lost_tokens"] == sum(recovery["lost_per_layer"])
    summary = [e for e in events if e["event"] == "summary"]
    assert summary and summary[-1]["steps"] == 20
    # The run's last step (20, off the interval of 3) is checkpointed, completely: every
    # expert from step 20, so with keep_last=1 retention frees every older step (the
    # demotion of steps a partial manifest still reads: tests/checkpoint/store).
    from moc.checkpoint.store.retention import referenced_steps
    from moc.checkpoint.store.steps import complete_steps, step_dir
    assert ckpts[-1]["step"] == 20 and ckpts[-1]["experts_saved"] == 8
    newest = Manifest.load(root / "ckpt", 20)
    assert complete_steps(root / "ckpt") == [20] and referenced_steps(newest) == {20}
    assert not step_dir(root / "ckpt", 18).exists()


def test_node_loss_recovers_from_storage_and_counts_the_lost_tokens(runs):
    _, events = runs["node"]
    (recovery,) = [e for e in events if e["event"] == "recovery"]
    assert recovery["source"] == "storage"
    assert recovery["resumed_from"] <= 12  # the newest persisted step before step 15
    assert recovery["lost_tokens"] > 0 and 0 < recovery["plt"] < 1
    ckpts = [e for e in events if e["event"] == "checkpoint"]
    assert all(e["mode"] == "moc" and e["k"] == 1 for e in ckpts)
    assert all(e["snapshot_s"] is not None for e in ckpts)
    assert summary_steps(events) == 20


def summary_steps(events: list[dict]) -> int:
    return [e for e in events if e["event"] == "summary"][-1]["steps"]


def test_checkpoint_of_another_model_config_is_a_one_line_error(runs):
    root, _ = runs["straight"]
    r = moc("train", "--config", "small", "--ckpt-dir", str(root / "ckpt"))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "different model" in r.stderr and "n_experts: checkpoint 4 vs now 8" in r.stderr


def test_a_finished_run_whose_final_step_is_damaged_trains_it_again(runs, tmp_path):
    """Issue 47, finding 8: a finished run whose final step had a truncated shard said
    "already complete" and exited 0, while `moc verify` and `moc export` refused that
    step. Now the damage is said in one line, the run trains again from the newest
    intact step, and ends where the undamaged run did, bitwise."""
    import shutil

    (straight, _) = runs["straight"]
    root = tmp_path / "ckpt"
    shutil.copytree(straight / "ckpt", root)
    shard = root / "step-00000020" / "rank-00001.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 64)
    r = moc("train", "--nproc", "2", "--ep", "2", "--config", "tiny", "--steps", "20",
            "--ckpt-dir", str(root), "--ckpt-interval", "10", "--ckpt-mode", "moc",
            "--k-persist", "all", "--metrics", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "already complete" not in r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if "is damaged" in ln]
    assert line.startswith(f"moc train: the final step 20 in {root} is damaged "
                           "(step-00000020/rank-00001.safetensors: size is "), line
    assert line.endswith("training again from the newest intact step"), line
    (recovery,) = [e for e in read_events(tmp_path / "m.jsonl") if e["event"] == "recovery"]
    assert recovery["resumed_from"] == 10
    assert moc("verify", str(root)).returncode == 0
    ma, mb = Manifest.load(straight / "ckpt", 20), Manifest.load(root, 20)
    read_a, read_b = CheckpointReader(straight / "ckpt", ma), CheckpointReader(root, mb)
    for key in ma.entries:
        if not key.startswith("rng/"):
            assert torch.equal(read_a.get(key), read_b.get(key)), key
    # Started again, it is complete now: one line, exit 0, nothing trained.
    again = moc("train", "--nproc", "2", "--ep", "2", "--config", "tiny", "--steps", "20",
                "--ckpt-dir", str(root), "--ckpt-mode", "moc")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already complete at step 20" in again.stderr


def test_recurring_faults_each_restart_meets_the_next_one(tmp_path):
    events = _train(tmp_path, "--ckpt-mode", "pec", "--k-persist", "1", "--fault-every", "7",
                    "--fault-rank", "1", "--max-restarts", "2", interval=5)
    assert [e["step"] for e in events if e["event"] == "fault"] == [7, 14]
    assert [e["resumed_from"] for e in events if e["event"] == "recovery"] == [5, 10]
    assert [e["steps"] for e in events if e["event"] == "summary"] == [20]


def test_checkpoint_blocks_alternate_with_blocks_without(tmp_path):
    """`--ckpt-blocks` (what `moc bench overhead --paired` runs): checkpoints in every
    other block of steps only, and the last step's all the same."""
    r = moc("train", "--nproc", "1", "--config", "tiny", "--steps", "8", "--ckpt-interval",
            "1", "--ckpt-blocks", "3", "--ckpt-dir", str(tmp_path / "ckpt"), "--metrics",
            str(tmp_path / "m.jsonl"), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    events = read_events(tmp_path / "m.jsonl")
    # In the order they complete: step 3's persist (the chain's first, every expert) may
    # end after 4's and 5's snapshots (their persists skipped while it runs).
    assert sorted(e["step"] for e in events if e["event"] == "checkpoint") == [3, 4, 5, 8]
    assert len([e for e in events if e["event"] == "step"]) == 8


@pytest.mark.parametrize(("args", "message"), [
    (["--nproc", "2", "--ep", "3"], "ep=3 must divide the number of ranks (2)"),
    (["--nproc", "3", "--ep", "3"], "ep=3 must divide the expert count (4)"),
    (["--data", "/nonexistent/corpus"], "--data /nonexistent/corpus: no such file"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--ckpt-blocks", "-2"], "--ckpt-blocks must be >= 0 (0: no blocks), got -2"),
    (["--fault-at", "5", "--fault-rank", "7"], "--fault-rank 7 does not exist"),
    (["--fault-at", "5", "--fault-every", "5"], "--fault-at and --fault-every exclude"),
    (["--k-persist", "9"], "--k-persist 9 is more than the 4 experts"),
    (["--plt-threshold", "-3"], "plt_threshold must be in (0, 1), got -3"),
])
def test_bad_input_gets_a_one_line_error(args, message, capsys):
    # In this process (moc.cli.main, as `python -m moc` calls it): the checks run before
    # anything starts, and a new interpreter per case cost 3 s of CI each. The real
    # process's exit is the next test's.
    code, err = moc_here(capsys, "train", *args)
    assert code == 2
    assert err.strip().count("\n") == 0, err
    assert message in err


def test_a_bad_option_exits_2_with_one_line_from_the_real_process():
    r = moc("train", "--nproc", "2", "--ep", "3")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("moc train: error: ep=3 must divide the number of ranks "
                                "(2); choose ep from [1, 2]"), r.stderr
