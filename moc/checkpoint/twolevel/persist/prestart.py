"""Persist processes started ahead of need: only the standard library, so that a process
can start one before it imports torch (`moc.train.host` loads this file first).

    prestart()        have one persist process of this process's waiting, imported
    take()            the waiting one, if any
    needed()          whether an engine of this process ever asked for one
    spawn()           a persist process now (what to serve on stdin): it admits the
                      ranks as soon as told, importing torch meanwhile (`LISTEN_FIRST`)

A node leader's engine needs its persist process up before the engine is built
(`PersistExecutor.start`), and a new persist process costs an interpreter and torch's
import: 1.5 s on the project's VM, the largest term of an in-job recovery. With one
prestarted, the new engine of a survivor (in-job recovery rebuilds it) or of a
replacement process finds it imported and waiting, and its start costs a connection.
The waiting process costs its memory, so only processes that expect to build engines
prestart: the training processes of `--recovery in-job` on a node's leader, at their
start and again once training is back after a recovery (not earlier: an interpreter
importing torch would slow the restore and the first steps, on the same cores).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

PERSIST = "moc.checkpoint.twolevel.persist.server"
"""The persist process's module, named (it imports this one)."""
_waiting: list[Any] = []
"""subprocess.Popen, or moc.checkpoint.twolevel.persist.forking.Forked."""
_needed = False
"""Whether an engine of this process asked for a persist process (`take`)."""


LISTEN_FIRST = """\
import importlib, importlib.util, json, os, signal, sys, threading
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
def load(name):
    full = "moc.checkpoint.twolevel.persist." + name
    spec = importlib.util.spec_from_file_location(full, os.path.join(sys.argv[1], name + ".py"))
    module = sys.modules[full] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
prestart, address = load("prestart"), load("address")
def imports():
    try:
        importlib.import_module("moc.checkpoint.twolevel.persist.server")
    except BaseException:
        pass  # the main thread's import below raises it again, and reports it
importing = threading.Thread(target=imports, daemon=True)
importing.start()
line = sys.stdin.readline()
if line:
    prestart.serving()
    order = json.loads(line)
    listener = address.Listener(order["dir"], bytes.fromhex(order["secret"]))
    importing.join()
    from moc.checkpoint.twolevel.persist.server import serve_order
    serve_order(order, listener)
"""
"""Every persist process started as a new interpreter: it imports the server, and torch
with it, on a thread, from its first instruction; when told what to serve it binds the
job's socket and admits the ranks (`twolevel.persist.address`, loaded by its path:
stdlib only) at once, imported or not, and serves once the import is done. So a rank
that takes it connects within an interpreter's start, whether it was started when
needed or ahead of need and is still importing (a fault soon after a recovery: a
survivor's engine waited 0.9 s for the import of the one prestarted after the first
steps, issue 49). The job's SIGTERM and SIGINT are ignored from the first line, as
`serve` ignores them (a preemption's final checkpoint needs this process)."""


def spawn() -> subprocess.Popen:
    """A persist process waiting on stdin for what to serve, listening first and
    importing meanwhile (`LISTEN_FIRST`): ahead of need (`prestart`) or needed now.
    -c rather than -m: it imports only what serving needs. It exits at EOF, unused:
    when the process that started it ends. It runs at the persist process's low
    priority from its first instruction (`worker.lower_process_priority`, which it
    applies again), so that its start-up, torch's import, takes the cores only when
    training leaves them."""
    return subprocess.Popen([sys.executable, "-c", LISTEN_FIRST, os.path.dirname(__file__)],
                            stdin=subprocess.PIPE, preexec_fn=_in_child)


PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when the thread that forked it ends."""
_PRCTL: Any = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork


def _in_child() -> None:
    """In the child before it runs Python: SIGKILL when its parent ends, and niceness 10
    (the persist process lowers it further itself where MOC_CKPT_PRIORITY asks) unless
    MOC_CKPT_PRIORITY says "normal" (an invalid value fails later, in the engine's own
    check).

    SIGKILL, not the EOF on stdin it also waits for: a stopped process reads nothing,
    and one SIGSTOPped with the job's other processes outlived the finished job, still
    stopped (issue 47). SIGKILL ends a stopped process; the signal follows the thread
    that started it, which is the main thread (`prestart`)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.environ.get("MOC_CKPT_PRIORITY", "nice") != "normal":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 10)


def prestart(fork: bool = False) -> None:
    """Have one persist process waiting (a no-op while one is). Call it on the main
    thread: a process keeps the scheduling class of the thread that started it.
    `fork`: fork it from this process, which has imported torch and runs no other
    thread yet (a training process just forked from its host, `forking`): it then
    waits imported at once, instead of after an interpreter's start and torch's import,
    which an engine built right after (a newcomer's) would wait for."""
    if not any(p.poll() is None for p in _waiting):
        _waiting.clear()
        _waiting.append(_fork() if fork else spawn())


def needed() -> bool:
    """Whether this process has built an engine that serves from a persist process: a
    loop that does not say what engine it uses (`moc.run`) prestarts only then."""
    return _needed


def serving() -> None:
    """In a prestarted persist process, once it was given what to serve: from now on
    its life is that of the engine it serves (`persist.serve` watches its parent), not
    the SIGKILL that `_in_child` set for its wait."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, 0, 0, 0, 0)


def _fork() -> Any:
    import importlib

    from moc.checkpoint.twolevel.persist.forking import fork

    # By name, as `spawn`'s command line names it: persist imports this module.
    return fork(lambda: importlib.import_module(PERSIST).serve_on(), stdin=True,
                on_fork=_in_child)


def take() -> subprocess.Popen | None:
    """The waiting persist process (None: none, or it died)."""
    global _needed
    _needed = True
    while _waiting:
        process = _waiting.pop()
        if process.poll() is None:
            return process
    return None
