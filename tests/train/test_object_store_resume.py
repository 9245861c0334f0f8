"""End to end on an object store: `moc train --ckpt-dir s3://...` against a real S3 API
server, a node lost to SIGKILL (its memory snapshots with it), the torchrun restart
reading the checkpoint back from S3, and every loss after it equal to an uninterrupted
run's, bitwise."""

from __future__ import annotations

import pytest

from moc.checkpoint.store.backend import open_root
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import complete_steps
from moc.checkpoint.tools import verify_checkpoints
from moc.train.metrics import read_events
from tests.engines import losses_by_step
from tests.train.test_resume import moc

pytestmark = pytest.mark.integration  # real processes: see README, Tests


def _train(ckpt_dir: str, metrics, *extra: str, mode: str = "moc") -> list[dict]:
    r = moc("train", "--nproc", "2", "--ep", "2", "--config", "tiny", "--steps", "16",
            "--ckpt-dir", ckpt_dir, "--ckpt-interval", "4", "--ckpt-mode", mode,
            "--k-persist", "all", "--persist-policy", "wait", "--metrics", str(metrics),
            *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_events(metrics)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[dict]:
    """The uninterrupted run, on local disk (losses do not depend on the store)."""
    tmp = tmp_path_factory.mktemp("straight")
    return _train(str(tmp / "ckpt"), tmp / "metrics.jsonl")


@pytest.mark.slow
def test_node_loss_resumes_from_s3_bitwise(s3_url, tmp_path, straight):
    faulted = _train(s3_url, tmp_path / "faulted.jsonl", "--fault-kind", "node",
                     "--fault-at", "10", "--fault-rank", "1", "--max-restarts", "1")
    (recovery,) = [e for e in faulted if e["event"] == "recovery"]
    # The newest step persisted before the kill: 8, or 4 while 8 was still uploading.
    resumed = recovery["resumed_from"]
    assert recovery["source"] == "storage" and resumed in (4, 8)
    assert recovery["lost_tokens"] == 0
    a, b = losses_by_step(straight), losses_by_step(faulted)
    assert all(len(b[s]) == 2 for s in range(resumed + 1, 10))  # redone after the restart
    for step in range(1, 17):
        assert all(loss == a[step][0] for loss in b[step]), f"step {step}: {a[step]} vs {b[step]}"
    assert complete_steps(s3_url) == [4, 8, 12, 16]
    assert verify_checkpoints(s3_url).ok


@pytest.mark.slow
def test_sync_engine_ranks_write_their_own_objects_and_resume_from_s3_bitwise(
        s3_url, tmp_path, straight):
    faulted = _train(s3_url, tmp_path / "faulted.jsonl", "--fault-at", "10",
                     "--fault-rank", "1", "--max-restarts", "1", mode="pec")
    (recovery,) = [e for e in faulted if e["event"] == "recovery"]
    assert (recovery["source"], recovery["resumed_from"]) == ("storage", 8)
    a, b = losses_by_step(straight), losses_by_step(faulted)
    for step in range(1, 17):
        assert all(loss == a[step][0] for loss in b[step]), f"step {step}: {a[step]} vs {b[step]}"
    manifest = Manifest.load(open_root(s3_url), 16)
    assert sorted(manifest.files) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert verify_checkpoints(s3_url).ok
