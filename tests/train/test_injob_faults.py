"""In-job recovery against faults that come while the job re-forms, or that torchrun's
own restart meets: a second fault 1.5 s after the first (rank 0 this time), a rank host
killed so that torchrun restarts one node only, a stop request while the job waits for
its newcomer. Real processes and signals; every run that finishes is bitwise equal to
the run without faults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moc.checkpoint.store.steps import complete_steps
from moc.injob.machines import parent_of
from moc.train.metrics import read_events
from tests.train.injob_runs import STEPS, assert_exact, events, train

pytestmark = pytest.mark.integration  # real processes: see README, Tests

TWO_NODES = ("--nodes", "2", "--nproc", "1", "--recovery", "in-job")


@pytest.fixture
def reference(injob_reference) -> dict[int, float]:
    """The run without faults: 2 simulated nodes of one rank (shared with
    test_injob.py)."""
    return injob_reference["two"]


class Run:
    """`moc train` in the background, its stderr read line by line as it comes."""

    def __init__(self, root: Path, *args: str) -> None:
        self.root = root
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moc", "train", "--config", "tiny", "--steps", str(STEPS),
             "--ckpt-dir", str(root / "ckpt"), "--ckpt-interval", "5", "--k-persist", "1",
             "--device", "cpu", "--no-progress", "--metrics", str(root / "metrics.jsonl"),
             *args], stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None, "".join(self.lines)[-3000:]
            assert time.monotonic() < deadline, f"no {text!r} in:\n{''.join(self.lines)}"
            time.sleep(0.02)

    def pids(self) -> list[int]:
        """Every rank's training process, as the newest placement event logged them."""
        return events(self.root, "placement")[-1]["pids"]

    def finish(self, timeout_s: float = 400) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout=timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        self._reader.join(timeout=10)
        return code, "".join(self.lines)


@pytest.mark.slow  # faults during re-formation: the slow tier (make test-slow)
def test_a_second_fault_while_the_job_re_forms_costs_one_more_generation(tmp_path,
                                                                         reference):
    """Rank 1 is killed, then rank 0 (whose host serves the job's store across nodes)
    1.5 s later, while the job waits for rank 1's newcomer: the newcomer must not wait
    on the dead rank 0 for the store's 300 s; the job re-forms once more and finishes."""
    run = Run(tmp_path, *TWO_NODES, "--fault-at", "12", "--fault-rank", "1")
    run.wait_for("lost a peer")
    rank0 = run.pids()[0]
    time.sleep(1.5)
    os.kill(rank0, signal.SIGKILL)
    code, stderr = run.finish()
    assert code == 0, stderr[-3000:]
    assert_exact(tmp_path, reference)
    placements = events(tmp_path, "placement")
    assert rank0 not in placements[-1]["pids"]
    assert placements[-1]["generation"] >= 2
    downtime = sum(e["downtime_s"] for e in events(tmp_path, "recovery"))
    print(f"second fault 1.5 s after the first: generations "
          f"{[p['generation'] for p in placements]}, total downtime {downtime:.2f}s")


@pytest.mark.slow  # faults during re-formation: the slow tier (make test-slow)
def test_a_node_restarted_by_torchrun_meets_the_others_again(tmp_path, reference):
    """Node 1's rank host itself is killed: torchrun restarts node 1's workers and its
    re-rendezvous restarts node 0's. The agents' restart counts now differ (1 and 0):
    the job's namespace is agreed per round, not taken from them, so the ranks meet."""
    run = Run(tmp_path, *TWO_NODES, "--max-restarts", "1")
    metrics = tmp_path / "metrics.jsonl"
    while not (metrics.exists() and any(e["event"] == "step" and e["step"] >= 12
                                        for e in read_events(metrics))):
        assert run.process.poll() is None, "".join(run.lines)[-3000:]
        time.sleep(0.05)
    os.kill(parent_of(run.pids()[1]), signal.SIGKILL)
    code, stderr = run.finish()
    assert code == 0, stderr[-3000:]
    assert_exact(tmp_path, reference)
    assert events(tmp_path, "recovery")[-1]["kind"] == "restart"


@pytest.mark.slow  # faults during re-formation: the slow tier (make test-slow)
def test_a_stop_while_the_job_re_forms_says_truly_what_is_durable(tmp_path):
    """SIGTERM to the launcher while rank 0 waits for rank 1's newcomer: no final
    checkpoint can be taken without rank 1; rank 0 stops at once and names the step
    storage holds, never "the grace period ran out"."""
    run = Run(tmp_path, *TWO_NODES, "--fault-at", "12", "--fault-rank", "1")
    run.wait_for("lost a peer")
    run.process.send_signal(signal.SIGTERM)
    code, stderr = run.finish()
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "grace period" not in stderr, stderr[-3000:]
    newest = complete_steps(tmp_path / "ckpt")[-1]
    if "re-formed after a fault" in stderr:  # the newcomer had not joined yet
        assert f"step {newest} is durable" in stderr, stderr[-3000:]


@pytest.mark.parametrize(("how", "args", "says"), [
    pytest.param("spare node", ["--spare-nodes", "1"], "adopted by spare node 2",
                 marks=pytest.mark.slow),  # CI time; the crash sweep loses machines too
    ("started again 2 s later", ["--machine-restart-s", "2"],
     "adopted by node started again 2")])
def test_a_lost_machine_is_taken_over_and_the_survivor_keeps_its_process(
        tmp_path, reference, how, args, says):
    """Every process of simulated machine 1 (its torchrun agent, rank host, training and
    persist processes) SIGKILLed and its memory wiped: no host is left to replace
    anything. A spare node's host, or a host of the machine started again as a
    scheduler would (outside torchrun's rendezvous: joining it would restart every
    agent's workers), sees machine 1's leases stop, adopts rank 1 and restores it from
    the replica node 0 keeps; rank 0 keeps its process throughout."""
    r = train(tmp_path, *TWO_NODES, *args, "--fault-kind", "machine", "--fault-node", "1",
              "--fault-at", "17")
    assert_exact(tmp_path, reference)
    (recovery,) = events(tmp_path, "recovery")
    before, after = (e["pids"] for e in events(tmp_path, "placement"))
    assert recovery["kind"] == "in-job" and recovery["replaced"] == [1]
    assert recovery["sources"] == {"memory": [0], "peer": [1]}
    assert before[0] == after[0] and before[1] != after[1]
    assert says in r.stderr, r.stderr[-3000:]
    placement = events(tmp_path, "placement")[-1]
    assert placement["nodes"] == [0, 1] and "node-2" in placement["shm_roots"][1]
    print(f"machine lost at step 17, {how}: downtime {recovery['downtime_s']:.2f}s")
