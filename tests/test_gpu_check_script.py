"""scripts/gpu_check.py is the GPU acceptance check; run its logic on the CPU here so
that it cannot rot unnoticed between GPU runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # minutes: make test-slow

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_check.py"


def test_gpu_check_script_passes_on_the_cpu():
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "from memory" in r.stdout and "PASS" in r.stdout
    # The 2-rank part ran too (gloo on the CPU), through a restart recovered from memory.
    assert "2 ranks: rank 1 killed at step 13, resumed from step 10 (memory)" in r.stdout
    assert "2 ranks: losses after the restart bitwise equal to the straight run: True" \
        in r.stdout
