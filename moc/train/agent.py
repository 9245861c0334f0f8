"""One torchrun agent, as `moc train` runs it: `python -m moc.train.agent TORCHRUN_ARGS`.

torchrun's own entry point is right for everything but how it ends: on the SIGTERM or
SIGINT that it forwards to its workers (a preemption, Ctrl-C) it prints a traceback of
its SignalException, and it logs a warning for every worker it signals. Here the workers
say, in one line from rank 0, where they stopped and what is on storage
(`moc.Preemption`); the agent only ends with the signal's status. A failed worker is one
line too. `moc train` runs its agent in-process (one node) or as this module (each
simulated node of `--nodes`).
"""

from __future__ import annotations

import logging
import signal
import sys


def run_agent(argv: list[str]) -> int:
    """Run torchrun with `argv` (its own options); its exit status: 0, 1 when workers
    failed (said in one line), or 128 + the signal's number after SIGTERM or SIGINT."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Each of torchrun's loggers has a level of its own, set when its module was
    # imported (above): its warnings repeat what moc says; its errors still show.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        stopped = {128 + int(s) for s in (signal.SIGTERM, signal.SIGINT)}
        if len(codes & stopped) == 1 and codes <= stopped | {-signal.SIGTERM}:
            # Workers stopped by a signal that reached them, not this agent (a `kill` of
            # one rank): every rank stopped with a final checkpoint, rank 0 said where.
            # (-SIGTERM: a worker this agent signalled once another had exited so, as it
            # was exiting itself.)
            return (codes & stopped).pop()
        failures = "; ".join(f"rank {r}: exit {f.exitcode}" for r, f in e.failures.items())
        print(f"moc train: error: workers failed ({failures})", file=sys.stderr)
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(run_agent(sys.argv[1:]))
