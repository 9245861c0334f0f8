"""Two-level checkpointing across 2 simulated nodes x 2 ranks (`moc train --nodes 2`):
every node persists its own ranks and node 0 commits; every rank keeps a peer replica of
the rank with its local rank on the other node. Losing node 1 between checkpoints then
loses nothing: its ranks come back from the replicas node 0 holds, and training goes on
exactly as if nothing had happened. Losing both nodes leaves storage (K_persist = 1),
and PLT says what that cost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import complete_steps
from moc.train.metrics import read_events
from tests.engines import losses_by_step

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # minutes: make test-slow

STEPS, INTERVAL, FAULT_AT = 14, 3, 8


def _train(root: Path, *extra: str, ok: bool = True) -> list[dict]:
    r = subprocess.run(
        [sys.executable, "-m", "moc", "train", "--nodes", "2", "--nproc", "2",
         *([] if "--ep" in extra else ["--ep", "2"]), "--config", "tiny", "--steps",
         str(STEPS), "--ckpt-dir", str(root / "ckpt"),
         "--ckpt-interval", str(INTERVAL), "--ckpt-mode", "moc", "--k-persist", "1",
         "--device", "cpu", "--no-progress", "--metrics", str(root / "metrics.jsonl"),
         *extra], capture_output=True, text=True, timeout=400)
    assert (r.returncode == 0) == ok, r.stderr[-3000:]
    return read_events(root / "metrics.jsonl")


def _node_fault(*extra: str) -> tuple[str, ...]:
    return ("--fault-kind", "node", "--fault-node", "1", "--fault-at", str(FAULT_AT), *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    dirs = {n: tmp_path_factory.mktemp(n) for n in ("straight", "node", "k1", "both")}
    out = {"straight": _train(dirs["straight"]),
           "node": _train(dirs["node"], *_node_fault("--max-restarts", "1")),
           # ep = 4: each expert lives on one rank only, so what the replica lacks
           # has no other replica to come from but storage.
           "k1": _train(dirs["k1"], *_node_fault("--max-restarts", "1", "--k-replica", "1",
                                                 "--ep", "4"))}
    # Both nodes lost: the job dies with node 1 (no restart left); a new job on new
    # machines (a new launcher: fresh memory on both nodes) has storage only.
    _train(dirs["both"], *_node_fault(), ok=False)
    out["both"] = _train(dirs["both"])
    out["dirs"] = dirs  # type: ignore[assignment]
    return out


def _recovery(events: list[dict]) -> dict:
    (event,) = [e for e in events if e["event"] == "recovery"]
    return event


def _hex(events: list[dict]) -> dict[int, list[str]]:
    return {s: [float(v).hex() for v in ls] for s, ls in losses_by_step(events).items()}


def test_a_lost_node_recovers_from_its_peer_replicas_losing_nothing(runs):
    rec = _recovery(runs["node"])
    assert rec["source"] == "peer"
    assert rec["sources"] == {"memory": [0, 1], "peer": [2, 3]}
    assert rec["resumed_from"] == 6 and rec["plt"] == 0.0 and rec["lost_tokens"] == 0
    straight, node = _hex(runs["straight"]), _hex(runs["node"])
    assert sorted(straight) == list(range(1, STEPS + 1))
    # Every step logged, before the fault and after the restart, equals the straight
    # run's loss bit for bit (step 7 was logged twice: by both attempts).
    assert all(set(node[s]) == set(straight[s]) for s in straight)
    assert len(node[7]) == 2 and len(node[8]) == 1


def test_every_node_writes_its_ranks_and_node_0_commits_one_manifest(runs):
    root = runs["dirs"]["node"] / "ckpt"
    assert complete_steps(root)[-1] == STEPS
    manifest = Manifest.load(root, STEPS)
    assert sorted(manifest.files) == [f"rank-{r:05d}.safetensors" for r in range(4)]
    # Nothing but what the manifest names: the commit's records are gone.
    step_dir = root / f"step-{STEPS:08d}"
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(
        [*manifest.files, "manifest.json"])
    checkpoints = [e for e in runs["node"] if e["event"] == "checkpoint"]
    assert checkpoints and all(len(e["bytes_per_rank"]) == 4 and all(e["bytes_per_rank"])
                               for e in checkpoints if not e["persist_skipped"])


def test_a_partial_replica_recovers_from_its_peer_and_counts_what_storage_lacked(runs):
    rec = _recovery(runs["k1"])
    assert rec["sources"] == {"memory": [0, 1], "peer": [2, 3]}
    # The replica held 1 of the rank's experts per layer; the others came from storage,
    # older, and no other rank holds them: the lost tokens are counted, not claimed 0.
    assert rec["plt"] > 0 and rec["lost_tokens"] > 0
    full = [e for e in runs["node"] if e["event"] == "checkpoint"]
    k1 = [e for e in runs["k1"] if e["event"] == "checkpoint"]
    assert max(e["replica_bytes"] for e in k1) < max(e["replica_bytes"] for e in full)


def test_losing_both_nodes_falls_back_to_storage_and_reports_plt(runs):
    rec = _recovery(runs["both"])
    assert rec["source"] == "storage"
    assert rec["plt"] > 0 and rec["lost_tokens"] > 0
    assert rec["resumed_from"] == 6


def test_host_memory_stays_within_its_bound(runs):
    """Own snapshots: 3 slots; replicas kept for the peer: 2 slots, each at most the
    size of its source's snapshot (the same model shard size on every rank here)."""
    (summary,) = [e for e in runs["straight"] if e["event"] == "summary"]
    own = summary["ckpt_host_bytes"] - summary["replica_host_bytes"]
    assert 0 < own <= 3 * summary["snapshot_bytes"]
    assert 0 < summary["replica_host_bytes"] <= 2 * summary["replica_slot_bytes"]
    assert summary["replica_slot_bytes"] <= summary["snapshot_bytes"] * 1.01
    print(json.dumps({k: summary[k] for k in ("ckpt_host_bytes", "snapshot_bytes",
                                               "replica_host_bytes", "replica_slot_bytes")}))
