"""Every subcommand answers --help, from any working directory."""

from __future__ import annotations

import subprocess
import sys

import pytest

import moc

COMMANDS = [["train"], ["demo"], ["inspect"], ["verify"], ["export"], ["bench"], ["bench", "size"],
            ["bench", "overhead"], ["bench", "accuracy"], ["simulate"]]


@pytest.mark.integration
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_subcommand_has_help_that_exits_0(command, tmp_path):
    r = subprocess.run([sys.executable, "-m", "moc", *command, "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage" in r.stdout and "error" not in r.stderr


@pytest.mark.integration
def test_simulate_finds_its_default_measurements_outside_the_repository(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moc", "simulate"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_init_distributed_outside_torchrun_is_a_no_op(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert moc.init_distributed() is False
