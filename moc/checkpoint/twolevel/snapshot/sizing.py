"""K_snapshot: how many experts a snapshot holds, and which (pure functions).

A complete snapshot (K_snapshot = N) makes recovery from a process crash exact. Where the
copy is the bottleneck (a GPU's device-to-host bandwidth), the paper's two-level PEC
snapshots K_snapshot experts per layer and its adaptive configuration picks the largest
K_snapshot whose copy still hides behind a forward and backward pass (`choose_k`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moc.checkpoint.policy.selection import SelectionContext, interleaves, select_experts
from moc.checkpoint.spec import parse_expert_key
from moc.checkpoint.twolevel.memory.slots import SnapshotHeader

if TYPE_CHECKING:
    from moc.checkpoint.twolevel.snapshot.worker import SnapshotHandle


@dataclass(frozen=True)
class SnapshotTiming:
    """What training did beside one snapshot (for `k_snapshot="auto"`)."""

    window: float
    """Seconds training ran between `save()` returning and `wait_for_snapshot()`."""
    period: float | None
    """Seconds between the last two saves (None at the first): what a snapshot's plan,
    capture and seal together may take before the next one waits behind them."""


def parse_k_snapshot(k_snapshot: int | str | None, n_experts: int) -> tuple[int, bool]:
    """(K_snapshot to start with, whether `auto` sizes it later) for the user's value.

    More experts than a layer has is refused, as `PECPolicy(k=...)` refuses it, rather
    than quietly read as 'all': a number above N is a mistake about the model (another
    config, the experts of all layers counted), and the user should hear of it."""
    if k_snapshot in (None, "all", "auto"):
        return n_experts, k_snapshot == "auto"
    if isinstance(k_snapshot, int) and not isinstance(k_snapshot, bool) and k_snapshot >= 1:
        if k_snapshot > n_experts:
            raise ValueError(f"k_snapshot={k_snapshot} is more than the {n_experts} experts "
                             f"per MoE layer; use k_snapshot <= {n_experts}, 'all' or 'auto'")
        return k_snapshot, False
    raise ValueError(f"k_snapshot must be an integer >= 1, 'all' or 'auto', "
                     f"got {k_snapshot!r}")


def parse_k_replica(k_replica: int | str | None, n_experts: int) -> int | str:
    """Experts per MoE layer a peer replica carries: "all" (the default, also for None or
    any K >= N), an integer K >= 1 (PEC-style, rotating, plus all non-expert state), or
    0 / "none": no replicas."""
    if k_replica in (None, "all"):
        return "all"
    if k_replica in (0, "none"):
        return 0
    if isinstance(k_replica, int) and not isinstance(k_replica, bool) and k_replica >= 1:
        return "all" if k_replica >= n_experts else k_replica
    raise ValueError(f"k_replica must be 'all', an integer >= 1, or 0 / 'none' for no "
                     f"replicas, got {k_replica!r}")


def snapshot_experts(n_experts: int, n_moe_layers: int, k_snapshot: int, index: int, ep: int,
                     persisted: list[list[int]] | None, first: bool) -> list[set[int]]:
    """Experts per layer in a snapshot: K_snapshot of them in sequential rotation
    (`index`: partial snapshots so far), plus those this checkpoint persists (the
    persist reads them from the snapshot); all of them when K_snapshot = N or the chain
    has no older copy yet (`first`)."""
    if first or k_snapshot >= n_experts:
        return [set(range(n_experts)) for _ in range(n_moe_layers)]
    ctx = SelectionContext(index, n_experts, n_moe_layers, k_snapshot, ep=ep)
    chosen = [set(e) for e in select_experts("sequential", ctx)]
    for m, extra in enumerate(persisted or []):
        chosen[m].update(extra)
    return chosen


def snapshot_index(keys: list[str], experts: list[set[int]], stems: dict[str, int],
                   write: set[str]) -> list[int]:
    """Positions in `keys` (a flattened state's) of what a snapshot copies: every
    non-expert key, the keys it persists (`write`), and the expert keys of `experts`.
    Run once per layout and selection: the planner keeps the result
    (`state_cache.StateLayout.remember`)."""
    out = []
    for i, key in enumerate(keys):
        parsed = parse_expert_key(key)
        if parsed is None or key in write or parsed[2] in experts[stems[parsed[1]]]:
            out.append(i)
    return out


def choose_k(header: SnapshotHeader, seconds: float, window: float, plan_s: float,
             stems: dict[str, int], n_experts: int, n_moe_layers: int, floor: int,
             ep: int = 1, seal_s: float = 0.0, period: float | None = None
             ) -> dict[str, Any]:
    """The paper's adaptive configuration: the largest K_snapshot whose capture still
    hides behind a forward and backward pass, from a capture just measured (its bytes in
    `header` and the time of its copies, `seconds`: without the one-time preparation of
    the slots) and the time training ran meanwhile (`window`: save() returning to
    wait_for_snapshot()) less the time the plan took before the copy (`plan_s`). Never
    below `floor` (K_persist: the persist reads from the snapshot).

    The seal (`seal_s`: the checksums the copy did not take, the header) runs after the
    capture, while training goes on, but on the same thread as the next snapshot: plan,
    capture and seal together must fit in the time between two saves (`period`, when
    known), or every snapshot would start later than the one before. K_snapshot is the
    largest that fits both. When K_snapshot < N, `reason` says why, in numbers.

    The measured copy is this rank's: its share of the experts (N / ep per layer under
    expert parallelism), so what fits is counted in the rank's own experts first. When
    all of them fit, K_snapshot = N. When fewer do, K_snapshot is what puts no more than
    that many on any rank: sequential selection interleaves over the ep ranks (a window
    of K puts ceil(K / ep) on each) when ep divides N, and may put the whole window on
    one rank when it does not."""
    nbytes = {k: torch.Size(e.shape).numel() * _itemsize(e.dtype)
              for k, e in header.entries.items()}
    dense = sum(b for k, b in nbytes.items() if parse_expert_key(k) is None)
    experts: dict[tuple[int, int], int] = {}
    for k, b in nbytes.items():
        parsed = parse_expert_key(k)
        if parsed is not None:
            at = (stems[parsed[1]], parsed[2])
            experts[at] = experts.get(at, 0) + b
    # Bytes of one expert in every layer, and the experts per layer this rank holds.
    per_k = (sum(experts.values()) / max(1, len(experts))) * n_moe_layers
    local = max(1, len(experts) // max(1, n_moe_layers))
    total = sum(nbytes.values())
    bandwidth = total / max(seconds, 1e-9)
    room = max(0.0, window - plan_s)
    fits = bandwidth * room  # bytes whose capture hides behind the window
    pipeline = None
    if period is not None and seal_s > 0:
        pipeline = total / max(seconds + seal_s, 1e-9)  # bytes/s captured and sealed
        fits = min(fits, pipeline * max(0.0, period - plan_s))
    budget = fits - dense
    fit = int(budget // per_k) if per_k else local  # of this rank's experts per layer
    k = n_experts if fit >= local else max(0, fit) * (ep if interleaves(n_experts, ep) else 1)
    k = max(min(floor, n_experts), min(n_experts, k))
    reason = None
    if k < n_experts:
        seal = ("" if pipeline is None else
                f", and seals at {total / max(seal_s, 1e-9) / 1e9:.2f} GB/s in the "
                f"{period:.3f} s between saves")
        reason = (f"a complete snapshot ({total / 1e6:.0f} MB on this rank) is captured in "
                  f"{seconds:.3f} s at {bandwidth / 1e9:.2f} GB/s{seal}, but forward and "
                  f"backward leave it {room:.3f} s ({window:.3f} s less {plan_s:.3f} s of "
                  f"planning): {max(0, fit)} of the rank's {local} experts per layer fit, "
                  f"so {k} of {n_experts}; k_snapshot='all' takes every expert anyway "
                  "(training then waits for the rest of the copy)")
    return {"k_snapshot": k, "window_s": window, "plan_s": plan_s, "copy_Bps": bandwidth,
            "copy_s": seconds, "seal_s": seal_s, "period_s": period, "reason": reason}


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


AUTO_SAMPLES = 3
"""Complete snapshots `k_snapshot="auto"` measures before it chooses (the best of them)."""


class AutoSnapshotK:
    """`k_snapshot="auto"`: measure the first AUTO_SAMPLES snapshots (complete ones) and
    keep the largest K_snapshot any of them allows.

    One copy can be starved by what only happens once (the chain's first persist of every
    expert, the first page faults, the other rank's warm-up): a copy measured at 0.49 GB/s
    ran at 3.5 GB/s from then on. A copy cannot be measured faster than the machine lets
    it run, so the best of a few is the one to trust. Rank 0 decides; the engine shares
    the choice at the next plan so that every rank uses the same K_snapshot (every rank
    counts the same snapshots, so all stop measuring at the same one)."""

    def __init__(self, rank: int, n_experts: int, n_moe_layers: int, ep: int) -> None:
        self.rank, self.n_experts, self.n_moe_layers, self.ep = rank, n_experts, n_moe_layers, ep
        self.measuring = True
        self._seen = 0
        self._choices: list[dict[str, Any]] = []  # rank 0: what each snapshot allowed

    def observe(self, sealed: list[tuple[SnapshotHandle, SnapshotTiming]],
                stems: dict[str, int], floor: int) -> dict[str, Any] | None:
        """Sealed snapshots measured (not one whose slot was not prepared before it: the
        preparation is a one-time cost, not the copy's); rank 0's choice once the last
        sample is in (None before, and on the other ranks: rank 0 decides, and the
        engine shares its choice at the next plan)."""
        for handle, timing in sealed:
            if not self.measuring or handle.header is None or not handle.prepared:
                continue
            if self.rank == 0:
                self._choices.append(choose_k(
                    handle.header, handle.copy_s, timing.window, handle.plan_s, stems,
                    self.n_experts, self.n_moe_layers, floor, self.ep,
                    seal_s=handle.seal_s, period=timing.period))
            self._seen += 1
            if self._seen >= AUTO_SAMPLES:
                self.measuring = False
        if self.measuring or not self._choices:
            return None
        return max(self._choices, key=lambda c: (c["k_snapshot"], c["copy_Bps"]))
