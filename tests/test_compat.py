"""The torch moc supports: one minimum, declared in pyproject.toml and checked when moc
is imported (moc.compat); what newer releases add is asked of torch itself. `make
test-compat` runs moc on exactly that minimum (scripts/test_compat.sh)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moc.cli
from moc.cli import check_train_config
from moc.compat import MIN_TORCH, check_torch, has_dcp_async_staging, torch_has, torch_release
from moc.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
NEED = ".".join(map(str, MIN_TORCH))


def test_pyproject_declares_the_minimum_moc_checks():
    declared = re.findall(r'"torch>=([0-9.]+)"', (REPO / "pyproject.toml").read_text())
    assert declared == [NEED]


def test_make_test_compat_installs_the_declared_minimum():
    script = (REPO / "scripts" / "test_compat.sh").read_text()
    assert "pyproject.toml" in script  # the version is read from there, not written twice
    assert re.search(r"^test-compat:", (REPO / "Makefile").read_text(), re.M)
    r = subprocess.run(["bash", "-n", str(REPO / "scripts" / "test_compat.sh")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(("version", "release"), [
    ("2.8.0", (2, 8)), ("2.10.0+cu128", (2, 10)), ("2.13.0+cpu", (2, 13)),
    ("2.9.0a0+git1234", (2, 9)), ("3.0.0.dev20270101", (3, 0))])
def test_the_release_is_read_off_any_build_of_torch(version, release):
    assert torch_release(version) == release


def test_the_minimum_and_every_build_of_it_are_accepted():
    for version in (f"{NEED}.0", f"{NEED}.1+cu128", f"{NEED}.0a0+gitabc", torch.__version__):
        check_torch(version)


@pytest.mark.parametrize("version", ["2.7.1+cu126", "2.4.0", "1.13.1"])
def test_an_older_torch_is_refused_saying_what_was_found_and_what_is_needed(version):
    with pytest.raises(ImportError) as e:
        check_torch(version)
    message = str(e.value)
    assert "\n" not in message
    assert f"moc needs torch {NEED} or newer, found torch {version}" in message
    assert f"pip install 'torch>={NEED}'" in message


def test_import_moc_under_an_older_torch_ends_in_that_one_line():
    # torch's version as an older release would report it, before moc is imported
    code = "import torch; torch.__version__ = '2.7.1'; import moc"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"ImportError: moc needs torch {NEED} or newer, found torch 2.7.1 (in ")


def test_a_feature_is_asked_of_torch_itself():
    assert torch_has("torch.distributed", "init_process_group")
    assert not torch_has("torch.distributed", "no_such_name")
    assert not torch_has("torch.no_such_module", "anything")
    from torch.distributed.checkpoint import staging

    assert has_dcp_async_staging() == hasattr(staging, "DefaultStager")


def test_dcp_async_on_a_torch_without_its_stager_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(moc.cli, "has_dcp_async_staging", lambda: False)  # torch 2.8
    with pytest.raises(ValueError) as e:
        check_train_config(TrainConfig.from_preset("tiny", ckpt_mode="dcp-async"), 2)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("--ckpt-mode dcp-async needs DCP's DefaultStager, which "
                                   f"torch {torch.__version__} lacks (torch 2.9 added it)")
    check_train_config(TrainConfig.from_preset("tiny", ckpt_mode="dcp-sync"), 2)
