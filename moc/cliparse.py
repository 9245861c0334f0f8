"""The argument parser of moc's commands: the standard library only, so that a command
that needs no torch (`moc simulate`) starts without importing it."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line that names what to read next, not the whole usage block
    first (`moc train`'s is 23 lines, and it hid the line that mattered: issue 50)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the "
                     "options)\n")
