"""The persist process and its protocol, with a real process and real shared memory:
two ranks' snapshots in, one committed step out, every message answered."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import complete_steps
from moc.checkpoint.tools import verify_checkpoints
from moc.checkpoint.twolevel.persist import PersistClient
from moc.checkpoint.twolevel.protocol import PERSIST_GONE, Failed, Persist, Ready
from moc.checkpoint.twolevel.slots import SnapshotStore, claim_job, job_dir

JOB = "persist-test"


@pytest.fixture
def clients(tmp_path):
    claim_job(JOB)
    rank0 = PersistClient(JOB, tmp_path / "ckpt", 0)  # starts the persist process
    rank1 = PersistClient(JOB, tmp_path / "ckpt", 1)
    yield rank0, rank1
    rank1.stop()
    rank0.stop()


def _snapshot(rank: int, step: int, slot: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s state at `step`, copied into its slot; returns it."""
    state = {f"param/w{rank}": torch.full((4,), float(step + rank)),
             "param/dense": torch.full((2,), float(step)), f"rng/rank={rank}": torch.arange(3)}
    SnapshotStore(JOB, rank).write(slot, step, state, {})
    return state


def _template(step: int) -> dict:
    return {"step": step, "mode": "moc", "layout": {"world_size": 2, "ep": 1},
            "model": {"config": "test"}, "extra": {"step": step}}


def test_a_step_is_committed_once_every_rank_reported_its_snapshot(clients, tmp_path):
    rank0 = clients[0]
    root = tmp_path / "ckpt"
    for rank, client in enumerate(clients):
        state = _snapshot(rank, 5, 0)
        write = [k for k in state if k != "param/dense" or rank == 0]  # dense: rank 0
        client.send(Ready(rank, 5, 0, write, list(state)))  # before the request: kept
    rank0.send(Persist(5, None, _template(5), world_size=2))
    (done,) = rank0.receive(5, block=True)
    assert done.ok and done.error is None and len(done.bytes_per_rank) == 2
    assert all(b > 0 for b in done.bytes_per_rank)
    manifest = Manifest.load(root, 5)
    assert set(manifest.entries) == {"param/w0", "param/w1", "param/dense", "rng/rank=0",
                                     "rng/rank=1"}
    assert manifest.entries["param/dense"].file == "rank-00000.safetensors"
    assert manifest.extra == {"step": 5} and verify_checkpoints(root).ok


def test_a_failed_snapshot_ends_its_persist_and_the_next_one_chains_on(clients, tmp_path):
    rank0, rank1 = clients
    root = tmp_path / "ckpt"
    done = {}
    for step, slot in ((5, 0), (6, 1), (7, 2)):
        rank0.send(Persist(step, None if step == 5 else 5, _template(step), world_size=2))
        state0 = _snapshot(0, step, slot)
        rank0.send(Ready(0, step, slot, list(state0), list(state0)))
        if step == 6:  # rank 1's copy of step 6 failed: never wait for it
            rank1.send(Failed(1, 6, "OSError: No space left on device"))
        else:
            # At step 7 rank 1 writes only its RNG: its weights stay at step 5's copy.
            state1 = _snapshot(1, step, slot)
            write = ["rng/rank=1"] if step == 7 else ["rng/rank=1", "param/w1"]
            rank1.send(Ready(1, step, slot, write, list(state1)))
        (done[step],) = rank0.receive(step, block=True)
    assert done[5].ok and done[7].ok and not done[6].ok
    assert done[6].error == ("rank 1's snapshot of step 6 failed: OSError: No space left "
                             "on device")
    assert complete_steps(root) == [5, 7]
    entries = Manifest.load(root, 7).entries
    assert entries["param/w1"].step == 5 and entries["param/w0"].step == 7
    assert verify_checkpoints(root).ok


def test_a_dead_persist_process_is_reported_gone_not_waited_for(clients):
    rank0, _ = clients
    rank0.send(Persist(5, None, _template(5), world_size=2))
    os.kill(rank0.process.pid, signal.SIGKILL)
    rank0.process.wait()
    (done,) = rank0.receive(5, block=True)
    assert (done.step, done.ok, done.error) == (5, False, PERSIST_GONE)
    assert rank0.alive is False


def test_the_process_stops_when_asked_and_leaves_the_job_dir_to_its_owner(tmp_path):
    claim_job(JOB)
    client = PersistClient(JOB, tmp_path / "ckpt", 0)
    client.stop()
    assert client.process.returncode == 0
    assert (job_dir(JOB) / "owner.pid").read_text() == str(os.getpid())
