from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moc.baselines.dcp import METADATA, dcp_step_dir
from moc.checkpoint.store.format import write_safetensors
from moc.checkpoint.store.manifest import Entry, Manifest
from moc.checkpoint.store.retention import apply_retention
from moc.checkpoint.store.steps import MANIFEST, begin_step, commit_step, rank_file, step_dir
from moc.checkpoint.tools import expert_ages, inspect_checkpoints, verify_checkpoints
from moc.cli import check_train_config, main
from moc.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]

# A hand-built partial chain: 2 MoE layers x 4 experts; layer 0 has two expert tensors.
N_EXPERTS = 4
STEMS = {"layers.0.ffn.experts.w1": 0, "layers.0.ffn.experts.w2": 0,
         "layers.1.ffn.experts.w1": 1}
SAVED = {10: None, 20: {"0": [1], "1": [2]}, 30: {"0": [2], "1": [3]}}
"""Step -> experts written at that step (None: all of them, a full save)."""


def _expert_keys(layer: int, g: int) -> list[str]:
    keys = []
    for stem, m in STEMS.items():
        if m == layer:
            keys += [f"param/{stem}/expert={g}", f"optim/{stem}/expert={g}/exp_avg",
                     f"optim/{stem}/expert={g}/step"]
    return keys


def _commit(root: Path, step: int, tensors: dict[str, torch.Tensor],
            inherited: dict[str, Entry], **fields) -> Manifest:
    """Write `tensors` as step `step`'s only file and commit a manifest that also points
    at `inherited` entries of older steps, as a partial checkpoint does."""
    name = rank_file(0)
    path = begin_step(root, step) / name
    records = write_safetensors(path, tensors)
    entries = dict(inherited)
    entries.update({k: Entry(step, name, r.dtype, r.shape, r.crc)
                    for k, r in records.items()})
    manifest = Manifest(step=step, mode=fields.pop("mode", "pec"),
                        layout={"world_size": 1, "ep": 1}, model={"n_experts": N_EXPERTS},
                        entries=entries, files={name: path.stat().st_size},
                        extra={"step": step}, **fields)
    commit_step(root, step, manifest.to_json())
    return manifest


def _partial_chain(root: Path) -> None:
    """Step 10 saves everything; steps 20 and 30 save the dense state and one expert
    per MoE layer (K=1) and point at older steps for the rest."""
    torch.manual_seed(0)
    experts = {"n_experts": N_EXPERTS, "n_moe_layers": 2, "stems": STEMS}
    previous: dict[str, Entry] = {}
    for step, saved in SAVED.items():
        tensors = {"param/embed.weight": torch.randn(8, 4),
                   "optim/embed.weight/exp_avg": torch.randn(8, 4),
                   "rng/rank=0": torch.randint(0, 255, (16,), dtype=torch.uint8)}
        for layer in (0, 1):
            ids = range(N_EXPERTS) if saved is None else saved[str(layer)]
            for g in ids:
                for key in _expert_keys(layer, g):
                    tensors[key] = (torch.tensor(float(step)) if key.endswith("/step")
                                    else torch.randn(3, 2))
        fields = {} if saved is None else {"policy": {"name": "pec", "k": 1},
                                           "experts_saved": saved}
        previous = _commit(root, step, tensors, previous, experts=experts, **fields).entries


def _full_ckpt(root: Path, steps: tuple[int, ...] = (1, 2)) -> None:
    """Full saves as the blocking baseline writes them: every key at every step, no
    partial-checkpoint fields (so no stem -> layer map either)."""
    torch.manual_seed(0)
    for step in steps:
        tensors = {"param/embed.weight": torch.randn(8, 4),
                   "optim/embed.weight/exp_avg": torch.randn(8, 4),
                   "optim/embed.weight/step": torch.tensor(float(step))}
        for layer in (0, 1):
            for g in range(N_EXPERTS):
                tensors.update({k: torch.randn(3, 2) for k in _expert_keys(layer, g)})
        _commit(root, step, tensors, {}, mode="blocking")


def _rank0(root: Path, step: int) -> Path:
    return step_dir(root, step) / rank_file(0)


# ---------------------------------------------------------------------------- inspect


def test_inspect_shows_experts_saved_k_and_ages_of_a_partial_chain(tmp_path):
    _partial_chain(tmp_path)
    info = inspect_checkpoints(tmp_path)
    by_step = {s["step"]: s for s in info["steps"]}
    assert list(by_step) == [10, 20, 30]
    assert by_step[10]["k"] == "all" and by_step[10]["experts_saved"] == "all"
    assert by_step[20]["k"] == 1 and by_step[20]["experts_saved"] == {"0": [1], "1": [2]}
    assert by_step[30]["experts_saved"] == {"0": [2], "1": [3]}
    # Each step's bytes are what it wrote itself: the full save is the largest.
    assert by_step[10]["bytes"] > by_step[20]["bytes"] > 0
    assert by_step[20]["bytes"] == (_rank0(tmp_path, 20)).stat().st_size
    newest = info["newest"]
    assert newest["step"] == 30 and newest["by"] == "moe_layer"
    assert newest["expert_age"] == {"0": [20, 10, 0, 20], "1": [20, 20, 10, 0]}


def test_inspect_table_names_experts_saved_and_the_age_matrix(tmp_path, capsys):
    _partial_chain(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "L0: 1  L1: 2" in out and "L0: 2  L1: 3" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows["10"][-2:] == ["all", "all"]  # K and experts saved of the full save
    assert rows["20"][3] == "1"  # K of a partial save
    assert rows["layer"] == ["e0", "e1", "e2", "e3"]
    assert rows["0"] == ["20", "10", "0", "20"]
    assert rows["1"] == ["20", "20", "10", "0"]


def test_inspect_json_parses_and_has_every_field(tmp_path, capsys):
    _partial_chain(tmp_path)
    assert main(["inspect", "--json", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dir"] == str(tmp_path)
    for s in info["steps"]:
        assert set(s) == {"step", "mode", "bytes", "files", "keys", "k", "experts_saved",
                          "corrupt", "damaged"}
        assert s["corrupt"] is None and s["damaged"] is None
    assert info["steps"][1]["experts_saved"] == {"0": [1], "1": [2]}
    assert info["newest"]["expert_age"]["1"] == [20, 20, 10, 0]


def test_inspect_says_what_the_superseded_step_directories_are(tmp_path, capsys):
    """Retention keeps the newest step and demotes the older ones it reads experts from:
    before, `ls` showed three step directories and `inspect` one, with no word why."""
    _partial_chain(tmp_path)
    apply_retention(tmp_path, keep_last=1)
    info = inspect_checkpoints(tmp_path)
    assert [s["step"] for s in info["steps"]] == [30]
    assert [(s["step"], s["read_by"]) for s in info["superseded"]] == [(10, [30]), (20, [30])]
    assert info["superseded"][0]["bytes"] == _rank0(tmp_path, 10).stat().st_size
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 superseded step directories: data, not checkpoints" in out
    assert "manifest.superseded.json" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows["10"][-1] == rows["20"][-1] == "30"  # read by step 30


def test_inspect_of_a_directory_without_superseded_steps_lists_none(tmp_path, capsys):
    _partial_chain(tmp_path)
    assert inspect_checkpoints(tmp_path)["superseded"] == []
    assert main(["inspect", str(tmp_path)]) == 0
    assert "superseded" not in capsys.readouterr().out


def test_age_is_that_of_the_oldest_tensor_and_falls_back_to_stems():
    def entry(step: int) -> Entry:
        return Entry(step, "rank-00000.safetensors", "F32", (1,), 0)

    entries = {"param/a.w/expert=0": entry(5), "param/a.v/expert=0": entry(9),
               "optim/a.w/expert=0/exp_avg": entry(9), "optim/a.w/expert=1/exp_avg": entry(7),
               "param/b.w/expert=1": entry(9), "param/dense.weight": entry(9),
               "optim/dense.weight/exp_avg": entry(9)}
    experts = {"n_experts": 3, "stems": {"a.w": 0, "a.v": 0, "b.w": 1}}
    manifest = Manifest(step=9, mode="pec", layout={}, model={}, entries=entries,
                        experts=experts)
    # Layer 0 expert 0: a restore brings back a.w from step 5, so it is 4 steps old.
    # Layer 0 expert 1: optimizer keys only. Expert 2: stored nowhere.
    assert expert_ages(manifest)["expert_age"] == {"0": [4, 2, None], "1": [None, 0, None]}
    # Only the optimizer state partial: its keys decide, as in the checkpointer.
    optim_partial = Manifest(step=9, mode="pec", layout={}, model={}, entries=entries,
                             experts=experts, policy={"apply_to": "optimizer"})
    assert expert_ages(optim_partial)["expert_age"] == {"0": [0, 2, None],
                                                        "1": [None, 0, None]}
    no_map = Manifest(step=9, mode="pec", layout={}, model={}, entries=entries)
    ages = expert_ages(no_map)
    assert ages["by"] == "stem" and ages["n_experts"] == 2
    assert ages["expert_age"] == {"a.v": [0, None], "a.w": [4, 2], "b.w": [None, 0]}


def test_full_saves_show_k_and_experts_saved_as_all(tmp_path, capsys):
    _full_ckpt(tmp_path)
    info = inspect_checkpoints(tmp_path)
    assert [(s["mode"], s["k"], s["experts_saved"]) for s in info["steps"]] == [
        ("blocking", "all", "all")] * 2
    assert info["newest"]["by"] == "stem"
    assert info["newest"]["expert_age"]["layers.1.ffn.experts.w1"] == [0, 0, 0, 0]
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(stem x expert" in out
    assert "layers.1.ffn.experts.w1   0   0   0   0" in out
    # A writer that records a full policy and every expert explicitly reads the same.
    (step_dir(tmp_path, 2) / MANIFEST).unlink()
    _commit(tmp_path, 3, {"param/x": torch.ones(1)}, {}, mode="full",
            experts={"n_experts": N_EXPERTS, "n_moe_layers": 2, "stems": STEMS},
            policy={"selection": "full", "k": N_EXPERTS},
            experts_saved={"0": [0, 1, 2, 3], "1": [3, 2, 1, 0]})
    newest = inspect_checkpoints(tmp_path)["steps"][-1]
    assert (newest["step"], newest["k"], newest["experts_saved"]) == (3, "all", "all")


def test_inspect_finds_a_truncated_shard_and_points_to_verify(tmp_path, capsys):
    """Issue 50: a step with a truncated shard was listed as complete, with no word that
    nothing but the manifests had been read. Sizes are checked (a stat per file); what
    sizes cannot show (a flipped byte) is `moc verify`'s, and the output says so."""
    _partial_chain(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (f"\nfile sizes checked, checksums not: `moc verify {tmp_path}` reads every "
            "byte\n") in out, out
    shard = next(p for p in sorted(step_dir(tmp_path, 20).iterdir())
                 if p.name != MANIFEST and p.stat().st_size > 8)
    size = shard.stat().st_size
    os.truncate(shard, size - 8)
    info = inspect_checkpoints(tmp_path)
    assert [s["damaged"] is not None for s in info["steps"]] == [False, True, False]
    assert info["steps"][1]["damaged"] == (f"{shard.name}: size is {size - 8} bytes, "
                                           f"manifest of step 20 records {size}")
    assert main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:2] == ["20", "DAMAGED"])
    assert shard.name in row
    assert "step(s) 20 cannot be restored as listed; file sizes checked" in out
    shard.unlink()
    assert "file is missing" in inspect_checkpoints(tmp_path)["steps"][1]["damaged"]


def test_inspect_reports_a_corrupt_manifest_instead_of_crashing(tmp_path, capsys):
    _partial_chain(tmp_path)
    (step_dir(tmp_path, 30) / MANIFEST).write_text("{not json")
    info = inspect_checkpoints(tmp_path)
    assert "not valid JSON" in info["steps"][-1]["corrupt"]
    assert info["newest"]["step"] == 20
    assert info["newest"]["expert_age"] == {"0": [10, 0, 10, 10], "1": [10, 10, 0, 10]}
    assert main(["inspect", str(tmp_path)]) == 1  # listed, and the exit status says so
    assert "CORRUPT" in capsys.readouterr().out


def test_inspect_exits_0_when_no_step_is_corrupt(tmp_path, capsys):
    _partial_chain(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    assert main(["inspect", "--json", str(tmp_path)]) == 0
    assert "CORRUPT" not in capsys.readouterr().out


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path, monkeypatch, capsys):
    """`moc inspect DIR | head -1`: the reader is gone before the output is written."""
    _partial_chain(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)
    pipe = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", pipe)
    try:
        assert main(["inspect", str(tmp_path)]) == 141
    finally:
        monkeypatch.undo()
        pipe.close()
    assert capsys.readouterr().err == ""


@pytest.mark.integration
def test_inspect_piped_into_head_prints_no_traceback(tmp_path):
    _partial_chain(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Many steps make the output longer than a pipe's buffer (64 KiB), so that it is
    # still being written when `head` exits. inspect reads manifests only: copies of
    # step 30's, renumbered, are enough.
    d = json.loads((step_dir(tmp_path, 30) / MANIFEST).read_text())
    for step in range(40, 10_000, 10):
        step_dir(tmp_path, step).mkdir()
        d["step"] = d["extra"]["step"] = step
        (step_dir(tmp_path, step) / MANIFEST).write_text(json.dumps(d))
    out = subprocess.run(f'"{sys.executable}" -m moc inspect "{tmp_path}" | head -c 10',
                         shell=True, capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=120)
    assert len(out.stdout) == 10
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_missing_or_empty_directory_is_a_one_line_usage_error(tmp_path, capsys, command):
    assert main([command, str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moc {command}: error:") and "nope" in err
    assert err.count("\n") == 1
    assert main([command, str(tmp_path)]) == 2
    assert "no complete checkpoint step" in capsys.readouterr().err


def test_step_directories_without_a_manifest_are_ignored(tmp_path, capsys):
    _partial_chain(tmp_path)
    # An interrupted save and a stray directory: neither may be read.
    (begin_step(tmp_path, 40) / rank_file(0)).write_bytes(b"garbage")
    step_dir(tmp_path, 50).mkdir()
    (step_dir(tmp_path, 50) / rank_file(0)).write_bytes(b"garbage")
    assert [s["step"] for s in inspect_checkpoints(tmp_path)["steps"]] == [10, 20, 30]
    report = verify_checkpoints(tmp_path)
    assert report.ok and report.steps == [10, 20, 30]
    assert main(["verify", str(tmp_path)]) == 0
    assert "OK" in capsys.readouterr().out


# ----------------------------------------------------------------------------- verify


def test_verify_passes_an_intact_directory(tmp_path, capsys):
    _full_ckpt(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    n_keys = len(Manifest.load(tmp_path, 1).entries)
    assert f"2 step(s) (1, 2), {2 * n_keys} key(s) in 2 file(s)" in out
    assert "OK" in out


def test_verify_reads_each_key_of_a_partial_chain_once(tmp_path):
    _partial_chain(tmp_path)
    report = verify_checkpoints(tmp_path)
    assert report.ok, report.bad_files
    # Every (file, key) pair that any manifest names, counted once.
    pairs = {(e.step, k) for step in (10, 20, 30)
             for k, e in Manifest.load(tmp_path, step).entries.items()}
    assert report.keys == len(pairs) and report.files == 3


def test_flipped_byte_fails_verify_naming_file_and_key(tmp_path, capsys):
    _full_ckpt(tmp_path)
    f = _rank0(tmp_path, 1)
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x01  # inside the last tensor's data
    f.write_bytes(bytes(raw))
    report = verify_checkpoints(tmp_path)
    assert list(report.bad_files) == ["step-00000001/rank-00000.safetensors"]
    [reason] = report.bad_files["step-00000001/rank-00000.safetensors"]
    last_key = list(json.loads(f.read_bytes()[8:8 + int.from_bytes(raw[:8], "little")]))[-1]
    assert "checksum mismatch" in reason and repr(last_key) in reason
    assert report.damaged_steps == [1] and report.intact_steps == [2]
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED: 1 bad file(s); damaged steps: 1; intact steps" in out
    assert "step-00000001/rank-00000.safetensors" in out and repr(last_key) in out


def test_truncated_file_is_reported(tmp_path, capsys):
    _full_ckpt(tmp_path)
    f = _rank0(tmp_path, 2)
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[:-40])
    report = verify_checkpoints(tmp_path)
    reasons = report.bad_files["step-00000002/rank-00000.safetensors"]
    assert f"size is {size - 40} bytes, manifest of step 2 records {size}" in reasons
    assert len(reasons) >= 2  # the size, and the read failure itself
    assert list(report.bad_files) == ["step-00000002/rank-00000.safetensors"]
    assert main(["verify", str(tmp_path)]) == 1


def test_deleted_file_is_reported_for_every_step_that_needs_it(tmp_path):
    _partial_chain(tmp_path)
    _rank0(tmp_path, 10).unlink()
    report = verify_checkpoints(tmp_path)
    assert list(report.bad_files) == ["step-00000010/rank-00000.safetensors"]
    text = "\n".join(report.bad_files["step-00000010/rank-00000.safetensors"])
    assert "file is missing (manifest of step 10 records" in text
    assert "file is missing; 39 key(s) point at it" in text
    # Steps 20 and 30 still point into step 10 for the experts they did not save.
    assert report.steps == [10, 20, 30] and report.damaged_steps == [10, 20, 30]


def test_corrupt_manifest_fails_verify(tmp_path):
    _partial_chain(tmp_path)
    (step_dir(tmp_path, 20) / MANIFEST).write_text('{"format": "moc-checkpoint"}')
    report = verify_checkpoints(tmp_path)
    assert not report.ok and report.steps == [10, 30]
    assert "step-00000020/manifest.json" in report.bad_files


@pytest.mark.integration
def test_verify_exit_code_end_to_end(tmp_path):
    _partial_chain(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def verify() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "moc", "verify", str(tmp_path)],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=120)

    ok = verify()
    assert ok.returncode == 0, ok.stderr
    f = _rank0(tmp_path, 20)
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    bad = verify()
    assert bad.returncode == 1
    assert "step-00000020/rank-00000.safetensors" in bad.stdout


# ------------------------------------------------------------------------ DCP launcher


class _Payload:
    """What a hostile `.metadata` holds: unpickling it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.mkdir, (str(self.marker),)


def test_the_launcher_check_never_unpickles_a_dcp_directory(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "unpickled"
    dcp_step_dir(root, 10).mkdir(parents=True)
    (dcp_step_dir(root, 10) / METADATA).write_bytes(pickle.dumps(_Payload(marker)))
    check_train_config(TrainConfig(ckpt_dir=str(root), ckpt_mode="dcp-sync"), 1)
    assert not marker.exists(), "moc's launcher unpickled the DCP step's .metadata"
