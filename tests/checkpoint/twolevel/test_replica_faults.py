"""Replica rounds that go wrong on one side end on both sides, within a bounded time
(issue 29, items 6 and 7): a receiver with no room for the replica (a real small tmpfs),
a sender whose snapshot cannot be read mid-stream, a peer stopped by SIGSTOP mid-round.

Before: the receiver's room ran out after a failed reservation had left a sparse slot
file, the next receive into it failed with EFAULT and the sender waited for ever; a
sender's error escaped mid-stream and left its receiver waiting for ever; a stopped peer
hung the other side in gloo, which has no timeout on a send or receive.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moc.checkpoint.twolevel.memory.slots import SnapshotStore, slot_capacity
from moc.checkpoint.twolevel.replicas.replica import (
    ReplicaChannel,
    ReplicaChannelBroken,
    ReplicaStore,
)
from moc.checkpoint.twolevel.replicas.wire import exchange_replicas
from moc.checkpoint.twolevel.snapshot.capture import write_snapshot
from tests.distributed import _entry, free_port, rank_process, run_ranks
from tests.fs import tmpfs

pytestmark = pytest.mark.integration  # real gloo processes

JOB = "job"
CHUNK = 64 << 10
BIG = 256 << 10  # float32 elements: a 1 MB replica, 16 chunks


def _node(base: str, rank: int) -> None:
    """This process's node-local memory: its own root."""
    os.environ["MOC_SHM_ROOT"] = str(Path(base) / f"node{rank}")


def _big(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((BIG,), float(step)), "b": torch.arange(7.0) + step}


def _outgoing(store: SnapshotStore, slot: int, header):
    return header, store.read(slot, header, verify=False), list(header.entries)


def _held_steps(store: ReplicaStore) -> list[int]:
    """The steps of every complete replica, each read back with its digests checked."""
    out = []
    for slot, header in store.headers().items():
        store.read(slot, header, verify=True)
        out.append(header.step)
    return sorted(out)


# -- a receiver with no room -------------------------------------------------------------


def _no_room_rank(rank: int, world: int, base: str) -> dict:
    """Rank 0 sends a 1 MB replica each round; rank 1's node (a tmpfs with room for one
    replica slot, not two) receives them, and sends its own small one back."""
    _node(base, rank)
    group = dist.new_group(backend="gloo")
    own = SnapshotStore(JOB, rank)
    replicas = ReplicaStore(JOB, 1 - rank)
    rounds = []
    for i, step in enumerate((10, 20, 30)):
        state = _big(step) if rank == 0 else {"x": torch.arange(5) + step}
        header = write_snapshot(own, i % 3, step, state, {})
        t0 = time.monotonic()
        report = exchange_replicas(group, 1 - rank, 1 - rank, _outgoing(own, i % 3, header),
                                   replicas, chunk_bytes=CHUNK)
        rounds.append((report, time.monotonic() - t0, _held_steps(replicas)))
    return {"rounds": rounds}


def test_a_receiver_without_room_drains_the_stream_and_both_sides_go_on(tmp_path):
    """The first replica fits, the spare slot does not; every later replica is refused
    and drained, the newest complete one kept, and the sender never waits."""
    replica_slot = slot_capacity(BIG * 4 + 32)
    own_slots = 3 * slot_capacity(64)
    room = own_slots + replica_slot + (256 << 10)  # + headers and directories
    assert room < own_slots + 2 * replica_slot
    with tmpfs(tmp_path / "node1", f"{room >> 10}k"):
        sender, receiver = run_ranks(_no_room_rank, 2, str(tmp_path), timeout=120)
    (r10, _, held10), (r20, _, held20), (r30, _, held30) = receiver["rounds"]
    assert r10.step_received == 10 and held10 == [10]
    assert "the next one has no room" in r10.error and "No space left" in r10.error
    for report, held in ((r20, held20), (r30, held30)):
        assert report.step_received is None and held == [10]
        assert "no room for the replica of step" in report.error
        assert report.bytes_received == 4 * BIG + 32  # drained: every byte announced
        assert report.step_sent is not None  # its own small replica went out
    for report, _, held in sender["rounds"]:
        assert report.error is None and report.step_sent is not None and held  # rank 1's
    assert [h for *_, h in sender["rounds"]][-1] == [20, 30]


# -- a sender whose snapshot cannot be read ------------------------------------------------


class FailingRead(torch.Tensor):
    """A snapshot's bytes whose read fails after `ok` slices (as a slot on a failing
    device would): wraps the real tensor, fails only where the stream reads it."""

    ok = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            if cls.ok <= 0:
                raise OSError(5, "Input/output error")
            cls.ok -= 1
        return super().__torch_function__(func, types, args, kwargs or {})


def _bad_read_rank(rank: int, world: int, base: str) -> dict:
    """Round 1: rank 0's snapshot read fails after 5 of its 16 chunks. Round 2: good."""
    _node(base, rank)
    group = dist.new_group(backend="gloo")
    own = SnapshotStore(JOB, rank)
    replicas = ReplicaStore(JOB, 1 - rank)
    rounds = []
    for i, step in enumerate((10, 20)):
        header = write_snapshot(own, i, step, _big(step), {})
        header, views, keys = _outgoing(own, i, header)
        if rank == 0 and step == 10:
            FailingRead.ok = 5
            views = {k: v.as_subclass(FailingRead) for k, v in views.items()}
        report = exchange_replicas(group, 1 - rank, 1 - rank, (header, views, keys),
                                   replicas, chunk_bytes=CHUNK)
        rounds.append((report, _held_steps(replicas)))
    return {"rounds": rounds}


def test_a_sender_whose_snapshot_cannot_be_read_sends_zeros_and_is_refused(tmp_path):
    sender, receiver = run_ranks(_bad_read_rank, 2, str(tmp_path), timeout=120)
    (s10, _), (s20, _) = sender["rounds"]
    (r10, held10), (r20, held20) = receiver["rounds"]
    assert s10.step_sent is None and "cut short at byte" in s10.error
    assert "Input/output error" in s10.error and "the rest went as zeros" in s10.error
    assert s10.bytes_sent == r10.bytes_received == 4 * BIG + 32  # the whole stream
    assert r10.step_received is None and "checksum mismatch for 'w'" in r10.error
    assert held10 == []  # refused: never published
    assert s20.error is None and r20.error is None  # the channel goes on
    assert r20.step_received == 20 and held20 == [20]
    assert [r.step_received for r, _ in sender["rounds"]] == [10, 20]


# -- a peer stopped mid-round --------------------------------------------------------------

TIMEOUT_S = 3.0
PATTERN = 1.5


def _stopped_rank(rank: int, world: int, base: str) -> dict:
    """Rank 0 sends a 4 MB replica at 1 MB/s; the test stops rank 1 (SIGSTOP) once it
    arrives, and resumes it after rank 0 has given up."""
    _node(base, rank)
    channel = ReplicaChannel(dist.new_group(backend="gloo"), timeout_s=TIMEOUT_S)
    own = SnapshotStore(JOB, rank)
    replicas = ReplicaStore(JOB, 1 - rank)
    outgoing = None
    if rank == 0:
        header = write_snapshot(own, 0, 10, {"w": torch.full((1 << 20,), PATTERN)}, {})
        outgoing = _outgoing(own, 0, header)
    out: dict = {}
    t0 = time.monotonic()
    try:
        exchange_replicas(channel, 1 - rank, 1 - rank, outgoing, replicas, rate_Bps=1e6,
                          chunk_bytes=CHUNK)
    except ReplicaChannelBroken as e:
        out["error"] = str(e)
    out["seconds"] = time.monotonic() - t0
    out["broken"] = channel.broken
    t0 = time.monotonic()
    try:  # a later round on the broken channel: refused at once, nothing posted
        exchange_replicas(channel, 1 - rank, 1 - rank, None, replicas, chunk_bytes=CHUNK)
    except ReplicaChannelBroken as e:
        out["again"] = (str(e), time.monotonic() - t0)
    out["held"] = _held_steps(replicas)
    return out


def test_a_peer_stopped_mid_round_breaks_the_channel_on_both_sides_within_the_bound(
        tmp_path, monkeypatch):
    port = free_port()
    out = tmp_path / "out"
    out.mkdir()
    procs = [rank_process(_entry, _stopped_rank, r, 2, port, str(out),
                          (str(tmp_path),)) for r in range(2)]
    for p in procs:
        p.start()
    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "node1"))
    store = ReplicaStore(JOB, 0)
    pattern = torch.tensor([PATTERN]).view(torch.uint8).numpy().tobytes()
    try:
        deadline = time.monotonic() + 120
        arriving = False
        while not arriving:
            assert time.monotonic() < deadline, "the replica never started arriving"
            for err in out.glob("*.err"):
                pytest.fail(err.read_text())
            for slot in range(2):
                path = store.bin_path(slot)
                if path.exists():
                    with open(path, "rb") as f:
                        arriving = arriving or f.read(4) == pattern
            time.sleep(0.005)
        os.kill(procs[1].pid, signal.SIGSTOP)  # the receiving node stops answering
        procs[0].join(60)  # well past TIMEOUT_S: a hang would run for ever
        assert procs[0].exitcode == 0, (out / "rank0.err").read_text() if (
            out / "rank0.err").exists() else procs[0].exitcode
        os.kill(procs[1].pid, signal.SIGCONT)
        procs[1].join(60)
        assert procs[1].exitcode == 0, (out / "rank1.err").read_text() if (
            out / "rank1.err").exists() else procs[1].exitcode
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                os.kill(p.pid, signal.SIGKILL)
            p.join(30)
    sender, receiver = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2))
    for res in (sender, receiver):
        assert "the replica channel is broken" in res["error"] and res["broken"]
        message, seconds = res["again"]
        assert message == res["error"] and seconds < 1.0  # refused before any wait
    assert "no answer within" in sender["error"] or "failed" in sender["error"]
    assert sender["seconds"] < 60
    assert receiver["held"] == []  # the replica cut short was never published
