"""Which line of training a checkpoint belongs to, and the order in which a line saves.

    line = Lineage.fresh(segment_id())               # an engine that restored nothing
    line = restored.continued(step, segment_id())    # an engine that restored `step`
    ok = newer.descends_from(p, older, q)            # is (older, q) an ancestor of (newer, p)?

The run id (`store.identity`) names a checkpoint directory, not a trajectory: two jobs
that resume the same directory from the same step, on two machines, continue it along
two different lines, and both label their steps 20, 30, ... A snapshot left in one
machine's memory by the first job carries the directory's run id as well as the second
job's commits do. Restoring it after the second job committed a newer step, and then
continuing the second job's chain of partial checkpoints, mixes two trajectories in one
model (issue 29: reproduced with three jobs on one directory).

So every checkpoint, in memory and on storage, records its lineage: the list of
segments `[(id, from), ...]` of the training that produced it. Each engine that trains
starts a segment with a random id (rank 0's, the same on every rank of the job): `from`
is the step it restored (None: a fresh start, nothing restored). A checkpoint written
by segment `w` at step q is an ancestor of a state at step p, whose lineage lists `w`
at position i, exactly when q lies in `w`'s stretch of that lineage: after `w` began
and no later than the step the next segment restored from `w` (`descends_from`).
Random ids make the test need nothing but the two lineages: no other checkpoint has to
still exist to prove it.

A lineage keeps its last MAX_SEGMENTS segments (one per restore); an ancestor older than
that is not recognised, which only makes a memory snapshot lose to storage (the safe
side).

`SaveOrder` is the engine's own line as it saves: the lineage it writes, and the lowest
step it may write next. A save at or below the newest step of the directory would
replace a step that newer partial steps read their experts from (and a save of step 3
after step 5 is the same mistake): it is refused before anything is written. The one
exception is the line's own newest step, saved again (e.g. with `final=True` right after
it was saved or restored): nothing newer depends on it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

MAX_SEGMENTS = 100
"""Segments a lineage keeps (one per restore of the line): enough for a run restarted
every few minutes for hours; older ancestry is forgotten, never invented."""
ID_BYTES = 8


def segment_id() -> str:
    """A new segment's id: random, so that no two segments ever share one. Take it on
    one rank and share it: every rank of a job writes the same lineage."""
    return secrets.token_hex(ID_BYTES)


@dataclass(frozen=True)
class Lineage:
    """The segments of training that led to a checkpoint, oldest first (immutable)."""

    segments: tuple[tuple[str, int | None], ...]

    @classmethod
    def fresh(cls, segment: str) -> Lineage:
        """A line that starts from nothing restored (a new run, or a loop that does not
        call restore()), as segment `segment`."""
        return cls(((segment, None),))

    @classmethod
    def unknown(cls) -> Lineage:
        """The lineage of a checkpoint written before moc recorded lineages (format
        versions 1-4): nothing is known of its ancestry."""
        return cls(())

    @property
    def writer(self) -> str | None:
        """The id of the segment that wrote the checkpoint (None: unknown)."""
        return self.segments[-1][0] if self.segments else None

    def continued(self, step: int, segment: str) -> Lineage:
        """The lineage of a line that restored this checkpoint, at `step`, and goes on as
        segment `segment`."""
        segments = (*self.segments, (segment, step))
        return Lineage(segments[-MAX_SEGMENTS:])

    def descends_from(self, step: int, other: Lineage, other_step: int) -> bool:
        """Whether `other`'s checkpoint at `other_step` is this one's (at `step`) or an
        ancestor of it: the state at `step` was trained from it.

        `other` of unknown lineage (an older moc wrote it) is an ancestor only of a line
        whose first known segment began by restoring `other_step` itself."""
        if other_step > step:
            return False
        if not other.segments:
            return bool(self.segments) and self.segments[0][1] == other_step
        writer = other.writer
        ids = [sid for sid, _ in self.segments]
        if writer not in ids:
            return False
        i = ids.index(writer)
        # The history both still list must agree (ids are random: a mismatch means a
        # tampered record, never a coincidence).
        n = min(len(other.segments), i + 1)
        if self.segments[i + 1 - n:i + 1] != other.segments[-n:]:
            return False
        start = self.segments[i][1]
        if start is not None and other_step < start:
            return False  # before the writer began: its own ancestry, not its work
        # (At `start` itself: the step it restored, saved again, the same state.)
        return i == len(ids) - 1 or other_step <= (self.segments[i + 1][1] or 0)

    def to_json(self) -> list[list[Any]]:
        return [[sid, start] for sid, start in self.segments]

    @classmethod
    def from_json(cls, value: object, what: str) -> Lineage:
        """Parse a lineage; ValueError naming `what` when it is malformed."""
        if not isinstance(value, list) or len(value) > MAX_SEGMENTS:
            raise ValueError(f"{what} is {value!r:.60}, expected a list of at most "
                             f"{MAX_SEGMENTS} [id, step] segments")
        segments = []
        for seg in value:
            if not (isinstance(seg, list) and len(seg) == 2 and isinstance(seg[0], str)
                    and seg[0] and (seg[1] is None or (type(seg[1]) is int and seg[1] >= 0))):
                raise ValueError(f"{what} has the segment {seg!r:.60}, expected [id, step "
                                 "or null]")
            segments.append((seg[0], seg[1]))
        if len({sid for sid, _ in segments}) != len(segments):
            raise ValueError(f"{what} names a segment twice")
        return cls(tuple(segments))


class SaveOrder:
    """The engine's own line: the lineage its checkpoints record and the steps it may
    still save. Owner: the engine's caller thread (the same decisions on every rank:
    it changes only at build, restore and save, which are collective)."""

    def __init__(self, newest: int | None, segment: str) -> None:
        """`newest`: the directory's newest step; `segment`: this line's id (the same on
        every rank)."""
        self.lineage = Lineage.fresh(segment)
        self.floor = newest
        """The newest step of this line (restored or saved) or, before any restore or
        save, of the directory: a save must be after it (or, the line's own, be it)."""
        self._from_directory = newest is not None
        """Whether `floor` is the directory's newest step, not one of this line's."""

    def check(self, step: int, directory: object) -> None:
        """ValueError, before anything is written, for a save that would go back.

        Saving the line's newest step again is allowed (a final save of the step just
        saved or restored: nothing newer depends on it). Saving the directory's newest
        step without having restored it is not: that step holds another line's state."""
        floor = self.floor
        if floor is None or step > floor or (step == floor and not self._from_directory):
            return
        if not self._from_directory:
            raise ValueError(
                f"step {step} is before step {floor}, which this run restored or saved "
                f"already in {directory}: steps must increase (saving the newest again is "
                "allowed); restore(step=S) rolls back to an older step S first")
        raise ValueError(
            f"step {step} is not after step {floor}, the newest checkpoint in {directory}: "
            f"saving it would replace a step that newer checkpoints read experts from; call "
            f"restore() to continue from step {floor}, restore(step=S) to roll back to "
            "step S, or use another directory")

    def saved(self, step: int) -> None:
        self.floor = step if self.floor is None else max(self.floor, step)
        self._from_directory = False

    def restored(self, step: int | None, lineage: Lineage, segment: str) -> None:
        """The engine restored `step` (None: nothing to restore), written by `lineage`:
        its checkpoints continue that line from there, as segment `segment` (the same
        on every rank)."""
        if step is None:
            self.lineage = Lineage.fresh(segment)
            return
        self.lineage = lineage.continued(step, segment)
        self.floor, self._from_directory = step, False

    def run(self, run_id: str | None) -> dict[str, Any]:
        """What a checkpoint of this line records about its run (`Manifest.run`, a
        snapshot's meta)."""
        return {"id": run_id, "line": self.lineage.to_json()}
