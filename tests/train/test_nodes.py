"""`moc train --nodes 2`: two torchrun agents on 127.0.0.1, one per simulated node, each
with its own node-local memory; a node fault (`--fault-kind node --fault-node 1`) kills
every rank of node 1 and the job resumes exactly."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moc.checkpoint.liveness import ProcessId
from moc.checkpoint.twolevel.memory.jobdir import OWNER
from moc.train.metrics import read_events
from tests.engines import losses_by_step
from tests.procs import dead_pid, moc_here

pytestmark = pytest.mark.integration  # real processes: see README, Tests

STEPS, INTERVAL, FAULT_AT = 12, 4, 10


def moc(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moc", *args], capture_output=True,
                          text=True, timeout=timeout)


def _train(root: Path, *extra: str) -> list[dict]:
    r = moc("train", "--config", "tiny", "--steps", str(STEPS), "--ckpt-dir",
            str(root / "ckpt"), "--ckpt-interval", str(INTERVAL), "--ckpt-mode", "pec",
            "--k-persist", "all", "--device", "cpu", "--no-progress",
            "--metrics", str(root / "metrics.jsonl"), *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_events(root / "metrics.jsonl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """2 ranks three ways: one node, two simulated nodes, two nodes losing node 1."""
    dirs = {n: tmp_path_factory.mktemp(n) for n in ("single", "nodes", "lost")}
    return {
        "single": _train(dirs["single"], "--nproc", "2"),
        "nodes": _train(dirs["nodes"], "--nodes", "2", "--nproc", "1"),
        "lost": _train(dirs["lost"], "--nodes", "2", "--nproc", "1", "--fault-kind", "node",
                       "--fault-node", "1", "--fault-at", str(FAULT_AT),
                       "--max-restarts", "1"),
    }


def _hex_losses(events: list[dict]) -> dict[int, list[str]]:
    return {s: [float(v).hex() for v in ls] for s, ls in losses_by_step(events).items()}


@pytest.mark.slow
def test_two_simulated_nodes_train_exactly_as_one_node_with_the_same_ranks(runs):
    single, nodes = _hex_losses(runs["single"]), _hex_losses(runs["nodes"])
    assert sorted(single) == list(range(1, STEPS + 1))
    assert nodes == single


@pytest.mark.slow
def test_losing_node_1_resumes_from_storage_and_matches_the_uninterrupted_run(runs):
    events = runs["lost"]
    (fault,) = [e for e in events if e["event"] == "fault"]
    assert (fault["step"], fault["node"], fault["kind"]) == (FAULT_AT, 1, "node")
    (recovery,) = [e for e in events if e["event"] == "recovery"]
    assert recovery["source"] == "storage" and recovery["resumed_from"] == 8
    assert recovery["lost_tokens"] == 0  # every expert was persisted (--k-persist all)
    straight, lost = _hex_losses(runs["nodes"]), _hex_losses(runs["lost"])
    # Step 9 ran twice (before the fault and after the restart); step 10 only after it.
    assert len(lost[9]) == 2 and len(lost[FAULT_AT]) == 1
    for step in range(1, STEPS + 1):
        assert all(v == straight[step][0] for v in lost[step]), (step, lost[step])
    assert [e["steps"] for e in events if e["event"] == "summary"] == [STEPS]


@pytest.mark.slow
def test_each_node_has_its_own_memory_root_kept_across_the_restart_and_removed_after(runs):
    placements = [e for e in runs["lost"] if e["event"] == "placement"]
    assert [p["attempt"] for p in placements] == [0, 1]
    roots = [[Path(r) for r in p["shm_roots"]] for p in placements]
    sim_root = roots[0][0].parent
    assert sim_root.name.startswith("moc-nodes-")
    # Rank r runs on node r (one rank per node) and sees node r's own root; c10d gave
    # each agent the same node rank again after the restart.
    for p, rs in zip(placements, roots, strict=True):
        assert p["nodes"] == [0, 1]
        assert rs == [sim_root / "node-0", sim_root / "node-1"]
    assert not sim_root.exists()  # the simulated machines are gone, and their memory
    (single,) = [e for e in runs["single"] if e["event"] == "placement"]
    assert single["nodes"] == [0, 0] and len(set(single["shm_roots"])) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "2", "--nproc", "1", "--fault-kind", "node", "--fault-node", "2",
      "--fault-at", "5"], "--fault-node 2 does not exist with --nodes 2 (nodes are numbered "
                          "0..1)"),
    (["--nodes", "2", "--nproc", "1", "--fault-node", "1", "--fault-at", "5"],
     "--fault-node 1 loses a whole node: it needs --fault-kind node or machine (got "
     "process)"),
    (["--nodes", "0"], "--nodes must be >= 1, got 0"),
    (["--nodes", "2", "--nproc", "1", "--recovery", "restart", "--spare-nodes", "1"],
     "--spare-nodes 1 stands machines by for in-job recovery across machines"),
    (["--nodes", "2", "--nproc", "1", "--recovery", "in-job", "--fault-kind", "machine",
      "--fault-node", "1", "--fault-at", "5"],
     "--fault-kind machine loses a machine for good: give --spare-nodes 1"),
    (["--nodes", "2", "--nproc", "1", "--recovery", "restart", "--fault-kind", "machine",
      "--fault-node", "1", "--fault-at", "5"], "--fault-kind machine loses a simulated "
                                               "machine"),
    (["--nodes", "2", "--nproc", "1", "--recovery", "restart", "--machine-restart-s", "2"],
     "--machine-restart-s 2 starts a lost machine again for in-job recovery"),
    (["--nodes", "2", "--nproc", "1", "--machine-restart-s", "-1"],
     "a number of seconds >= 0"),
    (["--nodes", "2", "--nproc", "1", "--fault-at", "5", "--fault-rank", "2"],
     "--fault-rank 2 does not exist with --nproc 1 x --nodes 2"),
])
def test_bad_node_options_get_a_one_line_error(args, message, capsys):
    code, err = moc_here(capsys, "train", *args)
    assert code == 2
    assert err.strip().count("\n") == 0, err
    assert message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_device_cuda_without_a_gpu_is_refused_before_any_worker_starts():
    r = moc("train", "--device", "cuda")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--device cuda: torch sees no CUDA device here" in r.stderr
    assert "use --device cpu" in r.stderr


@pytest.mark.slow
def test_a_node_lost_without_restarts_fails_the_job_and_still_removes_the_memory(tmp_path):
    r = moc("train", "--nodes", "2", "--nproc", "1", "--config", "tiny", "--steps", "8",
            "--ckpt-mode", "none", "--device", "cpu", "--no-progress", "--fault-kind", "node",
            "--fault-node", "1", "--fault-at", "3", "--metrics", str(tmp_path / "m.jsonl"),
            "--recovery", "restart")  # in-job (the default here) would replace the node
    assert r.returncode == 1, r.stderr[-3000:]
    assert "moc train: error: simulated nodes failed (" in r.stderr
    assert "node 1: exit 1" in r.stderr
    events = read_events(tmp_path / "m.jsonl")
    (placement,) = [e for e in events if e["event"] == "placement"]
    assert not Path(placement["shm_roots"][0]).parent.exists()
    assert not [e for e in events if e["event"] == "summary"]


def _processes_with_env(name: str, value: str) -> list[int]:
    """Pids of this user's processes whose environment sets `name=value` (/proc)."""
    needle = f"{name}={value}".encode()
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                pids.append(int(environ.parent.name))
        except OSError:  # gone, or another user's
            continue
    return pids


def _training(metrics: Path, *extra: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen:
    """A launcher of two simulated nodes training for ever, once its first step is in;
    its stderr goes to `_stderr(metrics)` (a file: a pipe nobody reads would fill up)."""
    with open(metrics.with_suffix(".err"), "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "moc", "train", "--nodes", "2", "--nproc", "1", "--config",
             "tiny", "--steps", "100000", "--device", "cpu", "--no-progress", "--metrics",
             str(metrics), *extra],
            stdout=subprocess.DEVNULL, stderr=err, env=env)
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"step"' in metrics.read_text()):
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            launcher.wait()
            pytest.fail(f"the launcher never trained: {_stderr(metrics)[-3000:]}")
        time.sleep(0.5)
    return launcher


def _stderr(metrics: Path) -> str:
    return metrics.with_suffix(".err").read_text()


@pytest.mark.parametrize("signum", [signal.SIGINT,
                                    pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_interrupting_the_launcher_stops_every_node_and_removes_the_memory(tmp_path, signum):
    metrics = tmp_path / "m.jsonl"
    launcher = _training(metrics, "--ckpt-mode", "none")
    try:
        (placement,) = [e for e in read_events(metrics) if e["event"] == "placement"]
        node_1 = placement["shm_roots"][1]
        assert _processes_with_env("MOC_SHM_ROOT", node_1)  # node 1's agent and worker
        launcher.send_signal(signum)  # the launcher only, as `kill` would
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    err = _stderr(metrics)
    assert launcher.returncode == 128 + signum, err[-2000:]
    # Forwarded to every node's workers: they stopped at one agreed step (no checkpoint
    # directory here, so nothing to save), rank 0 says so in one line.
    assert f"preempted ({signal.Signals(signum).name}) at step" in err, err[-2000:]
    assert "Traceback" not in err
    assert not _processes_with_env("MOC_SHM_ROOT", node_1)
    assert not Path(node_1).parent.exists()


# -- issue 29: the launcher's memory and its agents' lifetime (items 4 and 18) ------------


def _job_processes(roots: list[str]) -> list[int]:
    """This run's agents, workers and persist processes: every process whose MOC_SHM_ROOT
    is one of its nodes' roots."""
    return sorted({pid for root in roots for pid in _processes_with_env("MOC_SHM_ROOT", root)})


def _checkpoints(metrics: Path) -> list[dict]:
    return [e for e in read_events(metrics) if e["event"] == "checkpoint"]


@pytest.fixture
def shm() -> Iterator[Path]:
    """A shared-memory root of the test's own, with a short path: the persist process's
    socket lies three directories under it and AF_UNIX paths end at 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="moc-test-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_a_running_launchers_memory_outlives_another_jobs_cleanup_however_old(tmp_path, shm):
    """The simulated nodes' root had no owner record and an mtime that never changes:
    an hour after the start, any other job's claim of shared memory deleted it under
    the running job (before: "replica of step 90: FileNotFoundError ... slot-1.bin",
    then its snapshots). Now it is judged by its owner, the launcher: kept while it
    runs, removed once it is gone."""
    env = {**os.environ, "MOC_SHM_ROOT": str(shm)}
    metrics = tmp_path / "m.jsonl"
    launcher = _training(metrics, "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-interval",
                         "5", env=env)
    try:
        (root,) = shm.glob("moc-nodes-*")
        hours_ago = time.time() - 2 * 3600
        os.utime(root, (hours_ago, hours_ago))  # untouched for two hours
        dead = shm / "moc-nodes-dead"  # a launcher that is gone, its record left
        dead.mkdir(mode=0o700)
        record = ProcessId.of(os.getpid()).to_json() | {"pid": dead_pid()}
        (dead / OWNER).write_text(json.dumps(record))
        claim = subprocess.run(
            [sys.executable, "-c", "from moc.checkpoint.twolevel.memory.jobdir import claim_job,"
             " remove_stale_jobs; print(sorted(p.name for p in remove_stale_jobs('other')))"
             "; claim_job('other')"], env=env, capture_output=True, text=True, timeout=120)
        assert claim.returncode == 0, claim.stderr[-2000:]
        assert claim.stdout.strip() == "['moc-nodes-dead']"
        assert root.is_dir() and not dead.exists()
        after = max((e["step"] for e in _checkpoints(metrics)), default=0)
        deadline = time.monotonic() + 120
        while len([e for e in _checkpoints(metrics) if e["step"] > after]) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        for e in _checkpoints(metrics):
            assert e.get("error") is None and e.get("replica_error") is None, e
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    err = _stderr(metrics)
    assert launcher.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "No such file" not in err
    assert not root.exists()


@pytest.mark.slow
def test_a_launcher_killed_by_sigkill_takes_every_node_with_it(tmp_path, shm):
    """SIGKILL gives the launcher no chance to stop its agents: before, both torchrun
    agents (then reparented to init), their workers and the persist processes trained on
    unsupervised (six processes 45 s later). Now each agent gets SIGTERM when the
    launcher dies and stops its workers; the memory root left behind records the dead
    launcher, so the next job's claim removes it."""
    env = {**os.environ, "MOC_SHM_ROOT": str(shm)}
    metrics = tmp_path / "m.jsonl"
    launcher = _training(metrics, "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-interval",
                         "5", env=env)
    (placement,) = [e for e in read_events(metrics) if e["event"] == "placement"]
    roots = placement["shm_roots"]
    try:
        assert len(_job_processes(roots)) >= 4  # two agents, two workers (and persists)
        launcher.kill()  # SIGKILL: no handler of the launcher runs
        launcher.wait()
        deadline = time.monotonic() + 90  # torchrun: SIGTERM, then SIGKILL after 30 s
        while _job_processes(roots) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _job_processes(roots)
        assert not left, f"processes outlived their launcher: {left}"
        # Each rank says in one line that the store is gone; no C++ trace of c10d's
        # (TCPStore.cpp's warnings, 20 frames each, from every process, before).
        err = _stderr(metrics)
        assert "TCPStore.cpp" not in err and "frame #" not in err, err[-3000:]
    finally:
        for pid in _job_processes(roots):  # only this run's: found by its own roots
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    (root,) = shm.glob("moc-nodes-*")
    claim = subprocess.run(
        [sys.executable, "-c", "from moc.checkpoint.twolevel.memory.jobdir import claim_job;"
         "claim_job('next')"], env=env, capture_output=True, text=True, timeout=120)
    assert claim.returncode == 0, claim.stderr[-2000:]
    assert not root.exists()


def test_a_job_killed_whole_resumes_from_its_memory_when_started_again(tmp_path, shm):
    """Issue 47, finding 6: every process of the job SIGKILLed, the launcher first.
    Before, the same command made a fresh memory root, never found the dead job's
    snapshots and resumed from partial storage, losing tokens, with the snapshots left in
    /dev/shm. Now the memory root is named by the checkpoint directory: started again,
    the run restores from it, exactly, and removes it when it ends."""
    env = {**os.environ, "MOC_SHM_ROOT": str(shm)}
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [sys.executable, "-m", "moc", "train", "--nodes", "2", "--nproc", "1", "--ep",
            "2", "--config", "tiny", "--steps", "60", "--ckpt-dir", str(ckpt),
            "--ckpt-interval", "5", "--k-persist", "1", "--device", "cpu", "--no-progress",
            "--metrics", str(metrics)]
    err = tmp_path / "first.err"
    with open(err, "w") as stderr:
        launcher = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    roots: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while max((e["step"] for e in read_events(metrics) if e["event"] == "step"),
                  default=0) < 23:  # past four checkpoints, K = 1 of 4 on storage
            assert launcher.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never got going"
            time.sleep(0.2)
        (placement,) = [e for e in read_events(metrics) if e["event"] == "placement"]
        roots = placement["shm_roots"]
        # Every process of the job at once, the launcher first: no final checkpoint (a
        # launcher killed alone lets its ranks take one on their way out, when they are
        # quick enough, and the restart then finds it complete on storage).
        launcher.kill()
        launcher.wait()
    finally:
        for pid in _job_processes(roots):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _job_processes(roots) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(shm.glob("moc-nodes-*"))) == 1  # the dead job's memory, kept
    again = subprocess.run([*args[:-1], str(tmp_path / "again.jsonl")], env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    (recovery,) = [e for e in read_events(tmp_path / "again.jsonl")
                   if e["event"] == "recovery"]
    assert recovery["source"] == "memory" and recovery["lost_tokens"] == 0, recovery
    assert recovery["resumed_from"] >= 20
    assert not list(shm.glob("moc-nodes-*"))  # removed once the run ended
