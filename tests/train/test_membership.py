"""A training process's membership when the job moves on without it (issue 40): a real
process with a real `Membership` on a real store, the test playing the rest of the job.

- the job finished while the process gathered a generation: it exits 0, as done;
- the job moved past the process's generation while the process waits on a peer that
  is gone (a store wait only the store's 300 s would end): it exits REJOIN_STATUS, and
  its host starts it again;
- the same while its training thread waits on the device (NCCL: a kernel spinning for a
  dead peer's data): the heartbeat thread aborts the communicators, the wait returns,
  and the training thread raises a lost peer instead of reporting the step; on gloo
  nothing is aborted, as before. No GPU here: a gloo group of one stands for the
  generation's groups and a recording function for ncclCommAbort."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from moc.injob.membership import (
    ENV_FD,
    ENV_GEN,
    ENV_NS,
    FINISHED,
    FORM_FLOOR_S,
    PREFIX,
    REJOIN_STATUS,
    gen_key,
    next_generation,
)

pytestmark = pytest.mark.integration

RANK_1 = """\
import datetime, sys
from moc.injob.membership import Membership
m = Membership(1, 2, step=lambda: 0)
if sys.argv[1] == "gather":
    m.join("gloo")  # rank 0 never comes
    sys.exit(3)
if sys.argv[1] == "wait":
    m.store.wait(["a-key-a-dead-peer-never-writes"], datetime.timedelta(seconds=240))
    sys.exit(4)
import threading
import torch.distributed as dist
from moc.injob import membership as injob
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
m.groups.backend = sys.argv[1]
released = threading.Event()
def abort(groups):  # ncclCommAbort: a kernel waiting for a dead peer's data returns
    print(f"aborted {len(groups)} group(s) from {threading.current_thread().name}",
          flush=True)
    released.set()
    return len(groups)
injob.abort_nccl = abort
print("waiting on the device", flush=True)
released.wait(240)  # the training thread in `.item()` behind an all-reduce
try:
    m.check()
except injob.PeerLost as e:
    print(f"lost a peer: {injob.lost_peer(e)}", flush=True)
    print(f"left for generation {m.leave()}, groups gone: {not dist.is_initialized()}",
          flush=True)
    sys.exit(5)
sys.exit(6)
"""


class Job:
    """The job's store, served here, and rank 1's training process on it."""

    def __init__(self, what: str) -> None:
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.store = dist.PrefixStore(f"{PREFIX}/test", self.server)
        self.beats, write = os.pipe()
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.server.port),
               ENV_NS: "test", ENV_FD: str(write), ENV_GEN: "0"}
        self.process = subprocess.Popen([sys.executable, "-c", RANK_1, what], env=env,
                                        pass_fds=(write,), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        os.close(write)

    def until(self, what: str, done) -> None:
        deadline = time.monotonic() + 120
        while not done():
            assert self.process.poll() is None, f"rank 1 ended before {what}: " + \
                self.process.stderr.read()
            assert time.monotonic() < deadline, f"no {what} in 120 s"
            time.sleep(0.05)

    def end(self) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout=120)
        finally:
            self.process.kill()
            os.close(self.beats)
        self.out = self.process.stdout.read()
        return code, self.process.stderr.read()


def test_a_process_gathering_when_the_job_finishes_ends_as_done():
    job = Job("gather")
    job.until("membership", lambda: job.store.check([f"{gen_key(0)}/member/1"]))
    job.store.set(FINISHED, "1")  # rank 0's host, once rank 0 ended with 0
    code, err = job.end()
    assert code == 0, err
    assert "the job finished while generation 0 gathered; nothing left to do" in err


def test_a_process_the_job_left_behind_ends_to_be_started_again():
    job = Job("wait")
    job.until("heartbeat", lambda: os.read(job.beats, 4096))
    began = time.monotonic()
    assert next_generation(job.store, 0) == 1  # a fault elsewhere moved the job on
    code, err = job.end()
    assert code == REJOIN_STATUS, err
    assert "stranded in generation 0 (the job is at 1)" in err
    assert "waiting on a peer that is gone; starting again" in err
    # Not before twice the form timeout (5 s floor: nothing timed): a process busy
    # following the job has that long to do so.
    assert time.monotonic() - began >= 2 * FORM_FLOOR_S


def test_an_nccl_rank_waiting_on_the_device_is_freed_when_the_job_moves_on():
    job = Job("nccl")
    assert job.process.stdout.readline() == "waiting on the device\n"
    assert next_generation(job.store, 0) == 1  # a fault elsewhere moved the job on
    code, err = job.end()
    assert code == 5, err
    # Aborted once, on a thread of its own; the training thread's step is a lost peer.
    assert job.out.splitlines() == ["aborted 1 group(s) from moc-injob-abort",
                                    "lost a peer: True",
                                    "left for generation 1, groups gone: True"], job.out
    assert ("the job moved to generation 1 while this rank waited in generation 0: "
            "aborted its 1 NCCL communicator(s)") in err


def test_a_gloo_rank_left_behind_aborts_nothing_and_starts_again_as_before():
    job = Job("gloo")
    assert job.process.stdout.readline() == "waiting on the device\n"
    assert next_generation(job.store, 0) == 1
    code, err = job.end()
    assert code == REJOIN_STATUS, err  # `_stranded`'s exit, after twice the form timeout
    assert "aborted" not in job.out and "NCCL" not in err
