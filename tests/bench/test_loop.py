"""`moc bench loop`: a checkpoint every step in one process, paired against none, by phase
on the training thread (the figures themselves are the benchmark's, not a test's)."""

from __future__ import annotations

import json

import pytest

from moc.bench.loop import PHASES, figures, main
from moc.checkpoint.api import CheckpointResult


def _result(step: int, queued: float) -> CheckpointResult:
    return CheckpointResult(step, "moc", 1, [], 0.001, wait_s=0.002, snapshot_s=0.03,
                            copy_Bps=1e9, k_snapshot=4,
                            phases={"snapshot": {"copy": [0.02, 0.02, 0], "checksum":
                                                 [0.005, 0.0, 0], "header": [0.001, 0.0, 0],
                                                 "queued": [queued, 0.0, 0]}})


def test_the_paired_figures_compare_the_blocks_of_one_run():
    # Blocks of 4: steps 4-7 and 12-15 checkpoint; each block's first step is left out.
    times = {s: {name: 0.0 for name in PHASES} for s in range(1, 17)}
    for s, t in times.items():
        on = (s // 4) % 2 == 1
        t["step"] = 0.12 if on else 0.10
        t["wait"] = 0.02 if on else 0.0
        t["fwd_bwd"] = 0.06 if on else 0.05  # the snapshot thread's Python beside it
        t["in_flight"] = float(on and s % 4 != 0)
    times[4]["step"] = 0.5  # the first checkpointed step pays for what is not prepared
    results = [_result(s, 0.001) for s in (4, 5, 6, 7, 12, 13, 14, 15)]
    f = figures(times, results, block=4, warmup=0)
    assert f["paired_throughput"] == pytest.approx(0.10 / 0.12)
    assert f["wait_on_s"] == pytest.approx(0.02) and f["wait_off_s"] == 0.0
    assert f["first_checkpointed_s"][0] == 0.5
    assert f["worst_after_first_vs_plain"] == pytest.approx(0.12 / 0.10)
    assert f["checkpoints"] == 8 and f["failed"] == 0
    assert f["capture_Bps"] == 1e9 and f["seal_s"] == pytest.approx(0.006)
    assert f["queued_max_s"] == pytest.approx(0.001)
    assert f["fwd_bwd_on_s"] == pytest.approx(0.06) and f["fwd_bwd_off_s"] == 0.05
    assert f["fwd_bwd_ratio"] == pytest.approx(0.06 / 0.05)
    assert f["fwd_bwd_in_flight_share"] == 1.0  # each block's first step is left out


@pytest.mark.integration  # a real two-level engine and its persist process
def test_a_short_run_on_the_cpu_reports_every_figure(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))
    out = tmp_path / "loop.json"
    assert main(["--config", "tiny", "--device", "cpu", "--steps", "16", "--block", "2",
                 "--json", str(out), "--workdir", str(tmp_path)]) == 0
    r = json.loads(out.read_text())
    assert r["checkpoints"] == 8 and r["failed"] == 0  # steps 2, 3, 6, 7, 10, 11, 14, 15
    assert r["paired_throughput"] > 0 and r["paired_steps"] >= 2
    assert r["capture_Bps"] > 0 and r["d2h_pinned_Bps"] is None and r["slots"]["pinned"] is None
    assert len(r["times"]) == 16
    printed = capsys.readouterr().out
    assert "paired throughput" in printed and "| wait |" in printed
    assert r["fwd_bwd_ratio"] == pytest.approx(r["fwd_bwd_on_s"] / r["fwd_bwd_off_s"])
    assert 0 <= r["fwd_bwd_in_flight_share"] <= 1
    assert "forward+backward" in printed and "without a snapshot in flight" in printed
