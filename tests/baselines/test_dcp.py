"""The DCP baselines on real ranks (2 ranks, ep=2) and end to end under torchrun."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moc.baselines.dcp import (
    METADATA,
    DCPCheckpointer,
    complete_dcp_steps,
    dcp_step_dir,
)
from moc.compat import has_dcp_async_staging
from moc.parallel import clip_grad_norm_, sync_gradients
from moc.train.metrics import read_events
from tests.distributed import build_sharded, run_ranks
from tests.engines import losses_by_step

pytestmark = pytest.mark.integration  # real processes: see README, Tests

NEEDS_ASYNC = pytest.mark.skipif(not has_dcp_async_staging(),
                                 reason="dcp-async needs DCP's DefaultStager (torch 2.9+)")
MODES = ("dcp-sync", "dcp-async") if has_dcp_async_staging() else ("dcp-sync",)
"""The modes this torch has (moc supports older ones than dcp-async: moc/compat.py)."""
EVERY_MODE = [pytest.param("dcp-sync"), pytest.param("dcp-async", marks=NEEDS_ASYNC)]


def _step(model, opt, groups, ckpt, step: int, rank: int) -> None:
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
    out = model(idx, idx)
    out.loss.backward()
    sync_gradients(model, groups)
    clip_grad_norm_(model, groups, 1.0)
    ckpt.wait_for_snapshot()  # the staged copy must be taken before the weights change
    opt.step()
    model.zero_grad()


def _state(model, opt) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "optim": {n: {k: v.clone() for k, v in s.items()}
                      for n, s in opt.local_state().items()}}


def _train(rank: int, world: int, root: str) -> dict:
    """Per mode: save steps 1-3 (keep_last=2), then take step 4 without saving it, so
    that an async save of step 3 must have staged its copy before step 4 changed it;
    then a save of step 5 that DCP cannot write (its directory's name is taken by a
    symlink to itself), which must come back as an error, not be lost."""
    out = {}
    for mode in MODES:
        groups, model, opt = build_sharded(2)
        ckpt = DCPCheckpointer(model, opt, f"{root}/{mode}", groups=groups, mode=mode,
                               keep_last=2)
        results = []
        for step in range(1, 4):
            _step(model, opt, groups, ckpt, step, rank)
            ckpt.save(step, {"step": step, "rank": rank})
            # A result is final once drained (an async save's: once its upload is done).
            results += ckpt.drain_completed()
        saved = {**_state(model, opt), "rng": torch.get_rng_state()}
        _step(model, opt, groups, ckpt, 4, rank)
        ckpt.flush()
        results += ckpt.drain_completed()
        if rank == 0:
            dcp_step_dir(ckpt.root, 5).symlink_to(dcp_step_dir(ckpt.root, 5).name)
        torch.distributed.barrier()
        ckpt.save(5, {"step": 5})
        ckpt.flush()
        failed = ckpt.drain_completed()
        ckpt.close()
        out[mode] = {**saved, "results": [(r.step, r.error, r.stall_s, r.bytes_per_rank)
                                          for r in results],
                     "failed": [(r.step, r.error) for r in failed], "executor": ckpt.executor}
    return out


def _restore(rank: int, world: int, root: str) -> dict:
    out = {}
    for mode in MODES:
        groups, model, opt = build_sharded(2)  # fresh: the optimizer has no state yet
        ckpt = DCPCheckpointer(model, opt, f"{root}/{mode}", groups=groups, mode=mode)
        report = ckpt.restore()
        out[mode] = {**_state(model, opt), "rng": torch.get_rng_state(),
                     "report": (report.step, report.extra, report.source, report.lost_tokens,
                                report.plt, report.k, report.skipped)}
        ckpt.close()
    return out


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory) -> tuple[Path, list[dict], list[dict]]:
    root = tmp_path_factory.mktemp("dcp")
    saved = run_ranks(_train, 2, str(root))
    for mode in MODES:
        # A newer step that never got its metadata (a crash mid-save) must be ignored.
        partial = dcp_step_dir(root / mode, 9)
        shutil.copytree(dcp_step_dir(root / mode, 3), partial)
        (partial / METADATA).unlink()
    restored = run_ranks(_restore, 2, str(root))
    return root, saved, restored


@pytest.mark.parametrize("mode", EVERY_MODE)
def test_restore_gives_back_parameters_optimizer_state_and_rng_bitwise(dcp_runs, mode):
    _, saved, restored = dcp_runs
    for rank in range(2):
        a, b = saved[rank][mode], restored[rank][mode]
        assert b["report"] == (3, {"step": 3, "rank": 0}, "storage", 0, 0.0, 4, [])
        assert a["params"].keys() == b["params"].keys()
        for name, p in a["params"].items():
            assert torch.equal(p, b["params"][name]), name
        assert a["optim"].keys() == b["optim"].keys() and a["optim"]  # ZeRO shard present
        for name, state in a["optim"].items():
            assert state.keys() == b["optim"][name].keys()
            for k, v in state.items():
                assert torch.equal(v, b["optim"][name][k]), (name, k)
        assert torch.equal(a["rng"], b["rng"])


@pytest.mark.parametrize("mode", EVERY_MODE)
def test_saves_report_bytes_per_rank_and_keep_the_newest_steps(dcp_runs, mode):
    root, saved, _ = dcp_runs
    assert saved[0][mode]["executor"] == "process"
    results = saved[0][mode]["results"]
    assert sorted(r[0] for r in results) == [1, 2, 3]
    for _, error, stall, per_rank in results:
        assert error is None and stall >= 0.0
        assert len(per_rank) == 2 and all(b > 0 for b in per_rank)  # every rank wrote
    assert complete_dcp_steps(root / mode) == [2, 3]  # keep_last=2
    assert not dcp_step_dir(root / mode, 1).exists()


@pytest.mark.parametrize("mode", EVERY_MODE)
def test_a_save_dcp_cannot_write_comes_back_as_an_error_on_every_rank(dcp_runs, mode):
    _, saved, restored = dcp_runs
    for rank in range(2):
        ((step, error),) = saved[rank][mode]["failed"]
        assert step == 5 and error and "failed" in error
        assert restored[rank][mode]["report"][0] == 3  # the failed step is never restored


def moc(log: Path, *args: str, timeout: float = 300) -> int:
    """Run `moc` with its output in `log`, not in pipes: a checkpoint process that
    outlived its trainer would hold a pipe open and hang the test."""
    with open(log, "w") as out:
        return subprocess.run([sys.executable, "-m", "moc", *args], stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout).returncode


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """A straight run (dcp-sync) and a dcp-async run whose rank 1 is killed at step 15."""
    tmp_path = tmp_path_factory.mktemp("cli")
    runs = {}
    for name, extra in (("straight", ("--ckpt-mode", "dcp-sync")),
                        ("faulted", ("--ckpt-mode", "dcp-async", "--fault-at", "15",
                                     "--fault-rank", "1", "--max-restarts", "1"))):
        log = tmp_path / f"{name}.log"
        rc = moc(log, "train", "--nproc", "2", "--ep", "2", "--config", "tiny", "--steps", "20",
                 "--ckpt-dir", str(tmp_path / name), "--ckpt-interval", "10",
                 "--metrics", str(tmp_path / f"{name}.jsonl"), *extra)
        assert rc == 0, log.read_text()[-3000:]
        runs[name] = read_events(tmp_path / f"{name}.jsonl")
    return tmp_path, runs


@pytest.mark.slow
@NEEDS_ASYNC
def test_async_run_killed_at_15_resumes_from_10_and_equals_a_straight_run(cli_runs):
    _, runs = cli_runs
    (recovery,) = [e for e in runs["faulted"] if e["event"] == "recovery"]
    assert (recovery["resumed_from"], recovery["source"]) == (10, "storage")
    ckpts = [e for e in runs["faulted"] if e["event"] == "checkpoint"]
    # Step 10's upload is reported if it finished before the kill; step 20's always.
    assert ckpts[-1]["step"] == 20 and {e["step"] for e in ckpts} <= {10, 20}
    assert all(e["mode"] == "dcp-async" and e["bytes"] > 0 and e["persist_s"] > 0
               for e in ckpts)
    a, b = losses_by_step(runs["straight"]), losses_by_step(runs["faulted"])
    assert [len(b[s]) for s in range(11, 15)] == [2, 2, 2, 2]  # ran before and after
    for step in range(1, 21):
        assert all(loss == a[step][0] for loss in b[step]), f"step {step}: {a[step]} vs {b[step]}"


@pytest.mark.slow
@NEEDS_ASYNC
def test_a_dcp_directory_given_to_another_mode_is_a_one_line_error(cli_runs):
    root, _ = cli_runs
    log = root / "wrong-mode.log"
    rc = moc(log, "train", "--config", "tiny", "--ckpt-mode", "moc",
             "--ckpt-dir", str(root / "faulted"))
    assert rc == 2
    text = log.read_text().strip()
    assert "\n" not in text and "holds DCP checkpoints" in text, text
