"""Peer replicas: a rank's snapshot copied into another "node"'s memory over gloo, complete
exactly when verified, and never at the cost of the newest complete replica.

Each rank gets node-local memory of its own (`<tmp>/node<r>`, as MOC_SHM_ROOT), so what
a rank holds of another's is only what the transfer put there.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.twolevel.memory.jobdir import remove_job
from moc.checkpoint.twolevel.memory.places import slot_layout
from moc.checkpoint.twolevel.memory.slots import (
    SlotEntry,
    SnapshotHeader,
    SnapshotStore,
    slot_capacity,
)
from moc.checkpoint.twolevel.replicas.replica import REPLICA_SLOTS, ReplicaStore, replica_keys
from moc.checkpoint.twolevel.replicas.wire import (
    _Incoming,
    _Outgoing,
    exchange_replicas,
    receive_replica,
    send_replica,
)
from moc.checkpoint.twolevel.snapshot.capture import write_snapshot
from tests.distributed import _entry, free_port, rank_process, run_ranks

JOB = "job"
STEM = "layers.1.ffn.experts.w1_LDF"
N_EXPERTS = 4


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    """A rank's state at `step`: every dtype a snapshot holds, sizes that do not divide
    a chunk, expert keys of one MoE layer (deterministic: the test recomputes it)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    out = {"param/layers.0.attn.qkv.weight": torch.randn(37, 5, generator=g),
           "buffer/layers.0.norm.scale": torch.randn(3, generator=g).bfloat16(),
           "optim/param_groups": torch.randint(0, 255, (41,), generator=g).to(torch.uint8),
           "rng/rank=0": torch.randint(0, 2**40, (5,), generator=g),
           "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0)}
    for e in range(N_EXPERTS):
        out[f"param/{STEM}/expert={e}"] = torch.randn(17, 3, generator=g)
        out[f"optim/{STEM}/expert={e}/exp_avg"] = torch.randn(17, 3, generator=g)
    return out


def _node(base: str, rank: int) -> None:
    """This process's node-local memory: its own root."""
    os.environ["MOC_SHM_ROOT"] = str(Path(base) / f"node{rank}")


def _snapshot(rank: int, step: int, slot: int = 0) -> tuple[SnapshotStore, SnapshotHeader]:
    store = SnapshotStore(JOB, rank)
    meta = {"run_id": "r", "step": step}
    return store, write_snapshot(store, slot, step, _state(rank, step), meta)


def _outgoing(store: SnapshotStore, slot: int, header: SnapshotHeader, keys=None):
    return header, store.read(slot, header, verify=False), keys or list(header.entries)


def _held(store: ReplicaStore) -> dict[int, dict[str, torch.Tensor]]:
    """Every complete replica, by step, read back with its CRC32s checked."""
    return {h.step: {k: t.clone() for k, t in store.read(s, h, verify=True).items()}
            for s, h in store.headers().items()}


# -- which keys a replica carries -------------------------------------------------------------

def _header(keys: list[str]) -> SnapshotHeader:
    return SnapshotHeader(5, {k: SlotEntry(0, "float32", (1,), 0) for k in keys}, {})


def test_a_replica_carries_every_non_expert_key_and_k_experts_per_layer_in_rotation():
    header = _header(list(_state(0, 0)))
    stems = {STEM: 0}
    dense = [k for k in header.entries if "expert=" not in k]
    covered: set[int] = set()
    for index in range(N_EXPERTS):
        keys = replica_keys(header, stems, N_EXPERTS, 1, 1, 1, index)
        experts = {int(k.split("expert=")[1].split("/")[0]) for k in keys if "expert=" in k}
        assert len(experts) == 1 and [k for k in keys if "expert=" not in k] == dense
        # both tensors of the chosen expert (parameter and optimizer state) travel
        assert sum("expert=" in k for k in keys) == 2
        assert keys == [k for k in header.entries if k in keys]  # the snapshot's order
        covered |= experts
    assert covered == set(range(N_EXPERTS))  # N/K replicas cover every expert
    assert replica_keys(header, stems, N_EXPERTS, 1, 1, None, 3) == list(header.entries)
    assert replica_keys(header, stems, N_EXPERTS, 1, 1, N_EXPERTS, 3) == list(header.entries)


def test_a_replica_of_a_partial_snapshot_carries_only_what_the_snapshot_holds():
    keys = [k for k in _state(0, 0) if "expert=" not in k or "expert=0" in k]
    header = _header(keys)
    two = replica_keys(header, {STEM: 0}, N_EXPERTS, 1, 1, 2, 0)  # experts 0 and 1 chosen
    assert set(two) == set(keys)
    assert replica_keys(header, {STEM: 0}, N_EXPERTS, 1, 1, 2, 1) == [
        k for k in keys if "expert=" not in k]


def test_replica_keys_refuses_a_bad_k_and_an_unknown_stem():
    header = _header(list(_state(0, 0)))
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"k .* must be an integer >= 1"):
            replica_keys(header, {STEM: 0}, N_EXPERTS, 1, 1, bad, 0)
    with pytest.raises(ValueError, match="not among the model's expert stems"):
        replica_keys(header, {"other": 0}, N_EXPERTS, 1, 1, 1, 0)


# -- the store --------------------------------------------------------------------------------

def test_replica_store_has_two_slots_under_its_source_and_keeps_the_snapshot_rules():
    store = ReplicaStore(JOB, 3)
    assert store.n_slots == REPLICA_SLOTS == 2 and store.dir.name == "replica-00003"
    assert SnapshotStore(JOB, 3).dir.name == "rank-00003"  # existing callers unchanged
    slot, buf = store._begin(16)
    assert buf.numel() >= 16 and store.headers() == {}
    assert store.dir.stat().st_mode & 0o777 == 0o700
    assert store.bin_path(slot).stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="one directory name"):
        SnapshotStore(JOB, 0, name="../x")
    with pytest.raises(ValueError, match="n_slots"):
        SnapshotStore(JOB, 0, n_slots=0)


def test_bad_transfer_settings_are_refused_before_any_traffic():
    for kwargs, msg in (({"chunk_bytes": 0}, "chunk_bytes must be an integer >= 1"),
                        ({"rate_Bps": 0}, "rate_Bps must be > 0")):
        with pytest.raises(ValueError, match=msg):
            exchange_replicas(None, 1, 1, None, ReplicaStore(JOB, 1), **kwargs)


def test_a_replica_directory_planted_as_a_symbolic_link_is_refused(tmp_path):
    store = ReplicaStore(JOB, 1)
    store.dir.parent.mkdir(parents=True, mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    store.dir.symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="symbolic link"):
        store._begin(8)


def test_the_slot_being_received_is_never_the_newest_complete_replica():
    store = ReplicaStore(JOB, 0)
    for step in (10, 20, 30, 40):
        slot, _ = store._begin(8)
        newest = store.newest()
        assert newest is None or slot != newest[0]
        store._publish(slot, SnapshotHeader(step, {}, {}), 8)
        assert sorted(h.step for h in store.headers().values())[-1] == step
    # an empty slot (its replica invalidated) is taken before the older replica
    store.invalidate_newer_than(30)
    assert [h.step for h in store.headers().values()] == [30]
    slot, _ = store._begin(8)
    assert store.headers() and store.newest()[1].step == 30 and slot != store.newest()[0]


# -- the wire, without processes ---------------------------------------------------------------

def _wire(chunk: int) -> tuple[_Outgoing, SnapshotHeader, dict[str, torch.Tensor]]:
    store, header = _snapshot(0, 10)
    return _Outgoing.of(0, *_outgoing(store, 0, header), chunk), header, _state(0, 10)


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 1 << 20])
def test_the_stream_is_the_compact_layout_whatever_the_chunk(chunk):
    out, header, state = _wire(chunk)
    stream = torch.cat([out.chunk_tensor(i).clone() for i in range(out.n_chunks())])
    incoming = _Incoming.parse(0, out.prefix, out.frame)
    assert incoming.problem is None and incoming.size == stream.numel() == out.size
    assert incoming.mismatch(stream) is None
    got = incoming.header()
    for key, t in state.items():
        e = got.entries[key]
        raw = stream[e.offset:e.offset + t.numel() * t.element_size()]
        assert torch.equal(raw.view(t.dtype).view(t.shape), t), key
        assert e.crc == header.entries[key].crc  # the snapshot's own checksums


def test_a_damaged_or_misdirected_frame_is_refused_and_its_bytes_announced():
    out, _, _ = _wire(64)
    frame = out.frame.clone()
    frame[10] ^= 1
    damaged = _Incoming.parse(0, out.prefix, frame)
    assert "CRC32C does not match" in damaged.problem and damaged.size == out.size
    assert "comes from rank 0" in _Incoming.parse(1, out.prefix, out.frame).problem
    short = out.prefix.clone()
    short[4] -= 8
    assert "the prefix announces" in _Incoming.parse(0, short, out.frame).problem
    marker = _Outgoing.marker(3, "no snapshot", 64)
    got = _Incoming.parse(3, marker.prefix, marker.frame)
    assert got.step is None and got.problem is None and got.reason == "no snapshot"
    assert got.size == 0


# -- real transfers ---------------------------------------------------------------------------

def _ring_rank(rank: int, world: int, base: str, steps: list[int], chunk: int) -> dict:
    _node(base, rank)
    group = dist.new_group(backend="gloo")
    own = SnapshotStore(JOB, rank)
    replicas = ReplicaStore(JOB, (rank - 1) % world)
    reports, sizes = [], []
    for i, step in enumerate(steps):
        header = write_snapshot(own, i % 3, step, _state(rank, step), {"step": step})
        reports.append(exchange_replicas(group, (rank + 1) % world, (rank - 1) % world,
                                         _outgoing(own, i % 3, header), replicas,
                                         chunk_bytes=chunk))
        sizes.append(replicas.sizes())
    out = {"reports": reports, "held": _held(replicas), "sizes": sizes,
           "files": sorted(p.name for p in replicas.dir.iterdir()),
           "meta": {h.step: h.meta for h in replicas.headers().values()}}
    # ranks are global ranks, whatever the group: ranks 2 and 3 are 0 and 1 of this one
    pair = dist.new_group([2, 3], backend="gloo")
    if rank in (2, 3):
        peer = 5 - rank
        header = write_snapshot(own, 0, 99, _state(rank, 99), {})
        out["pair"] = exchange_replicas(pair, peer, peer, _outgoing(own, 0, header),
                                        ReplicaStore(JOB, peer), chunk_bytes=chunk)
    return out


@pytest.mark.integration
def test_a_ring_of_four_replicates_every_snapshot_byte_for_byte_within_two_slots(tmp_path):
    steps = [10, 20, 30]
    # 100-byte chunks: keys straddle chunks (staged) and fill them (sent from the slot)
    results = run_ranks(_ring_rank, 4, str(tmp_path), steps, 100)
    for rank, res in enumerate(results):
        src = (rank - 1) % 4
        for report, step in zip(res["reports"], steps, strict=True):
            assert report.error is None
            assert report.step_sent == step and report.step_received == step
            assert report.bytes_received == results[src]["reports"][0].bytes_sent > 0
        assert sorted(res["held"]) == [20, 30]  # the newest two; step 10's slot was reused
        for step in (20, 30):
            want = _state(src, step)
            got = res["held"][step]
            assert list(got) == list(want)
            for k, t in want.items():
                assert got[k].dtype == t.dtype and torch.equal(got[k], t), (rank, step, k)
            assert res["meta"][step] == {"step": step}
        assert res["files"] == ["slot-0.bin", "slot-0.json", "slot-1.bin", "slot-1.json"]
        for s in res["sizes"]:
            assert 0 < s["replica_host_bytes"] <= REPLICA_SLOTS * s["replica_bytes"]
        if rank in (2, 3):
            assert res["pair"].step_received == 99 and res["pair"].error is None


def _pair_rank(rank: int, world: int, base: str, k: int | None) -> dict:
    _node(base, rank)
    group = dist.new_group(backend="gloo")
    own, header = _snapshot(rank, 10)
    keys = replica_keys(header, {STEM: 0}, N_EXPERTS, 1, 1, k, rank)
    replicas = ReplicaStore(JOB, 1 - rank)
    with pytest.raises(ValueError, match="must be another rank"):  # its own node
        exchange_replicas(group, rank, 1 - rank, None, replicas)
    report = exchange_replicas(group, 1 - rank, 1 - rank, _outgoing(own, 0, header, keys),
                               replicas, chunk_bytes=64)
    return {"report": report, "keys": keys, "held": _held(replicas),
            "sizes": replicas.sizes(), "own": own.sizes()}


@pytest.mark.integration
def test_a_pair_exchanges_k_replicas_carrying_only_their_keys_compactly(tmp_path):
    results = run_ranks(_pair_rank, 2, str(tmp_path), 1)
    for rank, res in enumerate(results):
        src = 1 - rank
        sent_keys = results[src]["keys"]
        assert res["report"].error is None and res["report"].step_received == 10
        assert sum("expert=" in k for k in sent_keys) == 2  # one expert: param + optim
        got, want = res["held"][10], _state(src, 10)
        assert list(got) == sent_keys
        for k in sent_keys:
            assert torch.equal(got[k], want[k]), k
        # compact: the replica's slot holds only what it carries, less than the snapshot
        # (both slots reserved with the same slack: `slot_capacity`)
        assert res["sizes"]["replica_bytes"] == slot_capacity(res["report"].bytes_received)
        assert res["report"].bytes_received < slot_layout(want)[1]


def _faults_rank(rank: int, world: int, base: str) -> dict:
    """Rank 0's rounds: good (10), no snapshot (20), a byte flipped in its slot after
    the header was written (30), good again (40). Rank 1 sends good ones throughout."""
    _node(base, rank)
    group = dist.new_group(backend="gloo")
    replicas = ReplicaStore(JOB, 1 - rank)
    out = []
    for step in (10, 20, 30, 40):
        own, header = _snapshot(rank, step)
        outgoing = _outgoing(own, 0, header)
        if rank == 0 and step == 20:
            outgoing = None
        if rank == 0 and step == 30:
            e = header.entries[f"param/{STEM}/expert=2"]
            own._maps[0][e.offset + 5] ^= 0xFF  # after its CRC32 was taken
        report = exchange_replicas(group, 1 - rank, 1 - rank, outgoing, replicas,
                                   chunk_bytes=256)
        out.append((report, _held(replicas)))
    # a snapshot this rank cannot send (a key it does not have) goes as a marker
    own, header = _snapshot(rank, 50)
    bad = exchange_replicas(group, 1 - rank, 1 - rank, _outgoing(own, 0, header, ["nope"]),
                            replicas)
    return {"rounds": out, "bad": bad, "held": _held(replicas)}


@pytest.mark.integration
def test_a_failed_or_corrupted_source_leaves_the_newest_replica_intact(tmp_path):
    results = run_ranks(_faults_rank, 2, str(tmp_path))
    rounds = results[1]["rounds"]  # what rank 1 received from rank 0
    want10 = _state(0, 10)
    (r10, _), (r20, h20), (r30, h30), (r40, h40) = rounds
    assert r10.step_received == 10 and r10.error is None
    # no snapshot: a marker, nothing received, nothing lost, no hang
    assert results[0]["rounds"][1][0].step_sent is None
    assert r20.step_received is None and r20.error is None and r20.bytes_received == 0
    assert sorted(h20) == [10]
    # a flipped byte: detected on arrival, not published, step 10 kept as it was
    assert r30.step_received is None and "checksum mismatch for 'param/" in r30.error
    assert "expert=2" in r30.error and "step 10" in r30.error
    assert sorted(h30) == [10]
    assert all(torch.equal(h30[10][k], want10[k]) for k in want10)
    assert r40.step_received == 40 and sorted(h40) == [10, 40]
    # rank 0 received every one of rank 1's
    assert [r.step_received for r, _ in results[0]["rounds"]] == [10, 20, 30, 40]
    for res, held in zip(results, ([30, 40], [10, 40]), strict=True):
        assert res["bad"].step_sent is None and "sent no replica" in res["bad"].error
        assert res["bad"].step_received is None  # the peer's marker
        assert sorted(res["held"]) == held


def _recovery_rank(rank: int, world: int, base: str) -> dict:
    """Rank 1 replicates to rank 0, "loses its node" (its memory is wiped), and fetches
    its state back from rank 0; then rank 0's copy is corrupted and sent again."""
    _node(base, rank)
    group = dist.new_group(backend="gloo")
    replicas = ReplicaStore(JOB, 1 - rank)
    own, header = _snapshot(rank, 10)
    exchange_replicas(group, 1 - rank, 1 - rank, _outgoing(own, 0, header), replicas,
                      chunk_bytes=128)
    if rank == 1:
        own.release()
        remove_job(JOB)  # the node is lost: its memory with it
    out: dict = {}
    for attempt in ("good", "corrupted"):
        if rank == 0:
            slot, held = replicas.newest()
            if attempt == "corrupted":
                replicas._maps[slot][held.entries["rng/rank=0"].offset] ^= 1
            out[attempt] = send_replica(group, 1, replicas, slot, held, chunk_bytes=128)
        else:
            got = receive_replica(group, 0)
            out[attempt] = None if got is None else (
                got[0].step, {k: t.clone() for k, t in got[1].items()})
    return out


@pytest.mark.integration
def test_a_lost_rank_fetches_its_verified_replica_back_and_a_bad_copy_is_refused(tmp_path):
    holder, lost = run_ranks(_recovery_rank, 2, str(tmp_path))
    step, tensors = lost["good"]
    want = _state(1, 10)
    assert step == 10 and list(tensors) == list(want)
    for k, t in want.items():
        assert tensors[k].dtype == t.dtype and torch.equal(tensors[k], t), k
    assert holder["good"].error is None and holder["good"].step_sent == 10
    assert lost["corrupted"] is None
    assert holder["corrupted"].step_sent is None
    assert "checksum mismatch for 'rng/rank=0'" in holder["corrupted"].error


# -- a receiver killed mid-transfer ------------------------------------------------------------

BIG = 1 << 20  # float32 elements: 4 MB, sent at 1 MB/s in 64 KiB chunks
PATTERN = 1.5


def _killed_rank(rank: int, world: int, base: str) -> None:
    _node(base, rank)
    group = dist.new_group(backend="gloo")
    own = SnapshotStore(JOB, rank)
    replicas = ReplicaStore(JOB, 1 - rank)
    header = write_snapshot(own, 0, 10, _state(rank, 10), {})
    exchange_replicas(group, 1 - rank, 1 - rank, _outgoing(own, 0, header), replicas)
    if rank == 0:  # a replica large and slow enough to be cut short
        header = write_snapshot(own, 1, 20, {"w": torch.full((BIG,), PATTERN)}, {})
        exchange_replicas(group, 1, 1, _outgoing(own, 1, header), replicas, rate_Bps=1e6,
                          chunk_bytes=64 << 10)
    else:
        exchange_replicas(group, 0, 0, None, replicas, chunk_bytes=64 << 10)
    time.sleep(600)  # never reached in time: the test kills this process first


@pytest.mark.integration
def test_a_receiver_killed_mid_transfer_keeps_its_newest_complete_replica(tmp_path,
                                                                        monkeypatch):
    port = free_port()
    out = tmp_path / "out"
    out.mkdir()
    procs = [rank_process(_entry, _killed_rank, r, 2, port, str(out),
                          (str(tmp_path),)) for r in range(2)]
    for p in procs:
        p.start()
    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "node1"))
    store = ReplicaStore(JOB, 0)
    pattern = torch.tensor([PATTERN]).view(torch.uint8).numpy().tobytes()
    try:
        # No wall-clock bound that load can break (a loaded CI once missed a 120 s one):
        # the wait ends when the replica arrives, a rank fails, or a rank is gone.
        incoming = None
        while incoming is None and all(p.is_alive() for p in procs):
            for err in out.glob("*.err"):
                pytest.fail(err.read_text())
            for slot in range(REPLICA_SLOTS):
                path = store.bin_path(slot)
                with open(path, "rb") if path.exists() else open(os.devnull, "rb") as f:
                    if f.read(4) == pattern:
                        incoming = slot
            time.sleep(0.005)
        assert incoming is not None, (
            f"the big replica never started arriving (exit codes "
            f"{[p.exitcode for p in procs]}): {[e.read_text() for e in out.glob('*.err')]}")
        os.kill(procs[1].pid, signal.SIGKILL)  # the receiving node is lost mid-transfer
        procs[1].join(30)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(30)
    assert procs[1].exitcode == -signal.SIGKILL
    with open(store.bin_path(incoming), "rb") as f:
        f.seek(4 * BIG - 4)
        assert f.read(4) != pattern  # it really was cut short
    headers = store.headers()
    assert [h.step for h in headers.values()] == [10] and incoming not in headers
    held = _held(store)[10]
    assert all(torch.equal(held[k], t) for k, t in _state(0, 10).items())
