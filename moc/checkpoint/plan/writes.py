"""Who writes what: pure functions from (units, sizes, holders) to per-rank write plans.

A *unit* is the granularity of assignment: all keys of one unit are written by one rank.
The units are
    a non-expert module's parameters        held by every rank (data-parallel replicas)
    one expert's weights in one MoE layer    held by the expert's EDP replicas
    a rank's share of sharded optimizer state, its RNG state   held by that rank alone

`plan_writes` gives every unit to exactly one of its holders so that the busiest rank
writes as little as possible, in the paper's adaptive order (sec. 4): units with a
single holder first (they have no choice), then experts (few holders each), then the
non-expert modules (anyone can take them), each group largest first, each unit to the
least-loaded holder. Placing the freely placeable units last is what lets them even out
the load the others leave: when the last of them is placed, its rank's load was at most
the mean, so the maximum is at most max(load before them, mean + largest of them).

Every rank computes the same plan from the same inputs (sorted, with ties broken by
rank), so no communication is needed to agree on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

FIXED, EXPERT, DENSE = "fixed", "expert", "dense"
_ORDER = {FIXED: 0, EXPERT: 1, DENSE: 2}


@dataclass(frozen=True)
class WriteUnit:
    name: str
    nbytes: int
    holders: tuple[int, ...]
    """Ranks holding a copy; the writer is one of them."""
    kind: str = DENSE
    """fixed, expert or dense: the order of placement."""

    def __post_init__(self) -> None:
        if not self.holders:
            raise ValueError(f"write unit {self.name!r} has no holder")
        if self.nbytes < 0:
            raise ValueError(f"write unit {self.name!r} has negative size {self.nbytes}")
        if self.kind not in _ORDER:
            raise ValueError(f"write unit {self.name!r}: kind must be one of "
                             f"{', '.join(_ORDER)}, got {self.kind!r}")


@dataclass(frozen=True)
class WritePlan:
    writer: dict[str, int]
    """Unit name -> the rank that writes it."""
    load: tuple[int, ...]
    """Bytes each rank writes under this plan."""

    @property
    def imbalance(self) -> float:
        """Busiest rank's bytes over the mean (1.0 is perfect balance)."""
        return imbalance(self.load)


def imbalance(load: Iterable[int]) -> float:
    load = list(load)
    mean = sum(load) / len(load) if load else 0
    return max(load) / mean if mean else 1.0


def plan_writes(units: Iterable[WriteUnit], world_size: int) -> WritePlan:
    units = list(units)
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise ValueError("write unit names must be unique")
    for u in units:
        bad = [r for r in u.holders if not 0 <= r < world_size]
        if bad:
            raise ValueError(f"write unit {u.name!r}: holders {bad} outside 0..{world_size - 1}")
    load = [0] * world_size
    writer: dict[str, int] = {}
    ordered = sorted(units, key=lambda u: (_ORDER[u.kind] if len(u.holders) > 1 else 0,
                                           -u.nbytes, u.name))
    for u in ordered:
        rank = min(u.holders, key=lambda r: (load[r], r))
        writer[u.name] = rank
        load[rank] += u.nbytes
    return WritePlan(writer, tuple(load))


def greedy_bound(units: Iterable[WriteUnit], world_size: int) -> int:
    """An upper bound on the busiest rank's load under `plan_writes` when the dense
    units may go to any rank: max(busiest rank after the other units, mean + largest
    dense unit). (See the module docstring for why.)"""
    units = list(units)
    dense = [u for u in units if u.kind == DENSE and len(u.holders) == world_size]
    others = [u for u in units if u not in dense]
    before = plan_writes(others, world_size).load
    total = sum(u.nbytes for u in units)
    largest = max((u.nbytes for u in dense), default=0)
    return max(max(before, default=0), -(-total // world_size) + largest)
