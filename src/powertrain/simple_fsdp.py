"""SimpleFSDP: data parallelism from a parametrization and DTensor (Zhang et al., arXiv 2411.00284).

Every parameter is stored as a DTensor on the data-parallel mesh: sharded on dim 0 (``fully_shard``),
replicated (``replicate``, i.e. DDP) or both (``hybrid_shard`` on a 2-D mesh: replicate across dim 0,
shard across dim 1). Reading ``module.weight`` in forward goes through a parametrization that
``redistribute``s the stored DTensor to Replicate (an all-gather, after casting the shard to the compute
dtype) and hands the module a plain tensor whose gradient is marked Partial, so autograd runs the matching
reduction in backward (reduce-scatter for Shard, all-reduce for Replicate, in the reduce dtype). Because
this is ordinary PyTorch, ``torch.compile`` traces compute and communication in one graph.

Reshard after forward (``reshard_after_forward=True``, the default: gathered parameters are freed after
forward and gathered again in backward, eager and compiled) and eager bucketing (``buckets=[...]``: one
all-gather and one reduce-scatter per listed module, where compressors plug in) both wrap module forwards. They
live in ``powertrain._simple_fsdp_buckets``, below this module (it does not import it); import
:func:`checkpoint_gathers`, :func:`register_compressor` and :func:`quantize_all_gather` from here.

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
from collections.abc import Callable, Container, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from powertrain._compat import inductor_has_configs, redistribute
from powertrain._simple_fsdp_buckets import (
    bucket_owners,
    checkpoint_gathers,
    make_bucket,
    quantize_all_gather,
    register_compressor,
)

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
            raise RuntimeError(
                f"SimpleFSDP expected a DTensor parameter, got {type(stored).__name__}: "
                "was it replaced after data_parallel()?"
            )
        ndim = self.mesh.ndim
        full = redistribute(stored, [Replicate()] * ndim, self.param_dtype, self.reduce_dtype)
        # The gradient of the gathered weight is each rank's partial sum: averaged (all-reduce or
        # reduce-scatter) when autograd moves it back to the stored placement.
        return full.to_local(grad_placements=[Partial("avg")] * ndim)


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


def _param_names(module: nn.Module) -> tuple[str, ...]:
    return tuple(n for n, p in module.named_parameters(recurse=False) if p is not None)


def _swap_class(module: nn.Module, names: tuple[str, ...], gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Give ``module`` a subclass whose attribute ``name``, for each of ``names``, returns ``gather`` of the stored
    parameter; ``gather`` stays on the module as ``_simple_fsdp_gather`` (how buckets and RTP find it)."""
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
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"Invalid mesh={mesh!r}: pass a DeviceMesh (torch.distributed.device_mesh.init_device_mesh)")
    placements = _placements(mode, mesh)
    _check_policy(mp_policy)
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"Invalid reshard_after_forward={reshard_after_forward!r}: must be True or False")
    policy = mp_policy or MixedPrecisionPolicy()
    owners = bucket_owners(model, buckets, mode)
    plain = _parametrize(model, mesh, placements, policy, bucketed=owners)
    if reshard_after_forward and mode != "replicate":
        for module in plain:
            checkpoint_gathers(module)
    for owner in buckets:
        bucket = make_bucket(owner, owners, mesh, policy, reshard_after_forward)
        for member in bucket.members:
            if names := _param_names(member):
                _swap_class(member, names, bucket)
    if policy.param_dtype is not None and policy.cast_forward_inputs:
        model.register_forward_pre_hook(functools.partial(_cast_inputs, policy.param_dtype), with_kwargs=True)
    return model


def _parametrize(
    model: nn.Module,
    mesh: DeviceMesh,
    placements: Sequence[Replicate | Shard],
    policy: MixedPrecisionPolicy | None = None,
    *,
    bucketed: Container[int] = (),
    allow_meta: bool = False,
) -> list[nn.Module]:
    """Steps 1 and 2 of :func:`data_parallel`, except the class swap of the modules whose ids are in ``bucketed``
    (their bucket is their parametrization); returns the modules it swapped. ``allow_meta``: parameters on the
    meta device become DTensors on meta (RTP builds on them; the caller allocates with ``to_empty``)."""
    if is_simple_fsdp(model):
        raise ValueError("data_parallel() was already applied to this model (or one of its submodules)")
    policy = policy or MixedPrecisionPolicy()
    gather = _Gather(mesh, policy.param_dtype, policy.reduce_dtype)
    done: dict[int, nn.Parameter] = {}
    swapped = []
    for mod_name, module in model.named_modules():
        names = _param_names(module)
        if not names:
            continue
        for n in names:
            p = module._parameters[n]
            assert p is not None, "filtered above"
            if isinstance(p, DTensor):
                raise ValueError(
                    f"Parameter {mod_name}.{n} is already a DTensor (fully_shard or tensor parallel?): "
                    "SimpleFSDP takes plain parameters"
                )
            if p.device.type != mesh.device_type and not (allow_meta and p.is_meta):
                raise ValueError(
                    f"Parameter {mod_name}.{n} is on {p.device}, the mesh on {mesh.device_type}: "
                    "move the model to the mesh's device first"
                )
            if id(p) not in done:
                dt = distribute_tensor(p.detach(), mesh, placements)
                done[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            module._parameters[n] = done[id(p)]
        if id(module) not in bucketed:
            _swap_class(module, names, gather)
            swapped.append(module)
    return swapped


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
        raise ValueError(
            f"Invalid mp_policy output_dtype={policy.output_dtype!r}: SimpleFSDP does not cast outputs; leave it None"
        )


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return torch.utils._pytree.tree_map(cast, (args, kwargs))


def compile_model(model: nn.Module, *, bucket: bool = True, **kwargs: Any) -> Any:
    """``torch.compile(model, fullgraph=True)`` for a SimpleFSDP ``model`` (as :func:`data_parallel` returns it),
    with inductor's FSDP bucketing of the per-parameter all-gathers and reduce-scatters into a few large collectives
    when ``bucket`` (the default; per compile, through ``options``: no global config is changed): fewer, larger
    collectives, each with its fixed cost paid once (tools/bench_simple_fsdp.py measures both). Torch versions
    without the bucketing passes compile without them (with a warning).
    ``kwargs`` go to ``torch.compile``."""
    options = dict(kwargs.pop("options", None) or {})
    if bucket:
        names = ("bucket_all_gathers_fx", "bucket_reduce_scatters_fx")
        if inductor_has_configs(*names):
            options.update({n: "fsdp" for n in names})
        else:
            warnings.warn("this torch has no inductor collective bucketing: compiling without it", stacklevel=2)
    return torch.compile(model, fullgraph=True, options=options or None, **kwargs)
