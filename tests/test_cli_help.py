"""Every subcommand answers --help, from any working directory; default inputs do not
depend on the working directory."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import moc
from moc.bench.simulate import DEFAULT_OVERHEAD
from moc.cli import BENCHMARKS, build_parser
from tests.procs import moc_here

# Read from the parser itself, so that a new subcommand is checked without a word here.
COMMANDS = [["moc", name] for name in build_parser()[1]]
COMMANDS += [["moc", "bench", what] for what in BENCHMARKS]
COMMANDS += [["moc.train"]]  # the worker torchrun starts


def test_the_help_checks_cover_every_subcommand_and_benchmark():
    assert {" ".join(c[1:]) for c in COMMANDS if c[0] == "moc"} >= {
        "train", "demo", "inspect", "verify", "export", "bench", "simulate", "bench size",
        "bench overhead", "bench accuracy", "bench persist"}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_subcommand_has_help_that_exits_0(command, tmp_path, monkeypatch, capsys):
    """In this process, from another working directory (a new interpreter per command
    cost 1.4 s of CI each; `test_help_in_a_new_process` runs the real ones)."""
    from moc import cli
    from moc.train.__main__ import main as worker_main

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    try:  # argparse exits; `moc bench --help` returns
        code = (worker_main if command == ["moc.train"] else cli.main)([*command[1:],
                                                                        "--help"])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code in (0, None), err
    assert "usage" in out and "error" not in err.lower()


@pytest.mark.integration
@pytest.mark.parametrize("command", [["moc"], ["moc", "bench"], ["moc.train"]], ids=" ".join)
def test_help_in_a_new_process(command, tmp_path):
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


class _Built(Exception):
    """Raised in place of parsing: carries the parser a command's main() built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(main: Callable[[list[str]], int], monkeypatch: pytest.MonkeyPatch
               ) -> argparse.ArgumentParser:
    """The parser `main` builds for itself (the benchmarks and the worker build theirs
    inside main): stopped at parse_args, before it runs anything."""
    def stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Built(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        with pytest.raises(_Built) as built:
            main([])
    return built.value.parser


def _every_parser(monkeypatch: pytest.MonkeyPatch) -> dict[str, argparse.ArgumentParser]:
    from moc.train.__main__ import main as worker_main

    top, commands = build_parser()
    parsers = {"moc": top, **{f"moc {name}": p for name, p in commands.items()}}
    for what in (*BENCHMARKS, "simulate"):  # `moc bench WHAT`, `moc simulate` parse again
        module = f"moc.bench.{what}"
        parsers[module] = _parser_of(importlib.import_module(module).main, monkeypatch)
    parsers["moc.train"] = _parser_of(worker_main, monkeypatch)
    return parsers


def test_every_option_of_every_command_says_what_it_does(monkeypatch):
    parsers = _every_parser(monkeypatch)
    assert {"moc train", "moc.bench.size", "moc.bench.simulate", "moc.train"} <= set(parsers)
    assert len(parsers) == 1 + len(build_parser()[1]) + len(BENCHMARKS) + 2
    missing = [f"{prog} {'/'.join(a.option_strings) or a.dest}"
               for prog, p in parsers.items() for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
               and a.nargs != argparse.REMAINDER  # `moc bench`'s pass-through
               and not a.help]
    assert not missing, f"options without help text: {missing}"


def _help_of(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser()[0].parse_args(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_moc_train_help_is_grouped_and_testing_options_wait_for_help_all(capsys):
    """Issue 50: 38 options in one flat list, fault injection beside the options a run
    is configured with. The groups come in reading order; --help leaves the testing
    group out and names --help-all, which shows it."""
    short = _help_of(["train", "--help"], capsys)
    groups = ["ranks and nodes:", "model and data:", "checkpointing:", "recovery:"]
    assert [short.index(g) for g in groups] == sorted(short.index(g) for g in groups)
    assert "--help-all" in short and "--ckpt-interval" in short
    assert "--fault-at" not in short and "testing: fault injection" not in short
    full = _help_of(["train", "--help-all"], capsys)
    assert full.index("recovery:") < full.index("testing: fault injection") \
        < full.index("--fault-at") < full.index("--no-shard")


def test_every_option_of_moc_train_states_its_default(monkeypatch):
    """`--ckpt-interval` and `--keep-last` showed none; an option set by the preset
    names each preset's value, read from PRESETS (so a changed preset cannot leave the
    help behind)."""
    from moc.train.config import PRESETS

    for prog, parser in _every_parser(monkeypatch).items():
        if prog not in ("moc train", "moc.train"):
            continue
        for a in parser._actions:
            text = getattr(a, "hidden_help", a.help)
            if a.option_strings and a.dest not in ("help", argparse.SUPPRESS):
                assert "default" in text, f"{prog} {a.option_strings[0]}: {text}"
        interval = next(a for a in parser._actions if a.dest == "ckpt_interval").help
        assert all(f"{name} {cfg['ckpt_interval']}" in interval
                   for name, cfg in PRESETS.items()), interval


def test_the_hidden_testing_options_still_reach_the_workers():
    from moc.train.cli_args import worker_argv

    parser = build_parser()[1]["train"]
    args = parser.parse_args(["--fault-at", "7", "--no-shard", "--steps", "9"])
    argv = worker_argv(args, parser)
    assert argv[argv.index("--fault-at") + 1] == "7" and "--no-shard" in argv
    assert "--help-all" not in argv


@pytest.mark.parametrize("command", [["train"], ["inspect", "DIR"], ["verify", "DIR"],
                                     ["export", "DIR", "OUT"], ["demo"], ["bench", "size"],
                                     ["simulate"]], ids=" ".join)
def test_an_unknown_option_is_one_line_naming_the_subcommands_help(command, tmp_path,
                                                                    monkeypatch, capsys):
    """One line, not the usage block first (23 lines for `moc train`: issue 50)."""
    monkeypatch.chdir(tmp_path)
    code, err = moc_here(capsys, *command, "--badflag")
    name = " ".join(c for c in command if c.islower())
    assert code == 2, err
    assert err == (f"moc {name}: error: unrecognized arguments: --badflag (`moc {name} "
                   "--help` lists the options)\n"), err


@pytest.mark.parametrize(("argv", "says"), [
    (["--bogus"], "moc: error: unknown option --bogus: a command comes first (train, run, "),
    (["train", "--ckpt-interval", "x"],
     "moc train: error: argument --ckpt-interval: invalid int value: 'x' (`moc train "
     "--help`"),
    ([], "moc: error: the following arguments are required: command (`moc --help`"),
])
def test_a_usage_error_is_one_line_that_names_what_was_wrong(argv, says, capsys):
    code, err = moc_here(capsys, *argv)
    assert code == 2 and err.startswith(says) and err.count("\n") == 1, err


@pytest.mark.integration
def test_an_unknown_option_exits_2_from_the_real_process(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moc", "train", "--badflag"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("moc train: error: unrecognized "
                                                     "arguments: --badflag"), r.stderr


def test_init_distributed_outside_torchrun_is_a_no_op(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert moc.init_distributed() is False


@pytest.mark.integration
def test_moc_starts_without_importing_dtensor_fsdp_or_zero():
    """Every moc process (the CLI, each rank, each persist process) imports moc: importing
    torch.distributed.tensor, fsdp and optim with it cost 1.3 s of each start on the
    2-core VM. A tensor can be a DTensor, an optimizer ZeRO, only once the user imported
    them (`moc.checkpoint.shards.is_dtensor`)."""
    heavy = ["torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.optim"]
    r = subprocess.run([sys.executable, "-c", "import sys, moc, moc.cli, moc.train.loop, "
                        "moc.checkpoint.twolevel.persist.server; print([m for m in "
                        f"{heavy!r} if m in sys.modules])"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
