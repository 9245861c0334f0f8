"""Loaded by every Python process `scripts/walk.py` starts (PYTHONPATH): records which moc
module each call enters, and from which module, per thread, into $MOC_WALK_OUT.<pid>.
Not part of moc."""

import os
import sys
import threading

_out = os.environ.get("MOC_WALK_OUT")
if _out:
    _f = open(f"{_out}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115

    def _profile(frame, event, arg):
        # Calls of functions only: a module or class body (no CO_NEWLOCALS) runs at import.
        if event != "call" or not frame.f_code.co_flags & 0x2:
            return
        name = frame.f_globals.get("__name__") or ""
        if not name.startswith("moc."):
            return
        back = frame.f_back
        caller = (back.f_globals.get("__name__") or "") if back is not None else ""
        _f.write(f"{threading.current_thread().name}\t{name}\t{frame.f_code.co_name}\t"
                 f"{caller}\n")

    sys.setprofile(_profile)
    threading.setprofile(_profile)
