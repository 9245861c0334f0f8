"""scripts/gpu_check.py is the GPU acceptance check (issue 39); its logic runs on the CPU
here, with small presets, so that it cannot rot unnoticed between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # minutes: make test-slow

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_check.py"


def test_every_section_of_the_gpu_check_runs_on_the_cpu_and_writes_its_figures(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result["tests"]["ok"] and "passed" in result["tests"]["summary"]
    assert result["resume"]["bitwise"] and result["resume"]["source"] == "memory"
    for loop in ("loop_400m", "loop_800m"):
        assert result[loop]["checkpoints"] > 0 and result[loop]["failed"] == 0
        assert result[loop]["paired_throughput"] > 0
    for overhead in ("overhead_bench", "overhead_400m"):
        strategies = result[overhead]["strategies"]
        assert set(strategies) == {"none", "blocking", "dcp-async", "moc"}
        assert strategies["moc"]["checkpoints"] == strategies["dcp-async"]["checkpoints"] == 2
    assert result["two_ranks"]["ok"]
    c = result["criteria"]
    assert c["tests_pass"] and c["resume_bitwise"]
    assert c["overhead_bench_moc_vs_dcp"]["counts_equal"]
    assert "PASS" in r.stdout
