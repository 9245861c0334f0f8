"""The codec of every object moc's processes exchange: exact round trips, and data that
is not moc's (a pickle, an unknown type) refused rather than run."""

from __future__ import annotations

import math
import os
import pickle

import pytest
import torch

from moc.checkpoint import codec
from moc.checkpoint.dist import RankError
from moc.checkpoint.store.manifest import Entry
from moc.checkpoint.twolevel.persist.protocol import Done, Failed, Hello, Persist, Ready, Stop

ENGINE_OBJECTS = [
    None, True, 0, -3, 2**62, 1.5, "x", [], (), {},
    # sync.py's report: (rank, entries, bytes, error, retention error)
    (1, {"param/w": Entry(4, "rank-00001.safetensors", "F32", (2, 3), 123)}, 96, None, None),
    # planner's share: (results, in flight, alive, generation, choice, error)
    ([Done(4, True, None, 0.5, [10, 20]), Done(6, False, "gone")], 8, False, 2,
     {"k_snapshot": 3, "window_s": 0.1}, None),
    [RankError(0, "OSError", "disk full"), None],
    {"extra": {"step": 4, "nested": (1, [2, (3,)])}, "layout": {"world_size": 2}},
    {1: "int key", (2, 3): "tuple key", "__moc__": "the tag as a key", None: 0},
    [("w", "bfloat16", (4,)), ("step", "float32", ())],  # gather_tensors' metadata
    Hello(0), Ready(1, 5, 2, ["a"], ["a", "b"]), Failed(1, 5, "why"),
    Persist(5, None, {"step": 5, "extra": {"a": [1]}}, 2), Stop(),
]


@pytest.mark.parametrize("obj", ENGINE_OBJECTS, ids=lambda o: type(o).__name__)
def test_every_object_the_engines_send_round_trips_exactly(obj):
    got = codec.decode(codec.encode(obj))
    assert got == obj and _types(got) == _types(obj)


def _types(obj):
    """The value's shape with types: tuple != list, int != float, key types kept."""
    if isinstance(obj, dict):
        return ("dict", [(_types(k), _types(v)) for k, v in obj.items()])
    if isinstance(obj, list | tuple):
        return (type(obj).__name__, [_types(v) for v in obj])
    return type(obj).__name__


def test_non_finite_floats_round_trip():
    nan, inf, ninf = codec.decode(codec.encode([math.nan, math.inf, -math.inf]))
    assert math.isnan(nan) and inf == math.inf and ninf == -math.inf


@pytest.mark.parametrize("obj", [torch.ones(2), torch.float32, {1, 2}, object(), b"raw"])
def test_what_the_codec_does_not_carry_is_refused_by_name(obj):
    with pytest.raises(TypeError, match=r"cannot send a .*tensors travel by tensor"):
        codec.encode(obj)


class _Marker:
    """Unpickling this creates a file: the test of whether a payload ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Marker(str(marker)))
    with pytest.raises(codec.CodecError, match="not a moc message"):
        codec.decode(payload)
    assert not marker.exists()
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("tree", [
    b'{"__moc__": "os.system", "fields": {"command": "touch x"}}',
    b'{"__moc__": "SnapshotHeader", "fields": {}}',
    b'{"__moc__": "Hello", "fields": {"rank": 0, "extra": 1}}',
    b'{"__moc__": "Hello"}',
    b'{"__moc__": "float", "v": "1e309"}',
    b'{"__moc__": "map", "items": [[[1], 2]]}',
])
def test_unknown_types_and_malformed_messages_are_refused(tree):
    with pytest.raises(codec.CodecError):
        codec.decode(tree)
