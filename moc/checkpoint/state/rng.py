"""A rank's random number generators in a checkpoint: which it holds (the CPU's, and that
of every accelerator its parameters live on), their states taken at a save, and read back
and installed at a restore, so that a resumed run draws what an uninterrupted one would
(dropout). All of it is host-side: nothing here waits for a device.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from moc.checkpoint.errors import IncompatibleCheckpointError
from moc.checkpoint.shards import local
from moc.checkpoint.spec import rng_keys
from moc.checkpoint.state.flat import Named, Reader

log = logging.getLogger(__name__)


_warned_no_rng: set[str] = set()


def _rng_module(device_type: str) -> Any | None:
    """The torch module of a device type with `get_rng_state`/`set_rng_state` (torch for
    the CPU); None, with a warning once, for one without (its generator is then neither
    saved nor restored)."""
    if device_type == "cpu":
        return torch
    try:
        module = torch.get_device_module(device_type)
    except RuntimeError:
        module = None
    if callable(getattr(module, "get_rng_state", None)) and callable(
            getattr(module, "set_rng_state", None)):
        return module
    if device_type not in _warned_no_rng:
        _warned_no_rng.add(device_type)
        log.warning("torch.%s has no get_rng_state/set_rng_state: the RNG of the %s "
                    "devices is not checkpointed, and a resumed run's random draws there "
                    "differ from an uninterrupted one's", device_type, device_type)
    return None


def rank_generators(rank: int, named: Named) -> dict[str, torch.device]:
    """This rank's RNG keys, each with the device whose generator it holds (`rng_keys`):
    the CPU generator and that of every accelerator the rank's parameters live on."""
    devices = {local(p).device for _, p in named}
    return rng_keys(rank, [d for d in devices if _rng_module(d.type) is not None])


# The generators' states are host data: torch.cuda.get_rng_state/set_rng_state read and
# write a CUDAGeneratorImpl's seed and Philox offset, which it keeps in host memory
# (aten/src/ATen/cuda/CUDAGeneratorImpl.cpp: get_state memcpys them into a new CPU byte
# tensor, set_state copies them back), so neither waits for the device nor queues work
# on it (tests/gpu/test_cuda_path.py saves under set_sync_debug_mode("error")).
def take_rng(generators: dict[str, torch.device]) -> dict[str, torch.Tensor]:
    """The state of each generator of `generators` (`rank_generators`) now, by key: CPU
    uint8 tensors, taken without waiting for any device."""
    out = {}
    for key, device in generators.items():
        module = _rng_module(device.type)
        assert module is not None, "rank_generators keeps devices with a generator"
        out[key] = module.get_rng_state() if device.type == "cpu" else module.get_rng_state(
            device)
    return out


def read_rng(reader: Reader, generators: dict[str, torch.device]
             ) -> dict[torch.device, torch.Tensor]:
    """The checkpoint's state of each generator of `generators` it holds (copies: a view
    into a mapped file must not reach a generator), checked against the size of the
    generator's state now. A key the checkpoint lacks (a restart on more ranks, a CPU
    run resumed on CUDA) leaves its generator as it is; a key for a device this rank no
    longer uses is not read. Raises IncompatibleCheckpointError for a state of another
    size (another device type's or torch build's generator), before anything is
    installed."""
    out = {}
    for key, device in generators.items():
        if key not in reader:
            continue
        saved = reader.get(key)
        now = take_rng({key: device})[key]
        if saved.dtype != now.dtype or tuple(saved.shape) != tuple(now.shape):
            raise IncompatibleCheckpointError(
                f"{key}: the checkpoint's RNG state is {saved.dtype} of shape "
                f"{tuple(saved.shape)}, this process's {device} generator takes {now.dtype} "
                f"of shape {tuple(now.shape)}; restore on the device type and torch build "
                "the run was saved with")
        out[device] = saved.clone()
    return out


def install_rng(states: dict[torch.device, torch.Tensor]) -> None:
    """Set each device's generator to its state (`read_rng`'s); host-side (see above)."""
    for device, state in states.items():
        module = _rng_module(device.type)
        assert module is not None, "rank_generators keeps devices with a generator"
        if device.type == "cpu":
            module.set_rng_state(state)
        else:
            module.set_rng_state(state, device)
