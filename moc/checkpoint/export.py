"""`moc export`: one checkpoint step as the model's own state dict, for inference or for
another framework.

    report = moc.export("ckpt/", "out/", format="hf")      # newest step
    model = MixtralForCausalLM.from_pretrained("out/")

A step's state is spread over rank files and, under partial experts checkpointing, over
older steps (each expert's newest copy). The manifest says where every key lives, so the
export needs neither the model object nor torch.distributed nor the world size the run
had: it reads every `param/` and `buffer/` key through recovery's validated reader
(checksums included) and names it back as the model named it:

    param/<name>, buffer/<name>               <name>
    param/<stem>/expert=<g>, batched          <stem>: every expert of the layer stacked
                                              along the recorded dim ([E, ...], as
                                              transformers' MixtralExperts holds them)
    param/<stem>/expert=<g>, nn.ModuleList    <container>.<g>.<rest of the stem>

The layout comes from the manifest (`experts.params`, written since this release);
optimizer state and RNG are not exported. A step whose experts are not all as new as
the step (a partial checkpoint) is refused unless `allow_partial`, which reports each
expert's age. Reading never changes the checkpoint directory; the output is written into
a temporary directory next to OUT and renamed into place.

Formats: `hf` (sharded `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`),
`safetensors` (one `model.safetensors`), `torch` (`pytorch_model.bin`, a `torch.save` of
the state dict). Each gets `config.json` when the checkpoint stored the model's config
(`model_config`: a transformers config, saved by the engines), and `moc-export.json`
(where it came from, each expert's age).

Which tensors the state dict holds, and where each comes from, is `exportplan`'s (from
the manifest alone); this module reads them and writes the files.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moc.checkpoint.errors import CheckpointError, CorruptCheckpointError
from moc.checkpoint.exportplan import (
    ExportTensor,
    expert_ages,
    stale_message,
    state_dict_plan,
)
from moc.checkpoint.modelconfig import MAX_CONFIG_BYTES as MAX_CONFIG_BYTES
from moc.checkpoint.modelconfig import model_config_of as model_config_of
from moc.checkpoint.recovery import CheckpointReader, line_problems
from moc.checkpoint.state import read_piece
from moc.checkpoint.store.format import write_safetensors
from moc.checkpoint.store.identity import read_run_id
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import MANIFEST, complete_steps, fsync_dir
from moc.checkpoint.store.storage import Storage, open_storage

log = logging.getLogger(__name__)

FORMATS = ("hf", "safetensors", "torch")
DEFAULT_SHARD_BYTES = 5 * 10**9
"""Largest `hf` shard: save_pretrained's long-standing default ("5GB"); a tensor larger
than it gets a shard of its own."""
SAFETENSORS_METADATA = {"format": "pt"}
"""What transformers' loader expects in a safetensors header."""


class StaleExpertsError(CheckpointError):
    """The step asked for is partial: some expert's newest copy is older than the step,
    so its weights are not the model's at that step."""


@dataclass(frozen=True)
class ExportReport:
    """What `export` wrote."""

    step: int
    out: Path
    format: str
    files: list[str]
    """Files written into `out`, by name."""
    tensors: int
    total_bytes: int
    """Bytes of tensor data (what `metadata.total_size` of the hf index says)."""
    config: bool
    """Whether `config.json` was written (the checkpoint stored the model's config)."""
    expert_age: dict[int, list[int]] = field(default_factory=dict)
    """MoE layer -> age in steps of each expert's newest copy (0: saved at `step`)."""

    @property
    def partial(self) -> bool:
        return any(a for ages in self.expert_age.values() for a in ages)


# -- reading and writing ----------------------------------------------------------------


def _read(reader: CheckpointReader, t: ExportTensor) -> torch.Tensor:
    """One tensor of the export, every key checked against its checksum; a key stored as
    pieces assembled from them (`read_piece`)."""
    one = t.shape if t.dim is None else (*t.shape[:t.dim], *t.shape[t.dim + 1:])
    pieces = [read_piece(reader, k, one) for k in t.keys]
    return pieces[0] if t.dim is None else torch.stack(pieces, dim=t.dim)


def _shards(plan: dict[str, ExportTensor], limit: int) -> list[list[str]]:
    """Names in order, cut into shards of at most `limit` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in plan.items():
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += t.nbytes
    return shards


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _write_files(tmp: Path, fmt: str, plan: dict[str, ExportTensor],
                 read: Callable[[ExportTensor], torch.Tensor], shard_size: int) -> list[str]:
    """The tensor files of `fmt` in `tmp`; reads one shard's tensors at a time."""
    if fmt == "torch":
        state = {name: read(t) for name, t in plan.items()}
        with open(tmp / "pytorch_model.bin", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        return ["pytorch_model.bin"]
    if fmt == "safetensors":
        write_safetensors(tmp / "model.safetensors",
                          {name: read(t) for name, t in plan.items()},
                          metadata=SAFETENSORS_METADATA)
        return ["model.safetensors"]
    shards = _shards(plan, shard_size)
    weight_map: dict[str, str] = {}
    files = []
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(tmp / fname, {n: read(plan[n]) for n in names},
                          metadata=SAFETENSORS_METADATA)
        weight_map.update(dict.fromkeys(names, fname))
        files.append(fname)
    _write_json(tmp / "model.safetensors.index.json",
                {"metadata": {"total_size": sum(t.nbytes for t in plan.values())},
                 "weight_map": weight_map})
    return [*files, "model.safetensors.index.json"]


def _checked_out(storage: Storage, out: Path, force: bool) -> None:
    """Refuse an OUT that would change the checkpoint directory or lose other files."""
    root, r, o = storage.root, storage.local, out.resolve()
    if r is not None and (o == r or r in o.parents or o in r.parents):
        raise ValueError(f"OUT {out} is inside the checkpoint directory {root} (or holds "
                         "it): export never writes into what it reads; choose another OUT")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ValueError(f"OUT {out} exists and is not a directory; choose another OUT")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"OUT {out} exists and is not empty; pass force=True (--force) to "
                         "replace it, or choose another OUT")


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out` (an empty or replaced `out` included), so that
    OUT is either what it was or the complete export."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
        out.rename(old)
    try:
        tmp.rename(out)  # replaces an empty directory
    except BaseException:
        if old is not None:
            old.rename(out)  # OUT as it was
        raise
    fsync_dir(out.parent)
    if old is not None:
        try:
            shutil.rmtree(old)
        except OSError as e:  # the export is in place: not a failed export
            log.warning("the export is in %s; could not remove the replaced %s: %s",
                        out, old, e)


class _ReadFailed(Exception):
    """An OSError while reading the checkpoint, carried past the handler that turns the
    OSErrors of writing OUT into one line: it is the source's, not OUT's."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _parents(out: Path) -> list[Path]:
    """Create OUT's missing parent directories, outermost first, and return them (to
    remove if the export fails). Refuses an ancestor that is a file or a dangling link,
    which `mkdir(parents=True)` reports as "File exists"."""
    missing = []
    p = out.parent
    while not p.exists() and not p.is_symlink():
        missing.append(p)
        p = p.parent
    if not p.is_dir():
        what = (f"a symbolic link to {os.readlink(p)}, which does not resolve"
                if p.is_symlink() and not p.exists() else "not a directory")
        raise ValueError(f"OUT {out} cannot be created: {p} is {what}; choose another OUT")
    made = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
    except BaseException:
        _remove_dirs(made)
        raise
    return made


def _remove_dirs(made: list[Path]) -> None:
    """Remove the directories an export created, innermost first, if still empty."""
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            return


def _unwritable(out: Path, e: OSError | RuntimeError, total: int | None) -> str:
    """One line for an OUT the export cannot write: what the system said, where."""
    why = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
    if getattr(e, "errno", None) == errno.EBUSY and os.path.ismount(out):
        why += " (OUT is a mount point: export into a directory inside it)"
    at = getattr(e, "filename", None)
    where = f" (at {at})" if at and str(at) != str(out) else ""
    room = (f" with room for the export ({total / 1e6:.1f} MB)"
            if total is not None and getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
            else "")
    return (f"cannot write the export to OUT {out}: {why}{where}; OUT is as it was. Choose "
            f"an OUT on a writable file system{room}")


def _write_export(out: Path, write: Callable[[Path], list[str]]) -> list[str]:
    """Run `write(tmp)` in a temporary directory next to OUT, then rename it into place.
    On any failure, the temporary directory and the parents this created are removed
    and OUT is as it was."""
    made = _parents(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        files = write(tmp)
        fsync_dir(tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(made)
        raise
    return files


def _steps_message(storage: Storage, step: int, steps: list[int]) -> str:
    root, near = storage.root, storage.beside(step)
    why = f" ({', '.join(near)} exists: not a complete step)" if near else ""
    return (f"{root} has no complete step {step}{why}; complete steps: "
            f"{', '.join(map(str, steps))}")


def export(directory: str | Path, out: str | Path, *, step: int | None = None,
           format: str = "hf", allow_partial: bool = False,
           shard_size: int = DEFAULT_SHARD_BYTES, force: bool = False,
           progress: Callable[[int, int], None] | None = None) -> ExportReport:
    """Write the model state of one step of the checkpoint `directory` into `out`, under
    the model's own parameter names (see the module docstring). `step`: the newest
    complete step by default. Reads `directory` and never changes it.

    Raises ValueError for bad arguments (no checkpoint there, no such step, an OUT that is
    not empty without `force`), StaleExpertsError for a partial step without
    `allow_partial`, CorruptCheckpointError naming the file for a tensor that fails its
    checks, IncompatibleCheckpointError when the manifest cannot name the tensors.

    `progress(nbytes, total)`, if given, is called after each tensor is read and
    checked, with its bytes and the export's total: a hook for a progress bar (`moc
    export` draws one on a terminal)."""
    storage = open_storage(directory)  # a local directory, or an object store URL
    root = storage.root
    out = Path(os.path.abspath(out))  # "." has no name to rename
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1 byte, got {shard_size}")
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory; pass a checkpoint directory (the "
                         "--ckpt-dir of a training run)")
    steps = complete_steps(root)
    if not steps:
        raise ValueError(f"{root} holds no complete checkpoint step (no "
                         f"step-NNNNNNNN/{MANIFEST}); is it the right directory?")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(_steps_message(storage, step, steps))
    try:
        _checked_out(storage, out, force)
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Path.resolve)
        raise ValueError(_unwritable(out, e, None)) from e
    manifest = Manifest.load(root, step)
    problems = line_problems(root, manifest, read_run_id(root))
    if problems:  # another run's step, or one that mixes two lines: never a model
        raise CorruptCheckpointError(f"{root}/step-{step:08d}: {problems[0]}")
    plan = state_dict_plan(manifest)
    ages = expert_ages(manifest)
    if any(a for row in ages.values() for a in row) and not allow_partial:
        raise StaleExpertsError(stale_message(manifest, ages, root))
    reader = CheckpointReader(root, manifest)
    total = sum(t.nbytes for t in plan.values())

    def read(t: ExportTensor) -> torch.Tensor:
        try:
            tensor = _read(reader, t)
        except OSError as e:
            raise _ReadFailed(e) from e
        if progress is not None:
            progress(t.nbytes, total)
        return tensor

    def write(tmp: Path) -> list[str]:
        files = _write_files(tmp, format, plan, read, shard_size)
        if manifest.model_config:
            _write_json(tmp / "config.json", manifest.model_config)
            files.append("config.json")
        _write_json(tmp / "moc-export.json", {
            "source": storage.name,
            "step": step, "format": format,
            "expert_age": {str(m): row for m, row in ages.items()}})
        return [*files, "moc-export.json"]

    try:
        files = _write_export(out, write)
    except _ReadFailed as e:
        raise e.error from None
    except OSError as e:
        raise ValueError(_unwritable(out, e, total)) from e
    return ExportReport(step, out, format, files, len(plan), total,
                        bool(manifest.model_config), ages)


def format_export(report: ExportReport) -> str:
    """What the CLI prints: where it went, and each expert's age when any is stale."""
    lines = [f"exported step {report.step} ({report.tensors} tensors, "
             f"{report.total_bytes / 1e6:.2f} MB, format {report.format}"
             f"{', with config.json' if report.config else ''}) to {report.out}"]
    if report.partial:
        lines.append("PARTIAL: age in steps of each expert's weights (0 = saved at the step):")
        lines += [f"  MoE layer {m}: " + " ".join(f"e{g}={a}" for g, a in enumerate(row))
                  for m, row in report.expert_age.items()]
    return "\n".join(lines)
