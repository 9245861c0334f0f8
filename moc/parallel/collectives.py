"""Moving named tensors between ranks without pickling them.

`torch.distributed.gather_object` pickles every tensor through `torch.save`: on a
400 MB optimizer state that costs seconds of pure serialisation. Here only the names,
dtypes and shapes travel as objects; the bytes travel as one flat uint8 buffer per rank,
padded to the largest, in a single tensor gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_ALIGN = 8
"""Each tensor starts 8-byte aligned in the flat buffer, so it can be viewed as any
dtype again without a copy."""


def _pack(tensors: dict[str, torch.Tensor]) -> tuple[list[tuple[str, torch.dtype, tuple]],
                                                      torch.Tensor]:
    meta, parts, size = [], [], 0
    for key, t in tensors.items():
        raw = t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
        pad = -raw.numel() % _ALIGN
        parts += [raw, torch.zeros(pad, dtype=torch.uint8)] if pad else [raw]
        meta.append((key, t.dtype, tuple(t.shape)))
        size += raw.numel() + pad
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return meta, flat


def _unpack(meta: list[tuple[str, torch.dtype, tuple]], flat: torch.Tensor
            ) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for key, dtype, shape in meta:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out[key] = flat[offset:offset + n].view(dtype).reshape(shape)
        offset += n + (-n % _ALIGN)
    return out


def gather_tensors(tensors: dict[str, torch.Tensor], dst: int,
                   group: dist.ProcessGroup | None) -> list[dict[str, torch.Tensor]]:
    """Gather every rank's named CPU tensors to global rank `dst` (collective over
    `group`). Returns the per-rank dicts, in group rank order, on `dst`; [] elsewhere.
    Without a process group (or in a group of one) nothing moves."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [tensors]
    meta, flat = _pack(tensors)
    size = dist.get_world_size(group)
    infos: list = [None] * size
    dist.all_gather_object(infos, (meta, flat.numel()), group=group)  # names only: small
    longest = max(n for _, n in infos)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:flat.numel()] = flat
    if dist.get_rank() == dst:
        buffers = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
        dist.gather(padded, buffers, dst=dst, group=group)
        return [_unpack(m, buf[:n]) for (m, n), buf in zip(infos, buffers, strict=True)]
    dist.gather(padded, None, dst=dst, group=group)
    return []
