"""A persist process that exits after the next one has bound the job's socket leaves
that socket alone (issue 49): multiprocessing's listener unlinked its path at close and
at exit, which by then was the new process's socket, so the new process listened on a
name nobody could reach and rank 0's engine waited 60 s for it (a spare taking over
rank 0, about one run in four)."""

from __future__ import annotations

import subprocess
import sys
from multiprocessing.connection import Client
from pathlib import Path

from moc.checkpoint.twolevel.persist import address
from moc.checkpoint.twolevel.persist.address import Listener, socket_path

# The old persist process: binds the job's socket, waits for a line, closes its listener
# and exits normally (its interpreter's exit runs multiprocessing's finalizers).
# address.py is loaded by its path, as a persist process started ahead loads it: stdlib
# only, no torch to import.
OLD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("address", sys.argv[1])
address = importlib.util.module_from_spec(spec); spec.loader.exec_module(address)
listener = address.Listener(sys.argv[2], b"o" * 32)
print("bound", flush=True)
sys.stdin.readline()
listener.close()
"""


def test_an_old_persist_process_exiting_leaves_the_new_ones_socket(tmp_path: Path):
    old = subprocess.Popen([sys.executable, "-c", OLD, address.__file__, str(tmp_path)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert old.stdout is not None and old.stdout.readline() == "bound\n"
    new = Listener(tmp_path, b"n" * 32)  # replaces the old one's socket file
    try:
        old.communicate("exit\n", timeout=60)  # closes its listener, then exits
        assert old.returncode == 0
        assert (tmp_path / "persist.sock").exists(), "the old process removed the new socket"
        client = Client(socket_path(tmp_path), family="AF_UNIX", authkey=b"n" * 32)
        served = new.accepted.get(timeout=60)
        assert served is not None
        client.send("hello")
        assert served.recv() == "hello"
        client.close()
        served.close()
    finally:
        new.close()
    # Closed, the new one's file stays too: the next process replaces it at its bind.
    assert (tmp_path / "persist.sock").exists()
