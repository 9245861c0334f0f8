"""What the engines store of the model for export: its config as JSON (`model_config` in
every manifest, `config.json` in an export). Low in the package's layers, so the engine
core (`parts`) and the export tool above it both read it from here."""

from __future__ import annotations

import json
import logging
from typing import Any

from torch import nn

log = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 1 << 20
"""A model config is a few kB of JSON; anything larger is not stored in manifests (every
manifest carries it), with a warning."""


def model_config_of(model: nn.Module) -> dict[str, Any]:
    """`model.config` as JSON (a transformers `PretrainedConfig`: `to_json_string`, else
    anything with `to_dict`, or a plain dict, as moc's own `Transformer.config` is), for
    `config.json` on export; {} when the model has none or it is not JSON.
    `architectures` is filled in as save_pretrained does."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    try:
        if callable(getattr(config, "to_json_string", None)):
            d = json.loads(config.to_json_string(use_diff=False))
        elif callable(getattr(config, "to_dict", None)):
            d = config.to_dict()
        elif isinstance(config, dict):
            d = dict(config)
        else:
            return {}
        text = json.dumps(d, allow_nan=False)  # strict JSON, as manifests are
    except (TypeError, ValueError) as e:
        log.warning("model.config is not JSON (%s); exports of its checkpoints will have no "
                    "config.json", e)
        return {}
    if not isinstance(d, dict):
        return {}
    if len(text) > MAX_CONFIG_BYTES:
        log.warning("model.config is %d bytes of JSON, over %d; not stored (exports will "
                    "have no config.json)", len(text), MAX_CONFIG_BYTES)
        return {}
    if "architectures" in d and not d["architectures"]:
        d["architectures"] = [type(model).__name__]
    return d
