"""`moc export` / `moc.export`: a checkpoint step as the model's own state dict, from the
manifests alone; reading never changes the checkpoint directory; model-only engines
(`optimizer=None`) restore for inference.

Every test writes real checkpoints with the real engines and reads the export back with
the readers users have (safetensors, `torch.load`, transformers' `from_pretrained`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import moc
from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.export import StaleExpertsError
from moc.checkpoint.spec import ExpertSpec
from moc.checkpoint.store.manifest import Manifest
from moc.checkpoint.store.steps import MANIFEST, complete_steps, rank_file, step_dir
from moc.cli import main
from moc.model import ModelConfig, Transformer
from moc.parallel import ParallelGroups, ShardedAdamW
from tests.checkpoint.test_foreign_model import Net, _build, _spec, _step
from tests.distributed import run_ranks
from tests.fs import fill, tmpfs

REPO = Path(__file__).resolve().parents[2]
CFG = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)


def _moc_model(seed: int = 0) -> tuple[Transformer, ShardedAdamW]:
    torch.manual_seed(seed)
    model = Transformer(CFG)
    return model, ShardedAdamW(model, ParallelGroups.single(CFG.n_experts), lr=1e-2)


def _train_step(model: Transformer, opt: ShardedAdamW, seed: int) -> None:
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(idx, idx).loss.backward()
    opt.step()
    model.zero_grad()


def _checkpoints(root: Path, steps: int, k: int | None, final: bool) -> Transformer:
    """A moc model trained `steps` steps, checkpointed at each (K experts per layer), the
    last one final when `final`; returns the trained model."""
    model, opt = _moc_model()
    ckpt = moc.Checkpointer(model, opt, root, policy=moc.PECPolicy(k=k), interval=1,
                            model_meta=CFG.to_dict())
    for step in range(1, steps + 1):
        _train_step(model, opt, step)
        ckpt.record_routing(torch.ones(CFG.n_layers, CFG.n_experts, dtype=torch.int64))
        ckpt.save(step, {"step": step}, final=final and step == steps)
    ckpt.close()
    return model


def _model_only_restore(root: Path) -> Transformer:
    """The newest step restored into a fresh model by a model-only engine."""
    fresh, _ = _moc_model(seed=99)
    report = moc.Checkpointer(fresh, None, root, model_meta=CFG.to_dict()).restore()
    assert report is not None
    return fresh


def _assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def _flip_a_param_byte(path: Path) -> None:
    """Damage one byte of a model parameter's data (what export and restore read)."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    begin = next(v["data_offsets"][0] for k, v in header.items() if k.startswith("param/"))
    raw[8 + n + begin] ^= 0x01
    path.write_bytes(bytes(raw))


def _tree(root: Path) -> dict[str, tuple]:
    """Every path under `root` (links not followed) -> its kind, content and mtime: what
    a read must leave exactly as it was."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if p.is_symlink():
            what = ("link", os.readlink(p))
        elif p.is_file():
            what = ("file", p.read_bytes())
        else:
            what = ("dir", None)
        out[str(p.relative_to(root))] = (*what, st.st_mtime_ns)
    return out


# -- the state dict under the model's own names ------------------------------------------


def test_a_final_checkpoint_exports_the_trained_state_under_the_models_names(tmp_path):
    model = _checkpoints(tmp_path / "ckpt", 3, k=1, final=True)
    report = moc.export(tmp_path / "ckpt", tmp_path / "out", format="safetensors")
    assert report.step == 3 and not report.partial
    assert report.config  # moc's Transformer.config: load_exported reads it (tests/model)
    sd = load_file(tmp_path / "out" / "model.safetensors")
    _assert_state_equal(sd, model.state_dict())
    fresh, _ = _moc_model(seed=5)
    fresh.load_state_dict(sd, strict=True)  # batched experts restored as [E, ...] tensors


def test_export_reports_its_progress_tensor_by_tensor_up_to_the_total(tmp_path):
    _checkpoints(tmp_path / "ckpt", 2, k=None, final=True)
    calls: list[tuple[int, int]] = []
    report = moc.export(tmp_path / "ckpt", tmp_path / "out", format="hf",
                        progress=lambda n, total: calls.append((n, total)))
    assert len(calls) == report.tensors
    assert {total for _, total in calls} == {report.total_bytes}
    assert sum(n for n, _ in calls) == report.total_bytes


def test_modulelist_experts_export_as_their_modulelist_names(tmp_path):
    model, opt = _build(0)
    ckpt = moc.Checkpointer(model, opt, tmp_path / "ckpt", experts=_spec(model),
                            policy=moc.PECPolicy(k=1), interval=1)
    for step in range(1, 4):
        ckpt.record_routing(_step(model, opt, step))
        ckpt.save(step, final=step == 3)
    ckpt.close()
    moc.export(tmp_path / "ckpt", tmp_path / "out", format="torch")
    sd = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert "blocks.1.ffns.3.fc_in.weight" in sd
    _assert_state_equal(sd, model.state_dict())


def test_hf_format_shards_and_indexes_every_tensor(tmp_path):
    model = _checkpoints(tmp_path / "ckpt", 1, k=None, final=True)
    report = moc.export(tmp_path / "ckpt", tmp_path / "out", shard_size=20_000)
    shards = [f for f in report.files if f.endswith(".safetensors")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    sd = {}
    for shard in shards:
        part = load_file(tmp_path / "out" / shard)
        assert all(index["weight_map"][n] == shard for n in part)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 20_000 \
            or len(part) == 1
        sd.update(part)
    assert sorted(index["weight_map"]) == sorted(sd)
    assert index["metadata"]["total_size"] == report.total_bytes == sum(
        t.numel() * t.element_size() for t in sd.values())
    _assert_state_equal(sd, model.state_dict())


def test_transformers_mixtral_round_trips_through_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _mixtral(transformers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = moc.Checkpointer(model, opt, tmp_path / "ckpt", policy=moc.PECPolicy(k=1))
    for step in range(1, 3):
        _hf_step(model, opt, step)
        ckpt.record_routing(torch.ones(2, 4, dtype=torch.int64))
        ckpt.save(step, final=step == 2)
    ckpt.close()
    stored = Manifest.load(tmp_path / "ckpt", 2).model_config
    assert stored["model_type"] == "mixtral"
    assert stored["architectures"] == ["MixtralForCausalLM"]
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    loaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out")
    _assert_state_equal(loaded.state_dict(), model.state_dict())
    _assert_same_config(loaded.config, model.config)


# -- partial steps ------------------------------------------------------------------------


def test_a_partial_step_is_refused_with_counts_and_exported_with_ages_when_allowed(
        tmp_path, capsys):
    root = tmp_path / "ckpt"
    model = _checkpoints(root, 3, k=1, final=False)
    with pytest.raises(StaleExpertsError, match=r"step 3 is partial: 6 of 8 experts.*up to 2 "
                                                r"steps.*step 1 is complete \(--step 1\)"):
        moc.export(root, tmp_path / "out")
    assert main(["export", str(root), str(tmp_path / "out")]) == 2
    assert "--allow-partial" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(["export", str(root), str(tmp_path / "out"), "--allow-partial",
                 "--format", "safetensors"]) == 0
    printed = capsys.readouterr().out
    assert "PARTIAL" in printed and "MoE layer 1:" in printed
    ages = json.loads((tmp_path / "out" / "moc-export.json").read_text())["expert_age"]
    assert {m: sorted(row) for m, row in ages.items()} == {"0": [0, 1, 2, 2], "1": [0, 1, 2, 2]}
    sd = load_file(tmp_path / "out" / "model.safetensors")
    # Each expert at its newest copy: what a restore of the step installs, which is not
    # the live model (its stale experts moved on).
    _assert_state_equal(sd, _model_only_restore(root).state_dict())
    assert not all(torch.equal(sd[n], t) for n, t in model.state_dict().items())
    # An older complete step exports without the flag.
    assert moc.export(root, tmp_path / "out1", step=1).step == 1


# -- bad input ------------------------------------------------------------------------------


def test_bad_input_is_refused_with_what_to_do(tmp_path, capsys):
    root = tmp_path / "ckpt"
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "none"), str(out)]) == 2
    assert "is not a directory" in capsys.readouterr().err
    root.mkdir()
    assert main(["export", str(root), str(out)]) == 2
    assert "holds no complete checkpoint step" in capsys.readouterr().err
    _checkpoints(root, 2, k=None, final=True)
    assert main(["export", str(root), str(out), "--step", "7"]) == 2
    assert "no complete step 7; complete steps: 1, 2" in capsys.readouterr().err
    assert main(["export", str(root), str(root / "export")]) == 2
    assert "inside the checkpoint directory" in capsys.readouterr().err
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main(["export", str(root), str(out)]) == 2
    assert "not empty; pass force=True (--force)" in capsys.readouterr().err
    assert (out / "mine.txt").read_text() == "keep"
    assert main(["export", str(root), str(out), "--force", "--format", "torch"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "moc-export.json",
                                                     "pytorch_model.bin"]
    with pytest.raises(SystemExit):
        main(["export", str(root), str(out), "--shard-size", "lots"])
    assert "expected a size" in capsys.readouterr().err
    with pytest.raises(ValueError, match="format must be one of hf, safetensors, torch"):
        moc.export(root, tmp_path / "x", format="gguf")


def _bad_out(case: str, tmp: Path, stack: contextlib.ExitStack) -> tuple[Path, Path, list]:
    """(OUT, the directory to watch, extra arguments) of one bad OUT, on real file
    systems: mounts are real tmpfs mounts (skipped where mounting is not allowed)."""
    if case == "read-only mount":
        mnt = stack.enter_context(tmpfs(tmp / "ro", size="1m"))
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        return mnt / "out", mnt, []
    if case == "full file system, new parents":
        mnt = stack.enter_context(tmpfs(tmp / "full", size="1m"))
        fill(mnt)
        return mnt / "new" / "deeper" / "out", mnt, []
    if case == "mount point with --force":
        mnt = stack.enter_context(tmpfs(tmp / "mnt", size="4m"))
        (mnt / "mine.txt").write_text("keep")
        return mnt, mnt, ["--force"]
    if case == "under a regular file":
        (tmp / "a-file").write_text("keep")
        return tmp / "a-file" / "out", tmp, []
    if case == "under a dangling link":
        (tmp / "dangling").symlink_to(tmp / "nowhere")
        return tmp / "dangling" / "out", tmp, []
    if case == "under a link loop":
        (tmp / "loop").symlink_to("loop")
        return tmp / "loop" / "out", tmp, []
    if case == "name too long":
        return tmp / ("x" * 300), tmp, []
    if case == "under /proc":
        return Path("/proc/moc-export-out"), Path("/proc"), []
    assert case == "under /sys"
    return Path("/sys/moc-export-out"), Path("/sys"), []


def _listing(watched: Path) -> list[str]:
    """What a failed export must leave as it found: the directory's names, less /proc's
    process directories, which come and go with every process on a busy machine (a
    clean clone's run once failed on '29564' != '29563')."""
    return sorted(n for n in os.listdir(watched) if not (watched == Path("/proc") and n.isdigit()))


BAD_OUTS = ("read-only mount", "full file system, new parents", "mount point with --force",
            "under a regular file", "under a dangling link", "under a link loop",
            "name too long", "under /proc", "under /sys")


@pytest.mark.parametrize("case", BAD_OUTS)
def test_an_out_that_cannot_be_written_is_one_line_and_leaves_nothing_behind(
        tmp_path, capsys, case):
    """Each printed a traceback (OSError from mkdir, writev or rename) and exited 1."""
    root = tmp_path / "ckpt"
    _checkpoints(root, 1, k=None, final=True)
    (tmp_path / "bad").mkdir()
    with contextlib.ExitStack() as stack:
        out, watched, extra = _bad_out(case, tmp_path / "bad", stack)
        before = _listing(watched)
        assert main(["export", str(root), str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moc export: error: ") and err.count("\n") == 1, err
        assert str(out)[:40] in err and "choose" in err.lower(), err
        assert _listing(watched) == before, "the failed export left something"
        if case == "mount point with --force":
            assert (out / "mine.txt").read_text() == "keep"


def test_a_checkpoint_file_gone_while_exporting_is_the_sources_error_not_outs(tmp_path):
    """A rank file deleted after the manifest was read (retention of a running job) is
    reported as the checkpoint's problem, never as an OUT that cannot be written; the
    temporary directory is removed."""
    root = tmp_path / "ckpt"
    _checkpoints(root, 1, k=None, final=True)
    (step_dir(root, 1) / rank_file(0)).unlink()
    with pytest.raises(CorruptCheckpointError, match="file is missing") as e:
        moc.export(root, tmp_path / "out")
    assert "cannot write the export" not in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_corrupt_tensor_fails_the_export_naming_its_file(tmp_path, capsys):
    root = tmp_path / "ckpt"
    _checkpoints(root, 1, k=None, final=True)
    f = step_dir(root, 1) / rank_file(0)
    _flip_a_param_byte(f)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        moc.export(root, tmp_path / "out")
    assert main(["export", str(root), str(tmp_path / "out")]) == 2
    assert f"{f}: checksum mismatch" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary left behind


def test_a_checkpoint_without_the_expert_layout_says_to_save_it_again(tmp_path):
    root = tmp_path / "ckpt"
    _checkpoints(root, 1, k=None, final=True)
    path = step_dir(root, 1) / MANIFEST
    d = json.loads(path.read_text())
    del d["experts"]["params"]  # as moc 0.3.0 wrote it
    path.write_text(json.dumps(d))
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"did not record how the model names its experts.*save it again"):
        moc.export(root, tmp_path / "out")
    d["experts"]["params"] = {"layers.0.ffn.experts.w1_LDF": {"dim": "zero"}}
    path.write_text(json.dumps(d))
    with pytest.raises(CorruptCheckpointError, match=r"experts.params\['layers.0"):
        moc.export(root, tmp_path / "out")


# -- reading changes nothing -----------------------------------------------------------------


def _damaged(root: Path) -> Path:
    """Two steps, the newest corrupt; a stale .tmp; a leftover .replaced of step 1."""
    _checkpoints(root, 2, k=None, final=True)
    _flip_a_param_byte(step_dir(root, 2) / rank_file(0))
    (root / "step-00000003.tmp").mkdir()
    (root / "step-00000003.tmp" / rank_file(0)).write_bytes(b"half a file")
    shutil.copytree(step_dir(root, 1), root / "step-00000001.replaced")
    return root


def test_export_verify_inspect_and_restore_change_nothing_and_the_first_save_tidies(
        tmp_path):
    root = _damaged(tmp_path / "ckpt")
    before = _tree(root)
    moc.export(root, tmp_path / "out", step=1)
    assert main(["verify", str(root)]) == 1
    assert main(["inspect", str(root)]) == 0
    restored = _model_only_restore(root)
    assert _tree(root) == before, "a read changed the checkpoint directory"
    _assert_state_equal(load_file(tmp_path / "out" / "model-00001-of-00001.safetensors"),
                        restored.state_dict())
    # A training engine's restore reads the same way (its lock file names the holder).
    model, opt = _moc_model(seed=3)
    ckpt = moc.Checkpointer(model, opt, root, model_meta=CFG.to_dict())
    report = ckpt.restore()
    assert report.step == 1 and "checksum mismatch" in report.skipped[0]
    after = _tree(root)
    assert {k: v for k, v in after.items() if k != "moc.lock"} == \
        {k: v for k, v in before.items() if k != "moc.lock"}
    # The write path: the first save sets the corrupt step aside and removes the .tmp
    # before it commits; retention then never counts step 2 as a good newest step.
    ckpt.save(5, {"step": 5})
    ckpt.close()
    names = sorted(p.name for p in root.iterdir())
    assert names == ["moc-run.json", "moc.lock", "step-00000001", "step-00000002.corrupt",
                     "step-00000005"]
    assert "checksum mismatch" in (root / "step-00000002.corrupt" / "CORRUPT.txt").read_text()


def test_retention_after_a_restore_never_counts_the_corrupt_step_among_the_newest(tmp_path):
    root = tmp_path / "ckpt"
    _checkpoints(root, 3, k=None, final=True)
    _flip_a_param_byte(step_dir(root, 3) / rank_file(0))
    model, opt = _moc_model(seed=3)
    ckpt = moc.Checkpointer(model, opt, root, model_meta=CFG.to_dict(), keep_last=2)
    assert ckpt.restore().step == 2
    ckpt.save(4, {"step": 4})
    ckpt.close()  # waits for retention
    # Keeping the newest two: 2 and 4. Counting the corrupt 3 would have deleted 2, the
    # only good checkpoint before 4.
    assert sorted(p.name for p in root.glob("step-*")) == [
        "step-00000002", "step-00000003.corrupt", "step-00000004"]


def test_an_interrupted_recommit_is_put_back_only_by_a_restore_that_writes(tmp_path, caplog):
    root = tmp_path / "ckpt"
    _checkpoints(root, 2, k=None, final=True)
    # A crash between commit_step's renames: step 2's only good copy is `.replaced`.
    step_dir(root, 2).rename(root / "step-00000002.replaced")
    before = _tree(root)
    fresh, _ = _moc_model(seed=9)
    with caplog.at_level("WARNING"):
        report = moc.Checkpointer(fresh, None, root, model_meta=CFG.to_dict()).restore()
    assert report.step == 1 and "holds the only good copy" in caplog.text
    with pytest.raises(ValueError, match=r"no complete step 2 \(step-00000002.replaced"):
        moc.export(root, tmp_path / "out", step=2)
    assert _tree(root) == before
    model, opt = _moc_model(seed=3)
    ckpt = moc.Checkpointer(model, opt, root, model_meta=CFG.to_dict())
    assert ckpt.restore().step == 2
    ckpt.close()
    assert moc.export(root, tmp_path / "out").step == 2  # into an empty OUT, too
    (tmp_path / "empty").mkdir()
    assert moc.export(root, tmp_path / "empty").step == 2


READ_ONLY = """
import sys
from pathlib import Path
from tests.checkpoint.test_export import _model_only_restore
from moc.cli import main
root, out = Path(sys.argv[1]), sys.argv[2]
print("EXPORT", main(["export", str(root), out, "--step", "1"]))
print("VERIFY", main(["verify", str(root)]))
sd = _model_only_restore(root).state_dict()
print("RESTORED", len(sd))
"""


@pytest.mark.integration  # a process in its own mount namespace
def test_a_read_only_mount_exports_and_restores(tmp_path):
    """On a real read-only bind mount (EROFS): root ignores permission bits, so the
    process runs in its own mount namespace; skipped where that is not allowed."""
    root = _damaged(tmp_path / "ckpt")
    before = _tree(root)
    argv = [sys.executable, "-c", READ_ONLY, str(root), str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a read-only bind mount")
    shell = ('mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" '
             '|| { echo MOUNT_FAILED; exit 3; }; shift; exec "$@"')
    r = subprocess.run(["unshare", "-m", "sh", "-c", shell, "sh", str(root), *argv],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    if "MOUNT_FAILED" in r.stdout or (r.returncode and "unshare" in r.stderr):
        pytest.skip(f"not allowed to mount read-only here: {r.stderr}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "EXPORT 0" in r.stdout and "VERIFY 1" in r.stdout and "RESTORED" in r.stdout
    assert "Read-only file system" not in r.stderr and "could not" not in r.stderr
    assert _tree(root) == before
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()


# -- model-only engines -----------------------------------------------------------------------


def test_a_model_only_checkpointer_restores_the_model_and_never_writes(tmp_path, caplog):
    root = tmp_path / "ckpt"
    fresh_dir = tmp_path / "fresh"
    engine = moc.Checkpointer(_moc_model()[0], None, fresh_dir, model_meta=CFG.to_dict())
    assert engine.restore() is None and not fresh_dir.exists()  # no lock, no run id
    engine.close()
    trained = _checkpoints(root, 3, k=1, final=True)
    before = _tree(root)
    model, _ = _moc_model(seed=7)
    rng = torch.get_rng_state()
    ckpt = moc.Checkpointer(model, None, root, model_meta=CFG.to_dict())
    report = ckpt.restore()
    assert report.step == 3
    _assert_state_equal(model.state_dict(), trained.state_dict())
    assert torch.equal(torch.get_rng_state(), rng), "a model-only restore set the RNG"
    with pytest.raises(ValueError, match=r"optimizer=None.*cannot save"):
        ckpt.save(4, {"step": 4})
    with caplog.at_level("WARNING"):
        ckpt.close()
    assert "partial" not in caplog.text
    assert _tree(root) == before


def test_a_model_only_two_level_checkpointer_restores_from_storage(tmp_path):
    root = tmp_path / "ckpt"
    trained = _checkpoints(root, 2, k=1, final=True)
    before = _tree(root)
    model, _ = _moc_model(seed=7)
    ckpt = moc.TwoLevelCheckpointer(model, None, root, model_meta=CFG.to_dict())
    report = ckpt.restore()
    assert report.step == 2 and report.source == "storage"
    assert report.sources == {"storage": [0]}
    _assert_state_equal(model.state_dict(), trained.state_dict())
    with pytest.raises(ValueError, match="optimizer=None"):
        ckpt.save(3, {"step": 3})
    assert ckpt.drain_completed() == [] and not ckpt.pending
    ckpt.close()
    assert _tree(root) == before


READ_BESIDE = """
import sys
import moc
from tests.checkpoint.test_export import CFG, _moc_model
model, _ = _moc_model(seed=7)
ckpt = moc.TwoLevelCheckpointer(model, None, sys.argv[1], model_meta=CFG.to_dict())
report = ckpt.restore()
ckpt.close()
print(report.step, report.source)
"""


@pytest.mark.integration  # a training job's persist process, a reader in another process
def test_a_model_only_reader_beside_a_running_two_level_job_leaves_its_memory_alone(
        tmp_path):
    """The attack: an evaluation process opens the directory of a running two-level
    job with `optimizer=None` and the default job id, which is the trainer's. It used
    to claim the job's shared memory, start a second persist process for it and, at
    close, delete it: the trainer's next snapshot failed and its in-memory recovery was
    gone."""
    from moc.checkpoint.twolevel.memory.jobdir import job_dir
    root = tmp_path / "ckpt"
    model, opt = _moc_model()
    ckpt = moc.TwoLevelCheckpointer(model, opt, root, policy=moc.PECPolicy(k=1),
                                    interval=1, model_meta=CFG.to_dict())
    try:
        def train(steps: range) -> None:
            for step in steps:
                _train_step(model, opt, step)
                ckpt.record_routing(torch.ones(CFG.n_layers, CFG.n_experts,
                                               dtype=torch.int64))
                ckpt.wait_for_snapshot()
                ckpt.save(step, {"step": step})
            ckpt.flush()

        train(range(1, 4))
        shm = job_dir(ckpt.job)
        owner = (shm / "owner.json").read_text()
        held = sorted(p.name for p in shm.rglob("*"))
        r = subprocess.run([sys.executable, "-c", READ_BESIDE, str(root)], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        # Storage only (its newest complete step), never the job's memory (step 3).
        assert r.stdout.split() == [str(complete_steps(root)[-1]), "storage"]
        assert (shm / "owner.json").read_text() == owner
        assert sorted(p.name for p in shm.rglob("*")) == held
        train(range(4, 6))
        assert all(res.error is None for res in ckpt.drain_completed())
        report = ckpt.restore()  # the trainer's own memory is still its recovery source
        assert report.step == 5 and report.source == "memory"
    finally:
        ckpt.close()


# -- real parallel runs ------------------------------------------------------------------------


def _readme_export_commands() -> list[str]:
    """The shell lines of the README's Export section (its first bash block)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Export\n"):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    return [line for line in block[:block.index("```")].splitlines() if line.strip()]


@pytest.mark.integration
def test_moc_train_with_ep2_exports_what_a_one_rank_restore_holds(tmp_path):
    """moc's own trainer, 2 ranks, EP=2, partial checkpoints: the final step exports
    (experts gathered from both ranks' files and older steps) into a fresh single-process
    model with a strict load, every tensor equal to a 1-rank resharding restore of the
    same step. The README's export commands, run as written, export it with its
    config.json, and `load_exported` gives the restored model's logits."""
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(
        [sys.executable, "-m", "moc", "train", "--nproc", "2", "--ep", "2", "--config",
         "tiny", "--steps", "12", "--ckpt-dir", str(root), "--ckpt-interval", "5",
         "--ckpt-mode", "pec", "--k-persist", "1"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    m = Manifest.load(root, 12)
    assert m.layout == {"world_size": 2, "ep": 2}
    assert {e.file for k, e in m.entries.items() if "/expert=" in k} == {
        rank_file(0), rank_file(1)}
    assert main(["export", str(root), str(tmp_path / "out10"), "--step", "10"]) == 2
    assert main(["export", str(root), str(tmp_path / "st"), "--format", "safetensors"]) == 0
    from moc.model import load_exported
    from moc.train.config import PRESETS

    cfg = PRESETS["tiny"]["model"]
    exported = Transformer(cfg)
    exported.load_state_dict(load_file(tmp_path / "st" / "model.safetensors"), strict=True)
    restored = Transformer(cfg)
    report = moc.Checkpointer(restored, None, root, model_meta=cfg.to_dict()).restore()
    assert report.step == 12
    _assert_state_equal(exported.state_dict(), restored.state_dict())
    assert not all(torch.equal(a, b) for a, b in
                   zip(exported.state_dict().values(), Transformer(cfg).state_dict().values(),
                       strict=True)), "nothing was trained"

    commands = _readme_export_commands()
    assert commands[0].startswith("moc export ckpt/ out/")
    for line in commands:  # in the directory that holds ckpt/, as a user would
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (line, done.stderr[-3000:])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "moc"
    loaded = load_exported(tmp_path / "out")
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(idx).logits_BTV, restored.eval()(idx).logits_BTV)


def _mixtral(transformers: ModuleType) -> nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32))


def _qwen2_moe(transformers: ModuleType) -> nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32))


def _hf_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _assert_same_config(loaded: Any, original: Any) -> None:
    """What from_pretrained fills in itself (its path, the dtype it loaded) aside."""
    skip = {"_name_or_path", "dtype", "torch_dtype", "architectures", "transformers_version"}
    a, b = loaded.to_dict(), original.to_dict()
    assert {k: v for k, v in a.items() if k not in skip} == \
        {k: v for k, v in b.items() if k not in skip}


def _train_hf_ddp(rank: int, world: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """Inside a rank: each tiny transformers MoE trained 3 steps under plain DDP (every
    rank its own batch), partial checkpoints and a final one; rank 0 returns the trained
    state dicts."""
    import transformers
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name, build in (("mixtral", _mixtral), ("qwen2_moe", _qwen2_moe)):
        model = build(transformers)
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ckpt = moc.Checkpointer(ddp, opt, Path(root) / name, policy=moc.PECPolicy(k=1),
                                interval=1)
        for step in range(1, 4):
            _hf_step(ddp, opt, 100 * step + rank)
            ckpt.record_routing(torch.ones(2, 4, dtype=torch.int64))
            ckpt.maybe_save(step, final=step == 3)
        ckpt.close()
        out[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out if rank == 0 else {}


@pytest.mark.integration
def test_transformers_moes_trained_with_ddp_export_to_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    trained, _ = run_ranks(_train_hf_ddp, 2, str(tmp_path), timeout=600)
    for name, cls, build in (("mixtral", transformers.MixtralForCausalLM, _mixtral),
                             ("qwen2_moe", transformers.Qwen2MoeForCausalLM, _qwen2_moe)):
        root = tmp_path / name
        assert Manifest.load(root, 3).layout == {"world_size": 2, "ep": 1}
        assert main(["export", str(root), str(tmp_path / f"{name}-out"),
                     "--shard-size", "40kB"]) == 0
        loaded = cls.from_pretrained(tmp_path / f"{name}-out")
        _assert_state_equal(loaded.state_dict(), trained[name])
        _assert_same_config(loaded.config, build(transformers).config)
    assert "model.layers.1.mlp.shared_expert.up_proj.weight" in trained["qwen2_moe"]


class _LocalNet(Net):
    """test_foreign_model's Net holding only experts `first`, `first + 1` of its four
    (expert parallelism over 2 ranks, ModuleList layout)."""

    def __init__(self, first: int) -> None:
        super().__init__()
        for block in self.blocks:
            block.ffns = nn.ModuleList(block.ffns[first:first + 2])


def _save_ep_modulelist(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    groups = ParallelGroups.from_world(2, 4)
    torch.manual_seed(0)
    model = _LocalNet(2 * rank)
    with torch.no_grad():  # the same dense weights, different experts on each rank
        for block in model.blocks:
            for ffn in block.ffns:
                for p in ffn.parameters():
                    p.add_(rank + 1)
    spec = ExpertSpec.from_modules(model, ["blocks.0.ffns", "blocks.1.ffns"], n_experts=4,
                                   expert_offset=2 * rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = moc.Checkpointer(model, opt, root, experts=spec, groups=groups)
    ckpt.save(1, final=True)
    ckpt.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.integration
def test_modulelist_experts_sharded_over_two_ranks_export_under_global_ids(tmp_path):
    states = run_ranks(_save_ep_modulelist, 2, str(tmp_path / "ckpt"))
    moc.export(tmp_path / "ckpt", tmp_path / "out", format="safetensors")
    sd = load_file(tmp_path / "out" / "model.safetensors")
    want = {}
    for rank, state in enumerate(states):
        for name, t in state.items():
            parts = name.split(".")
            if parts[2:3] == ["ffns"]:  # blocks.<m>.ffns.<local>.<rest>: global 2 * rank + local
                parts[3] = str(2 * rank + int(parts[3]))
            want[".".join(parts)] = t
    _assert_state_equal(sd, want)
    Net().load_state_dict(sd, strict=True)
