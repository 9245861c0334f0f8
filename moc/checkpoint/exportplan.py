"""The model's own state dict as one step's manifest describes it, for `moc export`:
each of its names and the keys its tensor is read from (`state_dict_plan`: a piece
layout read whole, experts stacked or named back into their container), and how old
each expert's newest copy is (`expert_ages`: a partial step is named as such).

From the manifest alone: neither the model object nor torch.distributed nor the world
size the run had. Reading the tensors and writing the export are `export`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moc.checkpoint.errors import CheckpointError, IncompatibleCheckpointError
from moc.checkpoint.shards import extent, piece_index
from moc.checkpoint.spec import parse_expert_key
from moc.checkpoint.store.backend import ObjectPath
from moc.checkpoint.store.format import ITEM_SIZES
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import complete_steps


@dataclass(frozen=True)
class _Whole:
    """The dtype and shape of a tensor as a whole (of all its pieces)."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ExportTensor:
    """One tensor of the exported state dict: the keys it is read from, in order, and
    how they are put together (`dim` None: one key as it is; else stacked along dim)."""

    keys: tuple[str, ...]
    dim: int | None
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEM_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def _natural(name: str) -> list[Any]:
    """Sort key: layers.2 before layers.10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def state_dict_plan(manifest: Manifest) -> dict[str, ExportTensor]:
    """The model's own name -> where its tensor comes from, from the manifest alone.
    Raises IncompatibleCheckpointError when the manifest does not say how the model
    named its experts (written before moc recorded it)."""
    entries = manifest.entries
    layouts = manifest.experts.get("params")
    n_experts = manifest.experts.get("n_experts")
    experts: dict[str, dict[int, str]] = {}
    out: dict[str, ExportTensor] = {}

    def put(name: str, t: ExportTensor) -> None:
        if name in out:
            raise IncompatibleCheckpointError(
                f"step {manifest.step}: two keys map to the parameter name {name!r} "
                f"({out[name].keys[0]}, {t.keys[0]}); the manifest's experts.params is wrong")
        out[name] = t

    # A tensor stored as pieces (a DTensor layout) is exported whole: one logical key,
    # read by assembling its pieces.
    wholes = {key: (stored[0][0], extent(b for _, b in stored))
              for key, stored in piece_index((k, e.shape) for k, e in entries.items()).items()}
    for key, (first_key, shape) in wholes.items():
        entry = entries[first_key]
        parsed = parse_expert_key(key)
        if parsed is not None:
            if parsed[0] == "param":
                experts.setdefault(parsed[1], {})[parsed[2]] = key
            continue
        kind, _, name = key.partition("/")
        if kind in ("param", "buffer"):
            put(name, ExportTensor((key,), None, entry.dtype, shape))
    if experts and not isinstance(layouts, dict):
        raise IncompatibleCheckpointError(
            f"step {manifest.step} was written by a moc release that did not record how the "
            "model names its experts (the manifest has no experts.params), so their "
            "parameter names cannot be rebuilt without the model: restore it with "
            "moc.Checkpointer(model, optimizer, dir) and save it again with final=True, "
            "then export the new step")
    for stem, by_id in sorted(experts.items()):
        how = layouts.get(stem)
        ids = sorted(by_id)
        want = list(range(n_experts if isinstance(n_experts, int) else len(ids)))
        if ids != want:
            raise IncompatibleCheckpointError(
                f"step {manifest.step}: stem {stem!r} has experts {ids}, expected "
                f"{want[0]}..{want[-1]}: the checkpoint does not hold every expert")
        first = _Whole(entries[wholes[by_id[0]][0]].dtype, wholes[by_id[0]][1])
        if how is None:
            raise IncompatibleCheckpointError(
                f"step {manifest.step}: the manifest does not say how the model names the "
                f"expert tensors of {stem!r} (experts.params has no entry: the engine's "
                "ExpertSpec was built by hand without `container`); build it with "
                "ExpertSpec.from_modules and save again")
        if "dim" in how:
            dim = how["dim"]
            if any(wholes[by_id[g]][1] != first.shape or entries[wholes[by_id[g]][0]].dtype
                   != first.dtype for g in ids) or dim > len(first.shape):
                raise IncompatibleCheckpointError(
                    f"step {manifest.step}: the experts of {stem!r} differ in shape or dtype "
                    f"(or dim {dim} does not fit {first.shape}); they cannot be stacked")
            shape = (*first.shape[:dim], len(ids), *first.shape[dim:])
            put(stem, ExportTensor(tuple(by_id[g] for g in ids), dim, first.dtype, shape))
            continue
        container = how["container"]
        if container and not stem.startswith(container + "."):
            raise IncompatibleCheckpointError(
                f"step {manifest.step}: stem {stem!r} is not inside its recorded container "
                f"{container!r}")
        rest = stem[len(container) + 1:] if container else stem
        for g in ids:
            dtype, shape = entries[wholes[by_id[g]][0]].dtype, wholes[by_id[g]][1]
            name = f"{container}.{g}.{rest}" if container else f"{g}.{rest}"
            put(name, ExportTensor((by_id[g],), None, dtype, shape))
    return {n: out[n] for n in sorted(out, key=_natural)}


def expert_ages(manifest: Manifest) -> dict[int, list[int]]:
    """MoE layer -> the age in steps of each expert's weights at the manifest's step:
    the step minus the oldest step holding one of its `param/` tensors (0 when every
    one was saved at this step). Optimizer state is not exported, so it is not counted."""
    stems = manifest.experts.get("stems", {})
    oldest: dict[tuple[int, int], int] = {}
    for key, entry in manifest.entries.items():
        parsed = parse_expert_key(key)
        if parsed is None or parsed[0] != "param" or parsed[1] not in stems:
            continue
        at = (stems[parsed[1]], parsed[2])
        oldest[at] = min(oldest.get(at, entry.step), entry.step)
    ages: dict[int, list[int]] = {}
    for (layer, g), saved in sorted(oldest.items()):
        row = ages.setdefault(layer, [])
        row += [0] * (g + 1 - len(row))
        row[g] = manifest.step - saved
    return ages


def stale_message(manifest: Manifest, ages: dict[int, list[int]],
                   root: Path | ObjectPath) -> str:
    stale = sum(1 for row in ages.values() for a in row if a)
    total = sum(len(row) for row in ages.values())
    oldest = max(a for row in ages.values() for a in row)
    complete = _newest_complete_step(root, below=manifest.step)
    hint = (f"; step {complete} is complete (--step {complete})" if complete is not None
            else "; no older step is complete either")
    return (f"step {manifest.step} is partial: {stale} of {total} experts' newest copies "
            f"are older than the step (by up to {oldest} steps), so the export would not be "
            f"the model at step {manifest.step}. Export a complete checkpoint (the final "
            f"save of a run, save(final=True)){hint}; or pass allow_partial=True "
            "(--allow-partial) to export it anyway, each expert at its age")


def _newest_complete_step(root: Path | ObjectPath, below: int) -> int | None:
    """The newest step below `below` whose every expert is as new as the step."""
    for step in reversed([s for s in complete_steps(root) if s < below]):
        try:
            ages = expert_ages(Manifest.load(root, step))
        except CheckpointError:
            continue
        if not any(a for row in ages.values() for a in row):
            return step
    return None
