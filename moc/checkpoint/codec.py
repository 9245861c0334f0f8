"""The encoding of every object that moc's processes send each other: data, never code.

    data = encode(obj)      # bytes (UTF-8 JSON)
    obj = decode(data)      # the same value, exactly; CodecError for anything else

Why not pickle: unpickling runs whatever the bytes say (`__reduce__`), so whoever can
write to a socket or a collective's connection would run code as the trainer. Here a
message can only ever decode to plain data and to the frozen dataclasses listed in
`_types()`, each rebuilt through its own constructor from its declared fields.

What round-trips exactly (the engines' collectives rely on it): None, bool, int, float
(NaN and infinities included), str, list, tuple (kept apart from list), dict with any
encodable keys (int keys stay int), and the registered dataclasses. Anything else (a
tensor, a torch.dtype, a set, an arbitrary object) is refused by `encode` with a
TypeError naming its type: send tensors with tensor collectives and dtypes by name.

Encoding: plain JSON for JSON's own types and for dicts whose keys are all strings;
every other value is a JSON object {"__moc__": kind, ...}. A dict whose keys include
"__moc__" itself is encoded as a "map", so a plain JSON object never carries the tag.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

TAG = "__moc__"


class CodecError(ValueError):
    """Bytes that are not an encoding of moc's data (corrupt, foreign or malicious)."""


@functools.cache
def _types() -> dict[str, type]:
    """The closed list of classes that may travel, by name. Imported here, not registered
    by their modules: one place to review what a peer can make this process build."""
    from moc.checkpoint.dist import RankError
    from moc.checkpoint.store.manifest import Entry
    from moc.checkpoint.twolevel import protocol as p

    classes = (Entry, RankError, p.Hello, p.Ready, p.Failed, p.Persist, p.Abandon, p.Stop,
               p.Done)
    for cls in classes:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
    return {cls.__name__: cls for cls in classes}


def encode(obj: Any) -> bytes:
    """`obj` as bytes; TypeError for a value of a type this codec does not carry."""
    return json.dumps(_encode(obj), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """The value `data` encodes; CodecError if it is not a valid encoding."""
    try:
        tree = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise CodecError(f"not a moc message ({len(data)} bytes, {e}); a peer that is "
                         "not this job's, or a corrupt message") from None
    return _decode(tree)


def _encode(obj: Any) -> Any:
    if obj is None or isinstance(obj, bool | str):
        return obj
    if isinstance(obj, int):
        return int(obj)  # an IntEnum or a bool subclass would not decode as itself
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {TAG: "float", "v": repr(obj)}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if isinstance(obj, tuple):
        return {TAG: "tuple", "items": [_encode(v) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and TAG not in obj:
            return {k: _encode(v) for k, v in obj.items()}
        return {TAG: "map", "items": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    cls = type(obj)
    if _types().get(cls.__name__) is cls:
        return {TAG: cls.__name__, "fields": {f.name: _encode(getattr(obj, f.name))
                                              for f in dataclasses.fields(obj)}}
    raise TypeError(f"moc.checkpoint.codec cannot send a {cls.__module__}.{cls.__qualname__}"
                    f" ({obj!r:.80}); send plain data (None, bool, int, float, str, list, "
                    "tuple, dict) or a class listed in codec._types(); tensors travel by "
                    "tensor collectives, dtypes by name")


def _decode(tree: Any) -> Any:
    if isinstance(tree, list):
        return [_decode(v) for v in tree]
    if not isinstance(tree, dict):
        return tree  # None, bool, int, float, str: JSON's own
    if TAG not in tree:
        return {k: _decode(v) for k, v in tree.items()}
    kind = tree[TAG]
    try:
        if kind == "tuple":
            return tuple(_decode(v) for v in tree["items"])
        if kind == "map":
            return {_hashable(_decode(k)): _decode(v) for k, v in tree["items"]}
        if kind == "float":
            if tree["v"] not in ("nan", "inf", "-inf"):
                raise CodecError(f"not a float: {tree['v']!r:.40}")
            return float(tree["v"])
        cls = _types().get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise CodecError(f"unknown type {kind!r:.60} in a moc message; expected one of "
                             f"tuple, map, float, {', '.join(sorted(_types()))}")
        fields = tree["fields"]
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) != names:
            raise CodecError(f"a {kind} needs exactly the fields {sorted(names)}, got "
                             f"{sorted(fields) if isinstance(fields, dict) else fields!r:.80}")
        return cls(**{k: _decode(v) for k, v in fields.items()})
    except (KeyError, TypeError) as e:
        raise CodecError(f"malformed {kind!r:.40} in a moc message: {e}") from None


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise CodecError(f"a dict key must be hashable, got {type(key).__name__}") from None
    return key
