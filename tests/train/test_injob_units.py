"""The parts of in-job recovery that need no job: what counts as a lost peer, the
generations in the store, the host's hang rule, prestarted persist processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.twolevel.persist import prestart
from moc.injob import membership as injob
from moc.injob.membership import (
    FORM_FACTOR,
    FORM_FLOOR_S,
    REJOIN_STATUS,
    Membership,
    first_line,
    generation,
    lost_peer,
    next_generation,
)
from moc.train import host
from moc.train.config import TrainConfig


def test_broken_connections_and_timeouts_are_lost_peers_and_nothing_else_is():
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:1234")
    assert lost_peer(gloo)
    assert lost_peer(RuntimeError("Connection reset by peer"))
    assert lost_peer(RuntimeError("[gloo] Timed out waiting 300000ms for recv operation"))
    # An engine's agreed error that carries one, and one raised from one.
    assert lost_peer(CheckpointError("rank 1: RuntimeError: Connection closed by peer"))
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise CheckpointError("the snapshot's plan failed") from e
    except CheckpointError as chained:
        assert lost_peer(chained)
    # The store's: a rendezvous whose peer died before it wrote its key, a store whose
    # server is gone.
    assert lost_peer(dist.DistStoreError("wait timeout after 5000ms, keys: /gen-1/pg/0"))
    assert lost_peer(dist.DistNetworkError("The client socket has failed to connect to "
                                           "any network address of (127.0.0.1, 29500)"))
    assert lost_peer(RuntimeError("Connection refused"))
    for other in (RuntimeError("CUDA out of memory"), ValueError("Connection closed"),
                  KeyboardInterrupt(), CheckpointError("checksum mismatch"), None):
        assert not lost_peer(other), other


def test_a_generation_moves_once_however_many_notice_the_fault():
    store = dist.HashStore()
    assert next_generation(store, 0) == 1  # the first to ask, before anyone read it
    store = dist.HashStore()
    assert generation(store) == 0
    # The host of the lost rank and two survivors, in any order: one move.
    assert next_generation(store, 0) == 1
    assert next_generation(store, 0) == 1
    assert next_generation(store, 0) == 1
    assert generation(store) == 1
    # A later fault, noticed by a process still in generation 1.
    assert next_generation(store, 1) == 2


@pytest.fixture
def child():
    """A real process under a `host.Child`, with the test writing its heartbeats."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    read, write = os.pipe()
    c = host.Child(process, read)
    yield c, write
    process.kill()
    process.wait()
    c.close()
    os.close(write)


def beat(c: host.Child, fd: int, **fields) -> None:
    os.write(fd, (json.dumps({"gen": 0, "phase": "train", "waiting": False,
                              "trained": 1, **fields}) + "\n").encode())
    c.read()


def test_no_heartbeat_for_the_timeout_is_a_hang(child):
    c, fd = child
    beat(c, fd, step=1, step_s=0.01)
    assert c.hung(0.3) is None
    time.sleep(0.4)
    assert c.hung(0.3).startswith("no heartbeat for")


def test_a_step_that_does_not_come_is_a_hang_unless_the_rank_waits_for_a_peer(child):
    c, fd = child
    c.progress -= 1000
    assert c.hung(0.3) is None  # no heartbeat yet: starting, not training
    beat(c, fd, step=3)
    c.progress -= host.PROGRESS_FLOOR_S + 1  # alive, training, no step: its own hang
    assert c.hung(0.3).startswith("no step for")
    beat(c, fd, step=3, waiting=True)  # a thread waits for a peer: another's
    assert c.hung(0.3) is None
    c.progress -= host.PROGRESS_FLOOR_S - 1  # a pause shorter than the floor
    beat(c, fd, step=3)
    assert c.hung(0.3) is None
    beat(c, fd, step=3, phase="restore")  # not training: liveness only
    c.progress -= 1000
    assert c.hung(0.3) is None
    beat(c, fd, step=4)
    assert c.hung(0.3) is None


def test_a_process_that_does_not_get_out_of_a_lost_generation_hangs(child):
    """Leaving (groups dropped, engine abandoned) is watched as training is: a snapshot
    thread behind a kernel that no abort ended would hold the abandon for ever."""
    c, fd = child
    beat(c, fd, step=9)
    beat(c, fd, step=9, phase="leave")  # a new phase: progress
    assert c.hung(0.3) is None
    c.progress -= host.PROGRESS_FLOOR_S + 1
    assert c.hung(0.3).startswith("no progress leaving its generation for")
    beat(c, fd, step=9, phase="leave", waiting=True)  # a thread waits in a collective
    assert c.hung(0.3) is None
    beat(c, fd, step=9, phase="rejoin")  # waiting for its generation's ranks: liveness
    c.progress -= 1000
    assert c.hung(0.3) is None


def test_the_default_timeout_follows_the_step_time_above_a_floor(child):
    c, fd = child
    assert c.hung(None) is None  # starting: START_HANG_S before the first heartbeat
    beat(c, fd, step=1, step_s=0.001)
    c.beat -= host.HANG_FLOOR_S - 0.5
    assert c.hung(None) is None  # 10 x 1 ms is far below the floor
    c.beat -= 1.0
    assert c.hung(None) is not None
    beat(c, fd, step=2, step_s=1.0)  # slow steps: ten of them
    c.beat -= host.HANG_FLOOR_S + 1.0
    assert c.hung(None) is None
    c.beat -= host.HANG_FACTOR * 1.0
    assert c.hung(None) is not None


@pytest.mark.parametrize("phase", ["train", "done"])
def test_a_death_after_the_work_is_done_is_no_fault_and_a_death_before_is(phase):
    """A real process tells its host a phase, then dies of SIGKILL (as a C++ destructor's
    abort at exit would, after `Membership.done`). Replacing a process that had finished
    would start a newcomer that waits for peers who are gone."""
    read, write = os.pipe()
    line = json.dumps({"gen": 0, "step": 7, "phase": phase}) + "\n"
    process = subprocess.Popen(
        [sys.executable, "-c", "import os, signal, sys; os.write(int(sys.argv[1]), "
         "sys.argv[2].encode()); os.kill(os.getpid(), signal.SIGKILL)", str(write), line],
        pass_fds=(write,))
    os.close(write)
    c = host.Child(process, read)
    code = process.wait(timeout=60)
    c.read()
    c.close()
    assert code == -signal.SIGKILL and c.last["phase"] == phase
    if phase == "done":
        assert c.fault(code) is None
    else:
        assert c.fault(code) == f"process {process.pid} died (SIGKILL)"
    # Its own exits are never faults, but for the one that asks to be started again.
    assert c.fault(0) is None and c.fault(2) is None
    assert "lost a peer while it started" in c.fault(REJOIN_STATUS)


def test_a_prestarted_persist_process_waits_and_ends_unused_at_eof(monkeypatch):
    monkeypatch.delenv("MOC_CKPT_PRIORITY", raising=False)  # the default: low priority
    prestart.prestart()
    prestart.prestart()  # a no-op while one waits
    process = prestart.take()
    assert process is not None and process.poll() is None
    assert prestart.take() is None
    assert os.getpriority(os.PRIO_PROCESS, process.pid) >= 10  # low from its start
    process.stdin.close()  # its starter is done with it: EOF
    assert process.wait(timeout=60) == 0


def test_the_round_namespace_is_made_by_rank_0_and_read_by_every_other_host(monkeypatch):
    """Not torchrun's restart count, which each agent keeps for its own workers."""
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    made = host.agree_namespace(store, 0, agent=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert host.agree_namespace(store, 1, agent=False) == made
    assert made.startswith("round-") and made != host.agree_namespace(dist.HashStore(), 0,
                                                                       agent=False)
    # The agent's shared store outlives rounds: one node's count serves; across nodes
    # moc asks for a store per round, in one line.
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert host.agree_namespace(store, 0, agent=True) == "attempt-0"
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        host.agree_namespace(store, 0, agent=True)


def test_the_form_timeout_follows_the_step_time_with_a_floor():
    m = Membership.__new__(Membership)
    m.step_times, m.job_step_s = [], None
    assert m.form_timeout_s() == FORM_FLOOR_S  # nothing timed: the floor
    m.job_step_s = 2.0  # a newcomer: what the survivors left in the store
    assert m.form_timeout_s() == FORM_FACTOR * 2.0
    m.step_times = [0.01, 0.02, 0.03]
    assert m.form_timeout_s() == FORM_FLOOR_S


def test_recovery_is_in_job_for_more_than_one_rank_on_cpu_unless_asked_otherwise():
    cfg = TrainConfig.from_preset("tiny")
    assert (cfg.recovery, cfg.device) == ("auto", "cpu")
    assert (cfg.for_world(2).recovery, cfg.for_world(8).recovery) == ("in-job", "in-job")
    # On cuda in-job is asked for until it has run on GPUs (test_injob_nccl).
    assert TrainConfig.from_preset("tiny", device="cuda").for_world(2).recovery == "restart"
    # One rank gains nothing from a host; the DCP baselines cannot recover in-job.
    assert cfg.for_world(1).recovery == "restart"
    assert TrainConfig.from_preset("tiny", ckpt_mode="dcp-sync").for_world(2).recovery \
        == "restart"
    # What only in-job has asks for it, on one rank too; what is asked for is kept.
    for asks in ({"spares": 1}, {"hang_timeout": 5.0}, {"fault_kind": "hang"}):
        assert TrainConfig.from_preset("tiny", **asks).for_world(1).recovery == "in-job"
    assert TrainConfig.from_preset("tiny", recovery="restart").for_world(4).recovery \
        == "restart"
    assert TrainConfig.from_preset("tiny", recovery="in-job").for_world(1).recovery \
        == "in-job"


def test_a_standby_is_the_default_on_cuda_only_and_only_in_job():
    """A standby holds no CUDA context until it takes a rank's place: host memory only."""
    cpu, cuda = (TrainConfig.from_preset("tiny", device=d, recovery="in-job")
                 for d in ("cpu", "cuda"))
    assert (cpu.for_world(2).spares, cuda.for_world(2).spares) == (0, 1)
    auto = TrainConfig.from_preset("tiny", device="cuda")
    assert auto.for_world(1).spares == auto.for_world(2).spares == 0  # restart: no host
    assert TrainConfig.from_preset("tiny", device="cuda", spares=0).for_world(2).spares == 0
    with pytest.raises(ValueError, match="--spares and --hang-timeout are for --recovery"):
        TrainConfig.from_preset("tiny", recovery="restart", spares=1)


def test_a_lost_peer_is_told_in_its_first_sentence_without_gloo_s_source_location():
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
                        " Connection closed by peer [127.0.0.1]:1961. This may indicate a "
                        "possible application crash on rank 0 or a network set up issue.")
    assert first_line(gloo) == "Connection closed by peer [127.0.0.1]:1961"
    assert first_line(RuntimeError("[/x/pair.cc:537] Read error [127.0.0.1]:38634: "
                                   "Connection reset by peer")) \
        == "Read error [127.0.0.1]:38634: Connection reset by peer"
    assert first_line(RuntimeError("")) == "RuntimeError"


def _leases(token: str) -> dict[int, str]:
    """Node 1's two ranks' last leases, under a lost leader whose token is `token`."""
    return {2: f"{token}:17:0", 3: "other:17:0"}


def test_a_spare_lost_as_it_claims_a_machine_is_replaced_by_the_next_claim():
    """Issue 47, finding 4: the takeover key was named after the lost machine's last
    lease only, so a spare lost before its first lease renewal held the machine for
    ever: the job waited for its ranks every 30 s, and the other spare never adopted.
    A claim is now per attempt: the same loss found again (LOST_S after that claim, the
    node's leases still those of the dead machine) replaces it, and of several spares
    that find it so, one wins."""
    from moc.injob.machines import Claims

    store = dist.HashStore()
    dead, second, third = Claims(store, 2), Claims(store, 3), Claims(store, 4)
    assert dead.claim(1, _leases("lost"))  # then dies before it renews node 1's leases
    assert not second.claim(1, _leases("lost"))  # it sees the claim: someone adopts
    assert not third.claim(1, _leases("lost"))
    # LOST_S later the node is still lost: the claim it saw was a dead claimant's.
    results = [second.claim(1, _leases("lost")), third.claim(1, _leases("lost"))]
    assert sorted(results) == [False, True]  # one of them, never both
    # A later loss of node 1 (its new leader's lease) is a new claim.
    assert third.claim(1, _leases("successor")) or second.claim(1, _leases("successor"))


def test_a_live_claim_is_never_taken_from_its_claimant():
    """A spare that finds a claim for the first time never replaces it: only a claim it
    already saw, whose node stayed lost for a whole LOST_S since, is a dead one."""
    from moc.injob.machines import Claims

    store = dist.HashStore()
    first, other = Claims(store, 2), Claims(store, 3)
    assert first.claim(1, _leases("lost"))
    assert not other.claim(1, _leases("lost"))
    # The claimant's hosts renewed node 1's leases: the watch finds no loss, and a loss
    # found later is of the new leases (another key): the first claim stands.
    assert store.get("takeover/1/lost").decode().startswith("2:")


def test_a_prestarted_persist_process_stopped_with_its_starter_dies_with_it():
    """Issue 47, finding 7: a persist process started ahead of need and SIGSTOPped with
    the job outlived the finished job, still stopped (a stopped process never reads the
    EOF it waits for). It now gets SIGKILL when its starter ends, stopped or not."""
    starter = subprocess.run(
        [sys.executable, "-c", "import os, signal\n"
         "from moc.checkpoint.twolevel.persist import prestart\n"
         "prestart.prestart()\n"
         "p = prestart.take()\n"
         "os.kill(p.pid, signal.SIGSTOP)\n"
         "print(p.pid, flush=True)\n"
         "os._exit(0)  # no EOF sent by hand, no clean-up: as a killed process"],
        capture_output=True, text=True, timeout=120)
    assert starter.returncode == 0, starter.stderr[-2000:]
    pid = int(starter.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return  # gone (reaped by init)
        if state == "Z":
            return  # dead, awaiting its reaper
        time.sleep(0.1)
    raise AssertionError(f"the prestarted persist process {pid} outlived its starter "
                         f"(state {state})")


@pytest.mark.parametrize(("asked", "local_rank", "expected"),
                         [("1", "0", True), ("1", None, True), ("1", "1", False),
                          ("", "0", False), (None, "0", False)])
def test_a_persist_process_is_prestarted_only_by_a_node_leader_asked_to(monkeypatch, asked,
                                                                        local_rank, expected):
    """A node's persist process is started by its leader alone: a prestarted one on
    another rank was an interpreter importing torch beside the first steps, and never
    used (both ranks of a one-node `moc train` started one after their first step)."""
    for name, value in ((injob.ENV_PRESTART, asked), ("LOCAL_RANK", local_rank)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert injob.prestarts() is expected
