"""GaLore's communication: the row layout of a sharded parameter and the two collectives a refresh needs.

Under FSDP2 (``fully_shard``) and SimpleFSDP a parameter and its gradient are DTensors sharded on dim 0
(``Shard(0)``; HSDP adds ``Replicate`` on another mesh dimension): every rank holds a block of rows, cut as
``torch.chunk`` cuts (``ceil(m / W)`` rows per rank, the last ranks fewer or none). GaLoreAdamW projects
such a gradient on its columns (``G_i V_r``, see :mod:`.optimizer`), so a step is local; only the refresh
of ``V_r`` communicates, over the sharding mesh dimension's group:

* randomized SVD: ``sum_shards`` all-reduces the ``n x k`` sketches and ``k x k`` Gram matrices of all
  refreshed parameters in one packed buffer per stage (``power_iters + 2`` all-reduces per refresh);
* exact SVD: ``gather_rows`` all-gathers the whole gradient matrices (all parameters in one buffer) and
  every rank runs the same ``torch.linalg.svd``.

Everything goes through :class:`powertrain.comm.Communicator` (byte accounting, no-op when alone).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from powertrain.comm import CommStats, Communicator
from powertrain.ops.flat import flat_views, pack, shard_rows

__all__ = ["RowShard", "gather_rows", "row_shard", "sum_shards"]


@dataclasses.dataclass(frozen=True)
class RowShard:
    """This rank's rows ``[offset, offset + rows)`` of a parameter with ``total`` rows, split over ``comm``'s
    group in chunks of ``chunk`` rows (rank ``j`` holds ``[j * chunk, min((j + 1) * chunk, total))``)."""

    comm: Communicator
    offset: int
    rows: int
    total: int
    chunk: int

    def rows_of(self, rank: int) -> int:
        """How many rows rank ``rank`` of the group holds: ``chunk``, fewer for the last, 0 past the end."""
        return max(0, min(self.chunk, self.total - rank * self.chunk))


def row_shard(param: torch.Tensor, comms: dict[int, Communicator], stats: CommStats) -> RowShard | None:
    """How ``param`` is split by rows across ranks; None when this rank holds it whole (a plain tensor, or a
    DTensor replicated on every mesh dimension: DDP-like). ``comms`` caches one communicator per group.

    Raises ValueError for DTensor layouts other than ``Shard(0)`` on one mesh dimension (tensor parallelism,
    FSDP2's strided sharding with TP).
    """
    if not isinstance(param, DTensor):
        return None
    placements = param.placements
    sharded = [d for d, pl in enumerate(placements) if not isinstance(pl, Replicate)]
    if not sharded:
        return None
    dim = sharded[0]
    if len(sharded) > 1 or type(placements[dim]) is not Shard or placements[dim].dim != 0:  # type: ignore[attr-defined]
        raise ValueError(
            f"Invalid parameter placements={placements!r}: GaLoreAdamW supports DTensor parameters sharded on dim 0 "
            "over one mesh dimension (FSDP2, SimpleFSDP, HSDP), replicated over the others"
        )
    mesh = param.device_mesh
    group = mesh.get_group(dim)
    if id(group) not in comms:
        comms[id(group)] = Communicator(group, stats=stats)
    world, coord = mesh.size(dim), mesh.get_local_rank(dim)
    total = param.shape[0]
    chunk = shard_rows(total, world)
    offset = min(coord * chunk, total)
    rows = max(0, min(chunk, total - offset))
    local = param.to_local().shape[0]
    assert local == rows, f"expected torch.chunk sharding: {rows} rows of {total} on rank {coord}, found {local}"
    return RowShard(comms[id(group)], offset, rows, total, chunk)


def sum_shards(comm: Communicator, tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` (float32, any shapes) over ``comm``'s ranks in place, with one all-reduce."""
    if not tensors or not comm.is_distributed:
        return
    flat = pack(tensors, torch.float32, tensors[0].device)
    comm.all_reduce_sum_(flat)
    for t, view in zip(tensors, flat_views(flat, [t.shape for t in tensors]), strict=True):
        t.copy_(view)


def gather_rows(shards: list[RowShard], locals_: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole matrices from every rank's rows (all ``shards`` on one group), with one all-gather.

    Each rank sends its rows padded to ``chunk`` rows; since only trailing ranks hold fewer, the first
    ``total`` rows of the gathered ``(W * chunk) x n`` block are the matrix.
    """
    if not shards:
        return []
    comm = shards[0].comm
    assert all(s.comm is comm for s in shards), "gather_rows serves one group at a time"
    if not comm.is_distributed:
        return list(locals_)
    padded = []
    for s, t in zip(shards, locals_, strict=True):
        block = t.new_zeros(s.chunk, t.shape[1])
        block[: t.shape[0]] = t
        padded.append(block)
    dtype = locals_[0].dtype
    flat = pack(padded, dtype, locals_[0].device)
    gathered, _ = comm.all_gather(flat)  # (W, S)
    out, offset = [], 0
    for s, t in zip(shards, locals_, strict=True):
        size = s.chunk * t.shape[1]
        whole = gathered[:, offset : offset + size].reshape(comm.world_size * s.chunk, t.shape[1])
        out.append(whole[: s.total].contiguous())
        offset += size
    return out
