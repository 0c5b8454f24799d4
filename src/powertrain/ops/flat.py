"""Packing many tensors into one flat buffer so that one collective serves them all."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["flat_views", "index_dtype", "local_tensor", "pack", "pack_payload", "shard_rows", "unpack_payload"]


def shard_rows(rows: int, world: int) -> int:
    """Rows of each rank's dim-0 shard when ``rows`` are split over ``world`` ranks the way ``torch.chunk``, FSDP2
    and DTensor's ``Shard(0)`` split them: ``ceil(rows / world)`` each, the last ranks' shards short or empty
    (padded to that size where a collective needs equal parts)."""
    return -(-rows // world)


def index_dtype(numel: int) -> torch.dtype:
    """The smallest integer dtype that addresses ``numel`` positions (compact indices in a payload): int16 up to
    32768, else int32."""
    return torch.int16 if numel <= 2**15 else torch.int32


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (FSDP2, SimpleFSDP; in-place changes reach the
    DTensor), ``t`` itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def pack(tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy ``tensors`` (any shapes, any floating dtypes) into one new 1-D buffer of ``dtype``, on their device.

    One concatenation that casts as it copies (the values ``.to(dtype)`` gives), not a cast per tensor before it: a
    bucket holds a hundred parameters or more, and per-tensor calls, not bytes, are what packing costs."""
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    flat = [t.reshape(-1) for t in tensors]
    if torch.is_grad_enabled() and any(f.requires_grad for f in flat):  # out= takes no part in autograd
        return torch.cat([f.to(dtype) for f in flat])
    return torch.cat(flat, out=torch.empty(sum(f.numel() for f in flat), dtype=dtype, device=flat[0].device))


def flat_views(buffer: torch.Tensor, shapes: Sequence[torch.Size | tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of ``shapes`` laid out one after the other in the 1-D ``buffer`` (no copies)."""
    sizes = []
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        sizes.append(numel)
    assert sum(sizes) == buffer.numel(), f"buffer holds {buffer.numel()} elements, shapes need {sum(sizes)}"
    # one split for all the offsets, then a view per shape (a slice and a view each cost twice the calls)
    return [part.view(shape) for part, shape in zip(buffer.split(sizes), shapes, strict=True)]


def pack_payload(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate the bytes of ``parts`` (widest dtype first, so every part stays aligned) into a uint8
    buffer whose length is a multiple of 8, with a last byte reserved (zero) for a finiteness flag."""
    raw = [p.contiguous().view(-1).view(torch.uint8) for p in parts]
    used = sum(r.numel() for r in raw)
    pad = (-(used + 1)) % 8 + 1  # at least the flag byte
    device = parts[0].device if parts else torch.device("cpu")
    return torch.cat([*raw, torch.zeros(pad, dtype=torch.uint8, device=device)])


def unpack_payload(row: torch.Tensor, specs: Sequence[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """The parts of one :func:`pack_payload` buffer, given their dtypes and element counts (views)."""
    out, offset = [], 0
    for dtype, count in specs:
        size = count * torch.empty(0, dtype=dtype).element_size()
        out.append(row[offset : offset + size].view(dtype))
        offset += size
    return out
