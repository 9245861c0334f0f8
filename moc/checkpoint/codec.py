"""The encoding of every object that moc's processes send each other: data, never code.

    data = encode(obj)      # bytes (UTF-8 JSON)
    obj = decode(data)      # the same value, exactly; CodecError for anything else

Why not pickle: unpickling runs whatever the bytes say (`__reduce__`), so whoever can
write to a socket or a collective's connection would run code as the trainer. Here a
message can only ever decode to plain data and to the frozen dataclasses listed in
`CLASSES`, each rebuilt through its own constructor from its declared fields.

What round-trips exactly (the engines' collectives rely on it): None, bool, int, float
(NaN and infinities included), str, list, tuple (kept apart from list), dict with any
encodable keys (int keys stay int), and the dataclasses of `CLASSES`. Anything else (a
tensor, a torch.dtype, a set, an arbitrary object) is refused by `encode` with a
TypeError naming its type: send tensors with tensor collectives and dtypes by name.

Encoding: plain JSON for JSON's own types and for dicts whose keys are all strings;
every other value is a JSON object {"__moc__": kind, ...}. A dict whose keys include
"__moc__" itself is encoded as a "map", so a plain JSON object never carries the tag.

Layers: the codec sits below the engines, so it imports no class of theirs. The classes of
lower modules (`RankError`, `Entry`) it imports itself; a higher module's (the two-level
protocol's messages) are registered by that module when it is imported (`register`), and
only if `CLASSES` lists them: the list stays the one place to review what a peer can make
this process build.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from moc.checkpoint.errors import RankError
from moc.checkpoint.store.manifest import Entry

TAG = "__moc__"
CLASSES = {
    "RankError": "moc.checkpoint.errors",
    "Entry": "moc.checkpoint.store.manifest",
    **dict.fromkeys(("Hello", "Ready", "Failed", "Persist", "Abandon", "Stop", "Done"),
                    "moc.checkpoint.twolevel.persist.protocol"),
}
"""The closed list of classes that may travel: name on the wire -> the module that
defines the class of that name. Nothing else is ever built from a message."""


class CodecError(ValueError):
    """Bytes that are not an encoding of moc's data (corrupt, foreign or malicious)."""


_TYPES: dict[str, type] = {}
"""The classes of `CLASSES` registered in this process, by name."""


def register(*classes: type) -> None:
    """Let `classes` travel: each must be a frozen dataclass that `CLASSES` lists under
    its name and module (TypeError otherwise). Called by the module that defines them,
    when it is imported; a message of a listed class whose module this process has not
    imported does not decode (CodecError)."""
    for cls in classes:
        if CLASSES.get(cls.__name__) != cls.__module__:
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} is not in "
                            "moc.checkpoint.codec.CLASSES: a class travels only once "
                            "it is listed there")
        if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} must be a frozen "
                            "dataclass to travel")
        _TYPES[cls.__name__] = cls


register(RankError, Entry)


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


_STR = frozenset((str,))
_JSON_SCALARS = frozenset((str, int, type(None)))
"""Types of the elements of a list (or values of a dict with str keys) that JSON carries
exactly as they are (not bool, an int subclass kept apart by `set(map(type, ...))`; not
float: infinities need a tag): such a list or dict is sent and read in one C-level pass,
not one Python call per element (a persist message lists a snapshot's thousand keys)."""


def _encode(obj: Any) -> Any:
    if obj is None or isinstance(obj, bool | str):
        return obj
    if isinstance(obj, int):
        return int(obj)  # an IntEnum or a bool subclass would not decode as itself
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {TAG: "float", "v": repr(obj)}
    if isinstance(obj, list):
        if set(map(type, obj)) <= _JSON_SCALARS:  # a list of keys: one C-level pass
            return obj
        return [_encode(v) for v in obj]
    if isinstance(obj, tuple):
        return {TAG: "tuple", "items": [_encode(v) for v in obj]}
    if isinstance(obj, dict):
        if set(map(type, obj)) <= _STR and TAG not in obj:
            if set(map(type, obj.values())) <= _JSON_SCALARS:
                return obj
            return {k: _encode(v) for k, v in obj.items()}
        return {TAG: "map", "items": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    cls = type(obj)
    if _TYPES.get(cls.__name__) is cls:
        return {TAG: cls.__name__, "fields": {f.name: _encode(getattr(obj, f.name))
                                              for f in dataclasses.fields(obj)}}
    raise TypeError(f"moc.checkpoint.codec cannot send a {cls.__module__}.{cls.__qualname__}"
                    f" ({obj!r:.80}); send plain data (None, bool, int, float, str, list, "
                    "tuple, dict) or a class listed in codec.CLASSES; tensors travel by "
                    "tensor collectives, dtypes by name")


def _decode(tree: Any) -> Any:
    if isinstance(tree, list):
        if set(map(type, tree)) <= _JSON_SCALARS:
            return tree
        return [_decode(v) for v in tree]
    if not isinstance(tree, dict):
        return tree  # None, bool, int, float, str: JSON's own
    if TAG not in tree:
        if set(map(type, tree.values())) <= _JSON_SCALARS:
            return tree
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
        cls = _TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None and isinstance(kind, str) and kind in CLASSES:
            raise CodecError(f"a {kind} in a moc message, but this process has not "
                             f"imported {CLASSES[kind]}, which registers it")
        if cls is None:
            raise CodecError(f"unknown type {kind!r:.60} in a moc message; expected one of "
                             f"tuple, map, float, {', '.join(sorted(CLASSES))}")
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
