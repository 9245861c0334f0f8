"""moc on a machine with torch alone: crc32c, safetensors and tqdm are imported where
they are needed, not with moc (a lent GPU ran `scripts/gpu_check.sh` with the machine's
own python, which had no crc32c, and every section failed at import)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ABSENT = ("crc32c", "safetensors", "tqdm")
ROOT = Path(__file__).resolve().parents[1]


def _without(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter in which importing any of ABSENT fails, as it does
    where they are not installed (a sitecustomize puts None in sys.modules for them)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        f"import sys\nfor name in {ABSENT!r}:\n    sys.modules[name] = None\n")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path,
                          env={"PYTHONPATH": f"{site}:{ROOT}", "PATH": "/usr/bin:/bin",
                               "HOME": str(tmp_path), "MOC_SHM_ROOT": str(tmp_path / "shm")},
                          capture_output=True, text=True, timeout=300)


def test_every_module_imports_and_a_checkpoint_round_trips_without_them(tmp_path):
    r = _without(tmp_path, """
        import importlib, pkgutil, sys
        import torch
        import moc
        for name in ("crc32c", "safetensors", "tqdm"):
            try:
                importlib.import_module(name)
            except ImportError:
                pass
            else:
                raise SystemExit(f"{name} imported: the test blocks nothing")
        for info in pkgutil.walk_packages(moc.__path__, "moc."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
        from moc.model import ModelConfig, Transformer
        from moc.progress import progress
        with progress(3, "x") as bar:  # no tqdm: no bar, the lines still come
            bar.write("a line")
        cfg = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ffn=32, n_experts=4)
        torch.manual_seed(0)
        model = Transformer(cfg)
        opt = torch.optim.AdamW(model.parameters())
        ckpt = moc.Checkpointer(model, opt, "ckpt", interval=1)
        idx = torch.randint(0, 256, (2, 8))
        model(idx, idx).loss.backward()
        opt.step()
        ckpt.save(1)
        ckpt.close()
        fresh = Transformer(cfg)
        again = moc.Checkpointer(fresh, torch.optim.AdamW(fresh.parameters()), "ckpt")
        assert again.restore().step == 1
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
        again.close()
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    assert "a line" in r.stderr


@pytest.mark.parametrize(("what", "code", "package"), [
    ("a format-3 checksum", "from moc.checkpoint.store.format import Digest\n"
                            "Digest('crc32c').update(b'x')", "crc32c"),
    ("an export's safetensors", "from moc.model.exported import load_file\n"
                                "load_file('model.safetensors')", "safetensors"),
])
def test_what_needs_one_says_so_in_one_line(tmp_path, what, code, package):
    r = _without(tmp_path, code)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("ImportError") \
        and f"pip install {package}" in last, r.stderr
