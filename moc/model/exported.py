"""moc's own model back from what `moc export` wrote, as `from_pretrained` does for a
transformers model:

    moc export ckpt/ out/                                  # config.json + the weights
    model = moc.model.load_exported("out/")                # a Transformer, eval mode, CPU

The export's config.json is `Transformer.config` (`model_type: "moc"`), which the
engines store in every manifest. An export of a checkpoint written before they did has
no config.json: pass the run's `ModelConfig` (`config=`; for `moc train --config NAME`,
`moc.train.config.PRESETS[NAME]["model"]`). Every format of `moc export` is read (`hf`
shards and index, one `model.safetensors`, `pytorch_model.bin`), and the weights are
loaded strictly: a tensor missing, extra or of another shape is an error, never a model
silently half-initialised.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from moc.model.transformer import MODEL_TYPE, ModelConfig, Transformer

INDEX = "model.safetensors.index.json"
SAFETENSORS = "model.safetensors"
TORCH = "pytorch_model.bin"
CONFIG = "config.json"
_NOT_FIELDS = {"model_type", "architectures", "transformers_version"}
"""Keys of config.json that describe the file, not the architecture."""


def load_exported(path: str | Path, *, config: ModelConfig | None = None) -> Transformer:
    """The `Transformer` exported into `path` by `moc export` / `moc.export`, in eval
    mode on the CPU. `config`: the run's ModelConfig, needed only for an export without
    config.json; when both are there they must agree. Raises ValueError, in one line,
    for anything that is not an export of moc's model (a transformers export names
    `from_pretrained`) or whose weights do not fit the config."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory; pass the OUT of `moc export`")
    stored = stored_config(path)
    if config is None:
        if stored is None:
            raise ValueError(
                f"{path} has no {CONFIG} (an export of a checkpoint written before moc "
                "stored the model's config): pass load_exported(path, config=ModelConfig"
                "(...)), the run's model config (moc train --config NAME: "
                "moc.train.config.PRESETS[NAME]['model'])")
        config = stored
    elif stored is not None and stored != config:
        differ = [f.name for f in dataclasses.fields(ModelConfig)
                  if getattr(stored, f.name) != getattr(config, f.name)]
        raise ValueError(f"config differs from {path / CONFIG} in {', '.join(differ)}; "
                         "pass the config the run trained, or none")
    model = Transformer(config)
    try:
        model.load_state_dict(read_weights(path), strict=True)
    except RuntimeError as e:  # missing, unexpected or misshapen tensors
        why = " ".join(str(e).split())
        raise ValueError(f"the weights in {path} do not fit {config}: {why}") from None
    return model.eval()


def stored_config(path: Path) -> ModelConfig | None:
    """The ModelConfig in `path`'s config.json; None without one. Refuses another
    model's config (a transformers export) and fields this moc does not know."""
    f = path / CONFIG
    if not f.is_file():
        return None
    try:
        d: Any = json.loads(f.read_text())
    except ValueError as e:
        raise ValueError(f"{f} is not JSON ({e})") from None
    kind = d.get("model_type") if isinstance(d, dict) else None
    if kind != MODEL_TYPE:
        raise ValueError(f"{f} describes a {kind!r} model, not moc's ({MODEL_TYPE!r}): load "
                         "it with transformers, AutoModelForCausalLM.from_pretrained"
                         f"({str(path)!r})")
    fields = {field.name for field in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - fields - _NOT_FIELDS)
    if unknown:
        raise ValueError(f"{f} has fields this moc's ModelConfig does not know "
                         f"({', '.join(unknown)}): written by a newer moc? Upgrade moc to "
                         "load it")
    return ModelConfig(**{k: v for k, v in d.items() if k in fields})


class _SafetensorError(Exception):
    """safetensors' refusal of a file (its SafetensorError), as `load_file` raises it."""


def load_file(file: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, by the safetensors package, imported here and not
    with moc (a machine with torch alone still imports and trains with moc)."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file as load
    except ImportError:
        raise ImportError(f"{file} is a safetensors file: reading it needs the safetensors "
                          "package (pip install safetensors)") from None
    try:
        return load(file)
    except SafetensorError as e:
        raise _SafetensorError(str(e)) from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of an export, from whichever format it was written in."""
    try:
        if (path / INDEX).is_file():
            shards = json.loads((path / INDEX).read_text())["weight_map"].values()
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(shards)):
                if Path(shard).name != shard:  # a shard is a file of the export itself
                    raise ValueError(f"{path / INDEX} names a shard outside it: {shard!r}")
                state.update(load_file(path / shard))
            return state
        if (path / SAFETENSORS).is_file():
            return load_file(path / SAFETENSORS)
        if (path / TORCH).is_file():
            return torch.load(path / TORCH, map_location="cpu", weights_only=True)
    except (OSError, KeyError, TypeError, _SafetensorError) as e:
        raise ValueError(f"cannot read the weights in {path}: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None
    raise ValueError(f"{path} holds no weights ({INDEX}, {SAFETENSORS} or {TORCH}): is it "
                     "the OUT of `moc export`?")
