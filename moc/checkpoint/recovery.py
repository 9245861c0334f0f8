"""Find the newest intact checkpoint and load this rank's share of it.

Every rank reads only what it holds: its non-expert parameters, its own experts, and
the optimizer state of the parameters it owns under the sharded optimizer. Because keys
are per expert and per tensor, the layout at save time does not matter.

The ranks agree on the step: each tries the newest complete step, they take the
minimum of a success flag over the gloo side group, and if any rank met corruption all
of them fall back to the next older step together.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moc.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from moc.checkpoint.manifest import Manifest
from moc.checkpoint.optim_state import OptimizerState
from moc.checkpoint.spec import (
    ExpertSpec,
    dense_key,
    expert_key,
    flatten_params,
    load_params,
    optimizer_state,
    rng_key,
)
from moc.checkpoint.storage import TensorReader, complete_steps
from moc.parallel.groups import ParallelGroups

log = logging.getLogger(__name__)


class CheckpointReader:
    """Reads keys of one manifest, verifying each against its checksum."""

    def __init__(self, root: Path, manifest: Manifest) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self._readers: dict[Path, TensorReader] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.manifest.entries

    def get(self, key: str) -> torch.Tensor:
        entry = self.manifest.entries.get(key)
        if entry is None:
            raise CorruptCheckpointError(
                f"step {self.manifest.step}: the manifest has no key {key!r}")
        path = entry.path(self.root)
        if path not in self._readers:
            self._readers[path] = TensorReader(path)
        return self._readers[path].read(key, entry.crc32)

    def state_names(self, prefix: str) -> list[str]:
        """Names of the optimizer state tensors stored under `prefix/`."""
        return sorted({k[len(prefix) + 1:] for k in self.manifest.entries
                       if k.startswith(prefix + "/") and "/" not in k[len(prefix) + 1:]})


class DictReader:
    """The CheckpointReader interface over tensors already in memory (a snapshot)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def get(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise CorruptCheckpointError(f"the snapshot has no key {key!r}")
        return self.tensors[key]

    def state_names(self, prefix: str) -> list[str]:
        return sorted({k[len(prefix) + 1:] for k in self.tensors
                       if k.startswith(prefix + "/") and "/" not in k[len(prefix) + 1:]})


@dataclass
class RestoreResult:
    step: int
    manifest: Manifest
    source: str = "storage"
    recovery_s: float = 0.0
    skipped: list[str] = field(default_factory=list)
    """Newer steps that were found corrupt and skipped, with the reason."""
    skipped_steps: list[int] = field(default_factory=list)


def load_rank_state(reader: CheckpointReader | DictReader, model: nn.Module,
                    optimizer: OptimizerState, spec: ExpertSpec, rank: int) -> None:
    """Install this rank's share of a checkpoint: its parameters, the optimizer state
    of the parameters it owns, its RNG. Everything is read (and checked) before anything
    is installed, so a corrupt key never leaves a half-loaded model."""
    params = {k: reader.get(k) for k in flatten_params(model, spec)}
    experts = spec.by_name()
    named = dict(model.named_parameters())
    owned = {n: named[n] for n in optimizer.owned_names()}
    names = {}
    for n in owned:
        if n in experts:
            prefix = expert_key("optim", experts[n].stem, experts[n].global_ids[0])
        else:
            prefix = dense_key("optim", n)
        names[n] = reader.state_names(prefix)
    with_state = {n: p for n, p in owned.items() if names[n]}
    states = optimizer_state(with_state, names, spec, reader.get)
    rng = reader.get(rng_key(rank)) if rng_key(rank) in reader else None

    load_params(model, spec, params.__getitem__)
    optimizer.load_local_state(states)
    if rng is not None:
        torch.set_rng_state(rng.clone())  # a view into a mapped file would crash it


def _agree(status: tuple[str, str], groups: ParallelGroups) -> list[tuple[str, str]]:
    """Every rank's (status, message) for one step, on every rank."""
    if not groups.distributed:
        return [status]
    out: list = [None] * groups.world_size
    dist.all_gather_object(out, status, group=groups.side_group)
    return out


def _candidate_steps(root: Path, groups: ParallelGroups) -> list[int]:
    """Complete steps, newest first, as rank 0 lists them: every rank must try the same
    steps in the same order, even where a shared file system shows them stale lists."""
    steps = [list(reversed(complete_steps(root)))]
    if groups.distributed:
        dist.broadcast_object_list(steps, src=0, group=groups.side_group)
    return steps[0]


def restore_latest(root: Path, model: nn.Module, optimizer: OptimizerState, spec: ExpertSpec,
                   groups: ParallelGroups, model_meta: dict[str, Any]) -> RestoreResult | None:
    """Load the newest step every rank can read intact; None when there is none.

    Collective over the side group: the ranks try the same steps in the same order and
    agree on each outcome. A step any rank finds corrupt is skipped by all of them.
    IncompatibleCheckpointError (a different model, a shape that does not fit) is raised
    on every rank, not skipped: an older step of the same directory would not fit either.
    """
    t0 = time.perf_counter()
    skipped, skipped_steps = [], []
    for step in _candidate_steps(root, groups):
        status = ("ok", "")
        try:
            manifest = Manifest.load(root, step)
            manifest.check_model(model_meta, f"checkpoint {root}/step-{step:08d}")
            load_rank_state(CheckpointReader(root, manifest), model, optimizer, spec,
                             groups.rank)
        except IncompatibleCheckpointError as e:
            status = ("incompatible", str(e))
        except CorruptCheckpointError as e:
            status = ("corrupt", str(e))
        statuses = _agree(status, groups)
        for kind, message in statuses:
            if kind == "incompatible":
                raise IncompatibleCheckpointError(message)
        if all(kind == "ok" for kind, _ in statuses):
            return RestoreResult(step, manifest, "storage", time.perf_counter() - t0, skipped,
                                 skipped_steps)
        reason = next(message for kind, message in statuses if kind == "corrupt")
        log.warning("checkpoint step %d is not usable (%s); trying an older one", step, reason)
        skipped.append(f"step {step}: {reason}")
        skipped_steps.append(step)
    if skipped:
        raise CorruptCheckpointError(
            f"{root}: no intact checkpoint; every step failed: {'; '.join(skipped)}")
    return None
