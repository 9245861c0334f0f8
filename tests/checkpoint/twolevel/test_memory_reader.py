"""The restore's reader of this rank's snapshots: each key from the newest snapshot that
holds it, read and checked once."""

from __future__ import annotations

import pytest
import torch

from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.twolevel.memory.slots import SnapshotStore
from moc.checkpoint.twolevel.recovery.memory import _memory_reader
from moc.checkpoint.twolevel.snapshot.capture import write_snapshot


def _snapshots(store: SnapshotStore) -> dict[str, dict[int, torch.Tensor]]:
    """Three partial snapshots, as K_snapshot < N leaves them: step 6 holds `a`, step 5
    `a` and `c`, step 4 all three."""
    held = {4: "abc", 5: "ac", 6: "a"}
    values: dict[str, dict[int, torch.Tensor]] = {}
    for slot, (step, keys) in enumerate(held.items()):
        tensors = {k: torch.full((1000,), float(step)) for k in keys}
        write_snapshot(store, slot, step, tensors, {})
        for k, t in tensors.items():
            values.setdefault(k, {})[step] = t
    return values


def test_each_key_is_read_and_hashed_once_from_the_newest_snapshot_that_holds_it(
        tmp_path, monkeypatch):
    """A restore is downtime: older snapshots are read only for what the newer ones lack
    (read whole, as before issue 45, they were about 28 GB hashed on one thread at
    gpu-800m for keys the newest snapshot already held)."""
    store = SnapshotStore("job", rank=0)
    values = _snapshots(store)
    reads: list[tuple[int, list[str]]] = []
    original = SnapshotStore.read

    def read(self, slot, header, *args, **kwargs):
        keys = kwargs.get("keys")
        reads.append((header.step, sorted(header.entries) if keys is None else sorted(keys)))
        return original(self, slot, header, *args, **kwargs)

    monkeypatch.setattr(SnapshotStore, "read", read)
    reader, copies = _memory_reader(store, tmp_path, 6, store.headers(), None)
    assert reads == [(6, ["a"]), (5, ["c"]), (4, ["b"])]
    assert copies == {"a": (6, "slot-2"), "c": (5, "slot-1"), "b": (4, "slot-0")}
    for key, step in (("a", 6), ("c", 5), ("b", 4)):
        assert torch.equal(reader.get(key), values[key][step]), key


def test_an_older_snapshot_that_does_not_verify_is_not_used_but_the_restored_one_must(
        tmp_path):
    store = SnapshotStore("job", rank=0)
    _snapshots(store)
    with open(store.bin_path(0), "r+b") as f:  # a byte of `b` in step 4's snapshot
        f.seek(4000 + 10)  # a: bytes 0-3999, b: 4000-7999
        f.write(b"\xff")
    _, copies = _memory_reader(store, tmp_path, 6, store.headers(), None)
    assert "b" not in copies and copies["c"] == (5, "slot-1")
    with open(store.bin_path(2), "r+b") as f:  # the snapshot of the step restored
        f.write(b"\xff")
    with pytest.raises(CheckpointError, match="checksum mismatch for 'a'"):
        _memory_reader(store, tmp_path, 6, store.headers(), None)
