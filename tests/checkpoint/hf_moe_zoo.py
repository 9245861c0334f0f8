"""Every Mixture-of-Experts family the installed transformers ships, built tiny from its
own config on the CPU (no downloads): the zoo `test_routing_zoo.py` runs the routing
recorder over.

Families are found in transformers' sources (a modeling file that sets `self.experts`
or `self.num_experts`), so a newer transformers brings its new families into the test
by itself. Each is shrunk by one table of small sizes (`SMALL`: only the keys its config
has), per-layer lists cut to the layers kept, and the few keys a family checks against
each other (`EXTRA`, found by building each one of transformers 5.24). A family that
still does not build is skipped with transformers' error as the reason.
"""

from __future__ import annotations

import importlib
import re
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

LAYERS = 2
VOCAB = 128

SMALL: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "d_model": 32, "intermediate_size": 32,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "num_experts_per_token": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "max_position_embeddings": 64, "first_k_dense_replace": 0,
    "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
    "v_head_dim": 8, "qk_head_dim": 8, "num_nextn_predict_layers": 0,
    "mamba_d_state": 8, "ssm_state_size": 8, "mamba_dt_rank": 8, "mamba_n_heads": 4,
    "mamba_head_dim": 8, "mamba_num_heads": 4, "mamba_d_head": 8,
    "moe_shared_expert_intermediate_size": 16, "shared_experts_intermediate_size": 16,
    "shared_intermediate_size": 16, "dense_intermediate_size": 32,
    "expert_ffn_hidden_size": 16, "ffn_hidden_size": 32, "moe_hidden_size": 16, "d_ff": 32,
    "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
    "num_layers": LAYERS, "num_decoder_layers": LAYERS,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_head_dim": 8, "linear_num_heads": 4,
    "index_head_dim": 8, "index_n_heads": 2, "index_topk": 4,
    "swa_head_dim": 8, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
    "router_hidden_size": 16, "kv_channels": 8, "n_heads": 4, "num_heads": 4,
    "intermediate_size_mlp": 32, "unpadded_vocab_size": VOCAB, "sliding_window": 16,
}
"""Small sizes, each applied where a family's config has the key."""

_ROPE = {"rope_theta": 10000.0, "rope_type": "default"}

EXTRA: dict[str, dict[str, Any]] = {
    "dbrx": dict(d_model=32, n_heads=4, n_layers=LAYERS, max_seq_len=64,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "deepseek_ocr2": dict(mlp_layer_types=["sparse"] * LAYERS, num_experts_per_tok=2,
                          n_shared_experts=1),
    "diffusion_gemma": dict(num_experts=4, top_k_experts=2, moe_intermediate_size=16,
                            per_layer_config={}),
    "dots1": dict(n_shared_experts=1),
    "dots3_note": dict(num_key_value_heads=4),
    "ernie4_5_vl_moe": dict(moe_intermediate_size=[16, 16],
                            rope_parameters={**_ROPE, "mrope_section": [1, 1, 2]}),
    "flint": dict(mlp_only_layers=[]),
    "gemma4": dict(enable_moe_block=True, num_experts=4, top_k_experts=2,
                   moe_intermediate_size=16, vocab_size_per_layer_input=VOCAB,
                   hidden_size_per_layer_input=8, per_layer_config={}),
    "glm4v_moe": dict(rope_parameters={**_ROPE, "partial_rotary_factor": 0.5,
                                       "mrope_section": [1, 1, 0]}),
    "glm5_next": dict(num_key_value_heads=4, index_kpool=4, qk_rope_head_dim=0, head_dim=0,
                      qk_nope_head_dim=8, linear_head_dim=8, linear_num_heads=4),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8),
    "hy_v4": dict(indexer_types=["full"] * LAYERS),
    "hy_v4_vl": dict(qk_rope_head_dim=8, indexer_types=["full"] * LAYERS,
                     rope_parameters={**_ROPE, "mrope_section": [2, 1, 1]}),
    "lfm2_moe": dict(num_dense_layers=0, layer_types=["conv", "full_attention"]),
    "mistral4": dict(rope_parameters={**_ROPE, "llama_4_scaling_beta": 0.1,
                                      "original_max_position_embeddings": 64}),
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe"], mamba_num_heads=4,
                       mamba_head_dim=16, n_groups=1, ssm_state_size=8, chunk_size=8),
    "nllb_moe": dict(encoder_sparse_step=1, decoder_sparse_step=1),
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
                      indexer_budget=16, indexer_compress_ratio=4),
    "switch_transformers": dict(num_sparse_encoder_layers=LAYERS,
                                num_sparse_decoder_layers=LAYERS, d_kv=8),
    "vitpose_backbone": dict(part_features=8, num_experts=4, image_size=[32, 32],
                             patch_size=[16, 16], mlp_ratio=1),
    "zaya": dict(num_experts_per_tok=1),  # Zaya routes to one expert only
}
"""What a family's config checks beyond `SMALL` (found by building each of 5.24's)."""

_NOT_TEXT = ("Vision", "Audio", "Generation", "Sampler", "Encoder", "Talker", "Thinker",
             "CodePredictor", "Sam")


@cache
def families() -> tuple[str, ...]:
    """The model families of the installed transformers that hold experts."""
    import transformers

    models = Path(transformers.__file__).parent / "models"
    found = re.compile(r"self\.(experts|num_experts) = ")
    return tuple(sorted(
        f.parent.name for f in models.glob("*/modeling_*.py")
        if f.name == f"modeling_{f.parent.name}.py" and found.search(f.read_text())))


def config_class(family: str) -> type:
    """The family's text config if it has one (a vision-language model's MoE is in its
    text model), else its main config."""
    module = importlib.import_module(f"transformers.models.{family}")
    names = [n for n in dir(module) if n.endswith("Config")]
    text = [n for n in names if n.endswith("TextConfig") and "Talker" not in n]
    main = [n for n in names if not any(s in n for s in _NOT_TEXT)]
    return getattr(module, text[0] if text else min(main, key=len))


def tiny_config(family: str) -> Any:
    cls = config_class(family)
    default = cls().to_dict()
    kw = {k: v for k, v in SMALL.items() if k in default}
    n_layers = default.get("num_hidden_layers")
    if n_layers is not None:
        kw["num_hidden_layers"] = LAYERS
    for key, value in default.items():
        if isinstance(value, list) and n_layers and len(value) == n_layers:
            # Per-layer lists: layer indices and flags from the front; layer kinds from
            # the back, where the MoE layers are (after the dense ones).
            ints = all(isinstance(x, int) for x in value)
            kw[key] = value[:LAYERS] if ints else value[-LAYERS:]
        if key in ("pad_token_id", "bos_token_id", "eos_token_id") and \
                isinstance(value, int) and value >= VOCAB:
            kw[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key]
    if "kv_lora_rank" in default:  # multi-head latent attention: one rope width, kv heads
        kw.update(head_dim=8, qk_rope_head_dim=8, num_key_value_heads=4)
    kw.update(EXTRA.get(family, {}))
    return cls(**kw)


def model_class(family: str, config: Any) -> type:
    """The causal LM for `config`, else its base model (a text model of a multimodal
    family is not always in transformers' auto mappings)."""
    from transformers import AutoModel, AutoModelForCausalLM

    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            return auto._model_mapping[type(config)]
        except KeyError:
            pass
    module = importlib.import_module(f"transformers.models.{family}")
    found = [getattr(module, n) for n in dir(module)
             if n.endswith(("Model", "ForCausalLM", "Backbone"))
             and not n.endswith("PreTrainedModel")
             and getattr(getattr(module, n), "config_class", None) is type(config)]
    found.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM"),
                              not c.__name__.endswith("Model"), len(c.__name__)))
    return found[0]


def build(family: str, seed: int = 0) -> nn.Module:
    """A tiny `family` model in training mode (seeded init)."""
    config = tiny_config(family)
    torch.manual_seed(seed)
    return model_class(family, config)(config).train()


def forward_loss(model: nn.Module, step: int) -> torch.Tensor:
    """A scalar to backpropagate from one forward of a fixed batch of token ids."""
    idx = torch.randint(3, VOCAB - 3, (2, 8), generator=torch.Generator().manual_seed(step))
    kw: dict[str, Any] = {"input_ids": idx, "use_cache": False}
    if getattr(model.config, "is_encoder_decoder", False):
        kw["decoder_input_ids"] = idx
    out = model(**kw)
    return out[0].float().pow(2).mean()  # logits or the last hidden state
