"""Worker entry point: `torchrun --nproc-per-node N -m moc.train [options]`.

How a worker ends, and why each way ends the way it does:

- it trained every step, or SIGTERM/SIGINT stopped it at an agreed step with a final
  checkpoint (`moc.Preemption`): the engine is closed (collective: every rank is here),
  rank 0 prints the one line, and the process exits normally (0, or 128 + the signal's
  number after a preemption, as a shell reports a process a signal stopped);
- a bad argument, a checkpoint error or a lost peer: one line, then `os._exit` with
  the status. Nothing is closed: the other ranks may never reach a collective again, and
  the snapshots in shared memory are what a restart recovers from. Nor is Python's own
  teardown run: with a peer gone and the snapshot thread or gloo's threads still inside a
  collective, destroying the process groups at exit aborted the worker (SIGABRT, exit
  -6, issue 29) instead of letting it report its error.
"""

from __future__ import annotations

import os
import re
import sys
from typing import NoReturn

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.preemption import Preemption, exit_status
from moc.cliparse import OneLineParser
from moc.injob.membership import (
    ENV_GEN,
    REJOIN_STATUS,
    first_line,
    is_standby,
    lost_peer,
    nccl_note,
    standby_wait,
)
from moc.injob.membership import enabled as in_job
from moc.train.cli_args import add_train_args, config_from_args
from moc.train.engines import prepare_standby
from moc.train.loop import NothingToTrain, Trainer


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="moc.train", description="moc training worker")
    add_train_args(parser, launcher=False)
    args = parser.parse_args(argv)
    corpus = None
    if is_standby():  # a spare (in-job recovery): ready, until its host wakes it
        corpus = prepare_standby(config_from_args(args))
        standby_wait()
    # First of all: a signal from now on is a request to stop at a step boundary, not a
    # KeyboardInterrupt or a death where the process stands.
    preemption = Preemption(grace_s=args.grace_s if args.grace_s > 0 else None)
    trainer = None
    try:
        try:
            cfg = config_from_args(args)
            note = in_job() and nccl_note(cfg.device, int(os.environ.get("RANK", "0")),
                                          int(os.environ.get(ENV_GEN, "0")))
            if note:
                print(note, file=sys.stderr, flush=True)
            trainer = Trainer(cfg, preemption, corpus=corpus)
            result = trainer.run()  # and closes it: collective, when every rank got here
        except Exception as e:
            if in_job() and lost_peer(e):
                # A peer lost while this process started (a second fault while the job
                # re-forms): `run` rejoins by itself, a Trainer half made cannot. Its
                # host starts it again in the next generation, as it would a dead one.
                _leave(REJOIN_STATUS, f"moc train: rank {os.environ.get('RANK', '?')}: "
                                      f"lost a peer while starting ({first_line(e)}); "
                                      "starting again")
            raise
    except NothingToTrain as e:
        assert trainer is not None
        trainer.close()  # every rank raised it, at the same point
        return _leave(2, f"moc train: error: {e}")
    except (ValueError, CheckpointError) as e:
        return _leave(2, f"moc train: error: {e}")
    except RuntimeError as e:
        # A peer died (a fault): gloo reports it as a broken connection, NCCL as an
        # aborted communicator or a remote error (`lost_peer`). Say so in one line and
        # exit; torchrun restarts the whole job if --max-restarts allows.
        if "Connection" not in str(e) and not lost_peer(e):
            raise
        reason = re.search(r"Connection[^.\n]*", str(e))
        return _leave(1, f"moc train: rank {os.environ.get('RANK', '?')} lost a peer "
                         f"({reason.group(0) if reason else first_line(e)}); exiting")
    if result.preempted is None:
        if preemption.received is None:
            return 0
        # The signal came after the last step's agreement round: during the final
        # checkpoint, the validation or the close. The run finished all the same; it says
        # so, and ends with the signal's status as every stopped run does (issue 47:
        # before, 143 and no line).
        line = None
        if trainer.is_main:
            where = (f"checkpoint {trainer.step} is on storage"
                     if trainer.checkpointer is not None else "nothing was saved (no --ckpt-dir)")
            line = (f"moc train: {preemption.received.name} came after the last step "
                    f"({trainer.step}), as the run finished: the run is complete, {where}; "
                    f"exit {exit_status(preemption.received)} as for any signal")
        _leave(exit_status(preemption.received), line)
    sig = preemption.agreed  # maybe another rank's: this one may have received none
    assert sig is not None
    line = None
    if trainer.is_main:
        if trainer.checkpointer is None:
            where = "there is no checkpoint directory (--ckpt-dir), nothing was saved"
        elif result.final_error is not None:
            where = f"its final checkpoint failed: {result.final_error}"
        else:
            where = f"checkpoint {result.preempted} is on storage"
        line = f"moc train: preempted ({sig.name}) at step {result.preempted}: {where}"
    # At once: torchrun signals the other workers as soon as one has exited with a
    # signal's status, and Python's teardown puts the default handlers back, under which
    # that signal would end a worker done with its work as killed (-15).
    _leave(exit_status(sig), line)


def _leave(status: int, line: str | None) -> NoReturn:
    """Print `line` and end the process now, with `status` (see the module docstring)."""
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
