"""`moc.model.load_exported`: moc's own model back from `moc export`, from every format,
with the config the engines stored; anything else is one clear line.

Checkpoints are written by the real engine and exported by the real export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import moc
from moc.checkpoint.export import FORMATS
from moc.model import MODEL_TYPE, ModelConfig, Transformer, load_exported

CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)


def _trained_export(tmp: Path, fmt: str = "hf") -> tuple[Transformer, Path]:
    """A moc model trained 2 steps and checkpointed (final) by an engine given no
    model_meta, exported in `fmt`; the trained model and OUT."""
    torch.manual_seed(0)
    model = Transformer(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = moc.Checkpointer(model, opt, tmp / "ckpt", policy=moc.PECPolicy(k=1), interval=1)
    for step in (1, 2):
        idx = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator()
                            .manual_seed(step))
        model(idx, idx).loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.record_routing(torch.ones(CFG.n_layers, CFG.n_experts, dtype=torch.int64))
        ckpt.save(step, final=step == 2)
    ckpt.close()
    report = moc.export(tmp / "ckpt", tmp / f"out-{fmt}", format=fmt)
    assert report.config and "config.json" in report.files
    return model, tmp / f"out-{fmt}"


def _logits(model: Transformer) -> torch.Tensor:
    idx = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        return model.eval()(idx).logits_BTV


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_export_format_of_moc_s_model_loads_back_as_trained(tmp_path, fmt):
    trained, out = _trained_export(tmp_path, fmt)
    config = json.loads((out / "config.json").read_text())
    assert config == {"model_type": MODEL_TYPE, "architectures": ["Transformer"],
                      **CFG.to_dict()}
    loaded = load_exported(out)
    assert loaded.cfg == CFG and not loaded.training
    for name, t in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert torch.equal(_logits(loaded), _logits(trained))


def test_an_export_without_config_json_loads_with_the_runs_config(tmp_path):
    """As an export of a checkpoint written before moc stored the model's config."""
    trained, out = _trained_export(tmp_path)
    (out / "config.json").unlink()
    with pytest.raises(ValueError, match=r"has no config.json.*load_exported\(path, "
                                         r"config=ModelConfig"):
        load_exported(out)
    assert torch.equal(_logits(load_exported(out, config=CFG)), _logits(trained))


def test_what_is_not_moc_s_model_or_does_not_fit_is_refused_in_one_line(tmp_path):
    _, out = _trained_export(tmp_path)
    with pytest.raises(ValueError, match=r"config differs from .*config.json in n_layers"):
        load_exported(out, config=ModelConfig(**{**CFG.to_dict(), "n_layers": 3}))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "n_layers": 3}))
    with pytest.raises(ValueError, match=r"the weights in .* do not fit ModelConfig\(.*"
                                         r"Missing key\(s\).*layers\.2\.") as e:
        load_exported(out)
    assert "\n" not in str(e.value)
    (out / "config.json").write_text(json.dumps({**config, "model_type": "mixtral"}))
    with pytest.raises(ValueError, match=r"a 'mixtral' model, not moc's.*from_pretrained"):
        load_exported(out)
    (out / "config.json").write_text(json.dumps({**config, "n_routers": 2}))
    with pytest.raises(ValueError, match=r"fields this moc's ModelConfig does not know "
                                         r"\(n_routers\)"):
        load_exported(out)
    with pytest.raises(ValueError, match="is not a directory"):
        load_exported(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no config.json"):
        load_exported(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"holds no weights"):
        load_exported(tmp_path / "empty", config=CFG)


def test_a_transformers_export_is_pointed_to_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = moc.Checkpointer(model, opt, tmp_path / "ckpt")
    ckpt.save(1, final=True)
    ckpt.close()
    moc.export(tmp_path / "ckpt", tmp_path / "out")
    with pytest.raises(ValueError, match=r"describes a 'mixtral' model, not moc's \('moc'\): "
                                         r"load it with transformers, AutoModelForCausalLM"
                                         r"\.from_pretrained"):
        load_exported(tmp_path / "out")
