"""Worker entry point: `torchrun --nproc-per-node N -m moc.train [options]`."""

from __future__ import annotations

import argparse
import os
import re
import sys

from moc.checkpoint.errors import CheckpointError
from moc.train.cli_args import add_train_args, config_from_args
from moc.train.loop import Trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moc.train", description="moc training worker")
    add_train_args(parser, launcher=False)
    args = parser.parse_args(argv)
    try:
        trainer = Trainer(config_from_args(args))
        trainer.run()
        # Collective: only when every rank got here. After a failure the ranks must not
        # wait on each other, and the snapshots in shared memory are what a restarted
        # job recovers from, so nothing is cleaned up.
        trainer.close()
    except (ValueError, CheckpointError) as e:
        print(f"moc train: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        # A peer died (a fault): gloo reports it as a broken connection. Say so in one
        # line and exit; torchrun restarts the whole job if --max-restarts allows.
        if "Connection" not in str(e):
            raise
        reason = re.search(r"Connection[^.\n]*", str(e))
        print(f"moc train: rank {os.environ.get('RANK', '?')} lost a peer "
              f"({reason.group(0) if reason else 'connection error'}); exiting",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
