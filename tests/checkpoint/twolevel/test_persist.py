"""The persist process and its protocol, with a real process and real shared memory:
two ranks' snapshots in, one committed step out, every message answered."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest
import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import complete_steps
from moc.checkpoint.store.storage import open_storage
from moc.checkpoint.tools import verify_checkpoints
from moc.checkpoint.twolevel.memory.jobdir import claim_job, job_dir, read_owner
from moc.checkpoint.twolevel.memory.slots import SnapshotStore
from moc.checkpoint.twolevel.persist.channel import read_secret, secret_path, socket_path
from moc.checkpoint.twolevel.persist.client import PersistClient
from moc.checkpoint.twolevel.persist.protocol import PERSIST_GONE, Failed, Persist, Ready
from moc.checkpoint.twolevel.snapshot.capture import write_snapshot
from tests.fs import fill, tmpfs

JOB = "persist-test"


@pytest.fixture
def clients(tmp_path):
    claim_job(JOB)
    rank0 = PersistClient(JOB, open_storage(tmp_path / "ckpt"), 0)  # starts the process
    rank1 = PersistClient(JOB, open_storage(tmp_path / "ckpt"), 1)
    yield rank0, rank1
    rank1.stop()
    rank0.stop()


def _snapshot(rank: int, step: int, slot: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s state at `step`, copied into its slot; returns it."""
    state = {f"param/w{rank}": torch.full((4,), float(step + rank)),
             "param/dense": torch.full((2,), float(step)), f"rng/rank={rank}": torch.arange(3)}
    write_snapshot(SnapshotStore(JOB, rank), slot, step, state, {})
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
    rank0.send(Persist(5, None, _template(5), node_ranks=2))
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
        rank0.send(Persist(step, None if step == 5 else 5, _template(step), node_ranks=2))
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
    rank0.send(Persist(5, None, _template(5), node_ranks=2))
    os.kill(rank0.process.pid, signal.SIGKILL)
    rank0.process.wait()
    (done,) = rank0.receive(5, block=True)
    assert (done.step, done.ok, done.error) == (5, False, PERSIST_GONE)
    assert rank0.alive is False


def test_the_process_stops_when_asked_and_leaves_the_job_dir_to_its_owner(tmp_path):
    claim_job(JOB)
    client = PersistClient(JOB, open_storage(tmp_path / "ckpt"), 0)
    client.stop()
    assert client.process.returncode == 0
    assert read_owner(job_dir(JOB)).pid == os.getpid()


# -- who may talk to the persist process (docs/THREAT_MODEL.md) ------------------------


class _Marker:
    """Unpickling this creates a file: the test of whether a payload ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_sent_to_the_persist_process_never_runs_and_it_keeps_serving(clients,
                                                                              tmp_path):
    marker = tmp_path / "pwned"
    # Even a client holding the secret (the worst case) cannot make it unpickle.
    evil = Client(socket_path(job_dir(JOB)), family="AF_UNIX",
                  authkey=read_secret(job_dir(JOB), None))
    evil.send(_Marker(str(marker)))  # send(): a pickle, as the old protocol spoke
    with pytest.raises(EOFError):
        evil.recv_bytes()  # dropped
    # Without the secret, the handshake fails and nothing is read at all.
    with pytest.raises(AuthenticationError):
        Client(socket_path(job_dir(JOB)), family="AF_UNIX", authkey=b"guessed")
    test_a_step_is_committed_once_every_rank_reported_its_snapshot(clients, tmp_path)
    assert not marker.exists()


def test_the_secret_is_new_for_each_process_and_only_this_users(tmp_path):
    claim_job(JOB)
    secrets = []
    for _ in range(2):
        client = PersistClient(JOB, open_storage(tmp_path / "ckpt"), 0)
        secrets.append(read_secret(job_dir(JOB), None))
        assert stat.S_IMODE(secret_path(job_dir(JOB)).stat().st_mode) == 0o600
        client.stop()
    assert secrets[0] != secrets[1] and len(secrets[0]) == 32


def _shadowed(tmp_path, module: str, body: str) -> str:
    """A PYTHONPATH entry whose `module` (a package) shadows the real one for processes
    started with it (this one has imported it already)."""
    pkg = tmp_path / "shadow" / module
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    return str(tmp_path / "shadow")


def _broken_torch(tmp_path, body: str) -> str:
    """A `torch` for the persist process alone: one that dies, or hangs, as it starts
    (it binds its socket first: `prestart.LISTEN_FIRST`)."""
    return _shadowed(tmp_path, "torch", body)


def test_a_persist_process_dead_at_start_is_one_clear_error(tmp_path, monkeypatch):
    """It dies before it listens (in the standard library's `queue`, which its listener
    imports, shadowed in that process alone). One that dies in torch's import instead
    may have admitted rank 0 already (it listens first): its first persist then ends
    as PERSIST_GONE, the restart path."""
    claim_job(JOB)
    monkeypatch.setenv("PYTHONPATH", _shadowed(tmp_path, "queue", "raise SystemExit(3)"))
    with pytest.raises(CheckpointError, match=r"persist process exited with code 3 as it "
                                              r"started, before rank 0 connected to "
                                              r".*persist.sock"):
        PersistClient(JOB, open_storage(tmp_path / "ckpt"), 0)


def test_a_persist_process_dead_in_its_import_is_a_clear_error_or_a_lost_persist(
        tmp_path, monkeypatch):
    """Torch's import fails in the persist process, which listens first: rank 0 is
    refused at once (it died before rank 0 was admitted), or admitted and its first
    persist ends as PERSIST_GONE (kept in memory, the process restarted for the next):
    never a persist that waits, nor one reported done."""
    claim_job(JOB)
    monkeypatch.setenv("PYTHONPATH", _broken_torch(tmp_path, "raise SystemExit(3)"))
    try:
        client = PersistClient(JOB, open_storage(tmp_path / "ckpt"), 0)
    except CheckpointError as e:
        assert "exited with code 3 as it started" in str(e)
        return
    try:
        client.send(Persist(5, None, _template(5), node_ranks=1))
        (done,) = client.receive(5, block=True)
        assert not done.ok and done.error == PERSIST_GONE
    finally:
        client.stop(at_once=True)


def test_a_persist_process_that_never_listens_is_killed_not_leaked(tmp_path, monkeypatch):
    """A process that hangs before it binds its socket (here: in the standard library's
    `queue`, which its listener imports, shadowed in that process alone) is killed once
    the connection timeout passes, and reaped."""
    claim_job(JOB)
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("PYTHONPATH", _shadowed(
        tmp_path, "queue", f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
                           "time.sleep(600)\n"))
    monkeypatch.setattr("moc.checkpoint.twolevel.persist.client.CONNECT_TIMEOUT_S", 2.0)
    with pytest.raises(CheckpointError, match=r"no persist process answered on .* within 2 s"):
        PersistClient(JOB, open_storage(tmp_path / "ckpt"), 0)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)  # killed and reaped


def test_a_persist_process_that_hangs_in_its_import_is_killed_at_close_not_leaked(
        tmp_path, monkeypatch):
    """A process that listens (it binds its socket before it imports torch:
    `prestart.LISTEN_FIRST`) and then hangs in torch's import admits rank 0, which goes
    on; closing it kills the process once STOP_TIMEOUT_S passes, and reaps it."""
    claim_job(JOB)
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("PYTHONPATH", _broken_torch(
        tmp_path, f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
                  "time.sleep(600)\n"))
    monkeypatch.setattr("moc.checkpoint.twolevel.persist.client.STOP_TIMEOUT_S", 2.0)
    client = PersistClient(JOB, open_storage(tmp_path / "ckpt"), 0)
    deadline = time.monotonic() + 60
    while not pidfile.exists():  # it is in torch's import
        assert time.monotonic() < deadline and client.process.poll() is None
        time.sleep(0.05)
    client.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)  # killed and reaped


def test_a_full_disk_names_the_file_and_the_bytes(tmp_path):
    """A real full file system (a small tmpfs, filled; it takes O_DIRECT, so this is
    the direct writer's path): the error says which file, how many bytes and what to
    do, not only `[Errno 28]`; and a write that failed for space is no reason to stop
    writing with O_DIRECT."""
    from moc.checkpoint.twolevel.persist import server as persist
    claim_job(JOB)
    state = _snapshot(0, 5, 0)
    ready = {0: Ready(0, 5, 0, list(state), list(state))}
    template = {**_template(5), "layout": {"world_size": 1, "ep": 1}}
    with tmpfs(tmp_path / "fs", size="1m") as fs:
        (fs / "ckpt").mkdir()
        fill(fs)
        cache = persist.PersistCache()
        done = persist._run(JOB, open_storage(fs / "ckpt"), Persist(5, None, template, 1),
                            ready, os.getppid(), cache=cache)
        assert not done.ok
        assert done.error == (
            f"OSError: [Errno 28] could not write {fs}/ckpt/step-00000005.tmp/"
            "rank-00000.safetensors (48 bytes of rank 0's tensors): No space left on "
            "device; free space on the checkpoint file system (or keep fewer checkpoints: "
            "--keep-last); the next checkpoint retries")
        assert cache.direct.supported
        (fs / "filler").unlink()  # space again: the same process persists the step
        done = persist._run(JOB, open_storage(fs / "ckpt"), Persist(5, None, template, 1),
                            ready, os.getppid(), cache=cache)
        assert done.ok, done.error
        assert verify_checkpoints(fs / "ckpt").ok


@pytest.mark.parametrize("how", ["replaced", "rewritten in place, mtime set back"])
def test_a_manifest_changed_between_persists_is_read_again_not_reused(clients, tmp_path,
                                                                       how):
    """The persist process keeps the manifest it committed last and builds the next on
    it; when that file is changed under it (a rollback's new chain, a hand edit, even one
    that sets the mtime back), the next commit builds on what is on disk now."""
    rank0, rank1 = clients
    root = tmp_path / "ckpt"

    def persist(step: int, prev: int | None, rank1_writes: list[str]) -> None:
        template = _template(step)
        template["extra"]["note"] = "x" * 16  # room to keep a rewrite at the same length
        rank0.send(Persist(step, prev, template, node_ranks=2))
        state0 = _snapshot(0, step, step % 3)
        rank0.send(Ready(0, step, step % 3, list(state0), list(state0)))
        state1 = _snapshot(1, step, step % 3)
        rank1.send(Ready(1, step, step % 3, rank1_writes, list(state1)))
        (done,) = rank0.receive(step, block=True)
        assert done.ok, done.error

    persist(4, None, ["rng/rank=1", "param/w1"])
    persist(5, 4, ["rng/rank=1", "param/w1"])
    # Step 5 changes under the process: its param/w1 is now step 4's copy (a valid
    # chain), the file of the same length.
    path = root / "step-00000005" / "manifest.json"
    text = path.read_text()
    d = json.loads(text)
    d["entries"]["param/w1"] = json.loads((root / "step-00000004" / "manifest.json"
                                           ).read_text())["entries"]["param/w1"]
    d["extra"]["note"] = ""
    d["extra"]["note"] = "x" * (len(text) - len(json.dumps(d, separators=(",", ":"))))
    new = json.dumps(d, separators=(",", ":"))
    assert len(new) == len(text)
    if how == "replaced":
        (tmp := path.with_suffix(".new")).write_text(new)
        os.replace(tmp, path)
    else:
        before = path.stat()
        with open(path, "r+") as f:
            f.write(new)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = path.stat()
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
            before.st_ino, before.st_size, before.st_mtime_ns)
    persist(6, 5, ["rng/rank=1"])  # rank 1's weights: from step 5's manifest
    assert Manifest.load(root, 6).entries["param/w1"].step == 4
    assert verify_checkpoints(root).ok
