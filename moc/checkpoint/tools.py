"""Read-only tools over a checkpoint directory: `moc inspect` and `moc verify`.

Both read only complete steps (a directory without manifest.json is never opened) and
never write. `inspect` reads manifests only, so it is cheap on a large checkpoint and
shows what a partial-checkpoint policy did: which experts each step saved and how stale
every expert's newest copy is. `verify` reads every tensor and re-checks its CRC32 with
the same reader recovery uses, so "verify passes" means "recovery would read it intact".

The functions here return plain data (a JSON-ready dict, a dataclass) and the
`format_*` functions turn it into text; the CLI only parses arguments and prints.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moc.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from moc.checkpoint.recovery import CheckpointReader, line_problems
from moc.checkpoint.shards import extent, piece_index, split_key, tiles
from moc.checkpoint.spec import parse_expert_key
from moc.checkpoint.store.backend import ObjectPath
from moc.checkpoint.store.identity import RUN_FILE, read_run_id
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.retention import referenced_steps
from moc.checkpoint.store.steps import (
    MANIFEST,
    STEP_RE,
    SUPERSEDED,
    complete_steps,
    is_rank_file,
    step_dir,
)
from moc.checkpoint.store.storage import Storage, open_storage

ALL = "all"
"""Shown for K and experts_saved when a step saved every expert (no partial policy)."""

MAX_REASONS_SHOWN = 10
"""Reasons printed per bad file: a corrupt file can fail every key it holds, and the
first few name the problem as well as all of them would (VerifyReport keeps them all)."""


def _steps_of(storage: Storage) -> list[int]:
    """Complete steps of `storage`; ValueError (bad user input) when there are none."""
    root = storage.root
    try:
        found = root.is_dir()
    except OSError as e:  # an object store that cannot be reached: say which, and why
        raise ValueError(f"cannot read {root}: {e}; check AWS_ENDPOINT_URL and the "
                         "credentials in the environment") from None
    if not found:
        raise ValueError(f"{root} {storage.absent()}; pass a checkpoint directory (the "
                         "--ckpt-dir of a training run)")
    steps = complete_steps(root)
    if not steps:
        raise ValueError(f"{root} holds no complete checkpoint step (no "
                         f"step-NNNNNNNN/{MANIFEST}); is it the right directory?")
    return steps


def _strip_path(message: str, path: Path) -> str:
    """Errors from storage start with the file's path; the reports already group by file."""
    prefix = f"{path}: "
    return message[len(prefix):] if message.startswith(prefix) else message


# ---------------------------------------------------------------------------- inspect


def _k_of(manifest: Manifest) -> int | str:
    # A full save has no policy, or a full one (whose K is every expert), or none without
    # a K: every expert is saved.
    policy = manifest.policy
    full = policy.get("name") == "full" or policy.get("selection") == "full"
    return ALL if full or policy.get("k") is None else policy["k"]


def _experts_saved_of(manifest: Manifest) -> dict[str, list[int]] | str:
    """ALL when the step saved every expert: no experts_saved (a full save by a writer
    that does not record it), or one listing every expert of every MoE layer."""
    saved = manifest.experts_saved
    n_experts, n_layers = manifest.experts.get("n_experts"), manifest.experts.get("n_moe_layers")
    if not saved or (n_experts and n_layers and len(saved) == n_layers and all(
            sorted(ids) == list(range(n_experts)) for ids in saved.values())):
        return ALL
    return {layer: sorted(ids) for layer, ids in
            sorted(saved.items(), key=lambda kv: _layer_order(kv[0]))}


def _layer_order(label: str) -> tuple[int, int | str]:
    """MoE layer labels ("0", "1", ...) sort numerically; stem labels after them."""
    return (0, int(label)) if label.isdigit() else (1, label)


def expert_ages(manifest: Manifest) -> dict[str, Any]:
    """How many steps old each expert's newest copy is, per MoE layer, at `manifest.step`.

    An expert's newest copy is as old as its oldest tensor: the age of expert g in layer
    m is the manifest's step minus the smallest `entry.step` over g's `param/` keys of
    the stems of layer m, since a restore brings every one of them back and loses the
    updates since the oldest. This is the definition the checkpointer itself uses for
    staleness (`ChainState.saved_at`, from each entry's step): it follows the optimizer
    keys instead when only the optimizer state is partial (policy apply_to "optimizer"),
    and so does this;
    an expert with no keys of that kind falls back to the other kind.

    Without the manifest's `experts` field (stem -> MoE layer) stems cannot be grouped
    into layers reliably, so ages are reported per stem instead: `by` says which.
    """
    stems = {str(s): int(m) for s, m in manifest.experts.get("stems", {}).items()}
    by = "moe_layer" if stems else "stem"
    tracked = "optim" if manifest.policy.get("apply_to") == "optimizer" else "param"
    oldest: dict[str, dict[tuple[str, int], int]] = {"param": {}, "optim": {}}
    for key, entry in manifest.entries.items():
        parsed = parse_expert_key(key)
        if parsed is None:
            continue
        kind, stem, g = parsed
        at = (str(stems[stem]) if stem in stems else stem, g)
        steps = oldest[kind]
        steps[at] = min(steps.get(at, entry.step), entry.step)
    other = oldest["optim" if tracked == "param" else "param"]
    seen = oldest[tracked].keys() | other.keys()
    n_experts = int(manifest.experts.get("n_experts") or manifest.model.get("n_experts")
                    or max((g + 1 for _, g in seen), default=0))
    ages: dict[str, list[int | None]] = {}
    for group in sorted({group for group, _ in seen}, key=_layer_order):
        row: list[int | None] = []
        for g in range(n_experts):
            saved = oldest[tracked].get((group, g), other.get((group, g)))
            row.append(None if saved is None else manifest.step - saved)
        ages[group] = row
    return {"step": manifest.step, "by": by, "n_experts": n_experts, "expert_age": ages}


def inspect_checkpoints(root: str | Path) -> dict[str, Any]:
    """What every complete step of `root` holds, from the manifests alone (no tensor is
    read). Returns a JSON-ready dict:

        {"dir": str,
         "steps": [{"step": int, "mode": str, "bytes": int, "files": int, "keys": int,
                    "k": int | "all", "experts_saved": {"<layer>": [ids]} | "all",
                    "corrupt": None | str, "damaged": None | str}, ...],  # oldest first
         "newest": {"step": int, "by": "moe_layer" | "stem", "n_experts": int,
                    "expert_age": {"<layer or stem>": [age or None, by expert id]}} | None,
         "superseded": [{"step": int, "bytes": int, "read_by": [int]}, ...]}

    `superseded`: the step directories retention (`keep_last`) demoted to data
    (`store.retention`: manifest.json renamed to manifest.superseded.json): no longer
    checkpoints, kept because the complete steps in `read_by` read experts from their
    files (a partial checkpoint's experts live where they were last written); deleted
    once none does.

    A step whose manifest cannot be loaded is listed with `corrupt` set to the reason
    and None elsewhere. `damaged`: the first file of the step that is missing or not the
    size its manifest records (a stat per file: a truncated shard is found here, a
    flipped byte only by `verify_checkpoints`, which reads every byte). `newest`
    describes the newest step whose manifest loads (recovery skips unreadable manifests
    too), None if there is none. Raises ValueError when `root` is missing or holds no
    complete step.
    """
    storage = open_storage(root)
    root = storage.root
    steps = []
    newest: Manifest | None = None
    reads: dict[int, set[int]] = {}  # complete step -> the step directories it reads
    for step in _steps_of(storage):
        try:
            manifest = Manifest.load(root, step)
        except (CorruptCheckpointError, IncompatibleCheckpointError) as e:
            steps.append({"step": step, "mode": None, "bytes": None, "files": None,
                          "keys": None, "k": None, "experts_saved": None,
                          "corrupt": _strip_path(str(e), step_dir(root, step) / MANIFEST),
                          "damaged": None})
            continue
        newest = manifest
        reads[step] = referenced_steps(manifest)
        wrong = next((f"{path.name}: {problem}"
                      for path, problem in _file_sizes(root, step, manifest)
                      if problem is not None), None)
        steps.append({"step": step, "mode": manifest.mode,
                      "bytes": sum(manifest.files.values()), "files": len(manifest.files),
                      "keys": len(manifest.entries), "k": _k_of(manifest),
                      "experts_saved": _experts_saved_of(manifest), "corrupt": None,
                      "damaged": wrong})
    superseded = [{"step": step, "bytes": _rank_bytes(root, step),
                   "read_by": sorted(s for s, needs in reads.items() if step in needs)}
                  for step in _superseded_steps(root)]
    return {"dir": str(root), "steps": steps,
            "newest": None if newest is None else expert_ages(newest),
            "superseded": superseded}


def _file_sizes(root: Path | ObjectPath, step: int, manifest: Manifest
                ) -> Iterator[tuple[Path | ObjectPath, str | None]]:
    """Each file the manifest of `step` lists, and what is wrong with it by its size
    alone (missing, or not the size recorded), None if nothing: a stat per file, no byte
    read. `inspect` and `verify` both check it."""
    for name, size in manifest.files.items():
        path = step_dir(root, step) / name
        if not path.is_file():
            yield path, f"file is missing (manifest of step {step} records {size} bytes)"
        elif (actual := path.stat().st_size) != size:
            yield path, f"size is {actual} bytes, manifest of step {step} records {size}"
        else:
            yield path, None


def _superseded_steps(root: Path | ObjectPath) -> list[int]:
    """Step directories with manifest.superseded.json and no manifest.json, oldest first."""
    found = []
    for d in root.iterdir():
        m = STEP_RE.match(d.name)
        if m and (d / SUPERSEDED).is_file() and not (d / MANIFEST).is_file():
            found.append(int(m.group(1)))
    return sorted(found)


def _rank_bytes(root: Path | ObjectPath, step: int) -> int:
    """The bytes of a step directory's rank files."""
    return sum(f.stat().st_size for f in step_dir(root, step).iterdir()
               if is_rank_file(f.name))


def _human_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _columns(rows: list[list[str]], right: set[int]) -> list[str]:
    """Align `rows` (the first is the header) into lines; columns in `right` right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                      for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
            for r in rows]


def _saved_text(saved: dict[str, list[int]] | str) -> str:
    if isinstance(saved, str):
        return saved
    return "  ".join(f"L{layer}: {','.join(map(str, ids)) or '-'}"
                     for layer, ids in saved.items())


def format_inspect(info: dict[str, Any], as_json: bool = False) -> str:
    """The human table of `inspect_checkpoints`' result, or the result as one JSON
    document (`as_json`) for machines."""
    if as_json:
        return json.dumps(info, indent=1)
    lines = [f"checkpoints in {info['dir']}: {len(info['steps'])} committed step(s)", ""]
    rows = [["step", "mode", "bytes", "K", "experts saved (MoE layer: expert ids)"]]
    for s in info["steps"]:
        if s["corrupt"] is not None:
            rows.append([str(s["step"]), "CORRUPT", "", "", s["corrupt"]])
        elif s["damaged"] is not None:
            rows.append([str(s["step"]), "DAMAGED", _human_bytes(s["bytes"]), "",
                         s["damaged"]])
        else:
            rows.append([str(s["step"]), s["mode"], _human_bytes(s["bytes"]), str(s["k"]),
                         _saved_text(s["experts_saved"])])
    lines += _columns(rows, right={0, 2})
    lines += _superseded_lines(info.get("superseded") or [])
    bad = [str(s["step"]) for s in info["steps"] if s["corrupt"] or s["damaged"]]
    lines += ["", (f"step(s) {', '.join(bad)} cannot be restored as listed; " if bad else "")
              + "file sizes checked, checksums not: `moc verify "
              f"{info['dir']}` reads every byte"]
    newest = info["newest"]
    if newest is None:
        lines += ["", "no step has a readable manifest: nothing to restore from"]
        return "\n".join(lines)
    lines += ["", f"age in steps of each expert's newest copy at step {newest['step']} "
                  f"({'MoE layer' if newest['by'] == 'moe_layer' else 'stem'} x expert; "
                  "- = not stored)"]
    if not newest["expert_age"]:
        lines.append("(no expert keys)")
        return "\n".join(lines)
    header = ["layer" if newest["by"] == "moe_layer" else "stem"]
    rows = [header + [f"e{g}" for g in range(newest["n_experts"])]]
    for label, ages in newest["expert_age"].items():
        rows.append([label] + ["-" if a is None else str(a) for a in ages])
    lines += _columns(rows, right=set(range(1, len(rows[0]))))
    return "\n".join(lines)


def _superseded_lines(superseded: list[dict[str, Any]]) -> list[str]:
    """What the other step directories are: data of the complete steps, not checkpoints
    (before, `ls` showed five step directories and `inspect` two, with no word why)."""
    if not superseded:
        return []
    lines = ["", f"{len(superseded)} superseded step director"
                 f"{'y' if len(superseded) == 1 else 'ies'}: data, not checkpoints "
                 "(retention renamed their manifest.json",
             "to manifest.superseded.json); kept while a step above reads experts from "
             "their files"]
    rows = [["step", "bytes", "read by"]]
    for s in superseded:
        rows.append([str(s["step"]), _human_bytes(s["bytes"]),
                     ", ".join(map(str, s["read_by"])) or "none (deleted at the next save)"])
    return lines + _columns(rows, right={0, 1})


# ----------------------------------------------------------------------------- verify


@dataclass
class VerifyReport:
    """What `verify_checkpoints` checked and what it found wrong."""

    root: Path
    steps: list[int] = field(default_factory=list)
    """Complete steps whose manifest was read (corrupt manifests are in `bad_files`)."""
    keys: int = 0
    """Distinct (file, key) pairs read and checksummed; a key shared by several
    manifests (partial checkpoints point at older steps) is read once."""
    files: int = 0
    """Distinct tensor files referenced by the manifests."""
    tensor_bytes: int = 0
    """Bytes of tensor data read and checksummed."""
    bad_files: dict[str, list[str]] = field(default_factory=dict)
    """Path relative to `root` -> reasons, in the order found."""
    damaged_steps: list[int] = field(default_factory=list)
    """Complete steps recovery could not restore: the manifest is unreadable, or a key
    it needs fails to read (possibly from an older step's file, via a partial chain), or
    the step is another run's, or it reads files of another line of training."""

    @property
    def ok(self) -> bool:
        return not self.bad_files

    @property
    def intact_steps(self) -> list[int]:
        return [s for s in self.steps if s not in self.damaged_steps]

    def flag(self, path: Path, reason: str) -> None:
        reasons = self.bad_files.setdefault(str(path.relative_to(self.root)), [])
        if reason not in reasons:
            reasons.append(reason)


def verify_checkpoints(root: str | Path, only: Iterable[int] | None = None) -> VerifyReport:
    """Re-check every byte every complete step of `root` depends on (of the steps in
    `only`, when given: `moc train` checks a finished run's final step this way).

    For every manifest: it must be of the directory's run (`moc-run.json`), every older
    step whose files it reads must be of its own line of training (its lineage), each
    file it lists must exist with the recorded size, and each key it names (in whichever
    step's directory holds it) must read back with its recorded checksum and shape.
    Problems are collected by file rather than raised, so one run lists everything that
    is wrong. Raises ValueError when `root` is missing or
    holds no complete step.
    """
    storage = open_storage(root)
    root = storage.root
    report = VerifyReport(root)
    # (file, key) -> read back intact. Partial chains name the same pair in many
    # manifests; it is read once.
    key_ok: dict[tuple[Path, str], bool] = {}
    missing: dict[Path, set[str]] = defaultdict(set)
    files: set[Path] = set()
    steps = _steps_of(storage)
    if only is not None:
        wanted = set(only)
        steps = [step for step in steps if step in wanted]
    try:
        run_id = read_run_id(root)
    except CheckpointError as e:
        report.flag(root / RUN_FILE, _strip_path(str(e), root / RUN_FILE))
        run_id = None
    manifests: dict[int, Manifest] = {}
    for step in steps:
        manifest_path = step_dir(root, step) / MANIFEST
        try:
            manifest = Manifest.load(root, step)
        except (CorruptCheckpointError, IncompatibleCheckpointError) as e:
            report.flag(manifest_path, _strip_path(str(e), manifest_path))
            report.damaged_steps.append(step)
            continue
        manifests[step] = manifest
        report.steps.append(step)
        if not _same_line(root, manifest, run_id, manifests, report):
            report.damaged_steps.append(step)
        for path, problem in _file_sizes(root, step, manifest):
            files.add(path)
            if problem is not None:
                report.flag(path, problem)
        if not _pieces_tile(root, manifest, report) and step not in report.damaged_steps:
            report.damaged_steps.append(step)
        reader = CheckpointReader(root, manifest)
        for key, entry in manifest.entries.items():
            path = entry.path(root)
            files.add(path)
            if (path, key) not in key_ok:
                key_ok[path, key] = _verify_key(reader, key, path, entry.shape, step,
                                                report, missing)
            if not key_ok[path, key] and step not in report.damaged_steps:
                report.damaged_steps.append(step)
    for path, keys in missing.items():
        # One line per missing file, not one per key it should hold.
        report.flag(path, f"file is missing; {len(keys)} key(s) point at it, e.g. "
                          f"{min(keys)!r}")
    report.files = len(files)
    report.damaged_steps.sort()
    return report


def _pieces_tile(root: Path | ObjectPath, manifest: Manifest, report: VerifyReport) -> bool:
    """Whether every tensor stored as pieces (a DTensor layout) is tiled by them: each
    element in exactly one piece, up to the parameter's shape where the manifest's model
    description records it (a lost last piece leaves no gap otherwise). A gap or an
    overlap is flagged on the manifest."""
    ok = True
    dense = manifest.model.get("dense") if isinstance(manifest.model, dict) else None
    for key, stored in piece_index((k, e.shape) for k, e in manifest.entries.items()).items():
        if len(stored) == 1 and split_key(stored[0][0])[1] is None:
            continue  # stored whole
        boxes = [b for _, b in stored]
        name = key.split("/")[1] if key.startswith(("param/", "optim/")) else None
        whole = dense.get(name) if isinstance(dense, dict) else None
        shape = tuple(whole) if isinstance(whole, list) else extent(boxes)
        if not tiles(shape, boxes):
            report.flag(step_dir(root, manifest.step) / MANIFEST,
                        f"the pieces of {key} do not tile it (a gap or an overlap)")
            ok = False
    return ok


def _same_line(root: Path | ObjectPath, manifest: Manifest, run_id: str | None,
               manifests: dict[int, Manifest], report: VerifyReport) -> bool:
    """Whether `manifest`'s step is of the directory's run and of one line of training
    (`recovery.line_problems`); what is not is flagged on its manifest."""
    problems = line_problems(root, manifest, run_id, manifests)
    for problem in problems:
        report.flag(step_dir(root, manifest.step) / MANIFEST, problem)
    return not problems


def _verify_key(reader: CheckpointReader, key: str, path: Path, shape: tuple[int, ...],
                step: int, report: VerifyReport, missing: dict[Path, set[str]]) -> bool:
    """Read one key through recovery's own reader (CRC32 check included); record what is
    wrong in `report` (or `missing`) and return whether it is intact."""
    if not path.is_file():
        missing[path].add(key)
        return False
    report.keys += 1
    try:
        t = reader.get(key)
    except CheckpointError as e:
        report.flag(path, _strip_path(str(e), path))
        return False
    report.tensor_bytes += t.numel() * t.element_size()
    if tuple(t.shape) != shape:
        report.flag(path, f"key {key!r}: shape {tuple(t.shape)} in the file, manifest of "
                          f"step {step} records {shape}")
        return False
    return True


def format_verify(report: VerifyReport) -> str:
    """Summary line(s), then every bad file with its reasons."""
    steps = ", ".join(map(str, report.steps)) or "none"
    lines = [f"verified {report.root}: {len(report.steps)} step(s) ({steps}), "
             f"{report.keys} key(s) in {report.files} file(s), "
             f"{_human_bytes(report.tensor_bytes)} of tensor data"]
    if report.ok:
        lines.append("OK: every checksum and file size matches its manifest")
        return "\n".join(lines)
    intact = ", ".join(map(str, report.intact_steps)) or "none"
    lines.append(f"FAILED: {len(report.bad_files)} bad file(s); damaged steps: "
                 f"{', '.join(map(str, report.damaged_steps)) or 'none'}; intact steps "
                 f"(recovery can restore these): {intact}")
    for path, reasons in report.bad_files.items():
        lines.append(f"  {path}")
        lines += [f"    - {r}" for r in reasons[:MAX_REASONS_SHOWN]]
        if len(reasons) > MAX_REASONS_SHOWN:
            lines.append(f"    ... and {len(reasons) - MAX_REASONS_SHOWN} more")
    return "\n".join(lines)
