"""Training processes forked from their rank host (`moc.checkpoint.twolevel.persist.forking`).

A newcomer started as a new interpreter pays Python's start, torch's and moc's imports
before it can join the job: on the project's 2-core VM, with a node lost every 50 steps
(`small`, 2 simulated nodes, no spare), downtime fell from 4.6-4.9 s to 3.5-3.9 s when
the newcomer was forked instead (docs/DECISIONS.md). The rank host imports torch anyway
(the job's store); it imports the training modules too, once (`preload`), and forks
every training process (the first, a replacement, a standby) from itself.

`MOC_INJOB_START=spawn` starts new interpreters instead (also where fork is missing).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from moc.checkpoint.twolevel.persist.forking import Forked
from moc.checkpoint.twolevel.persist.forking import fork as fork_child

ENV_START = "MOC_INJOB_START"
"""fork (the default where os.fork exists) or spawn (a new interpreter per process)."""


def forking() -> bool:
    """Whether training processes are forked from the host: not where fork is missing,
    nor once this process has initialised CUDA (a child could not use it; the host
    makes no CUDA call, so this guards against one added later)."""
    how = os.environ.get(ENV_START, "fork")
    if how not in ("fork", "spawn"):
        raise SystemExit(f"moc train: error: {ENV_START}={how!r}: expected fork or spawn")
    import torch

    return how == "fork" and hasattr(os, "fork") and not torch.cuda.is_initialized()


def preload(script: str | None = None) -> None:
    """Import what `python -m moc.train` imports (for a `script` of the user's: torch
    and moc, what every such script imports first), in the host, before its first
    fork."""
    if script is not None:
        warm_script()
    else:
        import moc.train.__main__  # noqa: F401


def warm_script() -> None:
    """What a user's script pays for on its first steps, paid ahead (in the host before
    it forks, or by a spare while it waits): torch and moc, and torch._dynamo, which an
    optimizer's constructor imports on its first call (1.25 s on the project's VM: a
    spare's script building its optimizer after a fault spent it inside the downtime)."""
    import torch._dynamo  # noqa: F401

    import moc  # noqa: F401


def fork(argv: list[str], env: dict[str, str], keep_fd: int, stdin: bool,
         on_fork: Callable[[], None] | None) -> Forked:
    """`python -m moc.train argv` as a child of this host, with environment `env`;
    `keep_fd` (its heartbeat pipe) stays open in it; `stdin`: a pipe to it (a
    standby's, for its host's word); `on_fork`: `nodes.die_with_parent`'s prctl."""

    def run() -> int | None:
        os.environ.clear()
        os.environ.update(env)
        from moc.checkpoint.twolevel.persist import prestart
        from moc.injob.membership import prestarts
        from moc.train.__main__ import main

        if prestarts():
            prestart.prestart(fork=True)  # no thread runs yet: a fork, not an interpreter
        return main(argv)

    return fork_child(run, stdin=stdin, keep=(keep_fd,), on_fork=on_fork)


def fork_script(script: str, argv: list[str], env: dict[str, str], keep_fd: int,
                stdin: bool, on_fork: Callable[[], None] | None) -> Forked:
    """`python script argv` as a child of this host (`moc run`), as `fork` starts
    `moc.train`; a standby waits for its host's word before the script runs."""

    def run() -> int | None:
        os.environ.clear()
        os.environ.update(env)
        run_script(script, argv)
        return 0

    return fork_child(run, stdin=stdin, keep=(keep_fd,), on_fork=on_fork)


def run_script(script: str, argv: list[str]) -> None:
    """A user's training script as its own `__main__`, as `python script argv` would run
    it: a standby first waits for its host's word (the generation, the rank)."""
    import runpy
    import sys

    from moc.checkpoint.twolevel.persist import prestart
    from moc.injob.membership import is_standby, prestarts, standby_wait

    if is_standby():
        warm_script()  # a new interpreter's (spawn); forked, the host did
        standby_wait()
    if prestarts():  # before the script starts a thread: a fork, imported at once
        prestart.prestart(fork=True)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
