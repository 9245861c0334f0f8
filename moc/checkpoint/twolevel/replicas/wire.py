"""The wire of peer replicas: how a snapshot travels to another node's memory, and back.

Where replicas are kept, and the channel, are `twolevel.replicas.replica`.

One replication round (`exchange_replicas`), run by every rank of a dedicated gloo group
for the same step, on the snapshot thread after the copy:

    prefix   int64[6]: magic, version, frame length, frame CRC32C, stream bytes, chunk bytes
    frame    JSON: src, step (null: a marker, no snapshot follows), error, meta, pace_s
             (seconds per chunk the sender's rate limit may sleep: the receiver's waits
             allow for them), and the entries [key, dtype, shape, digest (XXH3)] in
             stream order
    stream   the entries' bytes, each 8-byte aligned (the receiver's compact slot layout),
             cut into chunks of `chunk bytes`

The prefix alone says how many bytes follow, so a receiver that cannot use a frame (bad
JSON, no room in shared memory, any error of its own) still drains the stream and its
sender never hangs; a rank with no snapshot sends a marker for the same reason, and a
sender whose snapshot cannot be read mid-stream sends zeros for the rest (the receiver's
digests refuse them). What the data cannot cause, the channel can (a peer gone, stopped
or wedged): every wait is bounded (TIMEOUT_S), and a channel that failed or timed out is
broken for good on that rank (`ReplicaChannel`, `ReplicaChannelBroken`). Sends and
receives of a step are posted before either is waited for, so a ring of ranks (each
sending to the next) cannot deadlock, and dst == src (a pair) works alike. The stream
lands straight in the receiving slot's shared-memory mapping; the header is written
(atomically) only after every entry's digest matched the sender's, so a replica exists
exactly when it is complete and verified. Of the two slots one always holds the newest
complete replica and is never written: a transfer cut short (a dead sender, a digest
mismatch, SIGKILL) costs the replica being received, never the one before it.

Recovery moves a replica back to the rank that lost its node: `send_replica` (the
holder verifies its copy first) and `receive_replica` (into ordinary CPU memory), with
the same framing.

Ranks are global ranks (torch.distributed's `dst=`/`src=`, whatever `group` is).
"""

from __future__ import annotations

import bisect
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.store.format import CRC32C, digest, tensor_bytes
from moc.checkpoint.twolevel.memory.places import ALIGN, DTYPE_NAMES
from moc.checkpoint.twolevel.memory.slots import SlotEntry, SnapshotHeader, SnapshotStore
from moc.checkpoint.twolevel.replicas.replica import (
    CHUNK_BYTES,
    ReplicaChannel,
    ReplicaReport,
    ReplicaStore,
)

_MAGIC = 0x6D6F632D7265706C  # b"moc-repl"
_VERSION = 3  # 3: XXH3 digests of the entries (2: CRC32C, 1: zlib CRC32)
_PREFIX = 6



# -- the wire --------------------------------------------------------------------------------


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=DTYPE_NAMES[dtype]).element_size()


def _compact(entries: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[list[int], int]:
    """Offsets of `entries` packed in order, each 8-byte aligned, and the total size: the
    stream's layout and the receiving slot's."""
    offsets, size = [], 0
    for _, dtype, shape, _ in entries:
        offsets.append(size)
        n = _nbytes(dtype, shape)
        size += n + (-n % ALIGN)
    return offsets, size


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat.contiguous().view(torch.uint8) if flat.numel() else flat.view(torch.uint8)


class _Outgoing:
    """What one rank sends: prefix, frame, and the stream's pieces (each key's bytes at
    its stream offset). Chunks lying inside one piece are sent from the snapshot slot as
    they are; the others (small keys, padding) are assembled in one staging buffer."""

    def __init__(self, frame: dict[str, Any], pieces: list[tuple[int, torch.Tensor]],
                 size: int, chunk: int) -> None:
        data = json.dumps(frame).encode()
        self.step: int | None = frame["step"]
        self.error: str | None = None
        """Why the stream went out cut short (zeros from the failing chunk on)."""
        self.frame = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else (
            torch.empty(0, dtype=torch.uint8))
        self.prefix = torch.tensor([_MAGIC, _VERSION, len(data), digest(data, CRC32C), size, chunk],
                                   dtype=torch.int64)
        self.pieces = pieces
        self._starts = [off for off, _ in pieces]
        self.size = size
        self.chunk = chunk
        self._staging: torch.Tensor | None = None

    @classmethod
    def marker(cls, src: int, reason: str | None, chunk: int) -> _Outgoing:
        return cls({"src": src, "step": None, "error": reason}, [], 0, chunk)

    @classmethod
    def of(cls, src: int, header: SnapshotHeader, views: dict[str, torch.Tensor],
           keys: list[str], chunk: int, pace_s: float = 0.0) -> _Outgoing:
        """`pace_s`: the seconds per chunk this rank's rate limit may sleep, told to the
        receiver so that its waits allow for them."""
        missing = [k for k in keys if k not in header.entries or k not in views]
        if missing:
            raise CheckpointError(f"replica of step {header.step}: keys {missing[:5]} are not "
                                  "in the snapshot (header and views)")
        entries = [(k, header.entries[k].dtype, header.entries[k].shape,
                    header.entries[k].crc) for k in keys]
        offsets, size = _compact(entries)
        pieces = []
        for (key, dtype, shape, _), off in zip(entries, offsets, strict=True):
            raw = _flat_bytes(views[key])
            if raw.numel() != _nbytes(dtype, shape):
                raise CheckpointError(f"replica of step {header.step}: {key!r} holds "
                                      f"{raw.numel()} bytes, its header says {dtype} {shape}")
            if raw.numel():
                pieces.append((off, raw))
        frame = {"src": src, "step": header.step, "error": None, "meta": header.meta,
                 "pace_s": pace_s, "entries": [[k, d, list(s), c] for k, d, s, c in entries]}
        return cls(frame, pieces, size, chunk)

    def n_chunks(self) -> int:
        return -(-self.size // self.chunk)

    def chunk_tensor(self, i: int) -> torch.Tensor:
        """The stream's chunk `i`. One that cannot be produced (the snapshot's bytes
        cannot be read) and every later one go as zeros, `error` saying why: the
        receiver still gets every byte it was announced, so neither side hangs, and its
        digest check refuses the replica."""
        if self.error is None:
            try:
                return self._chunk(i)
            except Exception as e:
                self.error = (f"the replica of step {self.step} was cut short at byte "
                              f"{i * self.chunk} of {self.size} ({type(e).__name__}: {e}); "
                              "the rest went as zeros, so the receiver refuses it")
        n = min((i + 1) * self.chunk, self.size) - i * self.chunk
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.zeros(n, dtype=torch.uint8)
        out = self._staging[:n]
        out.zero_()
        return out

    def _chunk(self, i: int) -> torch.Tensor:
        a, b = i * self.chunk, min((i + 1) * self.chunk, self.size)
        j = max(0, bisect.bisect_right(self._starts, a) - 1)
        off, raw = self.pieces[j] if self.pieces else (0, torch.empty(0, dtype=torch.uint8))
        if off <= a and off + raw.numel() >= b:
            return raw[a - off:b - off]  # no copy
        if self._staging is None:
            self._staging = torch.empty(min(self.chunk, self.size), dtype=torch.uint8)
        out = self._staging[:b - a]
        out.zero_()  # padding travels as zeros: a replica's bytes do not depend on history
        for off, raw in self.pieces[j:]:
            if off >= b:
                break
            lo, hi = max(a, off), min(b, off + raw.numel())
            if lo < hi:
                out[lo - a:hi - a].copy_(raw[lo - off:hi - off])
        return out


@dataclass
class _Incoming:
    """A received prefix and frame, checked. `problem` set: unusable (the stream is
    drained and dropped); `step` None and no problem: a marker."""

    size: int
    chunk: int
    step: int | None = None
    reason: str | None = None
    meta: Any = None
    entries: list[tuple[str, str, tuple[int, ...], int]] | None = None
    offsets: list[int] | None = None
    problem: str | None = None
    pace_s: float = 0.0
    """The sender's seconds per chunk of rate limiting (its frame says)."""

    @classmethod
    def parse(cls, src: int, prefix: torch.Tensor, frame: torch.Tensor) -> _Incoming:
        _, _, _, frame_crc, size, chunk = (int(x) for x in prefix)
        out = cls(size, chunk)
        data = frame.numpy().tobytes()
        try:
            if digest(data, CRC32C) != frame_crc:
                raise ValueError("the frame's CRC32C does not match")
            d = json.loads(data)
            if d["src"] != src:
                raise ValueError(f"it comes from rank {d['src']}")
            out.reason = d.get("error")
            pace = d.get("pace_s", 0.0)
            if isinstance(pace, bool) or not isinstance(pace, (int, float)) or not (
                    0 <= pace < math.inf):
                raise ValueError(f"bad pace_s {pace!r}")
            out.pace_s = float(pace)
            if d["step"] is None:
                if size:
                    raise ValueError("a marker announces bytes")
                return out
            out.step, out.meta = int(d["step"]), d["meta"]
            entries = []
            for key, dtype, shape, c in d["entries"]:
                if not isinstance(key, str) or dtype not in DTYPE_NAMES or not all(
                        isinstance(n, int) and n >= 0 for n in shape):
                    raise ValueError(f"bad entry {key!r}: {dtype} {shape}")
                entries.append((key, dtype, tuple(shape), int(c)))
            if len({e[0] for e in entries}) != len(entries):
                raise ValueError("duplicate keys")
            out.entries = entries
            out.offsets, total = _compact(entries)
            if total != size:
                raise ValueError(f"its entries hold {total} bytes, the prefix announces {size}")
        except Exception as e:  # whatever the bytes are: refused, and the stream drained
            out.problem = f"bad replica frame from rank {src}: {e}"
            out.step = None
        return out

    def header(self) -> SnapshotHeader:
        assert self.entries is not None and self.offsets is not None and self.step is not None
        return SnapshotHeader(self.step, {
            key: SlotEntry(off, dtype, shape, value)
            for (key, dtype, shape, value), off in zip(self.entries, self.offsets, strict=True)},
            self.meta)

    def mismatch(self, buf: torch.Tensor) -> str | None:
        """The first entry whose bytes in `buf` fail their digest, or None."""
        header = self.header()
        for key, e in header.entries.items():
            raw = buf[e.offset:e.offset + _nbytes(e.dtype, e.shape)]
            if digest(tensor_bytes(raw)) != e.crc:
                return key
        return None


def _check_prefix(src: int, prefix: torch.Tensor) -> None:
    magic, version, length, _, size, chunk = (int(x) for x in prefix)
    if magic != _MAGIC or version != _VERSION or length < 0 or size < 0 or (
            size and chunk < 1):
        raise CheckpointError(
            f"replica transfer from rank {src}: expected a moc replica prefix (version "
            f"{_VERSION}), got {prefix.tolist()}; the replica group carries other traffic "
            "or the peers run different moc versions: give replicas a group of their own")


def _transfer(channel: ReplicaChannel, dst: int | None, src: int | None,
              out: _Outgoing | None, sink: Any, rate_Bps: float | None
              ) -> tuple[_Incoming | None, int, int]:
    """Send `out` to `dst` and receive one replica from `src` (either may be None),
    concurrently. `sink(incoming)` is called once the frame is in and returns
    (buffer, problem): where the stream goes (None: drain it). Returns the incoming
    replica, the bytes sent and the bytes received.

    Whatever goes wrong with the data, both sides go through the whole announced stream
    (a sink that fails drains it, a chunk that cannot be read goes as zeros), so the
    round ends on both at the same message; only the channel itself (a transport error,
    a timeout) ends it early, and breaks it (the caller's `ReplicaChannel.round`)."""
    prefix = torch.zeros(_PREFIX, dtype=torch.int64) if src is not None else None
    channel.post(dst, src, out.prefix if out else None, prefix)
    frame = None
    if prefix is not None:
        _check_prefix(src, prefix)
        frame = torch.empty(int(prefix[2]), dtype=torch.uint8)
    channel.post(dst, src, out.frame if out else None, frame)
    incoming, buf = None, None
    if prefix is not None:
        assert frame is not None and src is not None
        incoming = _Incoming.parse(src, prefix, frame)
        if incoming.problem is None and incoming.step is not None:
            try:
                buf, incoming.problem = sink(incoming)
            except Exception as e:  # no room, no mapping: drained, never a hang
                buf, incoming.problem = None, (
                    f"the replica of step {incoming.step} from rank {src} could not be "
                    f"received: {type(e).__name__}: {e}")
    n_send = out.n_chunks() if out else 0
    n_recv = -(-incoming.size // incoming.chunk) if incoming and incoming.size else 0
    pace = max(out.chunk / rate_Bps if out and rate_Bps else 0.0,
               incoming.pace_s if incoming else 0.0)
    scratch = None
    t0, sent = time.monotonic(), 0
    for i in range(max(n_send, n_recv)):
        send = out.chunk_tensor(i) if out is not None and i < n_send else None
        recv = None
        if i < n_recv:
            assert incoming is not None
            a, b = i * incoming.chunk, min((i + 1) * incoming.chunk, incoming.size)
            if buf is not None:
                recv = buf[a:b]  # straight into the slot's shared memory
            else:
                if scratch is None:
                    scratch = torch.empty(min(incoming.chunk, incoming.size), dtype=torch.uint8)
                recv = scratch[:b - a]
        channel.post(dst, src, send, recv, pace)
        if send is not None:
            sent += send.numel()
            if rate_Bps:  # keep the average since the first chunk under the rate
                delay = t0 + sent / rate_Bps - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
    return incoming, sent, incoming.size if incoming else 0


def _check_peers(dst: int | None, src: int | None) -> int:
    if not dist.is_initialized():
        raise CheckpointError("replicas need torch.distributed: run under torchrun")
    me = dist.get_rank()
    for name, peer in (("dst", dst), ("src", src)):
        if peer is not None and (peer == me or not 0 <= peer < dist.get_world_size()):
            raise ValueError(f"{name}={peer}: a replica's peer must be another rank of "
                             f"the job (this is rank {me} of {dist.get_world_size()}); "
                             "a node's replica must live on another node")
    return me


def _check_chunk(chunk_bytes: int, rate_Bps: float | None) -> None:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")
    if rate_Bps is not None and not rate_Bps > 0:
        raise ValueError(f"rate_Bps must be > 0 bytes per second (or None for no limit), "
                         f"got {rate_Bps!r}")


def exchange_replicas(channel: ReplicaChannel | dist.ProcessGroup, dst: int, src: int,
                      outgoing: tuple[SnapshotHeader, dict[str, torch.Tensor], list[str]] | None,
                      store: ReplicaStore, *, rate_Bps: float | None = None,
                      chunk_bytes: int = CHUNK_BYTES) -> ReplicaReport:
    """One rank's side of one replication round: send `outgoing` to rank `dst`, receive
    rank `src`'s replica into `store`. Every rank of the channel's group calls it for the
    same step (a ring, or a pair with dst == src). Blocks until both transfers are done,
    each wait bounded (`ReplicaChannel.post`).

    `outgoing`: (the snapshot's header, its slot's tensors as `SnapshotStore.read(...,
    verify=False)` gives them, the keys to send: `replica_keys`), or None when this
    rank has no snapshot to send: a marker goes instead, so `dst` never waits for bytes
    that will not come. The frame carries the snapshot's own digests, so a byte that
    changed in the sender's slot after its header was written is caught by the receiver.

    A received replica is published only when complete with every digest matched; a
    refused one is reported (`error`) and the newest complete replica stays as it was.
    Whatever fails on either side with the data (a slot that cannot be reserved, a
    snapshot that cannot be read: zeros go instead), the round still ends on both sides
    and is reported. Raises ReplicaChannelBroken (a CheckpointError) when the channel
    itself fails (a peer gone or silent past the bound) or was broken before: the slot
    being received is then left without a header, and no later round uses the channel.
    `channel`: a ReplicaChannel, or the process group (its `ReplicaChannel.of`).
    `rate_Bps`: an average rate this rank's sends stay under (sleeping between chunks).
    """
    _check_chunk(chunk_bytes, rate_Bps)
    me = _check_peers(dst, src)
    channel = ReplicaChannel.of(channel)
    t0 = time.perf_counter()
    errors = []
    if outgoing is None:
        out = _Outgoing.marker(me, None, chunk_bytes)
    else:
        try:
            out = _Outgoing.of(me, *outgoing, chunk_bytes,
                               pace_s=chunk_bytes / rate_Bps if rate_Bps else 0.0)
        except Exception as e:  # whatever it is, dst must get a marker, not a hang
            errors.append(f"sent no replica: {e}")
            out = _Outgoing.marker(me, str(e), chunk_bytes)
    target: list[tuple[int, torch.Tensor]] = []  # the receiving slot and its mapping

    def sink(incoming: _Incoming) -> tuple[torch.Tensor | None, str | None]:
        try:
            target.append(store._begin(incoming.size))
        except CheckpointError as e:
            return None, f"no room for the replica of step {incoming.step}: {e}"
        return target[0][1], None

    with channel.round(f"replica round with ranks {dst} (to) and {src} (from)"):
        incoming, sent, received = _transfer(channel, dst, src, out, sink, rate_Bps)
    assert incoming is not None
    if out.error is not None:
        errors.append(out.error)
    step_received = None
    if incoming.problem is not None:
        errors.append(incoming.problem)
    elif incoming.step is not None:
        slot, buf = target[0]
        try:
            bad = incoming.mismatch(buf)
            if bad is not None:
                kept = store.newest()
                errors.append(
                    f"replica of step {incoming.step} from rank {src}: checksum mismatch for "
                    f"{bad!r}; not published (the newest complete replica: "
                    f"{'step ' + str(kept[1].step) if kept else 'none'})")
            else:
                step_received = _publish(store, slot, incoming, errors)
        except Exception as e:  # the channel is fine: reported, never raised
            errors.append(f"replica of step {incoming.step} from rank {src}: "
                          f"{type(e).__name__}: {e}")
    return ReplicaReport(out.step if out.error is None else None, sent, step_received,
                         received, time.perf_counter() - t0, "; ".join(errors) or None)


def _publish(store: ReplicaStore, slot: int, incoming: _Incoming, errors: list[str]
             ) -> int | None:
    """Publish a verified replica; its step, or None when its header could not be
    written. A spare slot that cannot be reserved afterwards is reported in `errors`:
    the replica is complete all the same, and the next round refuses (and drains) what
    finds no room."""
    try:
        store._publish(slot, incoming.header(), incoming.size)
    except CheckpointError as e:
        if store.header(slot) is None:
            raise
        errors.append(f"the replica of step {incoming.step} is kept, but the next one "
                      f"has no room: {e}")
    except OSError as e:
        raise CheckpointError(f"the replica of step {incoming.step} was not published: "
                              f"its header could not be written in {store.dir} "
                              f"({e.strerror or e})") from None
    return incoming.step


def send_replica(channel: ReplicaChannel | dist.ProcessGroup, dst: int, store: SnapshotStore,
                 slot: int, header: SnapshotHeader | None, *, rate_Bps: float | None = None,
                 chunk_bytes: int = CHUNK_BYTES) -> ReplicaReport:
    """Recovery, holder's side: send the copy in `slot` of `store` (a replica, or a
    rank's own snapshot left on this node) to rank `dst`, after checking every digest
    of it; a copy that fails them, or none (`header` None: the slot no longer holds
    it), is not sent: a marker goes instead (`receive_replica` returns None) and `error`
    says why. Blocks until sent, each wait bounded; ReplicaChannelBroken as
    `exchange_replicas`."""
    _check_chunk(chunk_bytes, rate_Bps)
    me = _check_peers(dst, None)
    channel = ReplicaChannel.of(channel)
    channel.check()  # before the copy is read and verified: there is no one to send it to
    t0 = time.perf_counter()
    error = None
    try:
        if header is None:
            raise CheckpointError("the slot holds no complete copy any more")
        views = store.read(slot, header, verify=True)
        out = _Outgoing.of(me, header, views, list(header.entries), chunk_bytes,
                           pace_s=chunk_bytes / rate_Bps if rate_Bps else 0.0)
    except Exception as e:  # whatever it is, dst must get a marker, not a hang
        error = f"the copy in {store.dir}/slot-{slot} was not sent: {e}"
        out = _Outgoing.marker(me, error, chunk_bytes)
    with channel.round(f"sending a replica to rank {dst}"):
        _, sent, _ = _transfer(channel, dst, None, out, None, rate_Bps)
    error = error or out.error
    return ReplicaReport(out.step if out.error is None else None, sent, None, 0,
                         time.perf_counter() - t0, error)


def receive_replica(channel: ReplicaChannel | dist.ProcessGroup, src: int
                    ) -> tuple[SnapshotHeader, dict[str, torch.Tensor]] | None:
    """Recovery, receiver's side: the replica rank `src` sends (`send_replica`), as its
    header (offsets into one CPU buffer) and verified CPU tensors (ordinary memory, not
    shared); None when the holder had no good copy, this rank had no memory for it
    (the stream is drained), or the bytes failed their digests in transit: recover from
    storage then. Blocks until received, each wait bounded; ReplicaChannelBroken as
    `exchange_replicas`."""
    _check_peers(None, src)
    channel = ReplicaChannel.of(channel)
    held: list[torch.Tensor] = []

    def sink(incoming: _Incoming) -> tuple[torch.Tensor, None]:
        held.append(torch.empty(incoming.size, dtype=torch.uint8))
        return held[0], None

    with channel.round(f"receiving a replica from rank {src}"):
        incoming, _, _ = _transfer(channel, None, src, None, sink, None)
    assert incoming is not None
    if incoming.problem is not None or incoming.step is None or incoming.mismatch(held[0]):
        return None
    header = incoming.header()
    tensors = {}
    for key, e in header.entries.items():
        raw = held[0][e.offset:e.offset + _nbytes(e.dtype, e.shape)]
        tensors[key] = raw.view(DTYPE_NAMES[e.dtype]).view(e.shape)
    return header, tensors
