"""Hierarchical compression: exact inside a node, compressed between nodes (DALL-E's split, Ramesh et al. 2021).

A cluster has fast links inside a node and a slow one between nodes. :class:`HierarchicalCompressor` averages
a call's gradients in three stages:

1. an exact mean over the node's ranks (one all-reduce on the node's group: a fast link);
2. each parameter belongs to one local rank (the largest first, each to the least loaded: about 1/M of the
   bytes each), which averages its node-mean gradient over the nodes with an inner compressor, on the group of
   the ranks with its local rank: the only traffic on the slow link, each local rank sending its share only;
3. an all-gather inside the node puts the parameters back together.

The inner compressor is any powertrain compressor (:func:`~powertrain.compress.make_compressor`'s names and
options), built on the parameters a local rank owns, so its state (error buffers, factors) lives there, once per
node. Error feedback conserves what it owes: over the nodes, the mean of node-mean + old residual equals the
approximation + the mean of the new residuals.

Whole parameters rather than dim-0 row shards (the DALL-E paper's ZeRO shards): a row shard of an n x m matrix
costs PowerSGD (n / M + m) r floats, so M shards send (n + M m) r where the whole matrix sends (n + m) r.

Each stage runs on process groups of its own (created here, one set per collective of a call), so the same
program runs synchronously and chained on futures in a DDP hook (:mod:`powertrain.ddp`) with the collectives
of different buckets in the same order on every rank. Statistics: ``comm.stats`` counts the inter-node
collectives (the slow link's payload, comparable with a flat compressor's), ``node_stats`` the intra-node ones.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from powertrain._checks import check_int
from powertrain.comm import CommStats, Communicator
from powertrain.compress.base import (
    Compressor,
    GatherRequest,
    NonFiniteGradientError,
    Program,
    ReduceRequest,
    Rows,
    placeholder,
)
from powertrain.compress.deferred import Transaction
from powertrain.ops.finite import finite_flag, read_flag

__all__ = ["HierarchicalCompressor", "node_layout"]


def node_layout(local_world: int | None = None, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(nodes, local_world)`` of the default group: ``local_world`` consecutive ranks per node.

    ``local_world`` defaults to torchrun's ``LOCAL_WORLD_SIZE``. Raises ValueError when it does not divide the
    world, or when torchrun's node numbering (``GROUP_RANK``) disagrees with consecutive ranks per node."""
    if group not in (None, dist.group.WORLD):
        raise ValueError("HierarchicalCompressor runs on the default process group: pass group=None")
    if local_world is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError(
                "HierarchicalCompressor needs local_world= (ranks per node): it is not under torchrun, "
                "which sets LOCAL_WORLD_SIZE"
            )
        local_world = int(env)
    check_int("local_world", local_world, 1, " (ranks per node)")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world % local_world:
        raise ValueError(
            f"local_world={local_world} does not divide the world size {world}: every node must run "
            "the same number of ranks"
        )
    node = os.environ.get("GROUP_RANK")
    if node is not None and world > 1 and int(node) != dist.get_rank() // local_world:
        raise ValueError(
            f"Rank {dist.get_rank()} is on node {node} but local_world={local_world} puts it on node "
            f"{dist.get_rank() // local_world}: run the same --nproc-per-node on every node"
        )
    return world // local_world, local_world


def _groups(nodes: int, local: int, kind: str) -> dist.ProcessGroup | None:
    """This rank's group of ``kind`` (``"node"``: its node's ranks, ``"cross"``: the ranks with its local rank);
    every rank creates all of them, in the same order (``new_group`` is collective over the default group)."""
    if nodes * local == 1:
        return None
    me = dist.get_rank()
    if kind == "node":
        sets = [list(range(n * local, (n + 1) * local)) for n in range(nodes)]
    else:
        sets = [list(range(j, nodes * local, local)) for j in range(local)]
    mine = None
    for ranks in sets:
        g = dist.new_group(ranks=ranks)
        if me in ranks:
            mine = g
    return mine


class HierarchicalCompressor(Compressor):
    """Exact mean inside each node, ``inner`` compression between nodes, each parameter by one local rank.

    Args:
        params: ``model.parameters()`` or ``model.named_parameters()``.
        inner: the compressor between nodes, by name (see :func:`~powertrain.compress.make_compressor`).
        local_world: ranks per node (consecutive ranks share a node); default torchrun's ``LOCAL_WORLD_SIZE``.
        group: must be None (the default group).
        **options: the inner compressor's options.

    Every rank must construct it, in the same order as its other process-group creations.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        inner: str = "powersgd",
        *,
        local_world: int | None = None,
        group: dist.ProcessGroup | None = None,
        **options: Any,
    ) -> None:
        from powertrain.compress import make_compressor

        if inner == "hierarchical":
            raise ValueError("inner='hierarchical' would nest: choose a flat compressor for the inter-node stage")
        self.nodes, self.local_world = node_layout(local_world, group)
        super().__init__(params, group=group)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.local_rank = dist.get_rank() % self.local_world if distributed else 0
        self.owner = _assign([s.numel() for s in self._shapes], self.local_world)
        self._owned = [i for i, o in enumerate(self.owner) if o == self.local_rank]
        self._inner_index = {i: k for k, i in enumerate(self._owned)}
        mine = [(self.names[i], placeholder(self.params[i].shape, self.params[i])) for i in self._owned]
        # One set of groups per collective of a call: node (reduce), inter-node (the inner's), node (gather).
        cross = lambda: _groups(self.nodes, self.local_world, "cross") if distributed else None
        node = lambda: _groups(self.nodes, self.local_world, "node") if distributed else None
        self.inner = make_compressor(inner, mine, group=cross(), **options)
        self.node_stats = CommStats()
        self.comm = Communicator(group, stats=self.inner.comm.stats)
        self._cross = [self.inner.comm] + [
            Communicator(cross(), stats=self.inner.comm.stats) for _ in range(self.inner.max_collectives_per_call() - 1)
        ]
        self._node = [Communicator(node(), stats=self.node_stats) for _ in range(2)]

    def max_collectives_per_call(self) -> int:
        """The inner compressor's, plus the all-reduce inside the node before and the all-gather after."""
        return 2 + self.inner.max_collectives_per_call()

    def communicators(self) -> list[Communicator]:
        """One per collective of a call, in order: the node's reduce, one per inner collective (between nodes),
        the node's gather."""
        return [self._node[0], *self._cross, self._node[1]]

    def program(
        self, grads: Sequence[torch.Tensor], indices: Sequence[int] | None = None, *, rows: Rows = None
    ) -> Program:
        """The exact mean inside the node, each parameter's through ``inner`` between nodes by the local rank that
        owns it, then an all-gather inside the node of the owners' results. ``rows`` (FSDP's row shards) raises
        ValueError: whole gradients only."""
        if rows is not None:
            raise ValueError(
                "HierarchicalCompressor averages whole gradients (DDP); FSDP's row shards are not "
                "supported: use parallel='ddp' or 'reference' with hierarchy"
            )
        idx = self._resolve(grads, indices)
        return self._run(grads, idx)

    @torch.no_grad()
    def _run(self, grads: Sequence[torch.Tensor], idx: list[int]) -> Program:
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        yield ReduceRequest(flat, "mean", comm=self._node[0], check=False)  # exact: the fast link; not the last
        node_means = flat.split([g.numel() for g in grads])
        mine = [
            (self._inner_index[i], m.view(g.shape))
            for g, i, m in zip(grads, idx, node_means, strict=True)
            if self.owner[i] == self.local_rank
        ]
        if mine:
            # A rank of this node sent NaN/Inf, maybe in a parameter another rank owns: every owner of this call
            # poisons what it sends, so that every node learns of it (on the device: the host does not wait here).
            first, ok = mine[0][1].view(-1)[:1], finite_flag([flat])
            assert isinstance(ok, torch.Tensor), "a flag of one tensor is a tensor"
            first.copy_(torch.where(ok, first, float("nan")))
        failed: NonFiniteGradientError | None = None
        averaged: list[torch.Tensor] = []
        txn: Transaction | None = None  # the inner call, its flag not read: the gather below carries it
        if mine:
            inner_idx = [k for k, _ in mine]
            if self.inner.replaced_state is not None:
                txn = Transaction(self.inner, inner_idx)
            try:
                averaged = yield from self._rerouted(self.inner.program([v for _, v in mine], inner_idx), txn)
            except NonFiniteGradientError as e:  # told to the node's other ranks in the gather, then raised
                failed = e
            if txn is not None and (failed is not None or txn.verdict.ok is None):
                txn.release()  # nothing committed, or decided on the host already
                txn = None
        # Put the parameters back together inside the node: every local rank sends the same (padded) size, plus one
        # element whose last byte says "a gradient somewhere was not finite".
        sizes = [sum(self._shapes[i].numel() for i in idx if self.owner[i] == j) for j in range(self.local_world)]
        payload = torch.zeros((max(sizes) + 1) * dtype.itemsize, dtype=torch.uint8, device=flat.device)  # rows aligned
        if averaged and failed is None:
            sent = torch.cat([a.reshape(-1).to(dtype) for a in averaged])
            payload[: sent.numel() * dtype.itemsize].copy_(sent.view(torch.uint8))
        payload[-1:].fill_(int(failed is not None))  # fill_ with a number: no host-to-device copy on CUDA
        if txn is not None:
            assert txn.verdict.ok is not None, "a pending transaction has its flag"
            payload[-1:].copy_(txn.verdict.ok.logical_not())  # on the device: the inner call's flag, not read here
        gathered = yield GatherRequest(payload, comm=self._node[1])
        assert gathered is not None, "a gather returns the gathered payloads"
        if failed is not None:
            raise failed
        if read_flag(gathered[:, -1].any()):  # every rank decides alike: the program's one host read
            if txn is not None:  # the node's decision, not only this rank's inner call's: all of it as before
                txn.restore()
            raise self._nonfinite_error([self.names[i] for i in idx], grads)
        if txn is not None:
            txn.release()
        out: list[torch.Tensor] = [flat[:0]] * len(idx)
        for j in range(self.local_world):
            values, pos = gathered[j, : sizes[j] * dtype.itemsize].view(dtype), 0
            for k, (g, i) in enumerate(zip(grads, idx, strict=True)):
                if self.owner[i] == j:
                    out[k] = values[pos : pos + g.numel()].view(g.shape).to(g.dtype, copy=True)
                    pos += g.numel()
        return out

    def _rerouted(self, program: Program, txn: Transaction | None) -> Program:
        """Run the inner program with its c-th collective on the c-th inter-node communicator; with ``txn``, its
        guard hands its flag to ``txn`` instead of reading it (on CUDA that read would hold the issuing thread)."""
        advance = txn.run if txn is not None else lambda step: step()
        phase = 0
        try:
            request = advance(lambda: next(program))
            while True:
                if phase >= len(self._cross):
                    raise RuntimeError(
                        f"the inner compressor issued more than {len(self._cross)} collectives in a "
                        "call (its max_collectives_per_call)"
                    )
                # unchecked for the driver: the gather follows, and carries the inner program's flag
                value = yield dataclasses.replace(request, comm=self._cross[phase], check=False)
                phase += 1
                request = advance(lambda: program.send(value))  # noqa: B023 (called at once)
        except StopIteration as stop:
            return stop.value

    def residuals(self) -> list[torch.Tensor]:
        """What this rank still owes per parameter: the inner compressor's residual for the parameters it owns,
        zeros for the others (summed over a node's ranks: the node's residual)."""
        inner = getattr(self.inner, "residuals", None)
        owed = inner() if inner is not None else []
        out = []
        for i, s in enumerate(self._shapes):
            dtype = torch.float64 if self.params[i].dtype == torch.float64 else torch.float32
            k = self._inner_index.get(i)
            out.append(owed[k].to(dtype) if k is not None and owed else torch.zeros(s, dtype=dtype, device=self.device))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The inner compressor's state (for the parameters this rank owns) with the layout it belongs to: ``nodes``,
        ``local_world`` and this rank's ``local_rank``."""
        return {
            "kind": type(self).__name__,
            "nodes": self.nodes,
            "local_world": self.local_world,
            "local_rank": self.local_rank,
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned into the inner compressor. ValueError for another compressor's
        state or one saved on another layout (nodes, ranks per node, local rank): error buffers cannot be resharded."""
        if not isinstance(state, Mapping) or state.get("kind") != type(self).__name__:
            got = state.get("kind") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"Expected a {type(self).__name__} state_dict, got {got!r}")
        saved = (state.get("nodes"), state.get("local_world"), state.get("local_rank"))
        if saved != (self.nodes, self.local_world, self.local_rank):
            raise ValueError(
                f"HierarchicalCompressor state was saved as (nodes, local_world, local_rank) = {saved}, this rank is "
                f"{(self.nodes, self.local_world, self.local_rank)}: per-rank error buffers cannot be resharded; "
                "resume on the same nodes x ranks per node"
            )
        self.inner.load_state_dict(state["inner"])


def _assign(sizes: list[int], local_world: int) -> list[int]:
    """The local rank that compresses each parameter: largest first, each to the least loaded local rank (ties:
    the lowest), so every local rank sends about 1/M of the bytes between nodes. Deterministic on every rank."""
    load = [0] * local_world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        j = min(range(local_world), key=lambda j: (load[j], j))
        owner[i], load[j] = j, load[j] + sizes[i]
    return owner
