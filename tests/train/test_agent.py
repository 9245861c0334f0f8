"""torchrun's options as `moc train` passes them: asked of this torch's own parser
(`--shutdown-timeout` is new in torch 2.12; torch 2.11's torchrun refused it and
`moc train` did not start, issue 39), and both command lines moc builds (one node, and
one agent per simulated node) with and without it."""

from __future__ import annotations

import argparse

import pytest
from torch.distributed.run import get_args_parser

import moc.cli
from moc.cli import SHUTDOWN_MARGIN_S, shutdown_timeout, single_node_argv, torchrun_shutdown_s
from moc.train.agent import TORCHRUN_SHUTDOWN_S, parser_accepts, torchrun_accepts
from moc.train.nodes import agent_argv

WORKER = ["worker", "--steps", "30"]


def torchrun_like(*options: str) -> argparse.ArgumentParser:
    """A parser shaped like torchrun's: options, then the script and its arguments."""
    p = argparse.ArgumentParser()
    p.add_argument("--nproc-per-node", default="1")
    for option in options:
        p.add_argument(option, type=int)
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def test_an_option_is_accepted_only_by_a_torchrun_that_has_it():
    assert parser_accepts(torchrun_like("--shutdown-timeout"), "--shutdown-timeout")
    assert not parser_accepts(torchrun_like(), "--shutdown-timeout")  # torch 2.10, 2.11


def test_this_torchs_torchrun_is_asked_for_its_own_options():
    assert torchrun_accepts("--max-restarts")
    assert not torchrun_accepts("--no-such-option")
    has = "--shutdown-timeout" in get_args_parser().format_help()
    assert torchrun_accepts("--shutdown-timeout") == has


def test_one_node_passes_the_shutdown_timeout_when_there_is_one():
    argv = single_node_argv(2, 1, 45, "moc.train", WORKER)
    assert argv == ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                    "--shutdown-timeout", "45", "--module", "moc.train", *WORKER]
    assert "--shutdown-timeout" not in single_node_argv(2, 1, None, "moc.train", WORKER)


def test_each_simulated_node_passes_the_shutdown_timeout_when_there_is_one():
    argv = agent_argv(2, 1, 0, "127.0.0.1:29500", "moc-x", WORKER, 45)
    assert argv[argv.index("--shutdown-timeout") + 1] == "45"
    assert argv[-len(WORKER) - 2:] == ["--module", "moc.train", *WORKER]
    assert "--shutdown-timeout" not in agent_argv(2, 1, 0, "127.0.0.1:29500", "moc-x",
                                                  WORKER, None)


def test_the_command_lines_moc_builds_parse_with_this_torchs_torchrun():
    shutdown_s = torchrun_shutdown_s(30.0)
    argvs = {"one node": single_node_argv(2, 1, shutdown_s, "moc.train", WORKER),
             "a simulated node": agent_argv(2, 1, 0, "127.0.0.1:29500", "moc-x", WORKER,
                                            shutdown_s)[3:]}  # after `python -m agent`
    for where, argv in argvs.items():
        args = get_args_parser().parse_args(argv)  # SystemExit on an unknown option
        assert args.training_script == "moc.train", where
        assert args.training_script_args == WORKER, where


def test_a_torchrun_with_the_option_gets_the_grace_period_and_the_margin(monkeypatch, capsys):
    monkeypatch.setattr(moc.cli, "torchrun_accepts", lambda option: True)
    assert torchrun_shutdown_s(30.0) == shutdown_timeout(30.0) == 30 + SHUTDOWN_MARGIN_S
    assert capsys.readouterr().err == ""


def test_a_torchrun_without_it_is_said_in_one_line_when_its_kill_cuts_the_grace_short(
        monkeypatch, capsys):
    monkeypatch.setattr(moc.cli, "torchrun_accepts", lambda option: False)
    assert torchrun_shutdown_s(30.0) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moc train: warning: ")
    assert "no --shutdown-timeout" in err
    assert f"kills the workers {TORCHRUN_SHUTDOWN_S} s after" in err
    assert "upgrade torch to 2.12+" in err
    assert f"--grace-s {TORCHRUN_SHUTDOWN_S - SHUTDOWN_MARGIN_S} or less" in err


@pytest.mark.parametrize("grace_s", [1.0, TORCHRUN_SHUTDOWN_S - SHUTDOWN_MARGIN_S])
def test_a_torchrun_without_it_is_not_mentioned_when_the_grace_fits(monkeypatch, capsys,
                                                                     grace_s):
    monkeypatch.setattr(moc.cli, "torchrun_accepts", lambda option: False)
    assert torchrun_shutdown_s(grace_s) is None
    assert capsys.readouterr().err == ""
