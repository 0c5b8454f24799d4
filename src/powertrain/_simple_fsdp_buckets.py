"""SimpleFSDP's eager bucketing and reshard after forward: what :func:`powertrain.simple_fsdp.data_parallel`
does around a module's forward. Import the public names from :mod:`powertrain.simple_fsdp`.

Buckets (``data_parallel(..., buckets=[...])``): the parameters of a listed module (and of its submodules that
are not listed themselves) share one all-gather and one reduce-scatter, in FSDP2's buffer layout, so a
``fully_shard`` unit's compressed reduce-scatter and quantized all-gather (:mod:`powertrain.fsdp`) run on them
unchanged. A bucket is its members' parametrization: the first parameter read in a forward gathers the whole
bucket, later reads take their tensor from that cache, and the owner's forward empties the cache on the way out.

Reshard after forward: each module that owns parameters runs its forward under a selective activation checkpoint
whose policy recomputes the collectives (and views of them) and saves every other op's output, so no compute is
repeated. Eagerly, autograd then holds no gathered weight; under ``torch.compile`` the same policy becomes
recompute tags on the joint graph, which the min-cut partitioner honours: one mechanism for eager and compiled
runs. What each mode holds between forward and backward is measured by tools/bench_simple_fsdp.py
(BENCHMARKS.md). Because the tags are part of the traced graph, an AOTAutograd cache hit cannot drop them (a
separate joint-graph pass could be skipped).

Both replace ``module.forward``, in one place (:func:`_wrap_forward`): a resharded bucket owner's checkpoint
recomputes the gathers of a freshly emptied cache in backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from powertrain._compat import funcol_all_gather, funcol_reduce_scatter_avg
from powertrain.compress import Compressor
from powertrain.fsdp import CompressedReduceScatter, QuantizedAllGather, check_supported
from powertrain.ops.flat import shard_rows

__all__ = ["checkpoint_gathers", "quantize_all_gather", "register_compressor"]


class Bucket:
    """Several fully sharded parameters gathered by one all-gather and reduced by one reduce-scatter, and the
    parametrization of the modules that hold them (``members``). Layout as FSDP2's: row ``r`` of the ``(W, S)``
    buffer holds rank ``r``'s dim-0 chunk of every parameter, each padded to ``ceil(rows / W)`` rows, in
    parameter order."""

    def __init__(
        self, params: list[nn.Parameter], members: list[nn.Module], mesh: DeviceMesh, policy: MixedPrecisionPolicy
    ) -> None:
        self.params, self.members, self.mesh, self.policy = params, members, mesh, policy
        self.world = mesh.size()
        self.chunk_rows = [shard_rows(p.shape[0], self.world) for p in params]
        self.cached: dict[int, torch.Tensor] = {}
        self.reduce_scatter: CompressedReduceScatter | None = None  # register_compressor
        self.all_gather: QuantizedAllGather | None = None  # quantize_all_gather

    def __call__(self, stored: torch.Tensor) -> torch.Tensor:
        if not self.cached:  # first read in this forward: gather the whole bucket
            shards = [p.to_local() for p in self.params]  # type: ignore[attr-defined]
            full = _BucketGather.apply(self, *shards)
            self.cached = {id(p): t for p, t in zip(self.params, full, strict=True)}
        return self.cached[id(stored)]

    def clear(self) -> None:
        self.cached = {}


class _BucketGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, bucket: Bucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.bucket = bucket
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (see backward)
        ctx.local_rows = [t.shape[0] for t in shards]
        dtype = bucket.policy.param_dtype or shards[0].dtype
        padded = [_pad_rows(t.to(dtype), c).reshape(-1) for t, c in zip(shards, bucket.chunk_rows, strict=True)]
        flat = torch.cat(padded)
        if bucket.all_gather is not None:
            rows = flat.new_empty(bucket.world, flat.numel())
            bucket.all_gather(rows.view(-1), flat, bucket.mesh.get_group())
        else:
            rows = funcol_all_gather(flat, bucket.mesh).view(bucket.world, -1)
        out, offset = [], 0
        for p, c in zip(bucket.params, bucket.chunk_rows, strict=True):
            inner = p.shape[1:]
            n = c * inner.numel()
            full = rows[:, offset : offset + n].reshape(bucket.world * c, *inner)[: p.shape[0]]
            out.append(full.contiguous())
            offset += n
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        bucket: Bucket = ctx.bucket
        dtype = bucket.policy.reduce_dtype or bucket.policy.param_dtype or bucket.params[0].dtype
        per_rank = []
        # Frozen parameters are gathered with the others but have no gradient to reduce (FSDP2's layout).
        reduced = [
            (p, c, g) for p, c, g in zip(bucket.params, bucket.chunk_rows, grads, strict=True) if p.requires_grad
        ]
        for p, c, g in reduced:
            g = torch.zeros(p.shape, dtype=dtype, device=p.to_local().device) if g is None else g.to(dtype)  # type: ignore[attr-defined]
            per_rank.append(_pad_rows(g, bucket.world * c).reshape(bucket.world, -1))
        buf = torch.cat(per_rank, dim=1).reshape(-1)
        if bucket.reduce_scatter is not None:
            mine = buf.new_empty(buf.numel() // bucket.world)
            bucket.reduce_scatter(mine, buf, bucket.mesh.get_group(), dist.ReduceOp.AVG)
        else:
            mine = funcol_reduce_scatter_avg(buf, bucket.mesh)
        out: list[torch.Tensor | None] = []
        offset = 0
        for p, c, local, g in zip(bucket.params, bucket.chunk_rows, ctx.local_rows, grads, strict=True):
            if not p.requires_grad:
                out.append(None)
                continue
            n = c * p.shape[1:].numel()
            # A parameter this rank did not use keeps grad None (as in FSDP2), so the optimizer skips it.
            out.append(None if g is None else mine[offset : offset + n].view(c, *p.shape[1:])[:local].to(p.dtype))
            offset += n
        return (None, *out)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def bucket_owners(model: nn.Module, buckets: Sequence[nn.Module], mode: str) -> dict[int, nn.Module]:
    """Map every module whose parameters go into a bucket to its bucket's module (validating ``buckets``)."""
    buckets = list(buckets)
    if not buckets:
        return {}
    if mode != "fully_shard":
        raise ValueError(f"buckets need mode='fully_shard', got mode={mode!r}")
    inside = {id(m) for m in model.modules()}
    for b in buckets:
        if not isinstance(b, nn.Module) or id(b) not in inside:
            raise ValueError(f"Invalid bucket {type(b).__name__}: buckets must be submodules of the model")
    if len({id(b) for b in buckets}) != len(buckets):
        raise ValueError("A module is listed twice in buckets")
    listed = {id(b) for b in buckets}
    owners: dict[int, nn.Module] = {}

    def visit(module: nn.Module, owner: nn.Module | None) -> None:
        owner = module if id(module) in listed else owner
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(model, None)
    return owners


def _post_order(module: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    for child in module.children():
        out.extend(_post_order(child))
    out.append(module)
    return out


def make_bucket(
    owner: nn.Module, owners: dict[int, nn.Module], mesh: DeviceMesh, policy: MixedPrecisionPolicy, reshard: bool
) -> Bucket:
    """The bucket of ``owner`` (``owners`` from :func:`bucket_owners`, parameters already DTensors), with
    ``owner``'s forward wrapped; the caller makes it the parametrization of its ``members``. A bucket that
    contains other buckets (the root) is not resharded after forward, as in FSDP2."""
    members = [m for m in _post_order(owner) if owners.get(id(m)) is owner]
    params: list[nn.Parameter] = []
    for m in members:  # children before their parent: FSDP2's order, so buffers match it element for element
        for p in m.parameters(recurse=False):
            if all(p is not q for q in params):
                params.append(p)
    if not any(p.requires_grad for p in params):
        raise ValueError(f"Bucket {type(owner).__name__} has no trainable parameters of its own")
    bucket = Bucket(params, members, mesh, policy)
    nested = any(owners.get(id(m)) is not owner for m in owner.modules())
    _wrap_forward(owner, bucket=bucket, reshard=reshard and not nested)
    return bucket


def _buckets(model: nn.Module) -> list[Bucket]:
    found: dict[int, Bucket] = {}
    for m in model.modules():
        # the parametrization powertrain.simple_fsdp's class swap stores on every module it parametrizes
        gather = getattr(m, "_simple_fsdp_gather", None)
        if isinstance(gather, Bucket):
            found[id(gather)] = gather
    if not found:
        raise ValueError("No SimpleFSDP buckets in this model: call data_parallel(..., buckets=[...]) first")
    return list(found.values())


def register_compressor(model: nn.Module, compressor: Compressor) -> list[CompressedReduceScatter]:
    """Reduce the gradients of ``model``'s SimpleFSDP buckets through ``compressor`` (built from
    ``model.named_parameters()`` after :func:`data_parallel`): the same compressed reduce-scatter as
    :func:`powertrain.fsdp.register_compressor` (exact, powersgd, int8, int4), with error feedback on each
    rank's full local gradient. Every trainable parameter must be in a bucket (``buckets=[*blocks, model]``).

    Returns:
        The installed reduce-scatters, one per bucket; the compressor holds all state
        (``compressor.state_dict()``).
    """
    if not isinstance(compressor, Compressor):
        raise ValueError(f"register_compressor needs a powertrain Compressor, got {type(compressor).__name__}")
    check_supported(compressor, "SimpleFSDP")
    comms = []
    for bucket in _buckets(model):
        trainable = [p for p in bucket.params if p.requires_grad]
        comms.append(CompressedReduceScatter(compressor, trainable, [p.shape for p in trainable]))
    covered = sorted(i for rs in comms for i in rs.indices)
    if covered != list(range(len(compressor.params))):
        raise ValueError(
            f"The compressor has {len(compressor.params)} parameters, the SimpleFSDP buckets hold {len(covered)} "
            "trainable ones: put every module's parameters in a bucket (buckets=[*model.blocks, model]) and build "
            "the compressor from model.named_parameters() after data_parallel"
        )
    for bucket, rs in zip(_buckets(model), comms, strict=True):
        bucket.reduce_scatter = rs
    return comms


def quantize_all_gather(model: nn.Module, *, bits: int = 8, chunk: int = 256) -> QuantizedAllGather:
    """All-gather the weights of ``model``'s SimpleFSDP buckets as ``bits``-bit integers (8, the default, or 4)
    with a float32 scale per ``chunk`` values (>= 8; default 256): QSDP, as :func:`powertrain.fsdp.quantize_all_gather`
    does for FSDP2; master weights stay exact. Returns the shared all-gather (its ``comm.stats`` count what it sent)."""
    gather = QuantizedAllGather(bits, chunk)
    for bucket in _buckets(model):
        if bucket.policy.param_dtype not in (None, torch.float32):
            raise ValueError("quantize_all_gather needs fp32 gathered weights (no param_dtype)")
        bucket.all_gather = gather
    return gather


# -- reshard after forward ---------------------------------------------------------------------------------

_COLLECTIVES = ("_c10d_functional.", "c10d_functional.")
_SAVE = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten.convolution",
    "aten._scaled_dot_product",
    "aten.native_layer_norm",
    "aten.embedding",
)


def _recompute_collectives(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy: save the outputs of expensive ops (matmuls, convolutions, attention,
    norms), recompute the rest, collectives included. Saving everything would also keep intermediates that
    autograd frees (a linear's product before its bias), which costs more memory than the gathers save."""
    name = str(op)
    if name.startswith(_COLLECTIVES):
        return CheckpointPolicy.MUST_RECOMPUTE
    if name.startswith(_SAVE):
        return CheckpointPolicy.PREFER_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_gathers(module: nn.Module) -> nn.Module:
    """Eager reshard-after-forward for ``module``, in place: its forward runs under a selective activation
    checkpoint that keeps every op's output for backward except the collectives' (and views of them), so
    gathered parameters are freed after forward and gathered again in backward. Compute is not repeated.
    Returns ``module``."""
    _wrap_forward(module, reshard=True)
    return module


def _wrap_forward(module: nn.Module, *, bucket: Bucket | None = None, reshard: bool = False) -> None:
    """Replace ``module.forward``: with ``bucket``, each call gathers the bucket afresh and empties its cache on
    the way out; with ``reshard``, the call (cache handling included) runs under the collective-recomputing
    checkpoint whenever autograd records."""
    run = module.forward
    if bucket is not None:
        run = _clearing(bucket, run)
    if reshard:
        run = _checkpointed(run)
    module.forward = run


def _clearing(bucket: Bucket, inner: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        bucket.clear()  # gather afresh in every forward (and in its recomputation)
        try:
            return inner(*args, **kwargs)
        finally:
            bucket.clear()  # the cache must not keep the gathered weights alive

    return forward


def _checkpointed(inner: Callable[..., Any]) -> Callable[..., Any]:
    context = functools.partial(create_selective_checkpoint_contexts, _recompute_collectives)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context, **kwargs)

    return forward
