"""Every collective the checkpoint engines run, in one place.

    dist = Dist(groups)
    reports = dist.all_gather((rank, entries, error))   # on every rank, in rank order
    dist.raise_if_any(error)                           # one exception, on every rank

Without a process group (a single process) every call is a no-op that returns what one
rank would see. Every collective runs on the gloo side group (`ParallelGroups.side_group`)
or, for the replicas of an expert, on the gloo EDP side group: never on the groups that
training uses, so checkpoint traffic stays on the CPU and off a GPU stream.

## Which thread may use the side group (the contract)

A process group pairs collectives by the order in which each rank issues them, so at
most one thread per rank may be issuing collectives on the side group at any time, and
every rank must issue the same sequence. The engines keep to this:

- The synchronous engines (`Checkpointer`, the baselines) issue them from the caller's
  thread only: `save`, `restore`, `close`.
- The two-level engine's snapshot thread issues the collectives of one checkpoint's plan
  (`exchange`), in the order of that rank's `save` calls. The caller's thread issues
  side-group collectives (`restore`, `flush`, `close`) only after `wait_for_snapshot()`
  has returned, i.e. when no plan is in flight, and `save()` itself waits for the
  previous plan before handing over the next. Every rank calls `save` for the same
  steps in the same order (the checkpoint interval is the same everywhere), so the
  plans' collectives pair up rank by rank.

Why this cannot deadlock with the training thread's collectives: those run on other
process groups (their own communicators and connections), which progress independently
of the side group. The training thread blocks on a plan only in `wait_for_snapshot()`,
and a plan needs only the other ranks' snapshot threads, which have been handed their
checkpoint before those ranks could reach the gradient all-reduce that the waiting rank
has already passed. No lock is held across a collective that another thread needs.

## Failures

A failure on one rank must not leave the others waiting in a collective it will never
enter. Each rank catches its own error and calls `agree` (or `raise_if_any`), a
collective every rank enters whatever happened: every rank then sees the same list of
failures and takes the same path. `raise_if_any` raises the same exception on every rank,
naming the ranks and their errors: IncompatibleCheckpointError if any rank's error was
one (a different model: nothing older fits either), else CorruptCheckpointError if any
was one, else CheckpointError.

## What travels

Objects travel encoded by `moc.checkpoint.codec` (JSON plus moc's own frozen
dataclasses), never pickled: `all_gather_object` and `broadcast_object_list` unpickle
what a peer sent, so a process that can reach the job's gloo connections could run code
in every rank. The bytes move in tensor collectives. An object the codec cannot encode
(a tensor, a torch.dtype, an arbitrary class) raises TypeError on the rank that sends
it, before it enters the collective: a bug in the caller, never a message.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moc.checkpoint import codec
from moc.checkpoint.errors import (  # RankError: here too, where it always was
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    RankError,
)
from moc.topology import ParallelGroups

SHARE_BYTES = 8192
"""Room for an encoded object inside `exchange`'s all-reduce; a larger one (long error
messages) takes a second collective."""
ALIGN = 8
"""Each tensor starts 8-byte aligned in `gather_tensors`' flat buffer, so it can be viewed
as any dtype again without a copy."""
_SEVERITY = (IncompatibleCheckpointError, CorruptCheckpointError, CheckpointError)


class Dist:
    """The collectives of one rank's checkpoint engine (see the module docstring for
    which thread may call them)."""

    def __init__(self, groups: ParallelGroups) -> None:
        self.groups = groups
        self.rank = groups.rank
        self.world_size = groups.world_size
        self.enabled = groups.distributed
        self._group = groups.side_group

    # -- objects ---------------------------------------------------------------------------

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        return self._all_gather_in(self._group, self.world_size, obj)

    def _all_gather_in(self, group: Any, size: int, obj: Any) -> list[Any]:
        """`all_gather` over `group` (of `size` ranks): the encoded sizes, then the bytes
        padded to the longest, as two tensor all-gathers (what `all_gather_object` does,
        minus the pickle)."""
        return [_decoded(b) for b in all_gather_bytes(codec.encode(obj), size, group)]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank (the others' `obj` is ignored)."""
        if not self.enabled:
            return obj
        data = _as_tensor(codec.encode(obj)) if self.rank == src else None
        size = torch.tensor([data.numel() if data is not None else 0])
        dist.broadcast(size, src=src, group=self._group)
        buf = data if data is not None else torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, src=src, group=self._group)
        return _decoded(buf)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self._group)

    # -- tensors ---------------------------------------------------------------------------

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a CPU tensor over every rank, in place."""
        if self.enabled:
            dist.all_reduce(t, group=self._group)
        return t

    def exchange(self, share: Any, counts: torch.Tensor | None = None) -> Any:
        """Rank 0's `share` to every rank, and `counts` (int64, CPU) summed over ranks in
        place, in one all-reduce instead of three collectives (a broadcast of the encoded
        size, one of the bytes, an all-reduce of the counts): the two-level engine pays
        for each collective of a checkpoint in stall. Rank 0's bytes travel as int64
        words that every other rank contributes as zeros, so the sum is rank 0's bytes,
        exactly."""
        if not self.enabled:
            return share
        n = 0 if counts is None else counts.numel()
        buf = torch.zeros(n + 1 + SHARE_BYTES // 8, dtype=torch.int64)
        if counts is not None:
            buf[:n] = counts.flatten()
        if self.rank == 0:
            data = codec.encode(share)
            if len(data) <= SHARE_BYTES:
                buf[n] = len(data)
                words = buf[n + 1:].view(torch.uint8)
                words[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            else:
                buf[n] = -1
        dist.all_reduce(buf, group=self._group)
        if counts is not None:
            counts.copy_(buf[:n].view(counts.shape))
        length = int(buf[n])
        if length < 0:
            return self.broadcast(share)
        return _decoded(buf[n + 1:].view(torch.uint8)[:length])

    def broadcast_edp_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Global rank `src`'s CPU tensor to every rank of this rank's EDP group (the
        replicas of its experts), in place; collective over that group."""
        if self.enabled and self.groups.layout.edp > 1:
            dist.broadcast(t, src=src, group=self.groups.edp_side_group)
        return t

    def gather_tensors(self, tensors: dict[str, torch.Tensor], dst: int, *,
                       edp: bool = False) -> list[dict[str, torch.Tensor]]:
        """Gather every rank's named CPU tensors to global rank `dst`, over the side
        group or (`edp`) this rank's EDP side group. The per-rank dicts, in group rank
        order, on `dst`; [] elsewhere. Nothing moves in a group of one.

        Not `gather_object`: it pickles every tensor through `torch.save`, which on a
        400 MB optimizer state costs seconds of serialisation. Only names, dtype names
        and shapes travel as objects; the bytes travel as one flat uint8 buffer per rank,
        padded to the largest, in a single tensor gather."""
        group = self.groups.edp_side_group if edp else self._group
        if not self.enabled:
            return [tensors]
        if group is None:  # None would mean the world group here: a silent mismatch
            raise ValueError("ParallelGroups.edp_side_group is not set; build the groups "
                             "with ParallelGroups.from_world(ep, n_experts)")
        if dist.get_world_size(group) == 1:
            return [tensors]
        meta, flat = _pack(tensors)
        size = dist.get_world_size(group)
        infos = self._all_gather_in(group, size, (meta, flat.numel()))  # names: small
        longest = max(n for _, n in infos)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:flat.numel()] = flat
        if self.rank == dst:
            buffers = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
            dist.gather(padded, buffers, dst=dst, group=group)
            return [_unpack(m, buf[:n]) for (m, n), buf in zip(infos, buffers, strict=True)]
        dist.gather(padded, None, dst=dst, group=group)
        return []

    # -- failures --------------------------------------------------------------------------

    def agree(self, error: BaseException | RankError | str | None) -> list[RankError]:
        """Every rank's failure (None: this rank succeeded), the same list on every
        rank; empty when every rank succeeded. Collective: call it whatever happened."""
        mine = error if isinstance(error, RankError) else None
        if isinstance(error, BaseException):
            mine = RankError.of(self.rank, error)
        elif isinstance(error, str):
            mine = RankError(self.rank, CheckpointError.__name__, error)
        return [e for e in self.all_gather(mine) if e is not None]

    def raise_if_any(self, error: BaseException | RankError | str | None) -> None:
        """Raise the same exception on every rank if any rank failed (see the module
        docstring for its type). Collective."""
        raise_failures(self.agree(error), self.world_size)


def raise_failures(failures: list[RankError], world_size: int) -> None:
    """Raise one exception for `failures` (agreed on every rank); nothing if empty."""
    if not failures:
        return
    names = {e.kind for e in failures}
    cls = next((c for c in _SEVERITY if c.__name__ in names), CheckpointError)
    raise cls(describe(failures, world_size))


def describe(failures: list[RankError], world_size: int) -> str:
    """One line naming each failing rank and its error; ranks that failed the same way
    share one entry. Ranks are not named where it says nothing: in a single process, or
    when every rank failed the same way (an error already agreed on, raised everywhere)."""
    by_message: dict[str, list[int]] = {}
    for e in failures:
        by_message.setdefault(e.message, []).append(e.rank)
    if world_size == 1 or (len(by_message) == 1 and len(failures) == world_size):
        return "; ".join(by_message)
    parts = []
    for message, ranks in by_message.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who}: {message}")
    return "; ".join(parts)


def all_gather_bytes(data: bytes, size: int, group: Any = None,
                     device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Every rank's `data` over `group` (of `size` ranks; None: the default group), in rank
    order, as uint8 CPU tensors: the sizes, then the bytes padded to the longest, as two
    tensor all-gathers on `device` (an NCCL group's tensors live on the GPU)."""
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(sizes, torch.tensor([len(data)], device=device), group=group)
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:len(data)] = _as_tensor(data).to(device)
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(bufs, padded, group=group)
    return [buf[:int(n)].cpu() for buf, n in zip(bufs, sizes, strict=True)]


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decoded(buf: torch.Tensor) -> Any:
    """A peer's object; a CheckpointError if its bytes are not moc's encoding (a
    corrupted or foreign peer): the engines' error path, not a crash in a decoder."""
    try:
        return codec.decode(buf.numpy().tobytes())
    except codec.CodecError as e:
        raise CheckpointError(f"a collective of the checkpoint engine received {e}") from None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"gather_tensors received an unknown dtype {name!r:.40}")
    return dtype


def _pack(tensors: dict[str, torch.Tensor]
          ) -> tuple[list[tuple[str, str, tuple[int, ...]]], torch.Tensor]:
    meta, parts = [], []
    for key, t in tensors.items():
        raw = t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
        pad = -raw.numel() % ALIGN
        parts += [raw, torch.zeros(pad, dtype=torch.uint8)] if pad else [raw]
        meta.append((key, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return meta, flat


def _unpack(meta: list[tuple[str, str, tuple[int, ...]]], flat: torch.Tensor
            ) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for key, name, shape in meta:
        dtype = _dtype(name)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out[key] = flat[offset:offset + n].view(dtype).reshape(shape)
        offset += n + (-n % ALIGN)
    return out
