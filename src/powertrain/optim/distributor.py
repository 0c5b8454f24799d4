"""Which rank computes each block's direction, and how every rank receives every direction it applies: the
communication of optimizers whose per-block work is too costly to repeat on every data-parallel rank
(:class:`~powertrain.optim.DistributedShampoo`'s roots, :class:`~powertrain.optim.Muon`'s Newton-Schulz).

Two distributors with one interface, chosen by the parameters:

- :class:`Gather`: replicated parameters on ``W > 1`` ranks (DDP). Blocks are assigned to ranks by their
  estimated time per step (:func:`assign`, from the optimizer's own cost model); each rank writes its blocks'
  directions into its part of one all-gather and applies them while the all-gather is in flight, the others' once
  it has arrived.
- :class:`Local`: one process, or every rank computing its own blocks. Every block is this rank's; nothing is sent.

Both hand the optimizer ``(block, direction)`` pairs in the same order for the same blocks, so the update is
bitwise the same whichever applies it (when the directions travel in the dtype they were computed in)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator

import torch

from powertrain.comm import Communicator
from powertrain.ops.flat import shard_rows

__all__ = ["Block", "Gather", "Local", "Shards", "assign", "shard_ranges"]


@dataclasses.dataclass(frozen=True)
class Block:
    param: int  # index in the optimizer's flat parameter list
    index: int  # block index within the parameter
    shape: tuple[int, ...]
    owner: int  # the rank that keeps its statistics and computes its direction


def assign(blocks: list[tuple[int, int, tuple[int, ...], float]], world: int) -> list[Block]:
    """Greedy longest-processing-time assignment of ``(param, index, shape, cost)`` blocks to ranks: the most
    costly first, each to the least loaded rank (ties: the lowest rank), deterministic."""
    load = [0.0] * world
    owner = [0] * len(blocks)
    for i in sorted(range(len(blocks)), key=lambda i: (-blocks[i][3], i)):
        r = min(range(world), key=lambda j: (load[j], j))
        owner[i] = r
        load[r] += blocks[i][3]
    return [Block(p, b, s, owner[i]) for i, (p, b, s, _) in enumerate(blocks)]


class Local:
    """Every block is this rank's; directions are applied where they are computed."""

    def __init__(self, blocks: list[tuple[int, int, tuple[int, ...], float]]) -> None:
        self.blocks = assign(blocks, 1)
        self.rank = 0

    def owned(self, blocks: list[Block]) -> list[Block]:
        """The blocks of ``blocks`` this rank computes, in order."""
        return [b for b in blocks if b.owner == self.rank]

    def slots(self, active: list[Block], device: torch.device) -> list[torch.Tensor | None]:
        """Where to write each owned active block's direction (None: a fresh tensor)."""
        return [None] * len(self.owned(active))

    def exchange(self, active: list[Block], mine: list[torch.Tensor]) -> Iterator[tuple[Block, torch.Tensor]]:
        """Every active block with its direction, this rank's (``mine``, in order) first."""
        yield from zip(self.owned(active), mine, strict=True)


class Gather(Local):
    """Blocks spread over ``comm``'s ranks by cost; directions exchanged by one all-gather in ``comm_dtype``."""

    def __init__(
        self, blocks: list[tuple[int, int, tuple[int, ...], float]], comm: Communicator, comm_dtype: torch.dtype
    ) -> None:
        self.blocks = assign(blocks, comm.world_size)
        self.rank, self.comm, self.comm_dtype = comm.rank, comm, comm_dtype
        self._send: torch.Tensor | None = None

    def _sizes(self, active: list[Block]) -> list[int]:
        """Every rank's part of the all-gather: the same on every rank, since gradients (and so the active blocks)
        are."""
        sizes = [0] * self.comm.world_size
        for b in active:
            sizes[b.owner] += math.prod(b.shape)
        return sizes

    def slots(self, active: list[Block], device: torch.device) -> list[torch.Tensor | None]:
        """Each owned active block's view of a new send buffer in ``comm_dtype`` (as wide as the largest rank's part):
        directions written there are the all-gather's input, with no copy. Call before :meth:`exchange`."""
        self._send = torch.empty(max(self._sizes(active)), dtype=self.comm_dtype, device=device)
        out: list[torch.Tensor | None] = []
        offset = 0
        for b in self.owned(active):
            n = math.prod(b.shape)
            out.append(self._send[offset : offset + n])
            offset += n
        return out

    def exchange(self, active: list[Block], mine: list[torch.Tensor]) -> Iterator[tuple[Block, torch.Tensor]]:
        """Starts the all-gather, yields this rank's blocks while it is in flight (their directions are the rows it
        sends, so every rank applies the same values), then the others' from its rows."""
        send, self._send = self._send, None
        assert send is not None, "slots() allocates the all-gather's buffer before exchange()"
        sizes = self._sizes(active)
        send[sizes[self.rank] :].zero_()
        rows, pending = self.comm.all_gather(send, async_op=True)  # (world, width)
        assert pending is not None, "a distributed all-gather returns a future"
        yield from zip(self.owned(active), mine, strict=True)
        t0 = time.perf_counter()
        pending.wait()
        self.comm.stats.add_time(comm_s=time.perf_counter() - t0)
        offsets = [0] * self.comm.world_size
        for b in active:
            k = math.prod(b.shape)
            if b.owner != self.rank:
                yield b, rows[b.owner, offsets[b.owner] : offsets[b.owner] + k]
            offsets[b.owner] += k
        assert offsets == sizes, f"all-gather layout {offsets} does not match the sizes sent {sizes}"


def shard_ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """Each rank's rows ``(lo, hi)`` of a dim-0 sharded tensor of ``rows`` rows, as ``torch.chunk``, FSDP2 and
    DTensor's ``Shard(0)`` split them (:func:`~powertrain.ops.flat.shard_rows` each, the last ranks' short or
    empty)."""
    size = shard_rows(rows, world)
    return [(min(rows, r * size), min(rows, (r + 1) * size)) for r in range(world)]


class Shards(Local):
    """Blocks that are whole parameters sharded by rows over ``comm``'s ranks (DTensor ``Shard(0)`` on a 1-D mesh:
    FSDP2, SimpleFSDP): a block's owner receives every rank's rows of it and computes the direction of the whole
    matrix, then sends each rank its rows back. One all-to-all each way serves every block of a step, so the shards
    of a matrix meet only on its owner (never a full all-gather on every rank): each rank sends and receives about
    twice its share of the parameters."""

    def __init__(self, blocks: list[tuple[int, int, tuple[int, ...], float]], comm: Communicator) -> None:
        self.blocks = assign(blocks, comm.world_size)
        self.rank, self.comm = comm.rank, comm

    def _rows(self, b: Block, rank: int) -> int:
        """Elements of rank ``rank``'s rows of block ``b``."""
        lo, hi = shard_ranges(b.shape[0], self.comm.world_size)[rank]
        return (hi - lo) * math.prod(b.shape[1:])

    def to_owners(self, active: list[Block], parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every active block's whole matrix on its owner: ``parts`` are this rank's rows of each active block (in
        order, one dtype); returns the whole of each block this rank owns (as :meth:`owned` orders them)."""
        world, me = self.comm.world_size, self.rank
        order = sorted(range(len(active)), key=lambda j: active[j].owner)  # stable: block order within an owner
        send_sizes = [0] * world
        for b in active:
            send_sizes[b.owner] += self._rows(b, me)
        owned = self.owned(active)
        recv_sizes = [sum(self._rows(b, r) for b in owned) for r in range(world)]
        like = parts[0] if parts else torch.empty(0)
        send = torch.cat([parts[j].reshape(-1) for j in order]) if parts else like.new_empty(0)
        received = self.comm.all_to_all(send, send_sizes, recv_sizes).split(recv_sizes)
        pieces = [part.split([self._rows(b, r) for b in owned]) for r, part in enumerate(received)]
        return [torch.cat([pieces[r][k].view(-1, *b.shape[1:]) for r in range(world)]) for k, b in enumerate(owned)]

    def from_owners(self, active: list[Block], mine: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of every active block's direction (in order), from ``mine``: the whole direction of each
        block this rank owns (as :meth:`owned` orders them, one dtype)."""
        world, me = self.comm.world_size, self.rank
        owned = self.owned(active)
        bounds = {b: shard_ranges(b.shape[0], world) for b in owned}
        send_parts = [
            d[slice(*bounds[b][r])].reshape(-1) for r in range(world) for b, d in zip(owned, mine, strict=True)
        ]
        like = mine[0] if mine else torch.empty(0)
        send = torch.cat(send_parts) if send_parts else like.new_empty(0)
        send_sizes = [sum(self._rows(b, r) for b in owned) for r in range(world)]
        recv_sizes = [0] * world
        for b in active:
            recv_sizes[b.owner] += self._rows(b, me)
        received = self.comm.all_to_all(send, send_sizes, recv_sizes).split(recv_sizes)
        from_owner = [
            part.split([self._rows(b, me) for b in active if b.owner == o]) for o, part in enumerate(received)
        ]
        taken = [0] * world
        out = []
        for b in active:
            out.append(from_owner[b.owner][taken[b.owner]].view(-1, *b.shape[1:]))
            taken[b.owner] += 1
        return out
