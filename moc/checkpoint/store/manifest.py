"""The on-disk description of one checkpoint step (docs/FORMAT.md), validated on load.

One manifest says where every key of the state lives: in which step's directory, in
which file, with which dtype, shape and checksum. Recovery reads a single manifest and
needs nothing else to find and check every byte.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.lineage import Lineage
from moc.checkpoint.shards import split_key
from moc.checkpoint.store.backend import ObjectPath
from moc.checkpoint.store.format import (
    BITS,
    CHECKSUM,
    CRC32,
    CRC32C,
    ITEM_SIZES,
    XXH3,
    TensorRecord,
    checksum,
    no_duplicate_keys,
)
from moc.checkpoint.store.steps import (
    MANIFEST,
    RANK_FILE_PATTERN,
    checked_step_dir,
    is_rank_file,
    step_dir,
)

FORMAT_NAME = "moc-checkpoint"
FORMAT_VERSION = 5
"""Version 5: the manifest records its run and lineage (`run`: the directory's run id and
the line of training that wrote it, `moc.checkpoint.lineage`). Entries are version 4's:
a 64-bit XXH3 ("xxh3") over bytes, dtype and shape (format.checksum), or, for a tensor
an older step wrote and this one inherits, that step's CRC32C ("crc32c", version 3) or
CRC32 ("crc32", version 2), kept as it was."""
PIECES_VERSION = 6
"""Version 6: version 5, and keys of pieces (`<key>@<offsets>`: a part of a tensor, as one
rank of a DTensor layout held it; `moc.checkpoint.shards`). Written only by a manifest
that holds pieces, so that every other checkpoint stays readable by releases that read
up to version 5, and a release that cannot assemble pieces refuses the step in one line
instead of reporting its keys missing."""
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
"""Version 4: as 5 without `run` (its lineage is unknown). Version 3: "crc32c" (CRC32C)
or an inherited "crc32". Version 2: every entry's "crc32", zlib's CRC32 over bytes,
dtype and shape. Version 1: "crc32" of the bytes alone, converted to version 2's meaning
on load."""
ENTRY_ALGORITHMS = {6: (XXH3, CRC32C, CRC32), 5: (XXH3, CRC32C, CRC32),
                    4: (XXH3, CRC32C, CRC32), 3: (CRC32C, CRC32), 2: (CRC32,), 1: (CRC32,)}
"""The checksum fields an entry of each version may have (exactly one)."""
MAX_MANIFEST_BYTES = 1 << 30
"""A manifest lists keys, not tensors: a model of a million keys needs a few hundred MB.
Anything larger is not a manifest, and is not read into memory."""


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
    crc: int
    """The checksum of dtype, shape and bytes (`format.checksum`)."""
    algo: str = CHECKSUM
    """Which algorithm `crc` is: XXH3, or CRC32C / CRC32 where a version-3 / 2 step
    wrote the tensor. On disk the entry's field is named after it ("xxh3": ...,
    "crc32c": ..., or "crc32": ...)."""

    def path(self, root: Path | ObjectPath) -> Path | ObjectPath:
        return step_dir(root, self.step) / self.file

    @property
    def record(self) -> TensorRecord:
        """What a read of this key must find in the file."""
        return TensorRecord(self.dtype, self.shape, self.crc, self.algo)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "file": self.file, "dtype": self.dtype,
                "shape": list(self.shape), self.algo: self.crc}


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
    model_config: dict[str, Any] = field(default_factory=dict)
    """The model's own configuration (a transformers `config.to_dict()`), when it has one:
    what `moc export` writes as config.json. Informational; restore never compares it."""
    run: dict[str, Any] = field(default_factory=dict)
    """{"id": the directory's run id, "line": the lineage of the training that wrote this
    step (`moc.checkpoint.lineage`)}; {} in a manifest older than version 5."""
    version: int = FORMAT_VERSION

    @property
    def lineage(self) -> Lineage:
        """The line of training this step belongs to (unknown before version 5)."""
        if not self.run:
            return Lineage.unknown()
        return Lineage.from_json(self.run["line"], "run.line")

    @property
    def run_id(self) -> str | None:
        return self.run.get("id")

    def to_json(self) -> str:
        """Compact JSON (`python -m json.tool` shows it indented): written once per
        checkpoint by the persist process, where an indented dump of a few thousand
        entries cost more CPU than the rest of the commit (Python's encoder, not the C
        one, runs for `indent`)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["entries"] = {k: e.to_dict() for k, e in self.entries.items()}
        for name in ("model_config", "run"):
            if not d[name]:
                # Absent rather than empty: a manifest without it stays readable by
                # releases that refuse unknown fields (0.3.0).
                del d[name]
        if any("@" in k for k in self.entries):
            d["version"] = PIECES_VERSION
        d = {"format": FORMAT_NAME, **d}
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str, known: Manifest | None = None) -> Manifest:
        """Parse and validate a manifest. Everything in it is checked (types, ranges,
        and that the fields agree with one another), since recovery acts on it: a
        malformed field is CorruptCheckpointError (recovery falls back to an older
        step), never a traceback later. An older readable manifest comes back as the
        current version: its entries keep their CRC32 ("crc32" algo; a version-1
        checksum extended over dtype and shape), so in memory every manifest means the
        same, and a new step carries inherited entries over unchanged.
        IncompatibleCheckpointError is for a format version this moc cannot read.

        `known`: a manifest this function returned before (the chain's previous step;
        never one built in memory, whose entries were not checked). An entry of this
        one that is exactly the JSON of `known`'s entry under the same key (types
        included) is taken from it instead of being checked again: a chain's next
        manifest carries all but K experts' entries over unchanged, and checking each
        of them again was half of a plan's CPU time with a checkpoint every step."""
        try:
            d = json.loads(text, object_pairs_hook=no_duplicate_keys)
        except ValueError as e:  # JSONDecodeError, and duplicate keys
            raise CorruptCheckpointError(f"{source}: manifest is not valid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{source}: not a moc manifest (no "
                                         f"'format': '{FORMAT_NAME}')")
        version = d.get("version")
        if not _is_int(version):
            raise CorruptCheckpointError(f"{source}: manifest 'version' is {version!r}, "
                                         "expected an integer")
        if version not in READABLE_VERSIONS:
            raise IncompatibleCheckpointError(
                f"{source}: format version {version!r}, this moc reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}; restore it with the moc "
                "release that wrote it")
        required = ("step", "mode", "layout", "model", "entries")
        missing = [k for k in required if k not in d]
        if missing:
            raise CorruptCheckpointError(f"{source}: manifest lacks {', '.join(missing)}")
        try:
            return _parse(d, version, known.entries if known is not None else {})
        except _Malformed as e:
            raise CorruptCheckpointError(
                f"{source}: malformed manifest: {e}; the step is corrupt (recovery uses an "
                "older one)") from None

    @classmethod
    def load(cls, root: Path | ObjectPath, step: int, known: Manifest | None = None
             ) -> Manifest:
        """`step`'s manifest (`known`: see `from_json`)."""
        return cls.decode(*read_manifest(root, step), step, known)

    @classmethod
    def decode(cls, raw: bytes, path: Path | ObjectPath, step: int,
               known: Manifest | None = None) -> Manifest:
        """The manifest of `step` from the bytes `read_manifest` returned."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{path}: over {MAX_MANIFEST_BYTES} bytes; not a "
                                         "manifest")
        try:
            text = raw.decode()
        except UnicodeDecodeError as e:
            raise CorruptCheckpointError(f"{path}: manifest is not UTF-8 ({e})") from None
        manifest = cls.from_json(text, str(path), known)
        if manifest.step != step:
            raise CorruptCheckpointError(f"{path}: manifest says step {manifest.step}, "
                                         f"directory says {step}")
        return manifest

    def check_model(self, model: dict[str, Any], source: str) -> None:
        """Raise IncompatibleCheckpointError naming the fields that differ."""
        check_model(self.model, model, source)


MAX_DIFFS_SHOWN = 5
"""A different width changes every parameter's shape; the first few say enough."""


def read_manifest(root: Path | ObjectPath, step: int) -> tuple[bytes, Path | ObjectPath]:
    """The bytes of `step`'s manifest file, unparsed, and its path (a symbolic link or
    an oversized file is refused as a corrupt step)."""
    path = checked_step_dir(root, step) / MANIFEST
    if isinstance(path, ObjectPath):
        try:
            return path.read_bytes(MAX_MANIFEST_BYTES), path
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: manifest is missing") from None
        except OSError as e:
            raise CorruptCheckpointError(f"{path}: cannot read manifest ({e})") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        what = "is a symbolic link" if os.path.islink(path) else e.strerror
        raise CorruptCheckpointError(f"{path}: cannot read manifest ({what})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read(MAX_MANIFEST_BYTES + 1), path
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot read manifest ({e.strerror})") from None


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
            "use the same model config, or another checkpoint directory")


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


# -- validation: a manifest's every field ---------------------------------------------


class _Malformed(ValueError):
    """What is wrong with one field; from_json turns it into CorruptCheckpointError."""


FIELDS = {"format", "version", "step", "mode", "layout", "model", "entries", "files",
          "extra", "experts", "policy", "experts_saved", "tokens", "model_config", "run"}
ENTRY_FIELDS = {"step", "file", "dtype", "shape"}
"""And one checksum field, named after its algorithm (`ENTRY_ALGORITHMS`)."""
POLICY_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "selection": (str,), "apply_to": (str,), "dynamic_k": (bool,),
    "plt_threshold": (int, float), "plt_base": (int, float)}
"""Typed policy fields besides the integers (`k`, `index`) and `lost_base`; other keys
are a policy's own and only need to be JSON."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not 1


def _uint(x: object, what: str, below: int | None = None) -> int:
    if not _is_int(x) or x < 0 or (below is not None and x >= below):
        bound = f" below {below}" if below is not None else ""
        raise _Malformed(f"{what} is {x!r}, expected an integer >= 0{bound}")
    return x


def _dict(x: object, what: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise _Malformed(f"{what} is {type(x).__name__} {x!r:.60}, expected an object")
    return x


def _int_table(x: object, rows: int | None, cols: int | None, what: str) -> list[Any]:
    """A list of `rows` lists of `cols` non-negative ints (a dimension None: any)."""
    if not isinstance(x, list) or (rows is not None and len(x) != rows):
        raise _Malformed(f"{what} is {x!r:.60}, expected {rows} rows (MoE layers)")
    for i, row in enumerate(x):
        if not isinstance(row, list) or (cols is not None and len(row) != cols):
            raise _Malformed(f"{what}[{i}] is {row!r:.60}, expected {cols} counts (experts)")
        for v in row:
            _uint(v, f"{what}[{i}] entry")
    return x


def _piece(key: str, entry: Entry, version: int) -> None:
    """A piece's key (`<key>@<offsets>`) must be of version 6 on, with one offset per
    dimension of its shape."""
    base, offsets = split_key(key)
    if version < PIECES_VERSION or offsets is None or not base:
        raise _Malformed(f"entries: {key!r} is not a key of version {version}")
    if len(offsets) != len(entry.shape):
        raise _Malformed(f"entries: {key!r} has {len(offsets)} offsets for the "
                         f"{len(entry.shape)} dimensions of its shape {list(entry.shape)}")


def _parse(d: dict[str, Any], version: int, known: dict[str, Entry]) -> Manifest:
    unknown = set(d) - FIELDS
    if unknown:
        raise _Malformed(f"unknown field(s) {', '.join(sorted(unknown))}")
    step = _uint(d["step"], "step")
    if not isinstance(d["mode"], str):
        raise _Malformed(f"mode is {d['mode']!r}, expected a string")
    layout = {k: _uint(v, f"layout.{k}") for k, v in _dict(d["layout"], "layout").items()}
    model = _dict(d["model"], "model")
    if version < FORMAT_VERSION:
        known = {}  # older entries are converted on the way in: never the same JSON
    entries = {}
    for k, e in _dict(d["entries"], "entries").items():
        old = known.get(k)
        entries[k] = (old if old is not None and old.step <= step and _unchanged(e, old)
                      else _entry(e, k, step, version))
        if "@" in k:
            _piece(k, entries[k], version)
    files = {}
    for name, size in _dict(d.get("files", {}), "files").items():
        if not is_rank_file(name):
            raise _Malformed(f"files names {name!r}, expected {RANK_FILE_PATTERN}")
        files[name] = _uint(size, f"files[{name!r}]")
    extra = _dict(d.get("extra", {}), "extra")
    if "step" in extra and (not _is_int(extra["step"]) or extra["step"] != step):
        raise _Malformed(f"extra.step is {extra['step']!r}, the manifest's step is {step}: "
                         "the loop state belongs to another step")
    experts = _experts(_dict(d.get("experts", {}), "experts"))
    n_layers, n_experts = experts.get("n_moe_layers"), experts.get("n_experts")
    policy = _policy(_dict(d.get("policy", {}), "policy"), n_layers)
    experts_saved = {}
    for layer, ids in _dict(d.get("experts_saved", {}), "experts_saved").items():
        if not layer.isdigit() or (n_layers is not None and int(layer) >= n_layers):
            raise _Malformed(f"experts_saved has layer {layer!r}, expected a MoE layer index"
                             f" below {n_layers}")
        if not isinstance(ids, list):
            raise _Malformed(f"experts_saved[{layer!r}] is {ids!r:.60}, expected a list")
        experts_saved[layer] = [_uint(g, f"experts_saved[{layer!r}] id", n_experts)
                                for g in ids]
    tokens = _dict(d.get("tokens", {}), "tokens")
    if tokens:
        if set(tokens) != {"cumulative", "at_save", "lost"}:
            raise _Malformed(f"tokens has {sorted(tokens)}, expected cumulative, at_save, "
                             "lost")
        _int_table(tokens["cumulative"], n_layers, n_experts, "tokens.cumulative")
        rows = len(tokens["cumulative"])
        cols = len(tokens["cumulative"][0]) if rows else n_experts
        _int_table(tokens["at_save"], rows, cols, "tokens.at_save")
        _int_table([tokens["lost"]], 1, rows, "tokens.lost")
    model_config = _dict(d.get("model_config", {}), "model_config")
    run = _run(_dict(d.get("run", {}), "run"), version)
    return Manifest(step=step, mode=d["mode"], layout=layout, model=model, entries=entries,
                    files=files, extra=extra, experts=experts, policy=policy,
                    experts_saved=experts_saved, tokens=tokens, model_config=model_config,
                    run=run, version=FORMAT_VERSION)


def _run(d: dict[str, Any], version: int) -> dict[str, Any]:
    """The `run` field: the run id and a well-formed lineage (version 5 on; absent: both
    unknown, as in a manifest written before version 5)."""
    if not d:
        return {}
    if version < 5:
        raise _Malformed(f"run is a version-5 field, the manifest says version {version}")
    if set(d) != {"id", "line"}:
        raise _Malformed(f"run has {sorted(d)}, expected id and line")
    if d["id"] is not None and (not isinstance(d["id"], str) or not d["id"]):
        raise _Malformed(f"run.id is {d['id']!r}, expected the run id (a string) or null")
    try:
        Lineage.from_json(d["line"], "run.line")
    except ValueError as e:
        raise _Malformed(str(e)) from None
    return d


def _unchanged(e: object, old: Entry) -> bool:
    """Is `e` exactly the JSON of `old`, types included? (Plain equality is not enough:
    JSON true and 1.0 both equal 1, and `_entry` refuses them.)"""
    if type(e) is not dict or len(e) != 5:
        return False
    at, crc, shape = e.get("step"), e.get(old.algo), e.get("shape")
    return (type(at) is int and at == old.step and type(crc) is int and crc == old.crc
            and e.get("file") == old.file and e.get("dtype") == old.dtype
            and type(shape) is list and len(shape) == len(old.shape)
            and all(type(x) is int and x == y for x, y in zip(shape, old.shape, strict=True)))


def _entry(e: object, key: str, step: int, version: int) -> Entry:
    e = _dict(e, f"entries[{key!r}]")
    algos = ENTRY_ALGORITHMS[version]
    named = [a for a in algos if a in e]
    if len(named) != 1 or set(e) != ENTRY_FIELDS | set(named):
        expected = f"{', '.join(sorted(ENTRY_FIELDS))} and one of {', '.join(algos)}"
        raise _Malformed(f"entries[{key!r}] has {sorted(e)}, expected {expected}")
    algo = named[0]
    what = f"entries[{key!r}]"
    at = _uint(e["step"], f"{what}.step", step + 1)  # older steps only, or this one
    if not is_rank_file(e["file"]):
        raise _Malformed(f"{what}.file is {e['file']!r}, expected a file of the step "
                         f"directory named {RANK_FILE_PATTERN}")
    if e["dtype"] not in ITEM_SIZES:
        raise _Malformed(f"{what}.dtype is {e['dtype']!r}, expected one of "
                         f"{', '.join(ITEM_SIZES)}")
    if not isinstance(e["shape"], list):
        raise _Malformed(f"{what}.shape is {e['shape']!r}, expected a list")
    shape = tuple(_uint(x, f"{what}.shape") for x in e["shape"])
    crc = _uint(e[algo], f"{what}.{algo}", 1 << BITS[algo])
    if version == 1:  # the bytes alone; extended as version 2 defines it
        crc = checksum(e["dtype"], shape, crc, CRC32)
    return Entry(at, e["file"], e["dtype"], shape, crc, algo)


def _experts(d: dict[str, Any]) -> dict[str, Any]:
    """The `experts` field: counts, and stems that map to MoE layer indices."""
    out = dict(d)
    for k in ("n_experts", "n_moe_layers"):
        if k in out:
            _uint(out[k], f"experts.{k}")
    if "stems" in out:
        below = out.get("n_moe_layers")
        out["stems"] = {str(k): _uint(v, f"experts.stems[{k!r}]", below)
                        for k, v in _dict(out["stems"], "experts.stems").items()}
    if "params" in out:
        for stem, how in _dict(out["params"], "experts.params").items():
            what = f"experts.params[{stem!r}]"
            how = _dict(how, what)
            if set(how) == {"dim"}:
                _uint(how["dim"], f"{what}.dim")
            elif not (set(how) == {"container"} and isinstance(how["container"], str)):
                raise _Malformed(f"{what} is {how!r:.60}, expected {{dim: int}} or "
                                 "{container: str}")
    return out


def _policy(d: dict[str, Any], n_layers: int | None) -> dict[str, Any]:
    """The `policy` field: the keys recovery and tools act on, typed."""
    for k in ("k", "index"):
        if k in d and d[k] is not None:
            _uint(d[k], f"policy.{k}")
    for k, types in POLICY_TYPES.items():
        if k in d and d[k] is not None and (
                not isinstance(d[k], types) or (bool not in types and isinstance(d[k], bool))):
            raise _Malformed(f"policy.{k} is {d[k]!r}, expected "
                             f"{' or '.join(t.__name__ for t in types)}")
    if "lost_base" in d:
        _int_table([d["lost_base"]], 1, n_layers, "policy.lost_base")
    return d
