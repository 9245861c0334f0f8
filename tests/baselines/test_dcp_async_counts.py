"""dcp-async gives one result per save: none is skipped while the previous one is in
flight, none is lost because its upload ends after the next save (`DCPCheckpointer`
waits for it first). On one H200 a `moc train --nproc 1 --ckpt-mode dcp-async` run
logged one `checkpoint` event in 40 steps at interval 5 against moc's eight; these pin
what the baseline does on the CPU, and how the count is read (failed saves are
`checkpoint_failed` events, which a count of `checkpoint` events alone misses)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moc.baselines.dcp import DCPCheckpointer, complete_dcp_steps, staging_options
from moc.compat import has_dcp_async_staging
from moc.model import ModelConfig, Transformer
from moc.parallel import ParallelGroups, ShardedAdamW
from moc.train.metrics import checkpoint_counts, read_events

pytestmark = pytest.mark.skipif(not has_dcp_async_staging(),
                                reason="dcp-async needs DCP's DefaultStager (torch 2.9+)")

TINY = ModelConfig(vocab_size=64, seq_len=16, d_model=16, n_layers=2, n_heads=2, d_ffn=32,
                   n_experts=4)


def _train(ckpt: DCPCheckpointer, model: Transformer, opt: ShardedAdamW, steps: int,
           interval: int, drain: bool) -> list:
    """The trainer's order: backward, wait for staging, step, save; drain when pending
    (`drain`) or only at the end."""
    results = []
    for step in range(1, steps + 1):
        idx = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len + 1),
                            generator=torch.Generator().manual_seed(step))
        model(idx[:, :-1], idx[:, 1:]).loss.backward()
        ckpt.wait_for_snapshot()
        opt.step()
        model.zero_grad(set_to_none=True)
        if step % interval == 0:
            ckpt.save(step, {"step": step})
        if drain and ckpt.pending:
            results += ckpt.drain_completed()
    ckpt.flush()
    return results + ckpt.drain_completed()


@pytest.mark.parametrize(("steps", "interval", "drain"), [(40, 5, True), (10, 1, False)])
def test_every_async_save_gives_one_result_none_skipped(tmp_path, steps, interval, drain):
    torch.manual_seed(0)
    model = Transformer(TINY)
    groups = ParallelGroups.single(TINY.n_experts)
    opt = ShardedAdamW(model, groups, lr=1e-2)
    ckpt = DCPCheckpointer(model, opt, tmp_path, groups=groups, mode="dcp-async")
    try:
        # Saves at every step with no drain between: each one meets the previous upload
        # in flight, and waits for it rather than skipping.
        results = _train(ckpt, model, opt, steps, interval, drain)
    finally:
        ckpt.close()
    due = list(range(interval, steps + 1, interval))
    assert [r.step for r in results] == due
    assert all(r.error is None for r in results), [r.error for r in results]
    assert complete_dcp_steps(tmp_path) == due


def test_staging_options_are_dcps_best_on_this_machine():
    options = staging_options()
    cuda = torch.cuda.is_available()
    assert options.use_async_staging and options.use_shared_memory
    # Pinned memory and non-blocking copies on the stager's own stream need CUDA.
    assert options.use_pinned_memory is cuda and options.use_non_blocking_copy is cuda


@pytest.mark.integration
def test_a_one_process_dcp_async_run_counts_one_checkpoint_per_interval(tmp_path):
    metrics = tmp_path / "m.jsonl"
    with open(tmp_path / "log", "w") as log:  # not a pipe: see test_dcp.moc
        rc = subprocess.run(
            [sys.executable, "-m", "moc", "train", "--nproc", "1", "--config", "tiny",
             "--steps", "40", "--ckpt-interval", "5", "--ckpt-mode", "dcp-async",
             "--device", "cpu", "--ckpt-dir", str(tmp_path / "ckpt"), "--metrics",
             str(metrics), "--no-progress"], stdout=log, stderr=subprocess.STDOUT,
            timeout=300).returncode
    assert rc == 0, (tmp_path / "log").read_text()[-3000:]
    events = read_events(metrics)
    counts = checkpoint_counts(events)
    assert (counts.written, counts.failed) == (8, 0), counts
    assert sorted(e["step"] for e in events if e["event"] == "checkpoint") == list(
        range(5, 41, 5))
