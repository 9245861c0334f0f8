"""Preemption in the library's own loop (issue 29, item 8): real signals to real
processes; every rank stops at the same step with a final complete checkpoint, and a
second signal or the grace period ends a process at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.preemption import Preemption, exit_status
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import complete_steps
from moc.checkpoint.sync import Checkpointer
from moc.checkpoint.tools import verify_checkpoints
from moc.parallel import sync_gradients
from tests.distributed import build_sharded, run_ranks

pytestmark = pytest.mark.integration  # real signals, real processes


def _loop(rank: int, world: int, root: str, signal_at: dict[int, int]) -> dict:
    """The README's loop with a Preemption; rank r signals itself at step signal_at[r]
    (a scheduler's SIGTERM reaching the ranks at different moments)."""
    groups, model, opt = build_sharded(1)
    preemption = Preemption(groups, grace_s=120)
    ckpt = Checkpointer(model, opt, root, groups=groups, policy=PECPolicy(k=1), interval=5)
    stopped = None
    for step in range(1, 1000):
        idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        out = model(idx, idx)
        out.loss.backward()
        sync_gradients(model, groups)
        opt.step()
        model.zero_grad()
        ckpt.record_routing(out.tokens_per_expert)
        if signal_at.get(rank) == step:
            os.kill(os.getpid(), signal.SIGTERM)
        stop = preemption.should_stop()
        ckpt.maybe_save(step, {"step": step}, final=stop)
        if stop:
            stopped = step
            break
    ckpt.close()
    preemption.close()
    return {"stopped": stopped, "received": preemption.received, "agreed": preemption.agreed}


def test_every_rank_stops_at_the_same_step_when_one_rank_is_signalled(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_loop, 2, root, {1: 7})
    stopped = {r["stopped"] for r in results}
    assert stopped == {8}  # one step after the boundary that saw it, on every rank
    assert [r["received"] for r in results] == [None, signal.SIGTERM]
    assert [r["agreed"] for r in results] == [signal.SIGTERM, signal.SIGTERM]
    assert complete_steps(root)[-1] == 8
    manifest = Manifest.load(root, 8)
    assert all(ids == [0, 1, 2, 3] for ids in manifest.experts_saved.values())  # complete
    assert verify_checkpoints(root).ok


def test_signals_at_different_steps_on_different_ranks_agree_on_the_first(tmp_path):
    results = run_ranks(_loop, 2, str(tmp_path / "ckpt"), {0: 3, 1: 11})
    assert {r["stopped"] for r in results} == {4}


CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from moc.checkpoint.preemption import Preemption
    p = Preemption(grace_s=float(sys.argv[1]))
    print("ready", flush=True)
    while not p.signalled:
        time.sleep(0.01)
    print("signalled", flush=True)
    time.sleep(60)  # a final checkpoint that does not finish
    print("finished", flush=True)
""")


def _child(grace_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(grace_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_the_grace_period_ends_the_process_with_the_signals_status():
    proc = _child(grace_s=2.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == exit_status(signal.SIGTERM) == 143
    assert time.monotonic() - t0 < 30  # the 60 s "checkpoint" was not waited for
    assert "signalled" in out and "finished" not in out
    assert "grace period (2 s after SIGTERM) ran out" in err and "Traceback" not in err


def test_a_second_signal_exits_at_once_but_a_repeat_within_two_seconds_does_not():
    proc = _child(grace_s=120.0)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)  # the same Ctrl-C, delivered again (torchrun)
    time.sleep(3.0)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == exit_status(signal.SIGINT) == 130
    assert "SIGINT again: exiting at once" in err and "Traceback" not in err


def test_a_grace_period_must_be_positive():
    with pytest.raises(ValueError, match="grace_s must be > 0"):
        Preemption(grace_s=0)
