"""Compressed gradient and weight communication for FSDP2 (``torch.distributed.fsdp.fully_shard``).

``register_compressor(model, compressor)`` replaces the reduce-scatter of every ``fully_shard`` module in
``model`` (``set_custom_reduce_scatter``). FSDP hands the custom reduce-scatter a ``(W, S)`` buffer whose
row ``r`` holds the ``r``-th dim-0 chunk of every gradient of the module; the adaptor views it back as one
full gradient per parameter, lets the compressor average those over ranks (with error feedback: each rank
keeps the residual of its own full gradient), and writes this rank's rows of the average into FSDP's
output. One compressor serves all modules, each call using the module's subset of its parameters.

* Exact fp32 passes FSDP's own reduce-scatter through unchanged (bitwise plain FSDP2); bf16/fp16 round
  the input and reduce-scatter in 16 bits.
* PowerSGD all-reduces only its low-rank factors.
* int8/int4 all-gather each rank's quantised gradient (error feedback on the full local gradient).
* top-k, random-k and sign are refused at registration: their payloads have no reduce-scatter form,
  and gathering them whole would send more than FSDP's dense reduce-scatter at scale.

gloo has no native reduce-scatter: it runs one as a full all-reduce, so plain FSDP2 on gloo sends the whole
``W * S`` buffer (its byte count here says so), twice what a real reduce-scatter (NCCL) sends.

``compress_gradients(model, name, group=...)`` builds the compressor itself, on what FSDP2 reduces: each
parameter's unsharded size on this rank, which under tensor parallelism (:mod:`powertrain.tp`) is the rank's
tensor-parallel block rather than the parameter's global shape.

``compress_replicas(model, name, group=...)`` is HSDP with a compressed replicate dimension: ``fully_shard`` on the
node's ranks (the shard dimension of a ``(replicate, shard)`` mesh) reduce-scatters exactly inside the node, and the
compressor averages each rank's shard over the nodes (``group``: the ranks that hold the same shard), after the
reduce-scatter (``set_all_reduce_hook``): only the compressed shards cross between nodes.

``quantize_all_gather(model, bits=8)`` additionally all-gathers the sharded *weights* as int8/int4 with
per-chunk scales (QSDP, Markov et al., arXiv 2302.02390): every rank runs forward and backward on the same
dequantised weights; the sharded fp32 master weights stay exact.

Inside backward no call waits for the device: each program's finiteness check is read once, at the end of
backward (``powertrain.compress.deferred``), where a non-finite gradient on any rank makes every rank raise
:class:`~powertrain.compress.NonFiniteGradientError` out of ``loss.backward()``; the calls that saw it leave the
compressor's state as it was.

Limitation: FSDP passes the reduce-scatter only the parameters that received a gradient, without saying
which; the adaptor therefore needs every trainable parameter of a sharded module to get a gradient each
step (mark unused ones ``requires_grad_(False)``) and raises a clear error otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # private: see powertrain._compat

from powertrain._checks import check_int
from powertrain._compat import all_gather_single, fsdp_managed_params, fsdp_param_group_count
from powertrain.comm import Communicator
from powertrain.compress import (
    AllReduceCompressor,
    Compressor,
    make_compressor,
)
from powertrain.compress.base import placeholder
from powertrain.compress.deferred import run_deferred
from powertrain.ops.flat import shard_rows
from powertrain.ops.quantize import dequantize, pack_codes, quantize, unpack_codes

__all__ = [
    "CompressedReduceScatter",
    "QuantizedAllGather",
    "compress_gradients",
    "compress_replicas",
    "quantize_all_gather",
    "register_compressor",
]


def _trainable_shard0(module: FSDPModule, what: str) -> list[tuple[torch.nn.Parameter, torch.Size]]:
    """(sharded parameter, unsharded size) of each trainable parameter ``module`` manages, in its reduce-scatter's
    order; ValueError naming ``what`` for one not sharded on dim 0."""
    managed = [(p, size, dim) for p, size, dim in fsdp_managed_params(module) if p.requires_grad]
    for _, _, dim in managed:
        if dim != 0:
            raise ValueError(f"{what} supports Shard(0) parameters only, got Shard({dim})")
    return [(p, size) for p, size, _ in managed]


def _fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    mods: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise ValueError("No fully_shard module found in the model: call fully_shard(...) first")
    for m in mods:
        if fsdp_param_group_count(m) > 1:
            raise ValueError(f"{type(m).__name__} has several FSDP parameter groups; custom communication needs one")
    return mods


class CompressedReduceScatter(ReduceScatter):
    """Reduce-scatter of a flat ``(W, S)`` gradient buffer (FSDP2's layout: row ``r`` holds the padded dim-0
    chunk ``r`` of every parameter, in order) through a powertrain compressor. Serves one ``fully_shard``
    module (:meth:`~powertrain.fsdp.CompressedReduceScatter.for_module`) or one SimpleFSDP bucket.

    Args:
        compressor: what averages the gradients; built on the ranks of the reduce-scatter's group.
        params: the compressor's parameters (by identity) whose gradients the buffer holds, in its order.
        sizes: each one's unsharded size, as FSDP2 reduce-scatters it (its padded dim-0 chunks make the rows).
    """

    def __init__(self, compressor: Compressor, params: Sequence[torch.Tensor], sizes: list[torch.Size]) -> None:
        self.compressor = compressor
        self.sizes = sizes
        self.indices = compressor.indices_of(params)

    @classmethod
    def for_module(cls, compressor: Compressor, module: FSDPModule) -> CompressedReduceScatter:
        """The reduce-scatter of one ``fully_shard`` module: its trainable parameters, in FSDP2's order."""
        managed = _trainable_shard0(module, "Compressed reduce-scatter")
        return cls(compressor, [p for p, _ in managed], [size for _, size in managed])

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """What FSDP2 calls for the reduce-scatter's buffers: a plain uninitialised ``torch.empty`` on ``device``
        (no special memory needed)."""
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        comp = self.compressor
        if group.size() != comp.comm.world_size:
            raise RuntimeError(
                f"FSDP2 reduce-scatters over {group.size()} ranks but the compressor averages over "
                f"{comp.comm.world_size}: build it on the ranks FSDP2 shards over (group=mesh['dp'].get_group() on a "
                "(dp, tp) mesh)"
            )
        if isinstance(comp, AllReduceCompressor):
            return self._exact(output_tensor, input_tensor, group, op, async_op)
        world, rank = group.size(), group.rank()
        padded = [(shard_rows(s[0], world) * world, s) for s in self.sizes]
        chunk_numels = [p0 // world * s[1:].numel() for p0, s in padded]
        if sum(chunk_numels) * world != input_tensor.numel():
            raise RuntimeError(
                f"FSDP reduce-scatter input has {input_tensor.numel()} elements, expected {sum(chunk_numels) * world} "
                "for all trainable parameters of this module: a parameter got no gradient this step. Compressed "
                "FSDP needs every trainable parameter to get a gradient; mark unused ones requires_grad_(False)"
            )
        by_rank = input_tensor.view(world, -1)
        grads, offset = [], 0
        for (p0, size), c in zip(padded, chunk_numels, strict=True):
            full = by_rank[:, offset : offset + c].reshape(p0, *size[1:])
            grads.append(full[: size[0]])
            offset += c
        # This rank's rows of each gradient; PowerSGD computes only those rows of its approximation.
        rows = [(min(rank * (p0 // world), s[0]), min((rank + 1) * (p0 // world), s[0])) for p0, s in padded]
        averaged = run_deferred(comp, grads, self.indices, rows=rows)  # no host wait in backward
        scale = 1.0 if _is_avg(op) else float(world)  # SUM: FSDP divides afterwards
        offset = 0
        for (p0, size), c, avg, (lo, hi) in zip(padded, chunk_numels, averaged, rows, strict=True):
            mine = output_tensor[offset : offset + c].view(p0 // world, *size[1:])
            mine.zero_()  # padding rows
            if hi > lo:
                torch.mul(avg, scale, out=mine[: hi - lo])
            offset += c
        return None

    def _exact(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op: Any, async_op: bool
    ) -> dist.Work | None:
        comp = self.compressor
        assert isinstance(comp, AllReduceCompressor), "exact path"
        # gloo runs a reduce-scatter as an all-reduce of the whole input: count what it really sends.
        if comp.dtype == input.dtype:
            comp.comm.stats.record(input, "reduce_scatter")
            return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
        low_in = input.to(comp.dtype)
        low_out = torch.empty(output.shape, dtype=comp.dtype, device=output.device)
        if _is_avg(op) and comp.dtype == torch.float16:
            low_in.div_(group.size())  # fp16 could overflow in the sum
            op = dist.ReduceOp.SUM
        comp.comm.stats.record(low_in, "reduce_scatter")
        dist.reduce_scatter_tensor(low_out, low_in, op=op, group=group)
        output.copy_(low_out)
        return None


def _is_avg(op: Any) -> bool:
    return op == dist.ReduceOp.AVG or str(op).endswith("AVG")


def register_compressor(model: torch.nn.Module, compressor: Compressor) -> list[CompressedReduceScatter]:
    """Send ``model``'s FSDP2 gradient reduce-scatters through ``compressor`` (every ``fully_shard`` module).

    Args:
        model: a model on which ``fully_shard`` was applied (to the root and/or submodules).
        compressor: built from ``model.named_parameters()`` (the sharded DTensor parameters); one of
            AllReduceCompressor (fp32/bf16/fp16), PowerSGDCompressor, QuantizedCompressor.

    Returns:
        The installed reduce-scatters; the compressor holds all state (``compressor.state_dict()``).
    """
    check_supported(compressor, "FSDP2")
    comms = []
    for module in _fsdp_modules(model):
        rs = CompressedReduceScatter.for_module(compressor, module)
        module.set_custom_reduce_scatter(rs)
        comms.append(rs)
    covered = sorted(i for rs in comms for i in rs.indices)
    if covered != list(range(len(compressor.params))):
        raise ValueError(
            f"The compressor has {len(compressor.params)} parameters, the fully_shard modules manage {len(covered)} "
            "trainable ones; build the compressor from model.named_parameters() after fully_shard"
        )
    return comms


def check_supported(compressor: Compressor, where: str) -> None:
    """Raise a clear error for a compressor whose messages have no reduce-scatter form."""
    if not compressor.reduce_scatter:
        raise ValueError(
            f"{type(compressor).__name__} cannot run under {where}: its messages have no reduce-scatter form. "
            "Use PowerSGDCompressor, QuantizedCompressor (int8/int4) or AllReduceCompressor, or DDP for this one"
        )


class QuantizedAllGather(AllGather):
    """FSDP2 all-gather of sharded weights as ``bits``-bit integers with per-chunk float32 scales.

    Args:
        bits: 8 (the default) or 4.
        chunk: values per scale (>= 8); default 256.
    """

    def __init__(self, bits: int = 8, chunk: int = 256) -> None:
        if bits not in (4, 8):
            raise ValueError(f"Invalid bits={bits!r}: must be 4 or 8")
        check_int("chunk", chunk, 8)
        self.bits, self.chunk = bits, chunk
        self.comm = Communicator()  # FSDP2 passes the group with each call; this counts what they send

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """What FSDP2 calls for the all-gather's buffers: a plain uninitialised ``torch.empty`` on ``device`` (no
        special memory needed)."""
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        if not input_tensor.is_floating_point():
            raise RuntimeError(
                "Quantised all-gather needs one floating dtype for all parameters of a module, "
                f"got {input_tensor.dtype}"
            )
        world, n = group.size(), input_tensor.numel()
        codes, scales = quantize(input_tensor.view(-1), self.bits, self.chunk)  # nearest: weights get no feedback
        payload = pack_codes(codes, scales, self.bits)
        gathered = torch.empty((world, payload.numel()), dtype=torch.uint8, device=payload.device)
        self.comm.stats.record(payload, "all_gather")
        all_gather_single(gathered.view(-1), payload, group=group)
        out_rows = output_tensor.view(world, n)
        for r in range(world):
            c, s = unpack_codes(gathered[r], n, scales.numel(), self.bits)
            out_rows[r].copy_(dequantize(c, s, self.chunk))
        return None


def quantize_all_gather(model: torch.nn.Module, *, bits: int = 8, chunk: int = 256) -> QuantizedAllGather:
    """All-gather ``model``'s FSDP2-sharded weights quantised (QSDP); returns the shared all-gather.

    Args:
        model: a model with ``fully_shard`` applied; every ``fully_shard`` module gets the all-gather.
        bits: 8 (the default) or 4.
        chunk: values per float32 scale (>= 8); default 256.
    """
    ag = QuantizedAllGather(bits, chunk)
    for module in _fsdp_modules(model):
        module.set_custom_all_gather(ag)
    return ag


class _ReplicaAverage:
    """FSDP2's all-reduce hook of one ``fully_shard`` module: this rank's reduce-scatter output (each parameter's
    padded dim-0 chunk, in order) averaged over the replicas by the compressor, in place."""

    def __init__(self, compressor: Compressor, indices: list[int], shapes: list[torch.Size]) -> None:
        self.compressor, self.indices, self.shapes = compressor, indices, shapes
        self.numel = sum(s.numel() for s in shapes)

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if reduce_output.numel() != self.numel:
            raise RuntimeError(
                f"FSDP's reduce-scatter output has {reduce_output.numel()} elements, expected {self.numel} for all "
                "trainable parameters of this module: a parameter got no gradient this step. Compressed replicas "
                "need every trainable parameter to get a gradient; mark unused ones requires_grad_(False)"
            )
        views = [
            v.view(s) for v, s in zip(reduce_output.split([s.numel() for s in self.shapes]), self.shapes, strict=True)
        ]
        for v, a in zip(views, run_deferred(self.compressor, views, self.indices), strict=True):
            v.copy_(a)


def _on_placeholders(
    model: torch.nn.Module, what: str, shape: Callable[[torch.Tensor, torch.Size], torch.Size]
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[FSDPModule, int, list[torch.Size]]]]:
    """Placeholders of ``shape(param, unsharded size)`` for every trainable parameter of every ``fully_shard``
    module (named as the model names them), and per module its first placeholder's index and their shapes: what a
    compressor is built on when what FSDP2 hands it is not the parameters' own shape."""
    names = {id(p): n for n, p in model.named_parameters()}
    built: list[tuple[str, torch.Tensor]] = []
    layout = []
    for module in _fsdp_modules(model):
        first, shapes = len(built), []
        for p, size in _trainable_shard0(module, what):
            shapes.append(shape(p, size))
            built.append((names.get(id(p), f"param[{len(built)}]"), placeholder(shapes[-1], p)))
        layout.append((module, first, shapes))
    if len(built) != sum(1 for p in model.parameters() if p.requires_grad):
        raise ValueError(
            f"The fully_shard modules manage {len(built)} of the model's trainable parameters, not all: the others "
            f"would never be averaged; call fully_shard on the root too ({what} after fully_shard)"
        )
    return built, layout


def compress_gradients(
    model: torch.nn.Module, name: str = "powersgd", *, group: dist.ProcessGroup | None = None, **options: Any
) -> Compressor:
    """Send ``model``'s FSDP2 gradient reduce-scatters through compressor ``name`` (its ``options`` as for
    :func:`~powertrain.compress.make_compressor`), built on what FSDP2 reduces: every trainable parameter at its
    unsharded size on this rank. Without tensor parallelism that is the parameter's shape (as
    :func:`register_compressor` with a compressor built from ``model.named_parameters()``); under
    :func:`powertrain.tp.tensor_parallel` it is the rank's tensor-parallel block, which the parameters' global
    shapes do not describe. ``group``: the ranks FSDP2 shards over (``mesh["dp"].get_group()`` on a ``(dp, tp)``
    mesh; default the world). Returns the compressor; save its ``state_dict()`` with the model."""
    grads, layout = _on_placeholders(model, "compress_gradients", lambda p, size: size)
    compressor = make_compressor(name, grads, group=group, **options)
    check_supported(compressor, "FSDP2")
    for module, first, shapes in layout:
        rs = CompressedReduceScatter(compressor, compressor.params[first : first + len(shapes)], shapes)
        module.set_custom_reduce_scatter(rs)
    return compressor


def compress_replicas(
    model: torch.nn.Module, name: str = "powersgd", *, group: dist.ProcessGroup, **options: Any
) -> Compressor:
    """HSDP whose replicate dimension is compressed: average the shards of ``model`` (``fully_shard`` applied on the
    shard dimension of a ``(replicate, shard)`` mesh only) over ``group`` with compressor ``name`` (its ``options``
    as for :func:`~powertrain.compress.make_compressor`).

    ``group`` holds the ranks with the same shard: ``mesh["replicate"].get_group()``. The compressor is built on
    each rank's padded shard of every parameter and keeps its state (error buffers) per shard; save its
    ``state_dict()`` with the model. Returns it."""

    def shard(p: torch.Tensor, size: torch.Size) -> torch.Size:
        mesh: Any = p.device_mesh  # type: ignore[attr-defined]
        if mesh.ndim != 1:
            raise ValueError(
                "compress_replicas needs fully_shard on the shard dimension only (mesh['shard']): "
                "on a 2-D mesh FSDP2 all-reduces the replicas itself, uncompressed"
            )
        return torch.Size([shard_rows(size[0], mesh.size()), *size[1:]])

    shards, layout = _on_placeholders(model, "compress_replicas", shard)
    compressor = make_compressor(name, shards, group=group, **options)
    for module, first, shapes in layout:
        module.set_all_reduce_hook(_ReplicaAverage(compressor, list(range(first, first + len(shapes))), shapes))
    return compressor
