from __future__ import annotations

import pytest
import torch

from moc.checkpoint.blocking import BlockingCheckpointer
from moc.checkpoint.errors import IncompatibleCheckpointError
from moc.checkpoint.storage import step_dir
from moc.model import ModelConfig, Transformer
from moc.parallel import ParallelGroups, ShardedAdamW

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


def _ckpt(root, model, opt, cfg=CFG) -> BlockingCheckpointer:
    return BlockingCheckpointer(root, model, opt, ParallelGroups.single(cfg.n_experts),
                                cfg.to_dict())


def test_restore_is_bitwise_and_returns_the_loop_state(tmp_path):
    model, opt = _trained(0, 3)
    stats = _ckpt(tmp_path, model, opt).save(3, {"step": 3, "note": "x"})
    assert stats.bytes_per_rank[0] > 0
    fresh, fresh_opt = _trained(1, 1)
    result = _ckpt(tmp_path, fresh, fresh_opt).restore()
    assert result.step == 3 and result.extra == {"step": 3, "note": "x"}
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
