"""examples/hf_trainer.py and examples/accelerate_loop.py as users run them (issue 32):
straight, then SIGKILLed in step 17 and started again with the same command. Under
torchrun with 2 ranks (Trainer's DDP, Accelerate's; gloo) and in one process (Qwen2-MoE).
The combined log of the killed run and its restart has every step once, each loss
bitwise equal to the straight run's, and the restart resumed from moc's memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_examples import EXAMPLES, REPO

pytestmark = pytest.mark.integration  # real processes: torchrun, ranks, persist process
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS, FAULT = 30, 17


def launch(example: str, out: Path, *extra: str, ranks: int) -> subprocess.CompletedProcess:
    """The example with `--dir out --steps 30 EXTRA`, under torchrun when `ranks` > 1.
    Returns the finished process, whatever its exit status."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
                if ranks > 1 else [])
    return subprocess.run([sys.executable, *launcher, str(EXAMPLES / example), "--dir",
                           str(out), "--steps", str(STEPS), *extra], cwd=out.parent, env=env,
                          capture_output=True, text=True, timeout=300)


def lines(r: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]


CASES = {"trainer-ddp": ("hf_trainer.py", 2, ()),
         "trainer-qwen": ("hf_trainer.py", 1, ("--model", "qwen2_moe")),
         "accelerate-ddp": ("accelerate_loop.py", 2, ()),
         "accelerate-qwen": ("accelerate_loop.py", 1, ("--model", "qwen2_moe"))}


@pytest.fixture(scope="module", params=[
    pytest.param(c, marks=pytest.mark.slow) if "qwen" in c else c  # CI time: the slow tier
    for c in sorted(CASES)])
def runs(request, tmp_path_factory) -> dict[str, object]:
    example, ranks, extra = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    straight = launch(example, root / "straight", *extra, ranks=ranks)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = launch(example, root / "faulted", *extra, "--fault-at", str(FAULT), ranks=ranks)
    restarted = launch(example, root / "faulted", *extra, ranks=ranks)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    return {"example": example, "ranks": ranks, "extra": extra, "root": root,
            "straight": straight, "killed": killed, "restarted": restarted}


def test_the_kill_is_a_real_sigkill(runs):
    r = runs["killed"]
    assert r.returncode != 0
    if runs["ranks"] == 1:
        assert r.returncode == -9  # SIGKILL
    else:
        assert "Signal 9 (SIGKILL)" in r.stderr or "exitcode  : -9" in r.stderr, r.stderr[-2000:]
    assert [e["step"] for e in lines(r) if "step" in e] == list(range(1, FAULT))


def test_the_restart_resumes_from_memory(runs):
    resumed = [e for e in lines(runs["restarted"]) if "resumed" in e]
    assert len(resumed) == 1, runs["restarted"].stdout
    assert resumed[0]["resumed"] == FAULT - 1  # moc checkpoints every step
    assert resumed[0]["source"] == "memory"
    assert resumed[0]["lost_tokens"] == 0


def test_no_step_is_repeated_or_skipped_and_every_loss_is_bitwise_equal(runs):
    straight = {e["step"]: e["hex"] for e in lines(runs["straight"]) if "step" in e}
    assert sorted(straight) == list(range(1, STEPS + 1))
    combined = [e for r in ("killed", "restarted") for e in lines(runs[r]) if "step" in e]
    assert [e["step"] for e in combined] == list(range(1, STEPS + 1))
    for e in combined:
        assert e["hex"] == straight[e["step"]], f"step {e['step']}"
    assert float.fromhex(straight[STEPS]) < float.fromhex(straight[1])  # it did learn


def refusal(runs: dict, *args: str) -> str:
    """The one line the example exits with when started again with `args` on the
    finished run's directory."""
    r = launch(runs["example"], runs["root"] / "faulted", *args, "--steps", "40",
               ranks=runs["ranks"])
    assert r.returncode != 0
    said = [x for x in r.stderr.splitlines() if x.startswith(f"{runs['example']}: ")]
    assert said, r.stderr[-3000:]  # (torchrun may stop the other rank first)
    return said[0]


def test_changed_gradient_accumulation_is_one_line(runs):
    line = refusal(runs, *runs["extra"], "--grad-accum", "4")
    assert f"moc's checkpoint of step {STEPS}" in line
    assert "gradient_accumulation_steps=2, this run has gradient_accumulation_steps=4" in line


def test_a_checkpoint_of_another_model_is_one_line(runs):
    other = "mixtral" if runs["extra"] else "qwen2_moe"
    assert "was written for a different model" in refusal(runs, "--model", other)


def test_a_changed_seed_is_one_line(runs):
    """Another seed shuffles the epochs otherwise: the batches skipped would be others."""
    assert "seed=0, this run has" in refusal(runs, *runs["extra"], "--seed", "1")
