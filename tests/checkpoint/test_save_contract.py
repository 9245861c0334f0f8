"""What every save promises before and after it writes: its arguments are checked before
anything is written (on every rank), a failed save is loud, the final one is complete,
an unmeasured loss is reported as unknown, and a model is stored under its own names."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moc
from moc.checkpoint.failures import CheckpointFailedError
from moc.checkpoint.policy.tokens import RoutingNotRecordedWarning
from moc.checkpoint.store.steps import complete_steps, step_dir
from moc.checkpoint.tools import inspect_checkpoints
from moc.model import ModelConfig, Transformer
from tests.distributed import TINY, build_sharded, run_ranks
from tests.fs import fill, tmpfs

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, step: int, ckpt=None):
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(step))
    out = model(idx, idx)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    if ckpt is not None:
        ckpt.record_routing(out.tokens_per_expert)


def _only_entries(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


# -- arguments are checked before anything is written ------------------------------------


@pytest.mark.parametrize("extra, match", [
    ({"loss": torch.tensor(1.0)}, "is a Tensor, which is not JSON"),
    ({"epochs": {3: "done"}}, "key 3 of type int"),
    ({"step": 40}, r"extra_state\['step'\] is 40 but the step saved is 45"),
    ({"best": float("nan")}, "no NaN"),
])
def test_invalid_extra_state_is_refused_before_anything_is_written(tmp_path, extra, match):
    model, opt = _build()
    ckpt = moc.Checkpointer(model, opt, tmp_path)
    with pytest.raises(ValueError, match=match):
        ckpt.save(45, extra)
    assert _only_entries(tmp_path) == []  # no step, no .tmp
    with pytest.raises(ValueError, match="int >= 0"):
        ckpt.save(-3)
    ckpt.save(45, {"step": 45, "epochs": {"3": "done"}})
    assert complete_steps(tmp_path) == [45]
    ckpt.close()


def _bad_extra_on_rank_1(rank: int, world: int, root: str, engine: str) -> list[str]:
    groups, model, opt = build_sharded(2)
    kwargs = {"groups": groups, "interval": 1, "policy": moc.PECPolicy(k=1)}
    ckpt = (moc.Checkpointer(model, opt, root, **kwargs) if engine == "sync"
            else moc.TwoLevelCheckpointer(model, opt, root, **kwargs))
    seen = []
    extra = {"step": 1, "t": torch.zeros(1)} if rank == 1 else {"step": 1}
    try:
        ckpt.save(1, extra)
        ckpt.flush()  # the two-level plan fails on every rank; raised here
    except ValueError as e:
        seen.append(str(e))
    ckpt.save(2, {"step": 2})  # the engine is still usable on every rank
    ckpt.flush()
    seen += [f"ok {r.step}" for r in ckpt.drain_completed() if r.ok]
    ckpt.close()
    return seen


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["sync", "twolevel"])
def test_a_bad_extra_state_on_one_rank_stops_every_rank_without_a_hang(tmp_path, monkeypatch,
                                                                       engine):
    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))
    seen = run_ranks(_bad_extra_on_rank_1, 2, str(tmp_path / "ckpt"), engine, timeout=120)
    for rank_seen in seen:
        assert "not JSON" in rank_seen[0] or "rejected on 1 of 2" in rank_seen[0]
        assert rank_seen[-1] == "ok 2"
    assert complete_steps(tmp_path / "ckpt") == [2]


def test_k_above_the_number_of_experts_is_an_error_not_a_clamp(tmp_path):
    model, opt = _build()
    with pytest.raises(ValueError, match="k=100 is more than the 4 experts"):
        moc.Checkpointer(model, opt, tmp_path, policy=moc.PECPolicy(k=100))


# -- the final checkpoint is complete -----------------------------------------------------


def test_the_final_checkpoint_holds_every_expert_from_its_own_step(tmp_path):
    model, opt = _build()
    ckpt = moc.Checkpointer(model, opt, tmp_path, policy=moc.PECPolicy(k=1), interval=1)
    for step in range(1, 8):
        _step(model, opt, step, ckpt)
        ckpt.maybe_save(step, final=step == 7)
    ckpt.close()
    ages = inspect_checkpoints(tmp_path)["newest"]["expert_age"]
    assert ages and all(a == 0 for row in ages.values() for a in row)
    fresh, fresh_opt = _build(1)
    report = moc.Checkpointer(fresh, fresh_opt, tmp_path, policy=moc.PECPolicy(k=1)).restore()
    assert (report.step, report.lost_tokens, report.plt) == (7, 0, 0.0)


# -- an unmeasured loss is unknown, never 0 ------------------------------------------------


def test_without_routing_counts_a_lossy_recovery_reports_plt_unknown(tmp_path):
    model, opt = _build()
    ckpt = moc.Checkpointer(model, opt, tmp_path, policy=moc.PECPolicy(k=1), interval=1)
    with pytest.warns(RoutingNotRecordedWarning, match="no routing was recorded"):
        for step in range(1, 5):
            _step(model, opt, step)  # record_routing forgotten
            ckpt.save(step)
    ckpt.close()
    fresh, fresh_opt = _build(1)
    report = moc.Checkpointer(fresh, fresh_opt, tmp_path, policy=moc.PECPolicy(k=1)).restore()
    assert report.step == 4 and report.plt is None and report.lost_tokens is None

    counted = tmp_path / "counted"
    model, opt = _build()
    ckpt = moc.Checkpointer(model, opt, counted, policy=moc.PECPolicy(k=1), interval=1)
    for step in range(1, 5):
        _step(model, opt, step, ckpt)
        ckpt.save(step)
    ckpt.close()
    report = moc.Checkpointer(*_build(1), counted, policy=moc.PECPolicy(k=1)).restore()
    assert report.plt > 0 and report.lost_tokens > 0


# -- a failed save is loud -----------------------------------------------------------------


def test_failed_saves_are_logged_then_raise_after_max_failures(tmp_path, caplog):
    with tmpfs(tmp_path / "fs", size="4m") as root:
        model, opt = _build()
        ckpt = moc.Checkpointer(model, opt, root / "ckpt", interval=1, max_failures=3)
        ckpt.save(1)
        fill(root)  # the disk fills up under the job
        ckpt.save(2)
        ckpt.save(3)
        errors = [r.error for r in ckpt.drain_completed()]
        assert errors[0] is None and all("No space left" in e for e in errors[1:])
        assert "failed (2 in a row)" in caplog.text
        with pytest.raises(CheckpointFailedError, match="3 checkpoints in a row failed"):
            ckpt.save(4)
        with pytest.raises(CheckpointFailedError, match=r"the final checkpoint \(step 5\) failed"):
            moc.Checkpointer(model, opt, root / "ckpt", max_failures=None).save(5, final=True)
        assert complete_steps(root / "ckpt") == [1]


# -- a model is stored under its own names, whatever wraps it ------------------------------


def _ddp_without_groups(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer(TINY)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ckpt = moc.Checkpointer(ddp, opt, root, interval=1)  # no groups: DP over the world
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(rank))
    ddp(idx, idx).loss.backward()
    opt.step()
    ckpt.save(1)
    ckpt.close()
    try:  # an expert-parallel model needs its groups: a clear error, not a race
        _, sharded, sharded_opt = build_sharded(2)
        moc.Checkpointer(sharded, sharded_opt, root + "-ep")
    except ValueError as e:
        assert "ParallelGroups.from_world" in str(e)
    else:
        raise AssertionError("an EP-sharded model without groups was accepted")
    dist.barrier()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.integration
def test_a_ddp_model_without_groups_is_saved_under_its_own_names_by_every_rank(tmp_path):
    root = tmp_path / "ckpt"
    states = run_ranks(_ddp_without_groups, 2, str(root), timeout=120)
    manifest = json.loads((step_dir(root, 1) / "manifest.json").read_text())
    assert not [k for k in manifest["entries"] if ".module." in k or "/module." in k]
    assert manifest["layout"]["world_size"] == 2 and len(manifest["files"]) == 2
    plain = Transformer(TINY)
    ckpt = moc.Checkpointer(plain, torch.optim.AdamW(plain.parameters()), root)
    assert ckpt.restore().step == 1
    for k, v in plain.state_dict().items():
        assert torch.equal(v, states[0][k]), k
