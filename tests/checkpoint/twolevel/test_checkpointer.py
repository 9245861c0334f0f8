"""Two-level checkpointing in one process: snapshot, persist process, memory recovery."""

from __future__ import annotations

import os
import shutil
import signal
import sys

import pytest
import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.failures import CheckpointFailedError
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.store.steps import complete_steps, step_dir
from moc.checkpoint.tools import verify_checkpoints
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.checkpoint.twolevel.memory.jobdir import job_dir
from moc.checkpoint.twolevel.persist.protocol import PERSIST_GONE
from moc.model import ModelConfig, Transformer

pytestmark = pytest.mark.integration  # real processes: see README, Tests

CFG = ModelConfig(seq_len=8, d_model=32, n_layers=2, n_heads=2, d_ffn=64, n_experts=8)


def _build(seed: int):
    torch.manual_seed(seed)
    model = Transformer(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, ckpt, steps, start=1, final_at=None):
    records = []
    for step in range(start, start + steps):
        idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(step))
        out = model(idx, idx)
        out.loss.backward()
        ckpt.wait_for_snapshot()
        opt.step()
        opt.zero_grad()
        ckpt.record_routing(out.tokens_per_expert)
        ckpt.maybe_save(step, {"step": step}, final=step == final_at)
        records += ckpt.drain_completed()
    return records


def test_snapshots_persist_partially_and_a_crash_recovers_exactly_from_memory(tmp_path):
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=2,
                                persist_policy="wait")
    _train(model, opt, ckpt, 8)
    ckpt.flush()
    records = ckpt.drain_completed()
    ckpt.close(keep_snapshots=True)  # as after a crash: memory survives
    assert complete_steps(root) == [2, 4, 6, 8]
    assert verify_checkpoints(root).ok
    assert records and all(r.snapshot_s is not None and r.persist_s is not None
                           for r in records)

    fresh, fresh_opt = _build(1)
    resumed = TwoLevelCheckpointer(fresh, fresh_opt, root, policy=PECPolicy(k=1), interval=2)
    report = resumed.restore()
    assert (report.step, report.source, report.lost_tokens) == (8, "memory", 0)
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    for pa, pb in zip(model.parameters(), fresh.parameters(), strict=True):
        for k in opt.state[pa]:
            assert torch.equal(opt.state[pa][k], fresh_opt.state[pb][k])
    resumed.close()
    assert not job_dir(resumed.job).exists()  # a finished job leaves no shared memory


def test_without_memory_recovery_comes_from_storage_and_counts_lost_tokens(tmp_path):
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=2,
                                persist_policy="wait")
    _train(model, opt, ckpt, 6)
    ckpt.flush()
    shutil.rmtree(job_dir(ckpt.job))  # the node's memory is lost before the run ends
    ckpt.close()  # nothing left in memory to complete the newest checkpoint with
    resumed = TwoLevelCheckpointer(*_build(1), root, policy=PECPolicy(k=1))
    report = resumed.restore()
    resumed.close()
    assert (report.step, report.source) == (6, "storage")
    assert report.lost_tokens > 0


@pytest.mark.parametrize(("policy", "skipped"), [("skip", True), ("wait", False)])
def test_a_checkpoint_during_a_running_persist_skips_or_waits(tmp_path, monkeypatch,
                                                              policy, skipped):
    monkeypatch.setenv("MOC_PERSIST_STALL_S", "1.0")
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", interval=1,
                                persist_policy=policy)
    records = _train(model, opt, ckpt, 1)
    ckpt.wait_for_snapshot()  # step 1's plan has sent its persist
    # However slow this machine, step 1's persist is still running at step 2's plan: its
    # process is stopped (SIGSTOP) until then. "wait" blocks on it, so it is left alone.
    pid = ckpt.persist.process.pid
    if skipped:
        os.kill(pid, signal.SIGSTOP)
    try:
        records += _train(model, opt, ckpt, 1, start=2)
        ckpt.wait_for_snapshot()  # step 2's plan is done
    finally:
        os.kill(pid, signal.SIGCONT)
    ckpt.flush()
    records += ckpt.drain_completed()
    ckpt.close()
    by_step = {r.step: r for r in records}
    assert by_step[1].persist_skipped is False and by_step[1].persist_s >= 1.0
    assert by_step[2].persist_skipped is skipped
    # Skipped or not, close() leaves the newest snapshot durable on storage.
    assert complete_steps(tmp_path / "ckpt") == [1, 2]


def _kill_persist_after_step_1(model, opt, ckpt) -> list:
    """Train steps 1-2, SIGKILL the persist process, train steps 3-5; the records."""
    records = _train(model, opt, ckpt, 2)
    # "wait": step 2's snapshot waits for step 1's persist, so once it is taken step 1
    # is persisted.
    ckpt.wait_for_snapshot()
    os.kill(ckpt.persist.process.pid, signal.SIGKILL)
    ckpt.persist.process.wait()
    records += _train(model, opt, ckpt, 3, start=3)
    ckpt.flush()
    return records + ckpt.drain_completed()


def test_a_killed_persist_process_is_restarted_and_the_chain_goes_on(tmp_path):
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1,
                                persist_policy="wait")
    first = ckpt.persist.process
    by_step = {r.step: r for r in _kill_persist_after_step_1(model, opt, ckpt)}
    ckpt.close()
    assert by_step[1].error is None
    assert by_step[2].error in (None, PERSIST_GONE)  # its persist may have been killed
    assert all(by_step[s].error is None for s in (3, 4, 5))
    assert ckpt.persist.process is not first and ckpt.persist.generation == 1
    # A lost step 2 left no gap: step 3 chains from step 1 and writes what 2 would have.
    assert complete_steps(root)[-3:] == [3, 4, 5] and verify_checkpoints(root).ok
    assert not job_dir(ckpt.job).exists()  # everything durable: the memory is released


def test_a_persist_process_that_cannot_be_restarted_fails_the_job_but_keeps_memory(
        tmp_path, monkeypatch):
    monkeypatch.setattr("moc.checkpoint.twolevel.persist.client.MAX_RESTARTS", 0)
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    # max_failures=None: training may go on with memory snapshots (by default, three
    # checkpoints in a row that do not reach storage stop it: see the test below).
    ckpt = TwoLevelCheckpointer(model, opt, root, interval=1, persist_policy="wait",
                                max_failures=None)
    by_step = {r.step: r for r in _kill_persist_after_step_1(model, opt, ckpt)}
    # Training went on with memory snapshots, each reported as not persisted ...
    assert by_step[1].error is None
    assert all(by_step[s].error == PERSIST_GONE for s in (3, 4, 5))
    # ... but the job does not end as a success, nor delete the only copies.
    with pytest.raises(CheckpointError, match=r"could not be restarted.*after step [12] "
                                              r"reached shared memory only, kept in .*moc-"):
        ckpt.close()
    assert complete_steps(root) in ([1], [1, 2])
    assert job_dir(ckpt.job).exists()
    resumed = TwoLevelCheckpointer(*_build(1), root)
    report = resumed.restore()
    resumed.close()
    assert (report.step, report.source) == (5, "memory")


def test_by_default_checkpoints_stuck_in_memory_stop_the_run_after_max_failures(
        tmp_path, monkeypatch):
    monkeypatch.setattr("moc.checkpoint.twolevel.persist.client.MAX_RESTARTS", 0)
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", interval=1,
                                persist_policy="wait")
    with pytest.raises(CheckpointFailedError, match="3 checkpoints in a row failed"):
        _kill_persist_after_step_1(model, opt, ckpt)
    with pytest.raises(CheckpointError, match="could not be restarted"):
        ckpt.close()
    assert job_dir(ckpt.job).exists()  # the newest copies stay for a restart


def _train_keeping_copies(model, opt, ckpt, steps):
    copies, records = {}, []
    for step in range(1, steps + 1):
        records += _train(model, opt, ckpt, 1, start=step)
        copies[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return copies, records


def test_a_partial_snapshot_restores_each_expert_from_its_newest_copy(tmp_path):
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, policy=PECPolicy(k=1), interval=1,
                                persist_policy="wait", k_snapshot=2)
    copies, _ = _train_keeping_copies(model, opt, ckpt, 9)
    ckpt.close(keep_snapshots=True)
    fresh, fresh_opt = _build(1)
    resumed = TwoLevelCheckpointer(fresh, fresh_opt, root, policy=PECPolicy(k=1),
                                   k_snapshot=2)
    report = resumed.restore()
    assert (report.step, report.source) == (9, "memory")
    assert report.lost_tokens > 0  # some experts came from copies older than step 9
    params = dict(fresh.named_parameters())
    for name, p in params.items():
        if "experts" not in name:
            assert torch.equal(p, copies[9][name]), name
    w1 = params["layers.0.ffn.experts.w1_LDF"]
    sources = {}
    for e in range(8):
        matches = [s for s in range(1, 10)
                   if torch.equal(w1[e], copies[s]["layers.0.ffn.experts.w1_LDF"][e])]
        assert matches, f"expert {e} matches no saved step"
        sources[e] = max(matches)
    assert len({s for s in sources.values()}) > 1 and max(sources.values()) == 9
    resumed.close()


def test_auto_k_snapshot_measures_the_first_copies_and_keeps_the_best(tmp_path, monkeypatch):
    from moc.checkpoint.twolevel.snapshot import sizing as module
    choose_k = module.choose_k

    measured = []

    def recorded(header, seconds, window, *args, **kwargs):
        # The first copy measured as if starved (a thousand times slower: what one copy
        # run beside the chain's first persist looks like), the others with a window of
        # forward and backward long enough for all of it (this model's is shorter than
        # the plan). The starved one must not decide.
        if measured:
            window += 60.0
        else:
            seconds *= 1e3
        measured.append(choose_k(header, seconds, window, *args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(module, "choose_k", recorded)
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", policy=PECPolicy(k=2),
                                interval=1, persist_policy="wait", k_snapshot="auto")
    records = _train(model, opt, ckpt, 6)
    ckpt.flush()
    records += ckpt.drain_completed()
    ckpt.close()
    # The first three snapshots (complete) are measured, no later one; the choice is
    # the best they allowed, reported once, and every later snapshot uses it.
    assert len(measured) == module.AUTO_SAMPLES == 3
    assert [r.k_snapshot for r in records[:3]] == [8, 8, 8]
    chosen = [r.k_snapshot_chosen for r in records if r.k_snapshot_chosen]
    assert len(chosen) == 1
    choice = chosen[0]
    assert measured[0]["k_snapshot"] == 2  # the starved copy allowed only K_persist
    assert choice["k_snapshot"] == max(c["k_snapshot"] for c in measured) == 8
    assert choice["copy_Bps"] == max(c["copy_Bps"] for c in measured
                                     if c["k_snapshot"] == choice["k_snapshot"])
    assert choice["window_s"] > 0 and choice["copy_Bps"] > 0
    assert records[-1].k_snapshot == choice["k_snapshot"]


def test_snapshots_newer_than_the_restored_step_are_forgotten(tmp_path):
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, interval=1, persist_policy="wait")
    _train(model, opt, ckpt, 7)
    ckpt.close(keep_snapshots=True)
    store = ckpt.snapshots.store
    (slot7,) = [s for s, h in store.headers().items() if h.step == 7]
    raw = bytearray(store.bin_path(slot7).read_bytes())
    raw[100] ^= 0xFF  # step 7's snapshot no longer verifies, and its persisted copy
    store.bin_path(slot7).write_bytes(bytes(raw))  # is gone too
    shutil.rmtree(step_dir(root, 7))
    resumed = TwoLevelCheckpointer(*_build(1), root)
    report = resumed.restore()
    assert (report.step, report.source) == (6, "memory")
    assert max(h.step for h in resumed.snapshots.store.headers().values()) == 6
    resumed.close()


def test_snapshots_of_another_model_are_not_resumed(tmp_path):
    from moc.checkpoint.errors import IncompatibleCheckpointError

    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, interval=1, model_meta={"config": "a"})
    _train(model, opt, ckpt, 2)
    ckpt.close(keep_snapshots=True)
    other = TwoLevelCheckpointer(*_build(1), root, model_meta={"config": "b"})
    with pytest.raises(IncompatibleCheckpointError, match="config: checkpoint 'a' vs now 'b'"):
        other.restore()
    other.close()


def test_a_failed_snapshot_is_raised_once_and_the_chain_goes_on(tmp_path, monkeypatch):
    """A copy that fails (here: a full /dev/shm) raises once on the caller's thread, its
    persist is abandoned instead of waited for, and later checkpoints persist as usual."""
    from moc.checkpoint.errors import CheckpointError

    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, interval=1, persist_policy="wait")
    records = _train(model, opt, ckpt, 2)
    ckpt.wait_for_snapshot()  # step 2's copy is done before the shared memory "fills"
    real_open = ckpt.snapshots.store.open

    def full_shm(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.snapshots.store, "open", full_shm)
    ckpt.save(3, {"step": 3})
    with pytest.raises(CheckpointError, match=r"snapshot of step 3 failed.*No space left"):
        ckpt.wait_for_snapshot()
    assert ckpt.wait_for_snapshot() is None  # raised once, not at every later call
    monkeypatch.setattr(ckpt.snapshots.store, "open", real_open)
    records += _train(model, opt, ckpt, 2, start=4)
    ckpt.flush()
    records += ckpt.drain_completed()
    ckpt.close()
    assert sorted(r.step for r in records if r.error is None) == [1, 2, 4, 5]
    assert complete_steps(root) == [1, 2, 4, 5]
    assert verify_checkpoints(root).ok


@pytest.mark.parametrize("capture", ["split", "fused"])
def test_a_failed_seal_is_raised_once_and_the_chain_goes_on(tmp_path, monkeypatch, capture):
    """A header that cannot be written (a full /dev/shm) is raised once: split, the seal
    runs after training was let go, and the next call that waits for it raises; fused,
    the capture waits for the header, and `wait_for_snapshot` raises. Its persist is
    abandoned, the slot is no recovery source, and later checkpoints go on."""
    from moc.checkpoint.errors import CheckpointError
    from moc.checkpoint.twolevel.snapshot.capture import CAPTURE_ENV

    monkeypatch.setenv(CAPTURE_ENV, capture)
    root = tmp_path / "ckpt"
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, root, interval=1, persist_policy="wait")
    records = _train(model, opt, ckpt, 2)
    ckpt.flush()
    real_publish = ckpt.snapshots.store.publish

    def full_shm(slot, header):
        raise CheckpointError(f"cannot write the header of the snapshot of step "
                              f"{header.step}: No space left on device")

    monkeypatch.setattr(ckpt.snapshots.store, "publish", full_shm)
    ckpt.save(3, {"step": 3})
    with pytest.raises(CheckpointError, match=r"snapshot of step 3 failed.*No space left"):
        if capture == "split":
            ckpt.wait_for_snapshot()  # captured: training goes on, the seal fails behind
        ckpt.flush()
    ckpt.flush()  # raised once
    assert 3 not in {h.step for h in ckpt.snapshots.headers().values()}
    monkeypatch.setattr(ckpt.snapshots.store, "publish", real_publish)
    records += ckpt.drain_completed()
    records += _train(model, opt, ckpt, 2, start=4)
    ckpt.flush()
    records += ckpt.drain_completed()
    ckpt.close()
    assert sorted(r.step for r in records if r.error is None) == [1, 2, 4, 5]
    assert complete_steps(root) == [1, 2, 4, 5]
    assert verify_checkpoints(root).ok


def test_restore_in_the_middle_of_a_run_first_finishes_the_checkpoint_in_flight(tmp_path):
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", interval=1)
    _train(model, opt, ckpt, 3)  # step 3's snapshot and persist are still in flight
    with pytest.raises(ValueError, match="step 3 is already being checkpointed"):
        ckpt.save(3, {"step": 3})
    report = ckpt.restore()
    # Finished before the restore, not racing it: every record is complete now.
    assert [r.step for r in ckpt.drain_completed()][-1] == 3
    assert not ckpt.pending
    assert (report.step, report.source) == (3, "memory")
    ckpt.close()


def test_a_retention_error_learned_in_close_is_raised_by_close(tmp_path, monkeypatch):
    """The commit of the last checkpoint is learned in close()'s own flush; a retention
    error it meets has no later plan to travel with, and close() must raise it."""
    import moc.checkpoint.store.retention as retention
    from moc.checkpoint.errors import CheckpointError

    def full_disk(root, keep_last):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(retention, "apply_retention", full_disk)
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", policy=PECPolicy(k=1),
                                interval=1, persist_policy="wait", keep_last=1)
    _train(model, opt, ckpt, 2)
    with pytest.raises(CheckpointError, match=r"deleting old checkpoints.*No space left"):
        ckpt.close()
    assert not job_dir(ckpt.job).exists()  # cleaned up all the same


def _scheduling(tid: int) -> tuple[int, int]:
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread scheduling")
def test_the_snapshot_thread_runs_in_sched_idle_the_persist_process_niced_training_as_it_was(
        tmp_path, monkeypatch):
    monkeypatch.delenv("MOC_CKPT_PRIORITY", raising=False)  # the default (tests: normal)
    # Checkpoint work yields a core to training (`worker.lower_thread_priority`); the
    # training thread keeps whatever class and niceness it was started with. A persist
    # process restarted from the snapshot thread (SCHED_IDLE, which a child inherits and
    # cannot leave) is niced like the first, not idle.
    import threading

    me = threading.get_native_id()
    before = _scheduling(me)
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", policy=PECPolicy(k=1),
                                interval=1, persist_policy="wait")
    try:
        first = ckpt.persist.process
        records = _kill_persist_after_step_1(model, opt, ckpt)
        ckpt.flush()
        assert ckpt.persist.process is not first and not records[-1].error
        assert os.sched_getscheduler(ckpt.snapshots.worker.thread.native_id) == os.SCHED_IDLE
        assert _scheduling(ckpt.persist.process.pid) == (os.SCHED_OTHER, 19)
        assert _scheduling(me) == before
    finally:
        ckpt.close()


@pytest.mark.parametrize(("value", "niceness"), [("nice", 10), ("normal", None)])
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread scheduling")
def test_moc_ckpt_priority_sets_how_checkpoint_work_is_scheduled(tmp_path, monkeypatch,
                                                                 value, niceness):
    # "nice": moc's scheduling before SCHED_IDLE; "normal": training's own.
    import threading

    monkeypatch.setenv("MOC_CKPT_PRIORITY", value)
    before = _scheduling(threading.get_native_id())
    snapshot = (before[0], max(before[1], niceness)) if niceness else None
    model, opt = _build(0)
    ckpt = TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", policy=PECPolicy(k=1),
                                interval=1, persist_policy="wait")
    try:
        _train(model, opt, ckpt, 2)
        ckpt.flush()
        expected = snapshot or before
        assert _scheduling(ckpt.snapshots.worker.thread.native_id) == expected
        assert _scheduling(ckpt.persist.process.pid) == (snapshot or before)
    finally:
        ckpt.close()


def test_an_unknown_moc_ckpt_priority_is_refused_before_anything_starts(tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("MOC_CKPT_PRIORITY", "low")
    model, opt = _build(0)
    with pytest.raises(ValueError, match=r"MOC_CKPT_PRIORITY='low': expected one of idle, "
                                         r"nice, normal"):
        TwoLevelCheckpointer(model, opt, tmp_path / "ckpt", policy=PECPolicy(k=1))
