"""A checkpoint directory is untrusted input: every way a step can lie about itself
(names outside the directory, headers that disagree with the manifest, malformed
fields, sizes that would make a reader allocate what the file does not hold) is
corruption, which recovery skips for an older step and `moc verify` reports.

Each test tampers with a real checkpoint written by the real Checkpointer, then checks
both readers: recovery (falls back to step 1) and verify (flags step 2)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import crc32c
import pytest
import torch
from safetensors.torch import load_file

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.recovery import CheckpointReader
from moc.checkpoint.store.format import descriptor, write_safetensors
from moc.checkpoint.store.manifest import Entry, Manifest
from moc.checkpoint.store.steps import MANIFEST, rank_file, step_dir
from moc.checkpoint.sync import Checkpointer
from moc.checkpoint.tools import verify_checkpoints
from moc.cli import main
from moc.model import ModelConfig, Transformer
from moc.parallel import ParallelGroups, ShardedAdamW

REPO = Path(__file__).resolve().parents[3]
CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)


def _trained(seed: int) -> tuple[Transformer, ShardedAdamW]:
    torch.manual_seed(seed)
    model = Transformer(CFG)
    opt = ShardedAdamW(model, ParallelGroups.single(CFG.n_experts), lr=1e-2)
    idx = torch.randint(0, 256, (2, 8))
    model(idx, idx).loss.backward()
    opt.step()
    model.zero_grad()
    return model, opt


def _ckpt(root: Path, seed: int = 1) -> Checkpointer:
    model, opt = _trained(seed)
    return Checkpointer(model, opt, root, model_meta=CFG.to_dict(), mode="blocking")


def _two_steps(root: Path, seed: int = 0) -> Path:
    ckpt = _ckpt(root, seed)
    ckpt.save(1, {"step": 1})
    ckpt.save(2, {"step": 2})
    ckpt.close()
    return root


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    return _two_steps(tmp_path / "ckpt")


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    """Another run's checkpoint of the same model, outside the checkpoint directory."""
    return _two_steps(tmp_path / "foreign", seed=7)


def _manifest(root: Path, step: int) -> dict:
    return json.loads((step_dir(root, step) / MANIFEST).read_text())


def _write_manifest(root: Path, step: int, d: dict) -> None:
    (step_dir(root, step) / MANIFEST).write_text(json.dumps(d))


def _tree(root: Path) -> dict[str, tuple[bool, bytes | str]]:
    """Every path under `root` (links not followed) -> (is a link, its bytes or target)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = (True, os.readlink(p))
        elif p.is_file():
            out[rel] = (False, p.read_bytes())
        else:
            out[rel] = (False, "dir")
    return out


def _assert_step_2_rejected(root: Path, match: str) -> None:
    """Recovery falls back to step 1 with a reason matching `match` and leaves the
    directory as it was; the job's next save sets step 2 aside (the write path)."""
    before = _tree(root)
    ckpt = _ckpt(root)
    report = ckpt.restore()
    assert report.step == 1, "the tampered step 2 was restored"
    assert any(match in r for r in report.skipped), report.skipped
    after = _tree(root)
    assert {k: v for k, v in after.items() if k != "moc.lock"} == \
        {k: v for k, v in before.items() if k != "moc.lock"}, "restore changed the directory"
    ckpt.save(3, {"step": 3})
    ckpt.close()
    aside = root / "step-00000002.corrupt"
    assert aside.exists() or aside.is_symlink()
    assert not step_dir(root, 2).exists() and not step_dir(root, 2).is_symlink()


def _assert_verify_flags_step_2(root: Path, match: str) -> None:
    report = verify_checkpoints(root)
    assert not report.ok and 2 in report.damaged_steps, report.bad_files
    assert 1 in report.intact_steps
    assert any(match in r for reasons in report.bad_files.values() for r in reasons), \
        report.bad_files
    assert main(["verify", str(root)]) == 1


def _header(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def _rewrite_header(path: Path, header: dict) -> None:
    """Write `header` over the file's own, padded to the same length (so every data
    offset stays valid and the safetensors library still opens the file)."""
    n, _, data = _header(path)
    blob = json.dumps(header, separators=(",", ":")).encode()
    assert len(blob) <= n
    path.write_bytes(struct.pack("<Q", n) + blob + b" " * (n - len(blob)) + data)


# -- item 11: entries name files inside the checkpoint directory, by the format's names


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_an_entry_naming_a_file_outside_the_directory_is_corrupt(ckpt_dir, foreign, how):
    d = _manifest(ckpt_dir, 2)
    theirs = _manifest(foreign, 2)
    outside = step_dir(foreign, 2) / rank_file(0)
    name = str(outside) if how == "absolute" else os.path.relpath(outside, step_dir(ckpt_dir, 2))
    for key, entry in d["entries"].items():  # the foreign weights, with their own CRCs
        entry.update(file=name, xxh3=theirs["entries"][key]["xxh3"])
    _write_manifest(ckpt_dir, 2, d)
    _assert_verify_flags_step_2(ckpt_dir, "rank-NNNNN.safetensors")
    _assert_step_2_rejected(ckpt_dir, "rank-NNNNN.safetensors")


def test_a_step_directory_that_is_a_symlink_out_of_the_directory_is_corrupt(
        ckpt_dir, foreign):
    shutil.rmtree(step_dir(ckpt_dir, 2))
    step_dir(ckpt_dir, 2).symlink_to(step_dir(foreign, 2))
    _assert_verify_flags_step_2(ckpt_dir, "symbolic link")
    _assert_step_2_rejected(ckpt_dir, "symbolic link")
    # Set aside is the link itself: nothing is written into the foreign directory.
    assert (ckpt_dir / "step-00000002.corrupt").is_symlink()
    assert sorted(p.name for p in step_dir(foreign, 2).iterdir()) == [MANIFEST, rank_file(0)]


def test_a_tensor_file_that_is_a_symlink_is_corrupt(ckpt_dir, foreign):
    d, theirs = _manifest(ckpt_dir, 2), _manifest(foreign, 2)
    for key, entry in d["entries"].items():
        entry["xxh3"] = theirs["entries"][key]["xxh3"]
    _write_manifest(ckpt_dir, 2, d)
    (step_dir(ckpt_dir, 2) / rank_file(0)).unlink()
    (step_dir(ckpt_dir, 2) / rank_file(0)).symlink_to(step_dir(foreign, 2) / rank_file(0))
    _assert_verify_flags_step_2(ckpt_dir, "symbolic link")
    _assert_step_2_rejected(ckpt_dir, "symbolic link")


# -- item 12: the checksum covers dtype and shape; the header must match the manifest


def test_a_dtype_changed_in_the_header_is_corrupt(ckpt_dir):
    path = step_dir(ckpt_dir, 2) / rank_file(0)
    _, header, _ = _header(path)
    key = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[key]["dtype"] = "I32"
    _rewrite_header(path, header)
    _assert_verify_flags_step_2(ckpt_dir, "I32")
    _assert_step_2_rejected(ckpt_dir, "I32")


def _swap_a_shape_in_the_header(ckpt_dir) -> str:
    """Reverse the shape of a non-square 2-D tensor in step 2's header; its key."""
    path = step_dir(ckpt_dir, 2) / rank_file(0)
    _, header, _ = _header(path)
    key = next(k for k, v in header.items()
               if k != "__metadata__" and len(v["shape"]) == 2 and v["shape"][0] != v["shape"][1])
    header[key]["shape"].reverse()
    _rewrite_header(path, header)
    return key


def test_a_shape_swapped_in_header_and_manifest_is_corrupt_not_incompatible(ckpt_dir):
    key = _swap_a_shape_in_the_header(ckpt_dir)
    d = _manifest(ckpt_dir, 2)
    d["entries"][key]["shape"].reverse()  # the manifest agrees: only the checksum knows
    _write_manifest(ckpt_dir, 2, d)
    _assert_verify_flags_step_2(ckpt_dir, "checksum mismatch")
    _assert_step_2_rejected(ckpt_dir, "checksum mismatch")


def test_a_shape_swapped_in_the_header_only_is_corrupt(ckpt_dir):
    _swap_a_shape_in_the_header(ckpt_dir)
    _assert_verify_flags_step_2(ckpt_dir, "the manifest records")
    _assert_step_2_rejected(ckpt_dir, "the manifest records")


OLDER_ALGO = {1: "crc32", 2: "crc32", 3: "crc32c"}


def _older_manifests(ckpt_dir: Path, version: int) -> None:
    """Steps 1 and 2 rewritten as an older moc wrote them: zlib CRC32s ("crc32"), of the
    bytes alone (version 1) or extended over dtype and shape (version 2), or CRC32Cs
    over the same (version 3). Computed here with zlib and crc32c themselves."""
    for step in (1, 2):
        d = _manifest(ckpt_dir, step)
        tensors = load_file(step_dir(ckpt_dir, step) / rank_file(0))
        for key, entry in d["entries"].items():
            t = tensors[key].reshape(-1)
            raw = t.view(torch.uint8).numpy() if t.numel() else b""
            desc = descriptor(entry["dtype"], tuple(entry["shape"]))
            del entry["xxh3"]
            if version == 3:
                entry["crc32c"] = crc32c.crc32c(desc, crc32c.crc32c(raw))
            else:
                data = zlib.crc32(raw)
                entry["crc32"] = data if version == 1 else zlib.crc32(desc, data)
        d["version"] = version
        del d["run"]  # version 5's
        _write_manifest(ckpt_dir, step, d)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_older_manifests_with_older_checksums_still_restore_and_continue(ckpt_dir, version):
    _older_manifests(ckpt_dir, version)
    assert verify_checkpoints(ckpt_dir).ok
    ckpt = _ckpt(ckpt_dir)
    assert ckpt.restore().step == 2
    ckpt.save(3, {"step": 3})  # a new version-5 step, on top of the older chain
    ckpt.close()
    d = _manifest(ckpt_dir, 3)
    assert d["version"] == 5
    # What step 3 wrote has XXH3s; what it inherits keeps the older step's checksum.
    algos = {e["step"]: {a for a in ("crc32", "crc32c", "xxh3") if a in e}
             for e in d["entries"].values()}
    assert algos[3] == {"xxh3"}
    assert all(a == {OLDER_ALGO[version]} for s, a in algos.items() if s < 3)
    assert verify_checkpoints(ckpt_dir).ok
    assert _ckpt(ckpt_dir).restore().step == 3


@pytest.mark.parametrize("version", [2, 3])
def test_an_older_checksum_is_still_checked(ckpt_dir, version):
    """An inherited version-2 or -3 checksum is a real check, not a pass: a flipped
    byte in a file of such a step fails it."""
    _older_manifests(ckpt_dir, version)
    path = step_dir(ckpt_dir, 2) / rank_file(0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    _assert_verify_flags_step_2(ckpt_dir, "checksum mismatch")


@pytest.mark.parametrize(("version", "algo"), [(2, "crc32c"), (2, "xxh3"), (3, "xxh3")])
def test_an_older_manifest_may_not_claim_a_newer_checksum(ckpt_dir, version, algo):
    """Version 2 knew only "crc32", version 3 "crc32c" and "crc32": an older manifest
    with entries of a later algorithm is not one moc wrote."""
    d = _manifest(ckpt_dir, 2)
    d["version"] = version
    for entry in d["entries"].values():
        entry[algo] = entry.pop("xxh3")
    _write_manifest(ckpt_dir, 2, d)
    _assert_step_2_rejected(ckpt_dir, "crc32")


# -- item 13: every manifest field is validated; malformed is corrupt


def _tampered_manifest(change: Callable[[dict], None]) -> str:
    """A valid manifest of every field, as JSON after `change` edits its dict."""
    m = Manifest(step=2, mode="pec", layout={"world_size": 1, "ep": 1}, model={},
                 entries={"param/x": Entry(1, rank_file(0), "F32", (2,), 7)},
                 files={rank_file(0): 100}, extra={"step": 2},
                 experts={"n_experts": 2, "n_moe_layers": 1, "stems": {"s": 0}},
                 policy={"k": 1, "selection": "sequential", "apply_to": "both",
                         "dynamic_k": False, "plt_threshold": 0.0375, "index": 0,
                         "lost_base": [0]},
                 experts_saved={"0": [1]},
                 tokens={"cumulative": [[3, 4]], "at_save": [[3, 0]], "lost": [0]})
    d = json.loads(m.to_json())
    change(d)
    return json.dumps(d)


def _set(path: str, value: object) -> Callable[[dict], None]:
    """An edit setting the dotted field `path` (entry keys contain no dot)."""

    def change(d: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        d[last] = value
    return change


MALFORMED = {
    "tokens not a table": _set("tokens", {"cumulative": "x", "at_save": [], "lost": []}),
    "tokens wrong shape": _set("tokens", {"cumulative": [[1]], "at_save": [[1]],
                                          "lost": [0]}),
    "tokens a list": _set("tokens", [["cumulative", 1]]),
    "policy.index a string": _set("policy.index", "4"),
    "policy.k a bool": _set("policy.k", True),
    "extra a list": _set("extra", []),
    "extra.step another step": _set("extra.step", 1),
    "extra.step a string": _set("extra.step", "2"),
    "version true": _set("version", True),
    "version null": _set("version", None),
    "negative step": _set("step", -3),
    "step a bool": _set("step", True),
    "entry step newer than the manifest": _set("entries.param/x.step", 5),
    "entry step negative": _set("entries.param/x.step", -1),
    "entry shape with a bool": _set("entries.param/x.shape", [True, 2]),
    "entry crc a float": _set("entries.param/x.crc32c", 7.5),
    "entry dtype unknown": _set("entries.param/x.dtype", "F8"),
    "files size a string": _set("files", {rank_file(0): "100"}),
    "files name not a rank file": _set("files", {"x.bin": 100}),
    "layout a string value": _set("layout.world_size", "1"),
    "experts_saved a string": _set("experts_saved", {"0": "12"}),
    "experts_saved id out of range": _set("experts_saved", {"0": [5]}),
    "experts.stems layer out of range": _set("experts.stems", {"s": 3}),
    "mode a number": _set("mode", 3),
    "unknown field": _set("surprise", 1),
}


@pytest.mark.parametrize("change", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_manifest_fields_are_corrupt(change):
    text = _tampered_manifest(change)
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(text, "m")


def test_the_untampered_template_is_valid():
    Manifest.from_json(_tampered_manifest(lambda d: None), "m")


def test_duplicate_json_keys_are_corrupt():
    text = _tampered_manifest(lambda d: None)
    with pytest.raises(CorruptCheckpointError, match="duplicate"):
        Manifest.from_json(text.replace('{', '{"mode": "evil", ', 1), "m")


@pytest.mark.parametrize("version", [0, 7, 99])
def test_another_int_version_is_incompatible(version):
    with pytest.raises(IncompatibleCheckpointError, match="format version"):
        Manifest.from_json(_tampered_manifest(_set("version", version)), "m")


@pytest.mark.parametrize("field", ["tokens", "policy.index", "extra", "extra.step"])
def test_malformed_fields_on_storage_fall_back_and_fail_verify(ckpt_dir, field):
    values = {"tokens": {"cumulative": [[1]], "at_save": [[1]], "lost": [0]},
              "policy.index": "4", "extra": [], "extra.step": 1}
    d = _manifest(ckpt_dir, 2)
    _set(field, values[field])(d)
    _write_manifest(ckpt_dir, 2, d)
    _assert_verify_flags_step_2(ckpt_dir, "")
    _assert_step_2_rejected(ckpt_dir, "")


# -- item 14: sizes are checked before anything is read


def test_a_header_declaring_a_huge_tensor_is_rejected_before_reading(tmp_path):
    """The header says 400 MB (a sparse file holds them), the manifest 8 bytes: the
    reader must refuse without reading the declared range. Measured in a fresh process:
    its peak RSS must not grow by the declared size."""
    root = tmp_path / "ckpt"
    step_dir(root, 1).mkdir(parents=True)
    path = step_dir(root, 1) / rank_file(0)
    huge = 100_000_000  # F32 elements: 400 MB
    header = json.dumps({"w": {"dtype": "F32", "shape": [huge],
                               "data_offsets": [0, 4 * huge]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * huge)  # sparse: no disk blocks
    manifest = Manifest(step=1, mode="blocking", layout={}, model={},
                        entries={"w": Entry(1, rank_file(0), "F32", (2,), 0)})
    (step_dir(root, 1) / MANIFEST).write_text(manifest.to_json())
    script = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "from moc.checkpoint.errors import CorruptCheckpointError\n"
        "from moc.checkpoint.recovery import CheckpointReader\n"
        "from moc.checkpoint.store.manifest import Manifest\n"
        "root = Path(sys.argv[1])\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    CheckpointReader(root, Manifest.load(root, 1)).get('w')\n"
        "    print('LOADED')\n"
        "except CorruptCheckpointError as e:\n"
        "    print('CORRUPT', e)\n"
        "print('GREW_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "CORRUPT" in out.stdout and "the manifest records" in out.stdout, out.stdout
    grew_kb = int(out.stdout.split("GREW_KB")[1])
    assert grew_kb < 100_000, f"the reader grew by {grew_kb} KB for a rejected tensor"


def _one_tensor_file(path: Path, header: dict | bytes, data: bytes = b"") -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize(("header", "match"), [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, "data_offsets span 12"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "overlap"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "beyond"),
    (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "w": {}}', "duplicate"),
    (b"[1, 2]", "header"),
])
def test_inconsistent_headers_are_corrupt(tmp_path, header, match):
    step_dir(tmp_path, 1).mkdir()
    _one_tensor_file(step_dir(tmp_path, 1) / rank_file(0), header, b"\0" * 8)
    manifest = Manifest(step=1, mode="blocking", layout={}, model={},
                        entries={"w": Entry(1, rank_file(0), "F32", (2,), 0)})
    with pytest.raises(CorruptCheckpointError, match=match):
        CheckpointReader(tmp_path, manifest).get("w")


def test_a_header_length_beyond_the_file_is_corrupt(tmp_path):
    step_dir(tmp_path, 1).mkdir()
    path = step_dir(tmp_path, 1) / rank_file(0)
    path.write_bytes(struct.pack("<Q", 2**60) + b"{}")
    manifest = Manifest(step=1, mode="blocking", layout={}, model={},
                        entries={"w": Entry(1, rank_file(0), "F32", (2,), 0)})
    with pytest.raises(CorruptCheckpointError, match="header length"):
        CheckpointReader(tmp_path, manifest).get("w")


def test_files_stay_standard_safetensors_and_read_back_bitwise(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(6).to(torch.int16),
               "c": torch.randn(4).bfloat16(), "flag": torch.tensor([True, False]),
               "scalar": torch.tensor(2.5, dtype=torch.float64), "empty": torch.zeros(0, 3)}
    step_dir(tmp_path, 1).mkdir()
    path = step_dir(tmp_path, 1) / rank_file(0)
    records = write_safetensors(path, tensors)
    loaded = load_file(path)
    manifest = Manifest(step=1, mode="blocking", layout={}, model={},
                        entries={k: Entry(1, rank_file(0), r.dtype, r.shape, r.crc)
                                 for k, r in records.items()})
    reader = CheckpointReader(tmp_path, manifest)
    for key, t in tensors.items():
        got = reader.get(key)
        assert got.dtype == t.dtype and got.shape == t.shape, key
        assert torch.equal(got, t) and torch.equal(loaded[key], t), key


# -- item 16: a read-only directory whose newest step is corrupt


READ_ONLY_RESTORE = """
import sys
from pathlib import Path
from moc.checkpoint.sync import Checkpointer
from tests.checkpoint.store.test_integrity import CFG, _trained
# Model-only: a training engine is refused on a directory it cannot write (issue 29).
ckpt = Checkpointer(_trained(1)[0], None, Path(sys.argv[1]), model_meta=CFG.to_dict())
print("RESTORED", ckpt.restore().step)
"""


def _restore_read_only(root: Path) -> subprocess.CompletedProcess:
    """Restore `root` in a fresh process that cannot write it. Not root: the directory
    is made 0o555. Root ignores permission bits, so then the process runs in its own
    mount namespace with `root` bind-mounted read-only over itself (EROFS); skipped
    where that is not allowed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", READ_ONLY_RESTORE, str(root)]
    if os.geteuid() != 0:
        root.chmod(0o555)
        try:
            return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO,
                                  timeout=120)
        finally:
            root.chmod(0o755)
    if shutil.which("unshare") is None:
        pytest.skip("running as root, and no unshare(1) to make a read-only bind mount")
    shell = ('mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" '
             '|| { echo MOUNT_FAILED; exit 3; }; shift; exec "$@"')
    out = subprocess.run(["unshare", "-m", "sh", "-c", shell, "sh", str(root), *argv],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    if "MOUNT_FAILED" in out.stdout or (out.returncode and "unshare" in out.stderr):
        pytest.skip(f"running as root without the right to mount read-only: {out.stderr}")
    return out


def test_a_read_only_directory_with_a_corrupt_newest_step_falls_back_in_place(ckpt_dir):
    f = step_dir(ckpt_dir, 2) / rank_file(0)
    raw = bytearray(f.read_bytes())
    n, _, _ = _header(f)
    raw[8 + n + 3] ^= 0x01  # in the first tensor, a weight: the model-only restore reads it
    f.write_bytes(bytes(raw))
    before = _tree(ckpt_dir)
    out = _restore_read_only(ckpt_dir)
    assert out.returncode == 0, out.stderr
    assert "RESTORED 1" in out.stdout
    # Restore no longer tries to set the step aside (the write path does): no failed
    # rename to warn about, and nothing changed.
    assert "could not" not in out.stderr, out.stderr
    assert _tree(ckpt_dir) == before
