"""Every subcommand answers --help, from any working directory; default inputs do not
depend on the working directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import moc
from moc.bench.simulate import DEFAULT_OVERHEAD
from moc.cli import BENCHMARKS, build_parser

# Read from the parser itself, so that a new subcommand is checked without a word here.
COMMANDS = [["moc", name] for name in build_parser()[1]]
COMMANDS += [["moc", "bench", what] for what in BENCHMARKS]
COMMANDS += [["moc.train"]]  # the worker torchrun starts


def test_the_help_checks_cover_every_subcommand_and_benchmark():
    assert {" ".join(c[1:]) for c in COMMANDS if c[0] == "moc"} >= {
        "train", "demo", "inspect", "verify", "export", "bench", "simulate", "bench size",
        "bench overhead", "bench accuracy", "bench persist"}


@pytest.mark.integration
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_subcommand_has_help_that_exits_0(command, tmp_path):
    r = subprocess.run([sys.executable, "-m", *command, "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage" in r.stdout and "error" not in r.stderr.lower()
    assert "Traceback" not in r.stderr


def test_default_inputs_are_absolute_paths_found_from_the_package():
    """An input default that lives in the repository is resolved from the package, so
    `moc simulate` reads the same file from any working directory."""
    assert DEFAULT_OVERHEAD.is_absolute() and DEFAULT_OVERHEAD.is_file()
    assert DEFAULT_OVERHEAD == Path(moc.__file__).resolve().parents[1] / "docs" / \
        "bench-overhead.json"


@pytest.mark.integration
def test_simulate_finds_its_default_measurements_outside_the_repository(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moc", "simulate"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_init_distributed_outside_torchrun_is_a_no_op(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert moc.init_distributed() is False
