"""SimpleFSDP: data parallelism from a parametrization and DTensor (Zhang et al., arXiv 2411.00284).

Every parameter is stored as a DTensor on the data-parallel mesh: sharded on dim 0 (``fully_shard``),
replicated (``replicate``, i.e. DDP) or both (``hybrid_shard`` on a 2-D mesh: replicate across dim 0,
shard across dim 1). Reading ``module.weight`` in forward goes through a parametrization that
``redistribute``s the stored DTensor to Replicate (an all-gather, after casting the shard to the compute
dtype) and hands the module a plain tensor whose gradient is marked Partial, so autograd runs the matching
reduction in backward (reduce-scatter for Shard, all-reduce for Replicate, in the reduce dtype). Because
this is ordinary PyTorch, ``torch.compile`` traces compute and communication in one graph.

Reshard after forward (``reshard_after_forward=True``, the default: gathered parameters are freed after
forward and gathered again in backward) is one mechanism for eager and compiled runs: each module that
owns parameters runs its forward under a selective activation checkpoint whose policy recomputes the
collectives (and views of them) and saves every other op's output, so no compute is repeated. Eagerly,
autograd then holds no gathered weight; under ``torch.compile`` the same policy becomes recompute tags on
the joint graph, which the min-cut partitioner honours. What each mode holds between forward and backward is
measured by ``powertrain bench simple_fsdp`` (BENCHMARKS.md). Because the tags are part of the traced graph, an
AOTAutograd cache hit cannot drop them (a separate joint-graph pass could be skipped).

Design note: the parametrization is installed by giving each module a subclass with one property per
parameter (as in the paper's implementation) rather than ``torch.nn.utils.parametrize``, which renames
parameters to ``parametrizations.<name>.original``: with properties, ``state_dict`` keys are the model's own,
so DCP checkpoints load across DDP, FSDP2 and SimpleFSDP, and ``state_dict`` reads the stored DTensors
without communication.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from powertrain._compat import funcol_all_gather, funcol_reduce_scatter_avg, inductor_has_configs, redistribute
from powertrain.compress import Compressor
from powertrain.fsdp import CompressedReduceScatter, QuantizedAllGather, check_supported
from powertrain.ops.flat import shard_rows

__all__ = [
    "checkpoint_gathers",
    "compile_model",
    "data_parallel",
    "is_simple_fsdp",
    "quantize_all_gather",
    "register_compressor",
]

Mode = Literal["replicate", "fully_shard", "hybrid_shard"]
_MODES = ("replicate", "fully_shard", "hybrid_shard")


@dataclasses.dataclass(frozen=True)
class _Gather:
    """How one parameter is made whole for compute (the parametrization)."""

    mesh: DeviceMesh
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None

    def __call__(self, stored: torch.Tensor) -> torch.Tensor:
        if not isinstance(stored, DTensor):
            raise RuntimeError(f"SimpleFSDP expected a DTensor parameter, got {type(stored).__name__}: "
                               "was it replaced after data_parallel()?")  # fmt: skip
        ndim = self.mesh.ndim
        full = redistribute(stored, [Replicate()] * ndim, self.param_dtype, self.reduce_dtype)
        # The gradient of the gathered weight is each rank's partial sum: averaged (all-reduce or
        # reduce-scatter) when autograd moves it back to the stored placement.
        return full.to_local(grad_placements=[Partial("avg")] * ndim)


class _Bucket:
    """Several fully sharded parameters gathered by one all-gather and reduced by one reduce-scatter (eager
    bucketing). Layout as FSDP2's: row ``r`` of the ``(W, S)`` buffer holds rank ``r``'s dim-0 chunk of every
    parameter, each padded to ``ceil(rows / W)`` rows, in parameter order."""

    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
        self.params, self.mesh, self.policy = params, mesh, policy
        self.world = mesh.size()
        self.chunk_rows = [shard_rows(p.shape[0], self.world) for p in params]
        self.cached: dict[int, torch.Tensor] = {}
        self.reduce_scatter: CompressedReduceScatter | None = None  # register_compressor
        self.all_gather: QuantizedAllGather | None = None  # quantize_all_gather

    def get(self, stored: torch.Tensor) -> torch.Tensor:
        if not self.cached:  # first read in this forward: gather the whole bucket
            shards = [p.to_local() for p in self.params]  # type: ignore[attr-defined]
            full = _BucketGather.apply(self, *shards)
            self.cached = {id(p): t for p, t in zip(self.params, full, strict=True)}
        return self.cached[id(stored)]

    def clear(self) -> None:
        self.cached = {}


class _BucketGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, bucket: _Bucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
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
        bucket: _Bucket = ctx.bucket
        dtype = bucket.policy.reduce_dtype or bucket.policy.param_dtype or bucket.params[0].dtype
        per_rank = []
        # Frozen parameters are gathered with the others but have no gradient to reduce (FSDP2's layout).
        reduced = [
            (p, c, g) for p, c, g in zip(bucket.params, bucket.chunk_rows, grads, strict=True) if p.requires_grad
        ]
        for p, c, g in reduced:
            g = torch.zeros(p.shape, dtype=dtype) if g is None else g.to(dtype)
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


def _buckets(model: nn.Module) -> list[_Bucket]:
    found: dict[int, _Bucket] = {}
    for m in model.modules():
        member = getattr(m, "_simple_fsdp_gather", None)
        if isinstance(member, _BucketMember):
            found[id(member.bucket)] = member.bucket
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
    """All-gather the weights of ``model``'s SimpleFSDP buckets as ``bits``-bit integers with per-chunk
    scales (QSDP), as :func:`powertrain.fsdp.quantize_all_gather` does for FSDP2; master weights stay exact.
    Returns the shared all-gather (its ``comm.stats`` count what it sent)."""
    gather = QuantizedAllGather(bits, chunk)
    for bucket in _buckets(model):
        if bucket.policy.param_dtype not in (None, torch.float32):
            raise ValueError("quantize_all_gather needs fp32 gathered weights (no param_dtype)")
        bucket.all_gather = gather
    return gather


@dataclasses.dataclass(frozen=True)
class _BucketMember:
    """The parametrization of a module whose parameters belong to a bucket."""

    bucket: _Bucket

    def __call__(self, stored: torch.Tensor) -> torch.Tensor:
        return self.bucket.get(stored)


def _placements(mode: Mode, mesh: DeviceMesh) -> tuple[Replicate | Shard, ...]:
    match mode:
        case "replicate" if mesh.ndim == 1:
            return (Replicate(),)
        case "fully_shard" if mesh.ndim == 1:
            return (Shard(0),)
        case "hybrid_shard" if mesh.ndim == 2:
            return (Replicate(), Shard(0))
    if mode not in _MODES:
        raise ValueError(f"Invalid mode={mode!r}: choose one of {', '.join(_MODES)}")
    want = "a 2-D mesh (replicate, shard)" if mode == "hybrid_shard" else "a 1-D mesh"
    raise ValueError(f"mode={mode!r} needs {want}, got a {mesh.ndim}-D mesh {tuple(mesh.shape)}")


_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _swap_class(module: nn.Module, names: tuple[str, ...], gather: _Gather | _BucketMember) -> None:
    module._simple_fsdp_gather = gather  # type: ignore[assignment]
    key = (type(module), names)
    if key not in _CLASSES:

        def prop(name: str) -> property:
            return property(lambda self: self._simple_fsdp_gather(self._parameters[name]))

        _CLASSES[key] = type(f"SimpleFSDP{type(module).__name__}", (type(module),), {n: prop(n) for n in names})
    module.__class__ = _CLASSES[key]


def is_simple_fsdp(module: nn.Module) -> bool:
    """Whether ``data_parallel`` has been applied to ``module`` (or any of its submodules)."""
    return any(hasattr(m, "_simple_fsdp_gather") for m in module.modules())


def data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mode: Mode = "fully_shard",
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    buckets: Sequence[nn.Module] = (),
) -> nn.Module:
    """Make ``model`` data parallel over ``mesh`` the SimpleFSDP way, in place; returns ``model``.

    Args:
        model: a module whose parameters are ordinary tensors on ``mesh``'s device type, identical on
            every rank (they are sharded from each rank's own copy: seed the initialisation).
        mesh: 1-D for ``replicate`` and ``fully_shard``, 2-D (replicate, shard) for ``hybrid_shard``.
        mode: ``replicate`` (DDP: all-reduce), ``fully_shard`` (FSDP: all-gather / reduce-scatter along
            dim 0; shapes need not divide the mesh size) or ``hybrid_shard`` (HSDP).
        mp_policy: compute / reduce dtypes; the stored (master) parameters keep their dtype.
        reshard_after_forward: free gathered parameters after forward and gather them again in backward
            (:func:`checkpoint_gathers` on every module that owns parameters); False keeps them from forward
            to backward (less communication, more memory). No effect for ``replicate``.
        buckets: eager bucketing (``fully_shard`` only): each listed module's parameters, except those of
            listed modules inside it, share one all-gather and one reduce-scatter, like a ``fully_shard``
            unit of FSDP2 (e.g. ``[*model.blocks, model]``). A bucket that contains other buckets (the root)
            is not resharded after forward, as in FSDP2. Compiled runs need none (:func:`compile_model`).

    Steps:
        1. Each parameter becomes an ``nn.Parameter`` holding a DTensor with the mode's placements
           (parameters shared between modules stay shared).
        2. Each module with parameters gets a subclass whose attribute of the same name gathers it.
        3. With ``reshard_after_forward``, those modules' forwards recompute the gathers in backward.

    The optimizer must be created afterwards, on ``model.parameters()`` (the DTensors).
    """
    return _data_parallel(model, mesh, mode=mode, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                          buckets=buckets)  # fmt: skip


def _data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mode: Mode = "fully_shard",
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    buckets: Sequence[nn.Module] = (),
    allow_meta: bool = False,
) -> nn.Module:
    """:func:`data_parallel`; ``allow_meta``: parameters on the meta device become DTensors on meta (RTP builds
    on them; the caller allocates with ``to_empty``)."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"Invalid mesh={mesh!r}: pass a DeviceMesh (torch.distributed.device_mesh.init_device_mesh)")
    placements = _placements(mode, mesh)
    _check_policy(mp_policy)
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"Invalid reshard_after_forward={reshard_after_forward!r}: must be True or False")
    if is_simple_fsdp(model):
        raise ValueError("data_parallel() was already applied to this model (or one of its submodules)")
    policy = mp_policy or MixedPrecisionPolicy()
    gather = _Gather(mesh, policy.param_dtype, policy.reduce_dtype)
    owners = _bucket_owners(model, buckets, mode)
    done: dict[int, nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        names = tuple(n for n, p in module.named_parameters(recurse=False) if p is not None)
        if not names:
            continue
        for n in names:
            p = module._parameters[n]
            assert p is not None, "filtered above"
            if isinstance(p, DTensor):
                raise ValueError(f"Parameter {mod_name}.{n} is already a DTensor (fully_shard or tensor parallel?): "
                                 "SimpleFSDP takes plain parameters")  # fmt: skip
            if p.device.type != mesh.device_type and not (allow_meta and p.is_meta):
                raise ValueError(f"Parameter {mod_name}.{n} is on {p.device}, the mesh on {mesh.device_type}: "
                                 "move the model to the mesh's device first")  # fmt: skip
            if id(p) not in done:
                dt = distribute_tensor(p.detach(), mesh, placements)
                done[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            module._parameters[n] = done[id(p)]
        if id(module) in owners:
            continue  # parametrized with its bucket, below
        _swap_class(module, names, gather)
        if reshard_after_forward and mode != "replicate":
            checkpoint_gathers(module)
    for owner in buckets:
        _make_bucket(owner, owners, mesh, policy, reshard_after_forward)
    if policy.param_dtype is not None and policy.cast_forward_inputs:
        model.register_forward_pre_hook(functools.partial(_cast_inputs, policy.param_dtype), with_kwargs=True)
    return model


def _check_policy(policy: object) -> None:
    """FSDP2's own :class:`MixedPrecisionPolicy`, with floating dtypes, and no ``output_dtype`` (SimpleFSDP does
    not cast outputs)."""
    if policy is None:
        return
    if not isinstance(policy, MixedPrecisionPolicy):
        raise ValueError(f"Invalid mp_policy={policy!r}: use torch.distributed.fsdp.MixedPrecisionPolicy")
    for name in ("param_dtype", "reduce_dtype"):
        value = getattr(policy, name)
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise ValueError(f"Invalid mp_policy {name}={value!r}: must be a floating torch.dtype or None")
    if policy.output_dtype is not None:
        raise ValueError(f"Invalid mp_policy output_dtype={policy.output_dtype!r}: SimpleFSDP does not cast outputs; "
                         "leave it None")  # fmt: skip


def _bucket_owners(model: nn.Module, buckets: Sequence[nn.Module], mode: Mode) -> dict[int, nn.Module]:
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


def _make_bucket(owner: nn.Module, owners: dict[int, nn.Module], mesh: DeviceMesh, policy: MixedPrecisionPolicy,
                 reshard: bool) -> None:  # fmt: skip
    members = [m for m in _post_order(owner) if owners.get(id(m)) is owner]
    params: list[nn.Parameter] = []
    for m in members:  # children before their parent: FSDP2's order, so buffers match it element for element
        for p in m.parameters(recurse=False):
            if all(p is not q for q in params):
                params.append(p)
    if not any(p.requires_grad for p in params):
        raise ValueError(f"Bucket {type(owner).__name__} has no trainable parameters of its own")
    bucket = _Bucket(params, mesh, policy)
    member = _BucketMember(bucket)
    for m in members:
        names = tuple(n for n, p in m.named_parameters(recurse=False) if p is not None)
        if names:
            _swap_class(m, names, member)
    nested = any(owners.get(id(m)) is not owner for m in owner.modules())
    inner = owner.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        bucket.clear()  # gather afresh in every forward (and in its recomputation)
        try:
            return inner(*args, **kwargs)
        finally:
            bucket.clear()  # the cache must not keep the gathered weights alive

    owner.forward = forward
    if reshard and not nested:
        checkpoint_gathers(owner)


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return torch.utils._pytree.tree_map(cast, (args, kwargs))


# -- reshard after forward ---------------------------------------------------------------------------------

_COLLECTIVES = ("_c10d_functional.", "c10d_functional.")


def _is_collective(op: Any) -> bool:
    name = str(op)
    return any(name.startswith(c) for c in _COLLECTIVES)


_SAVE = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution", "aten._scaled_dot_product",
         "aten.native_layer_norm", "aten.embedding")  # fmt: skip


def _recompute_collectives(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective-checkpoint policy: save the outputs of expensive ops (matmuls, convolutions, attention,
    norms), recompute the rest, collectives included. Saving everything would also keep intermediates that
    autograd frees (a linear's product before its bias), which costs more memory than the gathers save."""
    from torch.utils.checkpoint import CheckpointPolicy

    if _is_collective(op):
        return CheckpointPolicy.MUST_RECOMPUTE
    name = str(op)
    if any(name.startswith(s) for s in _SAVE):
        return CheckpointPolicy.PREFER_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_gathers(module: nn.Module) -> nn.Module:
    """Eager reshard-after-forward for ``module``, in place: its forward runs under a selective activation
    checkpoint that keeps every op's output for backward except the collectives' (and views of them), so
    gathered parameters are freed after forward and gathered again in backward. Compute is not repeated.
    Returns ``module``."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    inner = module.forward
    context = functools.partial(create_selective_checkpoint_contexts, _recompute_collectives)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context, **kwargs)

    module.forward = forward
    return module


def compile_model(model: nn.Module, *, bucket: bool = True, **kwargs: Any) -> Any:
    """``torch.compile(model, fullgraph=True)`` for a SimpleFSDP model, with inductor's FSDP bucketing of the
    per-parameter all-gathers and reduce-scatters into a few large collectives when ``bucket`` (per compile,
    through ``options``: no global config is changed): fewer, larger collectives, each with its fixed cost paid
    once (``powertrain bench simple_fsdp`` measures both). Torch versions without the bucketing passes compile
    without them (with a warning).
    ``kwargs`` go to ``torch.compile``."""
    options = dict(kwargs.pop("options", None) or {})
    if bucket:
        names = ("bucket_all_gathers_fx", "bucket_reduce_scatters_fx")
        if inductor_has_configs(*names):
            options.update({n: "fsdp" for n in names})
        else:
            warnings.warn("this torch has no inductor collective bucketing: compiling without it", stacklevel=2)
    return torch.compile(model, fullgraph=True, options=options or None, **kwargs)
