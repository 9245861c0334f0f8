"""One torchrun agent, as `moc train` runs it: `python -m moc.train.agent TORCHRUN_ARGS`.

torchrun's own entry point is right for everything but how it ends: on the SIGTERM or
SIGINT that it forwards to its workers (a preemption, Ctrl-C) it prints a traceback of
its SignalException, and it logs a warning for every worker it signals. Here the workers
say, in one line from rank 0, where they stopped and what is on storage
(`moc.Preemption`); the agent only ends with the signal's status. A failed worker is one
line too. `moc train` runs its agent in-process (one node) or as this module (each
simulated node of `--nodes`).

torchrun's options differ between torch releases (`--shutdown-timeout` is new in 2.12):
`torchrun_accepts` asks this torch's own parser, so that `moc train` passes an option
only where torchrun takes it.
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys

TORCHRUN_SHUTDOWN_S = 30
"""How long torchrun without `--shutdown-timeout` (torch before 2.12) gives its workers,
once it forwarded a signal to them, before it kills them: the fixed default of torch's
`PContext.close`, and 2.12's default for the option."""


@functools.cache
def torchrun_accepts(option: str) -> bool:
    """Whether this torch's torchrun takes `option` (as "--shutdown-timeout")."""
    from torch.distributed.run import get_args_parser

    return parser_accepts(get_args_parser(), option)


def parser_accepts(parser: argparse.ArgumentParser, option: str) -> bool:
    """Whether `parser` (torchrun's) takes `option` with one value. Asked by parsing, not
    by torch's version: a backport or a build of another branch answers for itself."""
    # An option it does not know comes back unparsed; the script is torchrun's positional.
    _, unknown = parser.parse_known_args([option, "1", "train.py"])
    return option not in unknown


def run_agent(argv: list[str], command: str = "moc train") -> int:
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
        print(f"{command}: error: workers failed ({failures})", file=sys.stderr)
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(run_agent(sys.argv[1:]))
