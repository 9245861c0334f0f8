"""In-job recovery on NCCL, the parts that run without a GPU: what counts as a lost peer
in NCCL's words, the settings and timeouts a training process gives its communicators,
when the heartbeat thread aborts them, and the one line that says it is unverified.

The NCCL messages below are torch's and NCCL's own texts, as their sources build them
(torch/csrc/distributed/c10d/NCCLUtils.{hpp,cpp}, ProcessGroupNCCL.cpp; NCCL's
ncclGetErrorString) and as jobs logged them."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from moc.injob import membership as injob
from moc.injob.membership import (
    COLLECTIVE_FACTOR,
    COLLECTIVE_FLOOR_S,
    ENV_FD,
    ENV_GEN,
    Communicators,
    Membership,
    PeerLost,
    abort_nccl,
    collective_timeout,
    first_line,
    form_options,
    lost_peer,
    nccl_backends,
    nccl_note,
    nccl_settings,
    set_nccl_timeout,
    should_abort,
)
from moc.topology import COLLECTIVE_TIMEOUT
from moc.train.config import TrainConfig

NCCL_VERSION = "NCCL version 2.21.5"
CHECK = "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, "
WATCHDOG = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=6463, "
            "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800017 "
            "milliseconds before timing out.")

LOST = {
    # NCCLComm::getNcclComm: a collective on a communicator the watchdog or moc aborted.
    "aborted": dist.DistBackendError("NCCL communicator was aborted on rank 1. "),
    "aborted, with the watchdog's reason": dist.DistBackendError(
        f"NCCL communicator was aborted on rank 0.  Original reason for failure was: "
        f"{WATCHDOG}"),
    # WorkNCCL::checkTimeout, raised by the work's wait() on the training thread.
    "watchdog timeout": dist.DistBackendError(WATCHDOG),
    # checkForNCCLErrorsInternal: a communicator's asynchronous error (a peer's death).
    "remote error": dist.DistBackendError(
        f"NCCL error: remote process exited or there was a network error, {NCCL_VERSION}\n"
        "ncclRemoteError: A call failed possibly due to a network error or a remote "
        "process exiting prematurely.\nLast error:\nNET/IB : Got completion from peer "
        "10.5.0.34<33956> with error 5, opcode 0, len 1, vendor err 244 (Recv)"),
    "error set by the process group": RuntimeError(
        f"NCCL communicator encountered error set by ProcessGroupNCCL: {WATCHDOG}"),
    # C10D_NCCL_CHECK around a call: a system error (a socket), NCCL < 2.13's peer death.
    "system error": dist.DistBackendError(
        f"{CHECK}unhandled system error (run with NCCL_DEBUG=INFO for details), "
        f"{NCCL_VERSION}\nncclSystemError: System call (e.g. socket, malloc) or external "
        "library call failed or device error. \nLast error:\nsocketPollConnect: connect "
        "returned No route to host"),
    "blocking wait": dist.DistBackendError(
        "[PG ID 0 PG GUID 0(default_pg) Rank 0] Work WorkNCCL(SeqNum=3, OpType=ALLREDUCE, "
        "NumelIn=1, NumelOut=1, Timeout(ms)=60000) timed out in blocking wait."),
    "non-blocking init": dist.DistBackendError(
        "NCCL timeout in communicator initialization."),
    "moc's own": PeerLost("the job moved past generation 3 while rank 1 waited on the "
                          "device: its NCCL communicators were aborted"),
}
NOT_LOST = {
    # A bug or this device's own fault: a re-formed generation would meet it again.
    "invalid usage": dist.DistBackendError(
        f"{CHECK}invalid usage (run with NCCL_DEBUG=WARN for details), {NCCL_VERSION}\n"
        "ncclInvalidUsage: This usually reflects invalid usage of NCCL library."),
    "cuda error": dist.DistBackendError(
        f"{CHECK}unhandled cuda error (run with NCCL_DEBUG=INFO for details), "
        f"{NCCL_VERSION}\nncclUnhandledCudaError: Call to CUDA function failed.\n"
        "Last error:\nCuda failure 'out of memory'"),
    "internal error": dist.DistBackendError(
        f"{CHECK}internal error - please report this issue to the NCCL developers, "
        f"{NCCL_VERSION}\nncclInternalError: Internal check failed."),
    "cuda out of memory": RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
}


@pytest.mark.parametrize("what", sorted(LOST))
def test_nccl_s_aborted_communicators_timeouts_and_remote_errors_are_lost_peers(what):
    assert lost_peer(LOST[what])
    try:  # as a checkpoint's collective meets one: the cause
        raise RuntimeError("the snapshot's plan failed") from LOST[what]
    except RuntimeError as chained:
        assert lost_peer(chained)


@pytest.mark.parametrize("what", sorted(NOT_LOST))
def test_nccl_s_usage_cuda_and_internal_errors_are_not(what):
    assert not lost_peer(NOT_LOST[what])


def test_gloo_s_lost_peers_are_still_lost_peers():
    assert lost_peer(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed "
                                  "by peer [127.0.0.1]:1234"))
    assert lost_peer(RuntimeError("[gloo] Timed out waiting 300000ms for recv operation"))
    assert not lost_peer(ValueError("Connection closed"))


def test_a_lost_nccl_peer_is_told_without_torch_s_source_location():
    assert first_line(LOST["system error"]) == (
        f"NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details), "
        f"{NCCL_VERSION}")
    assert first_line(LOST["aborted"]) == "NCCL communicator was aborted on rank 1"


def test_in_job_nccl_settings_are_applied_unless_given():
    assert nccl_settings({}) == injob.NCCL_SETTINGS
    # torchrun sets 1 for every worker: not a choice that can be told from the user's.
    assert nccl_settings({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == injob.NCCL_SETTINGS
    given = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
             "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "15000"}
    assert nccl_settings(given) == {}
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in nccl_settings(
        {"NCCL_ASYNC_ERROR_HANDLING": "0"})  # torch's older name
    assert injob.NCCL_SETTINGS["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly


def test_the_collective_timeout_follows_the_step_time_with_a_floor():
    assert collective_timeout(None) == COLLECTIVE_TIMEOUT  # nothing timed yet
    assert collective_timeout(0.05) == datetime.timedelta(seconds=COLLECTIVE_FLOOR_S)
    assert collective_timeout(30.0) == datetime.timedelta(seconds=COLLECTIVE_FACTOR * 30)


def test_nccl_forms_eagerly_on_its_device_and_gloo_as_before():
    import torch

    assert form_options("nccl", 1) == {"device_id": torch.device("cuda", 1)}
    assert form_options("gloo", 1) == {}


def test_the_heartbeat_aborts_nccl_once_when_the_job_moved_past_a_formed_generation():
    assert should_abort("nccl", formed=True, gen=2, current=3, aborted=None)
    assert should_abort("nccl", formed=True, gen=3, current=4, aborted=2)  # a later fault
    assert not should_abort("nccl", formed=True, gen=2, current=3, aborted=2)  # done once
    assert not should_abort("nccl", formed=True, gen=3, current=3, aborted=None)
    assert not should_abort("nccl", formed=False, gen=2, current=3, aborted=None)
    # gloo's collectives fail by themselves when a peer's sockets close: unchanged.
    assert not should_abort("gloo", formed=True, gen=2, current=3, aborted=None)
    assert not should_abort(None, formed=False, gen=0, current=1, aborted=None)


class FakeBackend:
    """What moc uses of a ProcessGroupNCCL backend, recorded."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self._name, self.calls = name, calls

    def name(self) -> str:
        return self._name

    def abort(self) -> None:
        self.calls.append(f"abort {self._name}")

    def _group_start(self) -> None:
        self.calls.append("group start")

    def _group_end(self) -> None:
        self.calls.append("group end")

    def _set_default_timeout(self, timeout: datetime.timedelta) -> None:
        self.calls.append(f"timeout {self._name} {timeout.total_seconds():g}")


class FakeGroup:
    def __init__(self, backend: FakeBackend | None) -> None:
        self.backend = backend

    def _get_backend(self, device):
        assert device.type == "cuda"
        if self.backend is None:
            raise RuntimeError("No backend type associated with device type cuda")
        return self.backend


def test_nccl_communicators_are_aborted_in_one_group_and_gloo_s_are_left():
    calls: list[str] = []
    groups = [FakeGroup(FakeBackend("nccl", calls)), FakeGroup(FakeBackend("gloo", calls)),
              FakeGroup(None), FakeGroup(FakeBackend("nccl", calls))]
    assert abort_nccl(groups) == 2
    assert calls == ["group start", "abort nccl", "abort nccl", "group end"]
    calls.clear()
    assert set_nccl_timeout(groups, datetime.timedelta(seconds=90)) == 2
    assert calls == ["timeout nccl 90", "timeout nccl 90"]
    assert abort_nccl([FakeGroup(FakeBackend("gloo", calls))]) == 0


def test_a_real_gloo_group_has_no_nccl_backend():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert nccl_backends(injob.live_groups()) == []
        assert len(injob.live_groups()) == 1
    finally:
        dist.destroy_process_group()
    assert injob.live_groups() == []


def test_free_aborts_once_on_its_own_thread_unless_the_training_thread_left_first(
        monkeypatch):
    aborted: list[int] = []
    said: list[str] = []
    monkeypatch.setattr(injob, "abort_nccl", lambda groups: aborted.append(len(groups)) or 3)
    groups = Communicators(said.append)
    groups.backend = "nccl"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        groups.free(2, 3, lambda: 2)
        assert groups.aborted == 2  # set before the abort: `check` sees it once freed
        _join_abort_threads()
        assert aborted == [1]
        assert said == ["the job moved to generation 3 while this rank waited in "
                        "generation 2: aborted its 3 NCCL communicator(s)"]
        groups.free(2, 3, lambda: 2)  # once per generation
        _join_abort_threads()
        assert aborted == [1]
        groups.free(4, 5, lambda: 5)  # the training thread left 4 meanwhile
        _join_abort_threads()
        assert aborted == [1] and groups.aborted == 4
    finally:
        dist.destroy_process_group()


def _join_abort_threads() -> None:
    import threading

    for thread in threading.enumerate():
        if thread.name == "moc-injob-abort":
            thread.join(timeout=60)
            assert not thread.is_alive()


def test_check_raises_a_lost_peer_only_for_the_generation_the_heartbeat_aborted():
    m = Membership.__new__(Membership)
    m.rank, m.gen, m.groups = 1, 3, Communicators(print)
    m.check()  # nothing aborted
    m.groups.aborted = 2
    m.check()  # an older generation's: this one left it
    m.groups.aborted = 3
    with pytest.raises(PeerLost, match="moved past generation 3") as caught:
        m.check()
    assert lost_peer(caught.value)


def test_the_unverified_line_is_rank_0_s_first_process_s_on_cuda_only():
    line = nccl_note("cuda", rank=0, gen=0)
    assert line is not None and "not yet verified" in line and "\n" not in line
    assert nccl_note("cuda", rank=1, gen=0) is None
    assert nccl_note("cuda", rank=0, gen=2) is None  # a replacement of rank 0
    assert nccl_note("cpu", rank=0, gen=0) is None


def test_auto_restarts_on_cuda_and_in_job_there_is_asked_for():
    cuda = TrainConfig.from_preset("tiny", device="cuda")
    assert cuda.for_world(2).recovery == "restart"
    assert cuda.for_world(2).spares == 0
    asked = TrainConfig.from_preset("tiny", device="cuda", recovery="in-job").for_world(2)
    assert (asked.recovery, asked.spares) == ("in-job", 1)
    for option in ({"spares": 1}, {"hang_timeout": 5.0}, {"fault_kind": "hang"}):
        assert TrainConfig.from_preset("tiny", device="cuda", **option).for_world(2) \
            .recovery == "in-job", option
    assert TrainConfig.from_preset("tiny", device="cpu").for_world(2).recovery == "in-job"


@pytest.mark.integration
@pytest.mark.parametrize("rank, says", [("0", True), ("1", False)])
def test_a_worker_in_job_on_cuda_says_once_that_it_is_unverified(rank, says, tmp_path):
    """The worker as its host starts it, on this machine without a GPU: rank 0 prints the
    line before anything else, then `--device cuda` is refused (exit 2)."""
    env = {**os.environ, "RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank,
           ENV_FD: "1", ENV_GEN: "0", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("MOC_INJOB_STANDBY", None)
    r = subprocess.run([sys.executable, "-m", "moc.train", "--device", "cuda", "--steps",
                        "2", "--no-progress", "--ckpt-mode", "none"], env=env,
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("not yet verified") == (1 if says else 0), r.stderr
    assert "--device cuda: torch sees no CUDA device here" in r.stderr
