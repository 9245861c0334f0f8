"""The on-disk description of one checkpoint step (docs/FORMAT.md), validated on load.

One manifest says where every key of the state lives: in which step's directory, in
which file, with which dtype, shape and CRC32. Recovery reads a single manifest and
needs nothing else to find and check every byte.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.store.steps import MANIFEST, step_dir

FORMAT_NAME = "moc-checkpoint"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Entry:
    """Where one key of the state is stored."""

    step: int
    """The step directory holding the newest copy of this key."""
    file: str
    """File name inside that step directory."""
    dtype: str
    """safetensors dtype name (F32, BF16, I64, ...)."""
    shape: tuple[int, ...]
    crc32: int

    def path(self, root: Path) -> Path:
        return step_dir(root, self.step) / self.file


@dataclass(frozen=True)
class Manifest:
    step: int
    mode: str
    """Which checkpointing strategy wrote it (blocking, pec, moc, ...)."""
    layout: dict[str, int]
    """Parallel layout at save time: world_size, ep. Informational; keys do not depend on it."""
    model: dict[str, Any]
    """The model's configuration; a restore into a different one is refused."""
    entries: dict[str, Entry]
    files: dict[str, int] = field(default_factory=dict)
    """Bytes of each file written at this step, by file name."""
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON state of the training loop (step counter, data position, schedule, ...)."""
    experts: dict[str, Any] = field(default_factory=dict)
    """{"n_experts": N, "n_moe_layers": M, "stems": {stem: moe layer}}: which key stems
    hold expert tensors, so tools can map keys to (layer, expert)."""
    policy: dict[str, Any] = field(default_factory=dict)
    """The checkpoint policy at this step, e.g. {"name": "pec", "k": 1, "selection":
    "sequential", "apply_to": "both"}."""
    experts_saved: dict[str, list[int]] = field(default_factory=dict)
    """MoE layer index (as a string) -> global expert ids written at this step."""
    tokens: dict[str, Any] = field(default_factory=dict)
    """Routed-token accounting for PLT (see moc.checkpoint.policy.tokens): cumulative counts
    per (layer, expert) at this step and at the save of each expert's newest copy."""
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        d = asdict(self)
        d = {"format": FORMAT_NAME, **d}
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CorruptCheckpointError(f"{source}: manifest is not valid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{source}: not a moc manifest (no "
                                         f"'format': '{FORMAT_NAME}')")
        if d.get("version") != FORMAT_VERSION:
            raise IncompatibleCheckpointError(
                f"{source}: format version {d.get('version')!r}, this moc reads version "
                f"{FORMAT_VERSION}; restore it with the moc release that wrote it")
        required = ("step", "mode", "layout", "model", "entries")
        missing = [k for k in required if k not in d]
        if missing:
            raise CorruptCheckpointError(f"{source}: manifest lacks {', '.join(missing)}")
        try:
            entries = {k: Entry(int(e["step"]), str(e["file"]), str(e["dtype"]),
                                tuple(int(s) for s in e["shape"]), int(e["crc32"]))
                       for k, e in d["entries"].items()}
            return cls(step=int(d["step"]), mode=str(d["mode"]), layout=dict(d["layout"]),
                       model=dict(d["model"]), entries=entries,
                       files={str(k): int(v) for k, v in d.get("files", {}).items()},
                       extra=dict(d.get("extra", {})), experts=_experts(d.get("experts", {})),
                       policy=dict(d.get("policy", {})),
                       experts_saved={str(k): [int(x) for x in v]
                                      for k, v in d.get("experts_saved", {}).items()},
                       tokens=dict(d.get("tokens", {})), version=int(d["version"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(f"{source}: malformed manifest entry ({e!r})") from None

    @classmethod
    def load(cls, root: Path, step: int) -> Manifest:
        path = step_dir(root, step) / MANIFEST
        try:
            text = path.read_text()
        except OSError as e:
            raise CorruptCheckpointError(f"{path}: cannot read manifest ({e.strerror})") from None
        manifest = cls.from_json(text, str(path))
        if manifest.step != step:
            raise CorruptCheckpointError(f"{path}: manifest says step {manifest.step}, "
                                         f"directory says {step}")
        return manifest

    def check_model(self, model: dict[str, Any], source: str) -> None:
        """Raise IncompatibleCheckpointError naming the fields that differ."""
        check_model(self.model, model, source)


MAX_DIFFS_SHOWN = 5
"""A different width changes every parameter's shape; the first few say enough."""


def check_model(saved: dict[str, Any], now: dict[str, Any], source: str) -> None:
    """Raise IncompatibleCheckpointError when a checkpoint's model description `saved`
    differs from the model being restored (`now`), naming the first fields that differ.
    Every kind of checkpoint (moc's manifests, snapshots, the DCP baseline's metadata)
    is checked by this one rule."""
    diffs = differences(saved, now)
    if diffs:
        shown = "; ".join(diffs[:MAX_DIFFS_SHOWN])
        hidden = len(diffs) - MAX_DIFFS_SHOWN
        more = f" (and {hidden} more)" if hidden > 0 else ""
        raise IncompatibleCheckpointError(
            f"{source} was written for a different model ({shown}{more}); "
            "use the same model config or a different --ckpt-dir")


def differences(saved: Any, now: Any, path: str = "") -> list[str]:
    """`path: checkpoint <a> vs now <b>` for every leaf where two JSON values differ."""
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for k in sorted(set(saved) | set(now), key=str):
            sub = f"{path}.{k}" if path else str(k)
            if k not in saved or k not in now:
                out.append(f"{sub}: checkpoint {saved.get(k)!r} vs now {now.get(k)!r}")
            else:
                out += differences(saved[k], now[k], sub)
        return out
    return [] if saved == now else [f"{path}: checkpoint {saved!r} vs now {now!r}"]


def _experts(d: dict[str, Any]) -> dict[str, Any]:
    """Validate the `experts` field: stems must map to MoE layer indices."""
    out = dict(d)
    if "stems" in out:
        out["stems"] = {str(k): int(v) for k, v in dict(out["stems"]).items()}
    for k in ("n_experts", "n_moe_layers"):
        if k in out:
            out[k] = int(out[k])
    return out
