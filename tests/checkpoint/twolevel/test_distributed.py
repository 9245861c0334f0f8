"""Two-level recovery on real ranks: one rank's snapshot is gone, the other's is not."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from moc.checkpoint.liveness import ProcessId
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.twolevel.checkpointer import TwoLevelCheckpointer
from moc.checkpoint.twolevel.memory.jobdir import OWNER, default_job_id, job_dir
from moc.parallel import clip_grad_norm_, sync_gradients
from tests.distributed import build_sharded, ranks_parent, run_ranks

pytestmark = pytest.mark.integration  # real processes: see README, Tests


def _train(rank: int, world: int, root: str, policy: PECPolicy | None = None,
           k_snapshot: int | None = None) -> dict[str, torch.Tensor]:
    groups, model, opt = build_sharded(1)  # every expert replicated
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups,
                                policy=policy or PECPolicy(k=1), interval=1,
                                persist_policy="wait", k_snapshot=k_snapshot)
    for step in range(1, 5):
        idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(10 * step
                                                                                     + rank))
        out = model(idx, idx)
        out.loss.backward()
        sync_gradients(model, groups)
        clip_grad_norm_(model, groups, 1.0)
        ckpt.wait_for_snapshot()
        opt.step()
        model.zero_grad()
        ckpt.record_routing(out.tokens_per_expert)
        ckpt.maybe_save(step, {"step": step})
    ckpt.close(keep_snapshots=True)
    return {**{n: p.detach().clone() for n, p in model.named_parameters()},
            **_optimizer_state(model, opt)}


def _optimizer_state(model, opt) -> dict[str, torch.Tensor]:
    from moc.checkpoint.optimizers import as_optimizer_state

    return {f"optim/{name}/{k}": v.clone() for name, state in
            as_optimizer_state(opt, model).local_state().items() for k, v in state.items()}


def _restore(rank: int, world: int, root: str) -> dict:
    groups, model, opt = build_sharded(1)  # every expert replicated
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1))
    report = ckpt.restore()
    ckpt.close()
    return {"step": report.step, "source": report.source, "lost": report.lost_tokens,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "optim": _optimizer_state(model, opt)}


def test_a_rank_without_its_snapshot_restores_from_storage_and_replicas_agree(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = run_ranks(_train, 2, root)
    shutil.rmtree(job_dir(default_job_id(root)) / "rank-00001")  # rank 1 lost its memory
    results = run_ranks(_restore, 2, root)
    for rank, res in enumerate(results):
        assert (res["step"], res["source"]) == (4, "mixed")
        assert res["lost"] == 0  # every expert came back from rank 0's memory
        for name, p in res["params"].items():
            assert torch.equal(p, saved[0][name]), name
        # Their optimizer state too (issue 47, finding 1: rank 1 kept the stale moments
        # of K = 1 storage, while the restore said 0 tokens lost).
        assert res["optim"].keys() == {k for k in saved[rank] if k.startswith("optim/")}
        for key, t in res["optim"].items():
            assert torch.equal(t, saved[rank][key]), key


def _train_step(groups, model, opt, ckpt, step: int) -> None:
    """One training step of the same batch on every rank, and its checkpoint."""
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(step))
    out = model(idx, idx)
    out.loss.backward()
    sync_gradients(model, groups)
    ckpt.wait_for_snapshot()
    opt.step()
    model.zero_grad()
    ckpt.record_routing(out.tokens_per_expert)
    ckpt.maybe_save(step, {"step": step})


def _train_then_crash(rank: int, world: int, root: str) -> dict[int, dict]:
    """Four steps, K = 1 on storage and complete snapshots in memory, then the engine
    abandoned as a crash leaves it: storage's newest step is partial, memory's whole.
    The state each rank had at steps 3 and 4."""
    groups, model, opt = build_sharded(1)
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                interval=1, persist_policy="wait")
    states = {}
    for step in range(1, 5):
        _train_step(groups, model, opt, ckpt, step)
        states[step] = {**{n: p.detach().clone() for n, p in model.named_parameters()},
                        **_optimizer_state(model, opt)}
    ckpt.flush()
    ckpt.abandon()
    return {step: states[step] for step in (3, 4)}


def _restore_from(rank: int, world: int, root: str, job: str) -> dict:
    groups, model, opt = build_sharded(1)
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                job=job)
    r = ckpt.restore()
    ckpt.close()
    return {"step": r.step, "source": r.source, "lost": r.lost_tokens,
            "per_layer": r.lost_per_layer, "optim": _optimizer_state(model, opt),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_a_rank_left_with_stale_optimizer_state_is_counted_as_lost(tmp_path):
    """Issue 47, finding 1: a rank restored from partial storage took its replicas'
    fresh weights, but kept the stale state of the expert moments it owns (ZeRO shards
    them over the replicas: no other rank holds them), and the restore said "mixed,
    0 expert tokens lost" while every later loss differed. Now the tokens that state
    lost are counted: the same count as restoring every rank from that storage step."""

    root = tmp_path / "ckpt"
    saved = [r[4] for r in run_ranks(_train_then_crash, 2, str(root))]
    memory = job_dir(default_job_id(root))
    (memory / OWNER).write_text(json.dumps(ProcessId.of(ranks_parent()).to_json()))
    for name, wipe in (("mixed", "rank-00001"), ("storage", None)):
        shutil.copytree(root, tmp_path / name)
        if wipe is not None:
            shutil.copytree(memory, job_dir(f"stale-{name}"),
                            ignore=shutil.ignore_patterns("*.sock"))
            shutil.rmtree(job_dir(f"stale-{name}") / wipe)
    try:
        mixed = run_ranks(_restore_from, 2, str(tmp_path / "mixed"), "stale-mixed")
        storage = run_ranks(_restore_from, 2, str(tmp_path / "storage"), "stale-storage")
    finally:
        shutil.rmtree(job_dir("stale-mixed"), ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    assert [r["source"] for r in mixed] == ["mixed", "mixed"]
    assert [r["source"] for r in storage] == ["storage", "storage"]
    # Rank 0's own memory is exact; rank 1 owns the moments of w2 (`build_sharded`'s
    # ZeRO partition) and has them only from storage, where 3 of 4 experts per layer
    # are older than step 4.
    assert any("w2" in k for k in saved[1] if k.startswith("optim/"))
    for key, t in mixed[0]["optim"].items():
        assert torch.equal(t, saved[0][key]), key
    stale = [k for k, t in mixed[1]["optim"].items() if not torch.equal(t, saved[1][k])]
    assert stale and all("w2" in k for k in stale), stale
    for name, p in mixed[1]["params"].items():  # the weights are the fresh replica's
        assert torch.equal(p, saved[0][name]), name
    # Counted by hand from the manifest: every expert whose copy on storage is older
    # than step 4 lost the tokens routed to it since that copy.
    manifest = Manifest.load(tmp_path / "storage", 4)
    tokens = manifest.tokens
    by_hand = [sum(c - a for c, a in zip(cum, at, strict=True))
               for cum, at in zip(tokens["cumulative"], tokens["at_save"], strict=True)]
    assert sum(by_hand) > 0
    for r in (*mixed, *storage):
        assert (r["step"], r["lost"], list(r["per_layer"])) == (4, sum(by_hand), by_hand)


def _restore_preferring(rank: int, world: int, root: str, job: str, prefer: str) -> dict:
    groups, model, opt = build_sharded(1)
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                job=job, prefer=prefer)
    r = ckpt.restore()
    ckpt.close()
    return {"step": r.step, "source": r.source, "lost": r.lost_tokens,
            "passed_over": r.passed_over, "optim": _optimizer_state(model, opt),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_a_flipped_bit_in_the_newest_snapshot_restores_the_exact_step_before(tmp_path):
    """Issue 47, findings 2 and 3: rank 1's newest snapshot (step 4) fails its checksum;
    storage's step 4 is partial (K = 1). Every rank has an exact copy of step 3 in
    memory. Before, the whole job restored partial storage (tokens lost) as soon as one
    copy failed, and a snapshot older than storage's newest step was never a candidate.
    Now the exact step 3 is taken, bitwise, the newer step is set aside, and the line
    says what the other choice would have cost; `prefer="newest"` takes step 4, with
    rank 1 from storage, and counts what that loses."""

    from moc.checkpoint.store.steps import complete_steps
    from moc.checkpoint.twolevel.memory.slots import SnapshotStore

    root = tmp_path / "ckpt"
    at_3 = [r[3] for r in run_ranks(_train_then_crash, 2, str(root))]
    memory = job_dir(default_job_id(root))
    (memory / OWNER).write_text(json.dumps(ProcessId.of(ranks_parent()).to_json()))
    store = SnapshotStore(default_job_id(root), 1)
    (slot,) = [i for i, h in store.headers().items() if h.step == 4]
    store.release()
    data = memory / "rank-00001" / f"slot-{slot}.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    results = {}
    for prefer in ("newest", "exact"):
        shutil.copytree(root, tmp_path / prefer)
        shutil.copytree(memory, job_dir(f"flip-{prefer}"),
                        ignore=shutil.ignore_patterns("*.sock"))
    try:
        for prefer in ("newest", "exact"):
            results[prefer] = run_ranks(_restore_preferring, 2, str(tmp_path / prefer),
                                        f"flip-{prefer}", prefer)
    finally:
        for prefer in ("newest", "exact"):
            shutil.rmtree(job_dir(f"flip-{prefer}"), ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    newest = results["newest"]
    assert [(r["step"], r["source"], r["passed_over"]) for r in newest] == [
        (4, "mixed", None)] * 2
    assert newest[0]["lost"] > 0  # rank 1's experts older than step 4, from storage
    # What the newer choice could lose, counted by hand from storage's step 4: every
    # expert's tokens since its copy there. Rank 0's own snapshot lost nothing, so
    # `prefer="newest"` lost less than that bound, never more.
    tokens = Manifest.load(tmp_path / "newest", 4).tokens
    bound = sum(c - a for cum, at in zip(tokens["cumulative"], tokens["at_save"], strict=True)
                for c, a in zip(cum, at, strict=True))
    assert 0 < newest[0]["lost"] <= bound
    exact = results["exact"]
    for rank, r in enumerate(exact):
        assert (r["step"], r["source"], r["lost"]) == (3, "memory", 0)
        assert r["passed_over"] == (
            "step 4 is newer, but rank(s) [1] have only a partial copy of it (experts "
            f"older than it: up to {bound} expert tokens would be lost); step 3 is "
            "exact on every rank, 1 step(s) to train again")
        for name, t in {**r["params"], **r["optim"]}.items():
            assert torch.equal(t, at_3[rank][name]), (rank, name)
    # The line goes on from step 3: step 4 is set aside, as a rollback's.
    assert complete_steps(tmp_path / "exact")[-1] == 3
    assert (tmp_path / "exact" / "step-00000004.rolledback").is_dir()


LOSSY = PECPolicy(k=1, dynamic_k=True, plt_threshold=0.01)
"""K = 1 of 4 experts per layer and a 1% budget: a recovery from partial copies loses
tokens, and Dynamic-K raises K."""
SOURCES = {"memory": None, "storage": "", "mixed": "rank-00001"}
"""How much of the node's memory each recovery finds: all, none, all but rank 1's."""


def _restore_each(rank: int, world: int, base: str) -> dict:
    out = {}
    for name in SOURCES:
        groups, model, opt = build_sharded(1)
        ckpt = TwoLevelCheckpointer(model, opt, f"{base}/{name}", groups=groups,
                                    policy=LOSSY, job=f"three-{name}", k_snapshot=1)
        r = ckpt.restore()
        ckpt.close()
        out[name] = {"report": (r.source, r.step, r.plt, r.lost_tokens, r.lost_per_layer,
                                r.k_before, r.k),
                     "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


def test_memory_storage_and_mixed_recovery_account_the_same_fault_alike(tmp_path):
    """The same fault recovered from memory, from storage and from both (each rank from
    what survived) reports the same step, PLT, lost tokens and K: every kind of recovery
    accounts through the one token ledger. With K_snapshot = K_persist = 1 and the wait
    policy a snapshot holds exactly the copies that reach storage, so all three restore
    the same state, and lose the same tokens."""

    root = tmp_path / "ckpt"
    run_ranks(_train, 2, str(root), LOSSY, 1)
    for name, wipe in SOURCES.items():
        shutil.copytree(root, tmp_path / name)
        memory = job_dir(f"three-{name}")
        shutil.copytree(job_dir(default_job_id(root)), memory,
                        ignore=shutil.ignore_patterns("*.sock"))  # the persist's, closed
        # Alive (the ranks' parent): not a stale job.
        (memory / OWNER).write_text(json.dumps(ProcessId.of(ranks_parent()).to_json()))
        if wipe is not None:
            shutil.rmtree(memory / wipe)
    for res in run_ranks(_restore_each, 2, str(tmp_path)):
        reports = {name: r["report"] for name, r in res.items()}
        assert [r[0] for r in reports.values()] == list(SOURCES)
        _, step, plt, lost, per_layer, k_before, k = reports["storage"]
        assert step == 4 and lost > 0 and sum(per_layer) == lost and plt > 0.01
        assert (k_before, k) == (1, 2)  # Dynamic-K: over budget, K doubles
        for name, report in reports.items():
            assert report[1:] == reports["storage"][1:], name
            for n, p in res[name]["params"].items():
                assert torch.equal(p, res["storage"]["params"][n]), (name, n)


def _save_while_the_peer_is_late(rank: int, world: int, root: str) -> dict:
    groups, model, opt = build_sharded(1)
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                interval=1)
    out = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    out.loss.backward()
    opt.step()
    ckpt.record_routing(out.tokens_per_expert)
    marker = Path(root) / "rank-0-save-returned"
    seen = None
    if rank == 0:
        ckpt.save(1, {"step": 1})  # its collective waits for rank 1; save() must not
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    else:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = marker.exists()
        ckpt.save(1, {"step": 1})
    ckpt.wait_for_snapshot()
    ckpt.flush()
    records = ckpt.drain_completed()
    ckpt.close()
    return {"seen": seen, "records": [(r.step, r.error, r.persist_skipped) for r in records]}


def test_save_returns_before_its_collective_so_a_late_peer_does_not_stall_it(tmp_path):
    """save() hands the collective (persist results, token counts) to the snapshot
    thread: rank 0's save returns while rank 1 has not even called save yet, and the
    checkpoint still completes on both."""
    results = run_ranks(_save_while_the_peer_is_late, 2, str(tmp_path / "ckpt"))
    assert results[1]["seen"] is True
    for res in results:
        assert res["records"] == [(1, None, False)]


def _exchange_on(rank: int, world: int) -> list:
    from moc.checkpoint.dist import SHARE_BYTES, Dist
    from moc.parallel import ParallelGroups

    dist = Dist(ParallelGroups.from_world(1, 4))
    out = []
    for share in ([("done", 5, True, None, 0.1, [1, 2])], "x" * (2 * SHARE_BYTES)):
        counts = torch.full((2, 4), rank + 1, dtype=torch.int64)
        mine = share if rank == 0 else None  # only rank 0's share counts
        out.append((dist.exchange(mine, counts), counts.tolist()))
    return out


def test_persist_results_and_token_counts_travel_in_one_exchange():
    """Rank 0's results reach every rank and the counts are summed, also when the
    results are too large for the all-reduce and take the fallback broadcast."""
    from moc.checkpoint.dist import SHARE_BYTES

    for got in run_ranks(_exchange_on, 2):
        (small, counts_a), (large, counts_b) = got
        assert small == [("done", 5, True, None, 0.1, [1, 2])]
        assert large == "x" * (2 * SHARE_BYTES)
        assert counts_a == counts_b == [[3] * 4] * 2


def _retention_fails_on_rank_0(rank: int, world: int, root: str) -> list:
    import moc.checkpoint.store.retention as retention
    from moc.checkpoint.errors import CheckpointError

    def full_disk(root, keep_last):
        raise OSError(28, "No space left on device")

    retention.apply_retention = full_disk  # only rank 0 runs retention
    groups, model, opt = build_sharded(1)
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                interval=1, persist_policy="wait", keep_last=1)
    raised = []
    for step in range(1, 7):
        out = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
        out.loss.backward()
        try:
            ckpt.wait_for_snapshot()
        except CheckpointError as e:
            raised.append((step, str(e)))
        opt.step()
        model.zero_grad()
        ckpt.maybe_save(step, {"step": step})
    try:
        ckpt.close()
    except CheckpointError as e:
        raised.append(("close", str(e)))
    return raised


def test_an_error_of_rank_0s_background_work_is_raised_on_every_rank(tmp_path):
    """Retention runs on rank 0 when a commit is learned, on its snapshot thread; its
    failure must reach every rank (at the same step), not stop rank 0 alone."""
    results = run_ranks(_retention_fails_on_rank_0, 2, str(tmp_path / "ckpt"))
    assert results[0] == results[1] and results[0], results
    step, message = results[0][0]
    assert isinstance(step, int) and "deleting old checkpoints" in message
    assert "No space left on device" in message


def _kill_persist_mid_run(rank: int, world: int, root: str) -> dict:
    import os
    import signal

    groups, model, opt = build_sharded(1)
    ckpt = TwoLevelCheckpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1),
                                interval=1, persist_policy="wait")
    records = []
    for step in range(1, 7):
        _train_step(groups, model, opt, ckpt, step)
        if step == 3 and rank == 0:  # step 3's persist (or step 2's) dies with it
            os.kill(ckpt.persist.process.pid, signal.SIGKILL)
        records += ckpt.drain_completed()
    ckpt.flush()
    records += ckpt.drain_completed()
    ckpt.close()
    return {"errors": {r.step: r.error for r in records}, "generation": ckpt.persist.generation}


def test_a_killed_persist_process_is_restarted_and_every_rank_reconnects(tmp_path):
    from moc.checkpoint.store.steps import complete_steps
    from moc.checkpoint.tools import verify_checkpoints

    root = tmp_path / "ckpt"
    results = run_ranks(_kill_persist_mid_run, 2, str(root))
    assert [r["generation"] for r in results] == [1, 1]  # both speak to the new process
    errors = results[0]["errors"]
    assert all(errors[s] is None for s in (1, 5, 6)), errors
    assert complete_steps(root)[-2:] == [5, 6] and verify_checkpoints(root).ok


def _start_with_a_dead_persist(rank: int, world: int, root: str, broken: str) -> str:
    import os

    from moc.checkpoint.errors import CheckpointError

    os.environ["PYTHONPATH"] = broken  # for the persist process rank 0 starts
    groups, model, opt = build_sharded(1)
    try:
        TwoLevelCheckpointer(model, opt, root, groups=groups)
    except CheckpointError as e:
        return str(e)
    return "started"


def test_a_persist_process_dead_at_start_fails_every_rank_with_rank_0s_error(tmp_path):
    # Shadows `queue` in the persist process only, which its listener imports: it dies
    # before it listens. (A shadowed torch dies after: the persist process listens first,
    # and rank 0, admitted, started; its first persist then ends as PERSIST_GONE, which
    # tests/checkpoint/twolevel/test_persist.py shows.)
    pkg = tmp_path / "broken" / "queue"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise SystemExit(3)")
    results = run_ranks(_start_with_a_dead_persist, 2, str(tmp_path / "ckpt"),
                        str(tmp_path / "broken"))
    assert results[0] == results[1]
    assert results[0].startswith("the persist process exited with code 3 as it started")
