"""Whether the process a record names is gone, said only when it can be proven.

moc leaves two records that outlive their writer: the object-store lock (`store.lock`)
and the owner of a job's shared memory (`twolevel.memory.slots.claim_job`). Each is taken
over, or removed, when its process is gone. A pid alone cannot prove that:

- a container with its own PID namespace sees none of another's pids, so a live
  holder in a container beside it (sharing the host name with host networking, or
  /dev/shm with `--ipc=host`, the usual way to run PyTorch in Docker) looks gone;
- a pid is reused: a dead holder's number may belong to another process by now.

So a record names its process by pid, start time (clock ticks since boot, from
/proc/PID/stat), the kernel's boot_id and the PID namespace. `ProcessId.gone` answers
True (provably gone: absent, reused, or exited and not yet reaped), False (running) or
None (cannot tell from here: another namespace, another machine): the callers treat
None as running.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def boot_id() -> str | None:
    """This boot of this machine's kernel (None without /proc)."""
    return _read("/proc/sys/kernel/random/boot_id")


def pid_namespace() -> str | None:
    """This process's PID namespace, e.g. "pid:[4026531836]" (None without /proc)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on; None when unreadable."""
    stat = _read(f"/proc/{pid}/stat")
    # The command name (field 2) may hold spaces and ")": split after its last ")".
    return None if stat is None else stat.rpartition(")")[2].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat, field 22):
    with the pid, it names one process even after the pid is reused. None when unknown."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def is_zombie(pid: int) -> bool:
    """Whether the process has exited and waits only to be reaped by its parent (state
    Z): it runs no code, holds no lock and writes nothing any more."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] in ("Z", "X")


@dataclass(frozen=True)
class ProcessId:
    pid: int
    started: int | None
    boot_id: str | None
    pid_ns: str | None

    @classmethod
    def of(cls, pid: int) -> ProcessId:
        """Process `pid` of this machine and PID namespace, as it is now."""
        return cls(pid, start_time(pid), boot_id(), pid_namespace())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, info: dict[str, Any]) -> ProcessId:
        """From `to_json`'s fields; KeyError, TypeError or ValueError when malformed. A
        field missing (a record of an older moc) is None: then `gone` cannot tell."""
        pid = info["pid"]
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"bad pid {pid!r}")
        started = info.get("started")
        if started is not None and (isinstance(started, bool) or not isinstance(started, int)):
            raise ValueError(f"bad start time {started!r}")
        ids = [info.get(k) for k in ("boot_id", "pid_ns")]
        if any(v is not None and not isinstance(v, str) for v in ids):
            raise ValueError("bad boot_id or pid_ns")
        return cls(pid, started, *ids)

    def gone(self, *, this_machine: bool) -> bool | None:
        """True when the process provably no longer runs, False when it runs, None when
        this process cannot tell (another PID namespace, or a record without one).

        `this_machine`: the record is known to come from this machine (a file in its
        memory), so another boot_id means a boot ago: gone. Otherwise (a record in shared
        storage, matched by host name) another boot_id may be another machine: None."""
        boot, ns = boot_id(), pid_namespace()
        if self.boot_id != boot:
            return True if this_machine and self.boot_id and boot else None
        if self.pid_ns != ns:
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # another user's live process: the start time says whether it is ours
        if is_zombie(self.pid):
            return True  # exited, not yet reaped
        # The pid runs: another process if it started at another time (the pid reused).
        now = start_time(self.pid)
        return self.started is not None and now is not None and now != self.started
