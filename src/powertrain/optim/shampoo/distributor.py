"""Which rank computes each block's direction, and how every rank receives every direction it applies.

Two distributors with one interface, chosen by the parameters:

- :class:`Gather`: replicated parameters on ``W > 1`` ranks (DDP). Blocks are assigned to ranks by their
  estimated time per step (:func:`assign`); each rank writes its blocks' directions into its part of one
  all-gather and applies them while the all-gather is in flight, the others' once it has arrived.
- :class:`Local`: one process, or sharded (DTensor) parameters whose shards each rank preconditions itself.
  Every block is this rank's; nothing is sent.

Both hand the optimizer ``(block, direction)`` pairs in the same order for the same blocks, so the update is
bitwise the same whichever applies it (with float32 communication)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator

import torch

from powertrain.comm import Communicator

__all__ = ["Block", "Gather", "Local", "assign", "block_cost"]


@dataclasses.dataclass(frozen=True)
class Block:
    param: int  # index in the optimizer's flat parameter list
    index: int  # block index within the parameter
    shape: tuple[int, ...]
    owner: int  # the rank that keeps its statistics and computes its direction


# Balancing model: a block's time per step in multiply-adds of a large matrix product: an eigendecomposition of a
# d x d factor costs about 10 d^3, the step's elementwise passes about 140 per entry (about 15 passes), and each
# block a fixed cost of dispatch and Python worth about 5e6. Only the balance depends on them: any deterministic
# assignment keeps the distributed optimizer bitwise the single-process one.
_ROOT_COST, _PASS_COST, _BLOCK_COST = 10, 140, 5e6


def block_cost(shape: tuple[int, ...], preconditioned: bool, products: int, frequency: int) -> float:
    """Estimated time of one step of a block: fixed and elementwise work, plus for a preconditioned block its
    ``products`` mode products per step (each ``numel * d_i`` multiply-adds per dimension ``i``; 2 for Shampoo:
    the factor update and the preconditioning; 4 eigenvalue-corrected: the factor update and three rotations) and
    its eigendecompositions amortised over ``frequency`` steps."""
    n = math.prod(shape)
    cost = _BLOCK_COST + _PASS_COST * n
    if preconditioned:
        cost += products * n * sum(shape) + _ROOT_COST * sum(d**3 for d in shape) / frequency
    return cost


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
