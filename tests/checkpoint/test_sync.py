from __future__ import annotations

import pytest
import torch

from moc.checkpoint.errors import IncompatibleCheckpointError
from moc.checkpoint.policy.selection import PECPolicy
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import step_dir
from moc.checkpoint.sync import Checkpointer
from moc.model import ModelConfig, Transformer
from moc.parallel import ParallelGroups, ShardedAdamW
from tests.engines import save_now

# These tests exercise what is saved, not PLT: most record no routing, on purpose.
pytestmark = pytest.mark.filterwarnings(
    "ignore::moc.checkpoint.policy.tokens.RoutingNotRecordedWarning")

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)


def _trained(seed: int, steps: int) -> tuple[Transformer, ShardedAdamW]:
    torch.manual_seed(seed)
    model = Transformer(CFG)
    opt = ShardedAdamW(model, ParallelGroups.single(CFG.n_experts), lr=1e-2)
    for _ in range(steps):
        idx = torch.randint(0, 256, (2, 8))
        model(idx, idx).loss.backward()
        opt.step()
        model.zero_grad()
    return model, opt


def _ckpt(root, model, opt, cfg=CFG) -> Checkpointer:
    return Checkpointer(model, opt, root, model_meta=cfg.to_dict(), mode="blocking")


def test_restore_is_bitwise_and_returns_the_loop_state(tmp_path):
    model, opt = _trained(0, 3)
    stats = save_now(_ckpt(tmp_path, model, opt), 3, {"step": 3, "note": "x"})
    assert stats.bytes_per_rank[0] > 0
    fresh, fresh_opt = _trained(1, 1)
    result = _ckpt(tmp_path, fresh, fresh_opt).restore()
    assert result.step == 3 and result.extra == {"step": 3, "note": "x"}
    assert result.lost_tokens == 0 and result.plt == 0.0
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    want, got = opt.local_state(), fresh_opt.local_state()
    assert want.keys() == got.keys()
    for name in want:
        for k in want[name]:
            assert torch.equal(want[name][k], got[name][k]), (name, k)


def test_corrupt_newest_step_falls_back_to_older(tmp_path):
    model, opt = _trained(0, 2)
    ckpt = _ckpt(tmp_path, model, opt)
    ckpt.save(1, {"step": 1})
    ckpt.save(2, {"step": 2})
    f = step_dir(tmp_path, 2) / "rank-00000.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    result = _ckpt(tmp_path, *_trained(1, 1)).restore()
    assert result.step == 1
    assert "checksum mismatch" in result.skipped[0]


def test_restore_into_a_different_model_is_refused(tmp_path):
    model, opt = _trained(0, 1)
    _ckpt(tmp_path, model, opt).save(1, {"step": 1})
    other = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=8)
    m2 = Transformer(other)
    o2 = ShardedAdamW(m2, ParallelGroups.single(8), lr=1e-2)
    with pytest.raises(IncompatibleCheckpointError, match="n_experts: checkpoint 4 vs now 8"):
        _ckpt(tmp_path, m2, o2, other).restore()


# -- partial experts checkpointing ------------------------------------------------------


PEC_CFG = ModelConfig(seq_len=8, d_model=32, n_layers=2, n_heads=2, d_ffn=64, n_experts=8)


def _pec_model(seed: int = 0) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Transformer(PEC_CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (2, 8), generator=g)
    out = model(idx, idx)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    return out.tokens_per_expert


def _pec(root, model, opt, **policy) -> Checkpointer:
    return Checkpointer(model, opt, root, policy=PECPolicy(**policy), interval=1)


def test_sequential_k1_saves_every_expert_once_per_8_checkpoints_and_size_matches_formula(
        tmp_path):
    model, opt = _pec_model()
    ckpt = _pec(tmp_path, model, opt, k=1)
    for step in range(0, 9):  # step 0: the chain's first (full) checkpoint
        ckpt.record_routing(_train_step(model, opt, step))
        ckpt.save(step)
    saved = [[0] * 8 for _ in range(2)]
    for step in range(1, 9):
        m = Manifest.load(tmp_path, step)
        assert m.policy["k"] == 1
        for layer, experts in m.experts_saved.items():
            assert len(experts) == 1
            saved[int(layer)][experts[0]] += 1
    assert saved == [[1] * 8, [1] * 8]

    # Size: (P_ne + K/N P_e) (B_w + B_o), B_w = 4 (fp32), B_o = 8 (two fp32 moments).
    experts = {p.name for p in ckpt.spec.params}
    p_e = sum(p.numel() for n, p in model.named_parameters() if n in experts)
    p_ne = sum(p.numel() for n, p in model.named_parameters() if n not in experts)
    predicted = (p_ne + p_e / 8) * (4 + 8)
    for step in range(1, 9):
        m = Manifest.load(tmp_path, step)
        written = sum(m.files.values())
        path = step_dir(tmp_path, step) / "rank-00000.safetensors"
        header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
        scalars = sum(4 for k, e in m.entries.items() if e.step == step and e.shape == ())
        rng = sum(5056 for k in m.entries if k.startswith("rng/"))
        metadata = header + scalars + rng
        assert abs(written - metadata - predicted) <= 0.02 * predicted, (step, written)


def test_pec_restore_takes_each_expert_from_its_newest_copy(tmp_path):
    model, opt = _pec_model()
    ckpt = _pec(tmp_path, model, opt, k=1)
    copies = {}
    for step in range(3):
        _train_step(model, opt, step)
        ckpt.save(step)
        copies[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
    fresh, fresh_opt = _pec_model(seed=9)
    report = _pec(tmp_path, fresh, fresh_opt, k=1).restore()
    assert report.step == 2
    m = Manifest.load(tmp_path, 2)
    w1 = dict(fresh.named_parameters())["layers.0.ffn.experts.w1_LDF"]
    for e in range(8):
        src = m.entries[f"param/layers.0.ffn.experts.w1_LDF/expert={e}"].step
        assert torch.equal(w1[e], copies[src]["layers.0.ffn.experts.w1_LDF"][e]), e
    assert {m.entries[f"param/layers.0.ffn.experts.w1_LDF/expert={e}"].step
            for e in range(8)} == {0, 1, 2}
    for name, p in fresh.named_parameters():
        if "experts" not in name:
            assert torch.equal(p, copies[2][name]), name


@pytest.mark.parametrize(("apply_to", "partial_kind"), [("weights", "param"),
                                                         ("optimizer", "optim")])
def test_apply_to_makes_only_that_part_partial(tmp_path, apply_to, partial_kind):
    model, opt = _pec_model()
    ckpt = _pec(tmp_path, model, opt, k=2, apply_to=apply_to)
    for step in range(2):
        _train_step(model, opt, step)
        ckpt.save(step)
    m = Manifest.load(tmp_path, 1)
    fresh_experts = {k.split("/expert=")[1].split("/")[0] for k, e in m.entries.items()
                     if "/expert=" in k and e.step == 1 and k.startswith(partial_kind)
                     and "layers.0." in k}
    assert len(fresh_experts) == 2
    other = "optim" if partial_kind == "param" else "param"
    assert all(e.step == 1 for k, e in m.entries.items() if k.startswith(other))


def test_plt_of_a_recovery_is_computed_from_the_routing_counts(tmp_path):
    model, opt = _pec_model()
    ckpt = _pec(tmp_path, model, opt, k=1)
    counts = torch.arange(16, dtype=torch.int64).view(2, 8)
    ckpt.record_routing(counts)
    ckpt.save(0)                      # full: every expert fresh
    ckpt.record_routing(2 * counts)
    ckpt.save(1)                      # sequential c=1: layer m saves expert (m + 1) % 8
    report = _pec(tmp_path, *_pec_model(3), k=1).restore()
    lost = (2 * counts).clone()
    lost[0, 1] = lost[1, 2] = 0
    assert report.lost_per_layer == lost.sum(1).tolist()
    total = (3 * counts).sum(1).double()
    assert report.plt == pytest.approx(float((lost.sum(1) / total).mean()))


def test_full_policy_recovery_loses_no_tokens(tmp_path):
    model, opt = _pec_model()
    ckpt = Checkpointer(model, opt, tmp_path, interval=1)
    ckpt.record_routing(_train_step(model, opt, 0))
    ckpt.save(1)
    report = Checkpointer(*_pec_model(1), tmp_path).restore()
    assert report.lost_tokens == 0 and report.plt == 0.0


def test_dynamic_k_doubles_k_when_plt_exceeds_the_threshold_and_persists_it(tmp_path):
    model, opt = _pec_model()
    ckpt = _pec(tmp_path, model, opt, k=1, dynamic_k=True, plt_threshold=0.05)
    ckpt.record_routing(torch.ones(2, 8, dtype=torch.int64))
    ckpt.save(0)
    ckpt.record_routing(torch.full((2, 8), 10, dtype=torch.int64))
    ckpt.save(1)
    model2, opt2 = _pec_model(1)
    resumed = _pec(tmp_path, model2, opt2, k=1, dynamic_k=True, plt_threshold=0.05)
    report = resumed.restore()
    assert report.plt > 0.05 and (report.k_before, report.k) == (1, 2)
    resumed.save(2)
    assert Manifest.load(tmp_path, 2).policy["k"] == 2
    assert all(len(v) == 2 for v in Manifest.load(tmp_path, 2).experts_saved.values())


def test_saving_a_step_number_again_keeps_the_newest_checkpoint_restorable(tmp_path):
    model, opt = _pec_model()
    ckpt = Checkpointer(model, opt, tmp_path, policy=PECPolicy(k=1), interval=1, keep_last=1)
    for step in (10, 20, 20):  # e.g. a final save right after maybe_save saved that step
        _train_step(model, opt, step)
        ckpt.save(step)
    ckpt.close()
    fresh, fresh_opt = _pec_model(5)
    report = _pec(tmp_path, fresh, fresh_opt, k=1).restore()
    assert report.step == 20 and not report.skipped
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        if "experts" not in n:
            assert torch.equal(a, b), n


def test_restore_keeps_the_configured_k_unless_dynamic_k_raised_it(tmp_path):
    model, opt = _pec_model()
    Checkpointer(model, opt, tmp_path, interval=1).save(1)  # full policy: k = N
    resumed = _pec(tmp_path, *_pec_model(1), k=1)
    assert resumed.restore().k == 1
    assert save_now(resumed, 2).k == 1


def test_a_rank_that_fails_to_write_leaves_the_previous_checkpoint_newest(tmp_path,
                                                                          monkeypatch):
    model, opt = _pec_model()
    ckpt = _pec(tmp_path, model, opt, k=1)
    ckpt.save(1)
    import moc.checkpoint.store.format as tensor_files

    def disk_full(path, tensors):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tensor_files, "write_safetensors", disk_full)
    stats = save_now(ckpt, 2)
    assert not stats.ok and "No space left" in stats.error
    monkeypatch.undo()
    assert Manifest.load(tmp_path, 1).step == 1
    from moc.checkpoint.store.steps import complete_steps
    assert complete_steps(tmp_path) == [1]
    assert save_now(ckpt, 3).ok  # the chain goes on from step 1
    assert Manifest.load(tmp_path, 3).policy["index"] == 1


def test_a_retention_error_of_the_last_save_is_raised_by_close(tmp_path, monkeypatch):
    """Deleting old steps fails in the background; with no later save to report it,
    close() must, and never swallow it."""
    import moc.checkpoint.store.retention as retention
    from moc.checkpoint.errors import CheckpointError

    def full_disk(root, keep_last):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(retention, "apply_retention", full_disk)
    model, opt = _pec_model()
    ckpt = Checkpointer(model, opt, tmp_path, policy=PECPolicy(k=1), interval=1, keep_last=1)
    ckpt.save(1)
    ckpt.parts.retention.wait()  # the background deletion step 1 asked for has failed
    ckpt.save(2)  # its request finds the error and keeps it for every rank
    with pytest.raises(CheckpointError, match=r"deleting old checkpoints.*No space left"):
        ckpt.close()
