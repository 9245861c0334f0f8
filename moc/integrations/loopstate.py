"""What a framework's loop must get back beside moc's checkpoint, kept in `extra_state`.

    rng = gather_rng(device)               # collective: every rank's host RNGs, deduplicated
    extra = {"rng": rng, "scheduler": encode_state(scheduler.state_dict()), ...}
    ...
    set_rng(rng_of(extra["rng"], rank))    # python, numpy and accelerator RNGs back
    scheduler.load_state_dict(decode_state(extra["scheduler"]))

moc's engines save the model, the optimizer (param groups included) and every rank's
torch CPU generator. A framework's loop has more: an lr scheduler, a gradient scaler,
python's and numpy's generators (a data collator's masking draws from them) and the
accelerator's. These travel in `extra_state`, which is JSON and is kept once per
checkpoint (rank 0's), so:

- The RNGs of every rank are gathered to every rank and stored deduplicated: ranks whose
  states are equal (the usual case: `set_seed` on each) share one entry, so the record
  stays the size of one state, not one per rank. The gather uses tensor collectives on
  the default group; nothing is pickled (docs/THREAT_MODEL.md).
- A state dict that is not JSON (a ReduceLROnPlateau's `best` is inf, a scaler may hold
  tensors) is carried as base64 of `torch.save`, and read back with `weights_only=True`:
  tensors, numbers, strings and containers, never code.
"""

from __future__ import annotations

import base64
import io
import json
import random
from typing import Any

import torch
import torch.distributed as dist

from moc.checkpoint.dist import all_gather_bytes


def host_rng() -> dict[str, Any]:
    """This process's generators that moc's engines do not save, as JSON: python's,
    numpy's (when numpy is installed) and every CUDA device's."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch; nothing to save then
        pass
    else:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available():
        state["cuda"] = [t.tolist() for t in torch.cuda.get_rng_state_all()]
    return state


def set_rng(state: dict[str, Any]) -> None:
    """Put back what `host_rng` returned (a generator it did not record is left alone)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    check_rng(state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8)
                                      for s in state["cuda"]])


def check_rng(state: dict[str, Any]) -> None:
    """Refuse a state `set_rng` could not put back whole: call it where every rank can
    still agree on the error (before training), not where one rank would raise alone."""
    if "cuda" in state and torch.cuda.is_available() \
            and len(state["cuda"]) != torch.cuda.device_count():
        raise ValueError(f"the checkpoint holds the RNG of {len(state['cuda'])} CUDA devices, "
                         f"this process sees {torch.cuda.device_count()}: set "
                         "CUDA_VISIBLE_DEVICES as the saving run did")


def gather_rng(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Collective over the default group (every rank, the same call): every rank's
    `host_rng()`, deduplicated: {"states": [distinct states], "rank": [index per rank]}.
    One process: its own state."""
    states = gather_json(host_rng(), device)
    distinct: list[str] = []
    index = []
    for s in states:
        text = json.dumps(s, sort_keys=True)
        if text not in distinct:
            distinct.append(text)
        index.append(distinct.index(text))
    return {"states": [json.loads(t) for t in distinct], "rank": index}


def rng_of(gathered: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank `rank`'s state in what `gather_rng` returned."""
    index = gathered["rank"]
    if rank >= len(index):
        raise ValueError(f"the checkpoint holds the RNGs of {len(index)} ranks; this is rank "
                         f"{rank}: resume with the number of ranks that saved it")
    return gathered["states"][index[rank]]


def gather_json(obj: Any, device: torch.device | str = "cpu") -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order, over the default process group (on
    `device`: the default group may be NCCL). Without a process group: [obj]."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    data = json.dumps(obj).encode()
    return [json.loads(t.numpy().tobytes().decode())
            for t in all_gather_bytes(data, dist.get_world_size(), None, device)]


def encode_state(state: dict[str, Any]) -> str:
    """A state dict (a scheduler's, a scaler's) as text for `extra_state`."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_state(text: str) -> dict[str, Any]:
    """What `encode_state` wrote, loaded with `weights_only=True`: data, never code."""
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)


def check_same(saved: dict[str, Any], now: dict[str, Any], step: int, where: str,
               fix: str) -> None:
    """Refuse a resume whose data layout differs from the run that saved `step`: the
    position (batches consumed) would then point at other samples, a silent wrong
    resume. One line, naming the first setting that differs, its two values, and `fix`."""
    for key, value in saved.items():
        if key in now and now[key] != value:
            raise ValueError(f"moc's checkpoint of step {step} in {where} was trained with "
                             f"{key}={value}, this run has {key}={now[key]}: the data "
                             f"position would not match; {fix}")
