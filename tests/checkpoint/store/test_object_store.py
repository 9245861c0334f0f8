"""Checkpoints in an object store: a real S3 API server (moto, a subprocess on
127.0.0.1), and fsspec's memory:// store.

The guarantees are the local directory's: a step is complete only when its manifest
exists, written last after every object is confirmed; a step without one is never read
and is cleaned up by the writer; retention deletes only what no restorable step reads;
verify reads every byte back; errors of the store surface, never swallowed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.liveness import ProcessId, start_time
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.store.backend import ObjectPath, open_root
from moc.checkpoint.store.lock import LOCK_FILE, DirectoryInUseError, DirectoryLock
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.retention import referenced_steps
from moc.checkpoint.store.steps import (
    FAULT_BEFORE_MANIFEST_ENV,
    MANIFEST,
    SUPERSEDED,
    complete_steps,
    object_steps,
    rank_file,
    step_dir,
)
from moc.checkpoint.sync import Checkpointer
from moc.checkpoint.tools import format_verify, inspect_checkpoints, verify_checkpoints
from moc.model import ModelConfig, Transformer
from tests.distributed import free_port
from tests.procs import UNSHARE_PIDS, can_unshare_pids, dead_pid

pytestmark = pytest.mark.filterwarnings(
    "ignore::moc.checkpoint.policy.tokens.RoutingNotRecordedWarning")

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)


def _build(seed: int) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Transformer(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: Transformer, opt: torch.optim.Optimizer, seed: int) -> torch.Tensor:
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
    out = model(idx, idx)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    return out.tokens_per_expert


def _assert_same(a: tuple, b: tuple) -> None:
    (ma, oa), (mb, ob) = a, b
    for (n, pa), (_, pb) in zip(ma.named_parameters(), mb.named_parameters(), strict=True):
        assert torch.equal(pa, pb), n
        for k in oa.state[pa]:
            assert torch.equal(oa.state[pa][k], ob.state[pb][k]), (n, k)


def _train_and_save(url: str, steps: int, **kw) -> tuple:
    model, opt = _build(0)
    ckpt = Checkpointer(model, opt, url, interval=1, **kw)
    for step in range(1, steps + 1):
        ckpt.record_routing(_step(model, opt, step))
        ckpt.save(step, {"step": step}, final=step == steps)
    ckpt.close()
    return model, opt


def _restored(url: str, **kw) -> tuple:
    fresh = _build(1)
    ckpt = Checkpointer(*fresh, url, **kw)
    report = ckpt.restore()
    ckpt.close()
    return report, fresh


# -- round trips ---------------------------------------------------------------------------


def test_sync_round_trip_on_s3_is_bitwise(s3_url):
    saved = _train_and_save(s3_url, 3, policy=PECPolicy(k=1))
    assert complete_steps(s3_url) == [1, 2, 3]
    report, fresh = _restored(s3_url, policy=PECPolicy(k=1))
    assert report.step == 3 and report.extra == {"step": 3}
    _assert_same(saved, fresh)
    # The layout is the local one, key for key; the lock is gone with the job.
    names = set(open_root(s3_url).listing())
    assert {f"step-0000000{s}/{n}" for s in (1, 2, 3)
            for n in (MANIFEST, rank_file(0))} <= names
    assert LOCK_FILE not in names and "moc-run.json" in names


def test_sync_round_trip_on_memory_store_is_bitwise():
    url = f"memory://moc-test-{os.getpid()}/run"
    saved = _train_and_save(url, 2)
    report, fresh = _restored(url)
    assert report.step == 2
    _assert_same(saved, fresh)
    assert verify_checkpoints(url).ok


@pytest.mark.integration  # the persist process is a real process, reaching the server
def test_two_level_persists_to_s3_from_the_persist_process_and_restores_bitwise(
        s3_url, tmp_path, monkeypatch):
    from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer

    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))  # node-local memory
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, s3_url, policy=PECPolicy(k=None), interval=2,
                                persist_policy="wait", k_snapshot="all")
    for step in range(1, 7):
        ckpt.wait_for_snapshot()
        ckpt.record_routing(_step(model, opt, step))
        ckpt.maybe_save(step, {"step": step})
    ckpt.flush()
    results = ckpt.drain_completed()
    ckpt.close()
    assert [r.step for r in results if r.error is None] == [2, 4, 6]
    assert complete_steps(s3_url) == [2, 4, 6]
    assert not any(k.startswith("shm") for k in open_root(s3_url).listing())
    report, fresh = _restored(s3_url)  # from storage: the sync engine reads the same format
    assert report.step == 6 and report.source == "storage"
    _assert_same((model, opt), fresh)


@pytest.mark.integration
def test_closing_after_a_partial_persist_of_the_newest_step_completes_it_on_s3(
        s3_url, tmp_path, monkeypatch):
    """close() persists the newest step again, complete, chained to that same step's
    partial manifest. On an object store beginning a step deletes its objects, manifest
    first, and the persist read the manifest it chains from only after that: the final
    checkpoint failed with "manifest is missing" (found while attacking issue 29)."""
    from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer

    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, s3_url, policy=PECPolicy(k=1), interval=2,
                                persist_policy="wait")
    for step in range(1, 5):
        ckpt.wait_for_snapshot()
        ckpt.record_routing(_step(model, opt, step))
        ckpt.maybe_save(step, {"step": step})
    ckpt.flush()
    assert Manifest.load(open_root(s3_url), 4).experts_saved["0"] != list(range(4))
    ckpt.close()  # the newest step again, with every expert
    manifest = Manifest.load(open_root(s3_url), 4)
    assert all(ids == list(range(4)) for ids in manifest.experts_saved.values())
    assert verify_checkpoints(s3_url).ok
    report, fresh = _restored(s3_url)
    assert report.step == 4
    _assert_same((model, opt), fresh)


@pytest.mark.integration
def test_a_persist_process_killed_before_the_manifest_leaves_that_step_unread(
        s3_url, tmp_path, monkeypatch):
    from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer

    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))
    monkeypatch.setenv(FAULT_BEFORE_MANIFEST_ENV, "4")  # inherited by the persist process
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, s3_url, policy=PECPolicy(k=None), interval=2,
                                persist_policy="wait", k_snapshot="all")
    first = ckpt.persist.process
    results = []
    for step in range(1, 9):
        ckpt.wait_for_snapshot()
        ckpt.record_routing(_step(model, opt, step))
        ckpt.maybe_save(step, {"step": step})
        results += ckpt.drain_completed()
    ckpt.flush()
    results += ckpt.drain_completed()
    root = open_root(s3_url)
    steps_before_close = complete_steps(s3_url)
    objects_of_4 = set(object_steps(root).get(4, {}))
    ckpt.close()
    assert first.returncode == -signal.SIGKILL  # killed itself at step 4's commit
    assert ckpt.persist.process is not first  # restarted for the steps after it
    assert {r.step: r.error is None for r in results} == {2: True, 4: False, 6: True,
                                                          8: True}
    assert steps_before_close == [2, 6, 8]
    # What the killed process left of step 4 went with the new process's first persist
    # (issue 40: a replaced persist process's orphans are tidied as at start).
    assert objects_of_4 == set()
    fresh = _build(1)
    again = Checkpointer(*fresh, s3_url, interval=1)
    report = again.restore()
    assert report.step == 8
    _assert_same((model, opt), fresh)
    again.close()
    assert 4 not in object_steps(root) and verify_checkpoints(s3_url).ok


# -- the commit protocol -------------------------------------------------------------------

CRASHING_SAVE = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("ignore")
    from tests.checkpoint.store.test_object_store import _train_and_save
    _train_and_save(sys.argv[1], 3)
""")


def test_a_crash_between_the_objects_and_the_manifest_leaves_the_step_unread(s3_url):
    env = {**os.environ, FAULT_BEFORE_MANIFEST_ENV: "3", "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", CRASHING_SAVE, s3_url], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    root = open_root(s3_url)
    # Step 3's object is in the store, confirmed, but without a manifest it is not a step.
    assert set(object_steps(root)[3]) == {rank_file(0)}
    assert complete_steps(s3_url) == [1, 2]
    assert (root / LOCK_FILE).is_file()  # SIGKILL: the lock object outlives its holder

    # The restart (same host, its holder gone) takes the lock over and restores step 2;
    # reading changes nothing, so step 3's abandoned objects stay until the first save,
    # which removes them before it writes.
    model, opt = _build(1)
    ckpt = Checkpointer(model, opt, s3_url, interval=1)
    report = ckpt.restore()
    assert report.step == 2
    assert set(object_steps(root)[3]) == {rank_file(0)}
    ckpt.save(4, {"step": 4})
    ckpt.close()
    assert 3 not in object_steps(root)
    assert complete_steps(s3_url) == [1, 2, 4]
    assert verify_checkpoints(s3_url).ok


def test_recommitting_a_step_replaces_it_whole(s3_url):
    saved = _train_and_save(s3_url, 2, policy=PECPolicy(k=1))
    first = (step_dir(open_root(s3_url), 2) / rank_file(0)).read_bytes()
    model, opt = _build(5)
    ckpt = Checkpointer(model, opt, s3_url, interval=1)
    ckpt.restore()  # a step is saved again only by the line that restored or saved it
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # a different state, committed again as step 2
    ckpt.save(2, {"step": 2}, final=True)
    ckpt.close()
    assert (step_dir(open_root(s3_url), 2) / rank_file(0)).read_bytes() != first
    report, fresh = _restored(s3_url)
    assert report.step == 2
    _assert_same((model, opt), fresh)
    assert not _same_state(saved, fresh)
    assert verify_checkpoints(s3_url).ok


def _same_state(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0].parameters(), b[0].parameters(),
                                                  strict=True))


def test_a_short_object_is_an_error_not_a_checkpoint(s3_url):
    obj = open_root(s3_url) / "probe.bin"
    obj.write_confirmed(b"x" * 100)
    obj.confirm(100)
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).pipe_file(obj.key, b"x" * 60)  # cut short
    with pytest.raises(OSError, match="100 bytes written but the store holds 60"):
        obj.confirm(100)
    with pytest.raises(OSError, match="the write was lost"):
        (open_root(s3_url) / "never-written").confirm(1)


# -- verify, inspect, retention ------------------------------------------------------------


def test_verify_on_s3_detects_a_flipped_byte(s3_url):
    _train_and_save(s3_url, 2)
    assert verify_checkpoints(s3_url).ok
    obj = step_dir(open_root(s3_url), 2) / rank_file(0)
    data = bytearray(obj.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's bytes: only its checksum can tell
    obj.write_confirmed(bytes(data))
    report = verify_checkpoints(s3_url)
    assert not report.ok
    assert report.damaged_steps == [2] and report.intact_steps == [1]
    assert list(report.bad_files) == ["step-00000002/rank-00000.safetensors"]
    assert "checksum mismatch" in format_verify(report)
    r = subprocess.run([sys.executable, "-m", "moc", "verify", s3_url], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "checksum mismatch" in r.stdout + r.stderr
    # Recovery agrees: the damaged step is skipped, the older one restored.
    report, _ = _restored(s3_url)
    assert report.step == 1


def _steps_2_and_4_with_4_corrupt(url: str) -> None:
    """Checkpoints of steps 2 and 4 (keep_last=2), then a flipped byte in step 4's data:
    the newest step is corrupt, the one before it intact."""
    model, opt = _build(0)
    ckpt = Checkpointer(model, opt, url, keep_last=2)
    for step in range(1, 5):
        ckpt.record_routing(_step(model, opt, step))
        if step % 2 == 0:
            ckpt.save(step, {"step": step})
    ckpt.close()
    assert complete_steps(url) == [2, 4]
    obj = step_dir(open_root(url), 4) / rank_file(0)
    data = bytearray(obj.read_bytes())
    data[-5] ^= 0x01
    obj.write_confirmed(bytes(data)) if isinstance(obj, ObjectPath) else obj.write_bytes(
        bytes(data))


@pytest.mark.parametrize("store", ["s3", "local"])
def test_a_corrupt_step_is_set_aside_so_retention_keeps_the_step_resumed_from(
        s3_url, tmp_path, store):
    """The attack: the newest step is corrupt, a run continues from the one before and
    commits a step below it with keep_last=1. Left in place, the corrupt step counted
    as the newest and retention deleted the only intact one (on an object store, which
    could not set it aside, until 2026-12-03)."""
    url = s3_url if store == "s3" else str(tmp_path / "ckpt")
    _steps_2_and_4_with_4_corrupt(url)
    # What an earlier set-aside of the same step number left (or a crash cut short).
    stale = open_root(url) / "step-00000004.corrupt" / "stale.txt"
    if store == "s3":
        stale.write_confirmed(b"older")
    else:
        stale.parent.mkdir()
        stale.write_text("older")

    model, opt = _build(1)
    ckpt = Checkpointer(model, opt, url, keep_last=1)
    assert ckpt.restore().step == 2
    assert complete_steps(url) == [2, 4]  # the read path changes nothing
    ckpt.record_routing(_step(model, opt, 3))
    ckpt.save(3, {"step": 3}, final=True)
    ckpt.close()
    saved = (model, opt)

    assert complete_steps(url) == [3]
    aside = open_root(url) / "step-00000004.corrupt"
    assert "checksum mismatch" in (aside / "CORRUPT.txt").read_text()
    assert (aside / MANIFEST).is_file()  # kept for inspection, never read again
    assert not stale.is_file()
    report, fresh = _restored(url)
    assert report.step == 3 and not report.skipped
    _assert_same(saved, fresh)


SET_ASIDE_THEN_DIE = textwrap.dedent("""
    import os, signal, sys
    from moc.checkpoint.store import backend
    from moc.checkpoint.store.steps import set_aside
    real_unlink = backend.ObjectPath.unlink

    def unlink(self, missing_ok=False):
        if self.key.endswith("step-00000004/manifest.json"):
            os.kill(os.getpid(), signal.SIGKILL)  # every object copied, the manifest kept
        real_unlink(self, missing_ok)

    backend.ObjectPath.unlink = unlink
    set_aside(backend.open_root(sys.argv[1]), 4, "checksum mismatch (test)")
""")


def test_a_set_aside_killed_before_the_manifest_goes_is_done_again_by_the_next_job(
        s3_url):
    """SIGKILL at the set-aside's worst moment: `step-4.corrupt/` holds a full copy and
    `step-4` still its manifest. The step is still complete and still corrupt, so the
    next job skips it again and sets it aside, and the intact step survives retention."""
    _steps_2_and_4_with_4_corrupt(s3_url)
    r = subprocess.run([sys.executable, "-c", SET_ASIDE_THEN_DIE, s3_url], timeout=120,
                       env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert complete_steps(s3_url) == [2, 4]
    assert (open_root(s3_url) / "step-00000004.corrupt" / MANIFEST).is_file()

    model, opt = _build(1)
    ckpt = Checkpointer(model, opt, s3_url, keep_last=1)
    assert ckpt.restore().step == 2
    ckpt.record_routing(_step(model, opt, 3))
    ckpt.save(3, {"step": 3}, final=True)
    ckpt.close()
    assert complete_steps(s3_url) == [3]
    aside = open_root(s3_url) / "step-00000004.corrupt"
    assert "checksum mismatch for key" in (aside / "CORRUPT.txt").read_text()
    report, fresh = _restored(s3_url)
    assert report.step == 3 and not report.skipped
    _assert_same((model, opt), fresh)


def test_inspect_on_s3_reads_the_manifests(s3_url):
    _train_and_save(s3_url, 2, policy=PECPolicy(k=1))
    info = inspect_checkpoints(s3_url)
    assert info["dir"] == s3_url and [s["step"] for s in info["steps"]] == [1, 2]
    r = subprocess.run([sys.executable, "-m", "moc", "inspect", s3_url, "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [s["step"] for s in json.loads(r.stdout)["steps"]] == [1, 2]


def test_retention_on_s3_deletes_only_what_no_restorable_step_reads(s3_url):
    model, opt = _build(0)
    ckpt = Checkpointer(model, opt, s3_url, policy=PECPolicy(k=1), interval=1, keep_last=2)
    for step in range(1, 11):
        ckpt.record_routing(_step(model, opt, step))
        ckpt.save(step, {"step": step})
        ckpt.parts.retention.wait()
    ckpt.close()
    root = open_root(s3_url)
    listed = object_steps(root)
    complete = sorted(s for s, n in listed.items() if MANIFEST in n)
    assert complete == [9, 10]
    needed = set().union(*(referenced_steps(Manifest.load(root, s)) for s in complete))
    assert set(listed) == needed  # everything read is there, nothing else is
    for s in needed - {9, 10}:
        assert set(listed[s]) == {SUPERSEDED, rank_file(0)}  # data only, demoted
    assert verify_checkpoints(s3_url).ok
    report, _ = _restored(s3_url, policy=PECPolicy(k=1))
    assert report.step == 10


# -- the lock and bad input ----------------------------------------------------------------

HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from moc.checkpoint.store.lock import DirectoryLock
    DirectoryLock.acquire(sys.argv[1])
    print("locked", flush=True)
    time.sleep(60)
""")


def test_a_second_job_on_the_same_prefix_is_refused_while_the_first_runs(s3_url):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, s3_url], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DirectoryInUseError, match=f"pid {holder.pid} on"):
            DirectoryLock.acquire(s3_url)
    finally:
        holder.kill()
        holder.wait()
    DirectoryLock.acquire(s3_url).release()  # its holder is gone: taken over, released
    assert not (open_root(s3_url) / LOCK_FILE).is_file()


def test_a_lock_object_of_another_host_is_not_broken(s3_url):
    lock = open_root(s3_url) / LOCK_FILE
    lock.write_confirmed(json.dumps({"host": "elsewhere", "pid": 1, "user": "u",
                                     "since": "then", "command": "moc train"}).encode())
    with pytest.raises(DirectoryInUseError, match=f"delete {lock}"):
        DirectoryLock.acquire(s3_url)


TRY_LOCK = textwrap.dedent("""
    import sys
    from moc.checkpoint.store.lock import DirectoryInUseError, DirectoryLock
    try:
        DirectoryLock.acquire(sys.argv[1])
    except DirectoryInUseError as e:
        print("refused:", e)
    else:
        print("taken over")
""")


@pytest.mark.skipif(not can_unshare_pids(), reason="needs unshare(1) with user namespaces")
def test_a_job_in_another_pid_namespace_does_not_take_a_live_lock_over(s3_url):
    """The attack: a second job in a container that shares the host name (host
    networking) but not the PID namespace. The holder's pid does not exist in there, so
    a check by host name and pid alone would call the live holder gone."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, s3_url], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = subprocess.run([*UNSHARE_PIDS, sys.executable, "-c",
                            TRY_LOCK, s3_url], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.stdout.startswith(f"refused: checkpoint directory {s3_url} is in use"), \
            r.stdout + r.stderr[-2000:]
        assert f"pid {holder.pid} on" in r.stdout
    finally:
        holder.kill()
        holder.wait()


def _plant_lock(url: str, **fields) -> ObjectPath:
    """A lock object as another process wrote it: this process's identity unless
    `fields` says otherwise."""
    lock = open_root(url) / LOCK_FILE
    info = {"host": socket.gethostname(), "user": "u", "since": "then",
            "command": "moc train", **ProcessId.of(os.getpid()).to_json(), "token": "theirs"}
    lock.write_confirmed(json.dumps({**info, **fields}).encode())
    return lock


@pytest.mark.parametrize("other", [
    # A container with host networking: same host name, its own PID namespace, so the
    # holder's pid does not exist here whether or not the holder runs.
    {"pid_ns": "pid:[1]"},
    # The same host name after a reboot, or another machine named alike.
    {"boot_id": "00000000-0000-0000-0000-000000000000"},
    # An older moc's lock, which recorded neither.
    {"boot_id": None, "pid_ns": None, "started": None},
], ids=["another-pid-namespace", "another-boot", "no-identity"])
def test_a_lock_whose_holder_cannot_be_proven_gone_is_not_broken(s3_url, other):
    lock = _plant_lock(s3_url, pid=dead_pid(), **other)
    with pytest.raises(DirectoryInUseError, match=f"delete {lock}"):
        DirectoryLock.acquire(s3_url)
    assert json.loads(lock.read_text())["token"] == "theirs"


def test_a_lock_whose_pid_now_names_another_process_is_taken_over(s3_url):
    """The pid was reused: a live process, but one started after the lock was written."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = start_time(other.pid)
        assert started is not None
        lock = _plant_lock(s3_url, pid=other.pid, started=started - 1)
        DirectoryLock.acquire(s3_url).release()
        assert not lock.is_file()
        # The same pid with its own start time is its holder: refused.
        _plant_lock(s3_url, pid=other.pid, started=started)
        with pytest.raises(DirectoryInUseError, match=f"pid {other.pid} on"):
            DirectoryLock.acquire(s3_url)
    finally:
        other.kill()
        other.wait()
    DirectoryLock.acquire(s3_url).release()  # now gone: taken over


def test_a_missing_bucket_is_a_clear_error(s3_url):
    url = "s3://no-such-bucket-moc/run"
    with pytest.raises(CheckpointError, match=r"no-such-bucket-moc.*bucket"):
        Checkpointer(*_build(0), url)


def test_an_endpoint_nobody_listens_on_is_a_clear_error(s3_url, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(CheckpointError, match="AWS_ENDPOINT_URL"):
        Checkpointer(*_build(0), s3_url)


def test_an_unknown_protocol_is_a_value_error():
    with pytest.raises(ValueError, match="nosuch://"):
        open_root("nosuch://bucket/run")
    assert open_root("file:///tmp/x") == open_root("/tmp/x")
    assert isinstance(open_root("memory://b/p"), ObjectPath)


def test_two_level_refuses_a_memory_store_its_persist_process_cannot_see(tmp_path,
                                                                        monkeypatch):
    from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer

    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))
    url = f"memory://moc-test-{os.getpid()}/two-level"
    with pytest.raises(ValueError, match="memory:// store lives in one process"):
        TwoLevelCheckpointer(*_build(0), url)
    DirectoryLock.acquire(url).release()  # the refused engine left no lock behind


def test_moc_train_refuses_a_dcp_baseline_on_an_object_store(s3_url):
    r = subprocess.run([sys.executable, "-m", "moc", "train", "--ckpt-mode", "dcp-sync",
                        "--ckpt-dir", s3_url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "writes a local directory" in r.stderr


def test_export_reads_a_checkpoint_on_s3_without_changing_it(s3_url, tmp_path):
    from safetensors.torch import load_file

    import moc

    model, _ = _train_and_save(s3_url, 3, policy=PECPolicy(k=1))
    before = open_root(s3_url).listing()
    report = moc.export(s3_url, tmp_path / "out", format="safetensors")
    assert report.step == 3 and not report.partial
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported[name], tensor), name
    assert open_root(s3_url).listing() == before  # read only
