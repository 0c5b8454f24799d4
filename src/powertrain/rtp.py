"""Rotated tensor parallelism (RTP): Luo, Zhong, Fox, "RTP: Rethinking Tensor Parallelism with Memory
Deduplication", arXiv 2311.01635.

Every rank trains on its own micro-batch with full-width activations, as with DDP, but stores only 1/W of each
rotated weight (and so of its gradient and optimizer state): no replica of it anywhere. The shards travel:

* forward: for ``i = 0 .. W-1`` a rank computes with the shard it holds while that shard moves one hop around the
  ring (to rank+1, from rank-1), so the next one arrives during the compute. Every rotated module is split along
  its output features (``nn.Linear``'s rows, ``nn.Embedding``'s columns, a convolution's output channels): each
  shard gives a slice of the output and the slices are concatenated, so the output is exactly the module's own on
  this rank's input.
* backward: the weights go round again (only where the input's gradient needs them), and each shard's gradient
  buffer goes round too, starting one rank after its owner: every rank adds its own contribution as the buffer
  passes, and it stops at its owner summed over all ranks (W - 1 hops: a ring reduce-scatter, one buffer at a
  time, overlapped with compute; the paper's buffer travels with its shard and needs one hop more). Gradients
  are averaged over the ranks, as DDP does.

Which modules rotate: every ``nn.Linear``, ``nn.Embedding``, ``nn.Conv1d`` / ``2d`` / ``3d`` and
``nn.MultiheadAttention`` (exactly those classes, and the attention's output projection; convolutions with
``groups=1`` and zero padding, attention with its packed in-projection, whose rows are split like a Linear's).
Everything else (LayerNorm, other subclasses of Linear) stays replicated and its gradient is averaged by an
all-reduce in backward (:func:`powertrain.simple_fsdp.data_parallel`'s ``replicate`` mode). Unlike the reference
code, the replicated parameters are averaged too and ``group`` is honoured by every collective.

Parameters are DTensors on a 1-D mesh over the group: rotated ones ``Shard(0)`` (Linear, convolution and attention
weights and biases) or ``Shard(1)`` (Embedding weight), the rest ``Replicate()``. The state dict keys are the
model's own, so DCP checkpoints load into a DDP, FSDP2 or RTP model alike, and the optimizer holds only the shards.

A full weight need never exist on any rank (the paper's "flyweight" construction): build the model on the meta
device, make it rotated tensor parallel, then ``model.to_empty(device=...)`` allocates each rank's shards only, and
a checkpoint loaded with DCP fills them, reading only this rank's slices.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from powertrain.comm import CommStats, Communicator, collective_device
from powertrain.ops.flat import flat_views, pack
from powertrain.simple_fsdp import _parametrize

__all__ = ["comm_stats", "is_rtp", "replicated_traffic", "rotated_tensor_parallel"]

_WEIGHTS, _GRADS = 0, 1  # message tags: the weight stream and the gradient stream between the same peers


class _Ring:
    """The group a model rotates over, and whether hops overlap compute (False: each hop is waited for before
    the compute that could hide it, to measure what the overlap saves)."""

    def __init__(self, comm: Communicator, overlap: bool) -> None:
        self.comm, self.overlap = comm, overlap


def _one_message(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A module's shards (weight and bias) as one buffer: one message per hop, not one per tensor (each send
    has a fixed cost to the caller, on gloo most of all)."""
    return tensors[0] if len(tensors) == 1 else pack(tensors, tensors[0].dtype, tensors[0].device)


def _ring_forward(ring: _Ring, own: list[torch.Tensor], compute: Any) -> None:
    """Call ``compute(j, shards)`` for every shard ``j`` while the shards rotate; ``own`` is this rank's."""
    comm = ring.comm
    world, me = comm.world_size, comm.rank
    shapes = [t.shape for t in own]
    held = _one_message(own)
    for i in range(world):
        nxt = held
        wait = None
        if i < world - 1:
            nxt = torch.empty_like(held)
            wait = comm.shift([held], [nxt], tag=_WEIGHTS)
            if not ring.overlap:
                wait()
        compute((me - i) % world, flat_views(held, shapes) if len(shapes) > 1 else [held])
        if wait is not None:
            wait()
        held = nxt


def _ring_reduce(
    ring: _Ring, grad_part: Any, weights: list[torch.Tensor] | None = None, use_weights: Any = None
) -> list[torch.Tensor]:
    """The averaged gradient of this rank's shard. ``grad_part(j)`` is this rank's part of shard ``j``'s gradient;
    each shard's buffer starts one rank after its owner, collects every rank's part on its way round the ring (one
    message per hop) and stops at the owner, summed over the ranks: W - 1 hops, a ring reduce-scatter. With
    ``weights``, the weight shards rotate alongside and ``use_weights(j, held)`` is called with every shard
    ``j`` (the input's gradient needs them); the two streams are independent, so neither waits for the other."""
    comm = ring.comm
    world, me = comm.world_size, comm.rank
    incoming = torch.empty(0)
    shapes: list[torch.Size] = []
    wait_grads = None
    held = weights
    for i in range(world):
        wait_weights = None
        nxt = held
        if held is not None and i < world - 1:
            nxt = [torch.empty_like(t) for t in held]
            wait_weights = comm.shift(held, nxt, tag=_WEIGHTS)
            if not ring.overlap:
                wait_weights()
        if held is not None:
            use_weights((me - i) % world, held)
        parts = grad_part((me - 1 - i) % world)  # the last one (i = W - 1) is this rank's own shard
        shapes = [t.shape for t in parts]
        part = _one_message(parts)
        if wait_grads is not None:  # this shard's buffer, summed over the ranks it has passed
            wait_grads()
            part = incoming.add_(part)
        if i < world - 1:
            incoming = torch.empty_like(part)
            wait_grads = comm.shift([part], [incoming], tag=_GRADS)
            if not ring.overlap:
                wait_grads()
        if wait_weights is not None:
            wait_weights()
        held = nxt
    part.div_(world)
    return flat_views(part, shapes) if len(shapes) > 1 else [part]


class _RotatedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ring: _Ring) -> torch.Tensor:
        rows = w.shape[0]
        out = x.new_empty(*x.shape[:-1], rows * ring.comm.world_size)

        def compute(j: int, held: list[torch.Tensor]) -> None:
            out[..., j * rows : (j + 1) * rows] = F.linear(x, held[0], held[1] if b is not None else None)

        _ring_forward(ring, [w] if b is None else [w, b], compute)
        ctx.save_for_backward(x, w)
        ctx.ring, ctx.has_bias = ring, b is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        rows = w.shape[0]
        x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        gx = torch.zeros(x2.shape, dtype=g2.dtype, device=g2.device) if ctx.needs_input_grad[0] else None

        # Under autocast forward's products ran in its dtype (bf16) and ``grad`` comes in x's dtype, which may differ
        # from the weights': the products here run in the gradient's dtype (as autocast's own backward does), the
        # weights' gradient parts travel and sum in the weights' dtype (as DDP's do). Without autocast every .to is
        # a no-op.
        def use_weights(j: int, held: list[torch.Tensor]) -> None:
            assert gx is not None, "weights rotate only when the input needs a gradient"
            gx.addmm_(g2[:, j * rows : (j + 1) * rows], held[0].to(gx.dtype))

        def grad_part(j: int) -> list[torch.Tensor]:
            gy = g2[:, j * rows : (j + 1) * rows]
            gw = (gy.t() @ x2.to(gy.dtype)).to(w.dtype)
            return [gw, gy.sum(0).to(w.dtype)] if ctx.has_bias else [gw]

        grads = _ring_reduce(ctx.ring, grad_part, [w] if gx is not None else None, use_weights)
        return (gx.view_as(x) if gx is not None else None, grads[0], grads[1] if ctx.has_bias else None, None)


class _RotatedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, idx: torch.Tensor, w: torch.Tensor, ring: _Ring, padding_idx: int | None) -> torch.Tensor:
        cols = w.shape[1]
        out = w.new_empty(*idx.shape, cols * ring.comm.world_size)

        def compute(j: int, held: list[torch.Tensor]) -> None:
            out[..., j * cols : (j + 1) * cols] = F.embedding(idx, held[0])

        _ring_forward(ring, [w], compute)
        ctx.save_for_backward(idx)
        ctx.ring, ctx.shape, ctx.padding_idx = ring, w.shape, padding_idx
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (idx,) = ctx.saved_tensors
        cols = ctx.shape[1]
        flat, g2 = idx.reshape(-1), grad.reshape(-1, grad.shape[-1])

        def grad_part(j: int) -> list[torch.Tensor]:
            part = g2.new_zeros(ctx.shape).index_add_(0, flat, g2[:, j * cols : (j + 1) * cols])
            if ctx.padding_idx is not None:
                part[ctx.padding_idx] = 0  # as nn.Embedding: the padding row gets no gradient
            return [part]

        return None, _ring_reduce(ctx.ring, grad_part)[0], None, None


class _RotatedConv(torch.autograd.Function):
    """A convolution (1-, 2- or 3-D, ``groups=1``, zero padding) split along its output channels: each shard gives
    a slice of the output's channels (dim 1), as a Linear's gives a slice of its features."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ring: _Ring, geometry: tuple[Any, ...]
    ) -> torch.Tensor:
        stride, padding, dilation = geometry
        chans = w.shape[0]
        parts: dict[int, torch.Tensor] = {}

        def compute(j: int, held: list[torch.Tensor]) -> None:
            bias = held[1] if b is not None else None
            parts[j] = torch.convolution(x, held[0], bias, stride, padding, dilation, False, [0] * len(stride), 1)

        _ring_forward(ring, [w] if b is None else [w, b], compute)
        out = torch.cat([parts[j] for j in range(ring.comm.world_size)], dim=1)
        ctx.save_for_backward(x, w)
        ctx.ring, ctx.has_bias, ctx.geometry, ctx.chans = ring, b is not None, geometry, chans
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        stride, padding, dilation = ctx.geometry
        c = ctx.chans
        gx = torch.zeros(x.shape, dtype=grad.dtype, device=grad.device) if ctx.needs_input_grad[0] else None

        def conv_backward(j: int, weight: torch.Tensor, mask: list[bool]) -> tuple[Any, ...]:
            gy = grad[:, j * c : (j + 1) * c]
            bias_sizes = [c] if ctx.has_bias else None
            # in the gradient's dtype (autocast: see _RotatedLinear.backward); no-op casts without autocast
            xs, ws = x.to(gy.dtype), weight.to(gy.dtype)
            return torch.ops.aten.convolution_backward(
                gy, xs, ws, bias_sizes, stride, padding, dilation, False, [0] * len(stride), 1, mask
            )

        def use_weights(j: int, held: list[torch.Tensor]) -> None:
            assert gx is not None, "weights rotate only when the input needs a gradient"
            gx.add_(conv_backward(j, held[0], [True, False, False])[0])

        def grad_part(j: int) -> list[torch.Tensor]:
            _, gw, gb = conv_backward(j, w, [False, True, ctx.has_bias])
            return [gw.to(w.dtype), gb.to(w.dtype)] if ctx.has_bias else [gw.to(w.dtype)]

        grads = _ring_reduce(ctx.ring, grad_part, [w] if gx is not None else None, use_weights)
        return gx, grads[0], grads[1] if ctx.has_bias else None, None, None


def _local(module: nn.Module, name: str) -> torch.Tensor | None:
    p = module._parameters[name]
    return None if p is None else p.to_local()  # type: ignore[attr-defined]


def _ring(module: nn.Module) -> _Ring:
    ring = module.__dict__["_rtp_ring"]
    assert isinstance(ring, _Ring), "set by rotated_tensor_parallel"
    return ring


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _RotatedLinear.apply(x, _local(self, "weight"), _local(self, "bias"), _ring(self))
    return out


def _embedding_forward(self: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _RotatedEmbedding.apply(idx, _local(self, "weight"), _ring(self), self.padding_idx)
    return out


def _conv_forward(self: nn.Conv1d | nn.Conv2d | nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _RotatedConv.apply(
        x, _local(self, "weight"), _local(self, "bias"), _ring(self), _conv_geometry(self)
    )
    return out


def _mha_forward(
    self: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.MultiheadAttention.forward`` with its in-projection rotated (the packed ``3E x E`` weight split along
    its rows) and its out-projection a rotated Linear; the attention itself is each rank's own, as the rest of the
    model's compute. ``is_causal`` is a hint about ``attn_mask``, which must be given, as in torch."""
    if is_causal and attn_mask is None:
        raise ValueError("is_causal=True needs attn_mask (nn.MultiheadAttention's hint): pass the causal mask")
    unbatched = query.dim() == 2
    # one rotation per distinct input (self-attention: one), told apart before the layout changes below
    inputs = [query, key, value]
    first = [next(i for i, u in enumerate(inputs) if u is t) for t in inputs]
    if unbatched:
        inputs = [t.unsqueeze(0) for t in inputs]
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    elif not self.batch_first:
        inputs = [t.transpose(0, 1) for t in inputs]
    e, h = self.embed_dim, self.num_heads
    w, b, ring = _local(self, "in_proj_weight"), _local(self, "in_proj_bias"), _ring(self)
    projected = {j: _RotatedLinear.apply(inputs[j], w, b, ring) for j in dict.fromkeys(first)}
    q, k, v = (projected[j][..., i * e : (i + 1) * e] for i, j in enumerate(first))
    batch, length, source = q.shape[0], q.shape[1], k.shape[1]
    q, k, v = (t.reshape(batch, -1, h, e // h).transpose(1, 2) for t in (q, k, v))
    mask = _attention_mask(attn_mask, key_padding_mask, q.dtype, batch, h, length, source)
    dropout = self.dropout if self.training else 0.0
    weights = None
    if need_weights:  # the weights are formed: nn.MultiheadAttention's own order (softmax, then dropout)
        scores = q @ k.transpose(-2, -1) / math.sqrt(e // h)
        attn = (scores if mask is None else scores + mask).softmax(-1)
        weights = attn.mean(1) if average_attn_weights else attn
        out = F.dropout(attn, dropout) @ v if dropout else attn @ v
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
    out = self.out_proj(out.transpose(1, 2).reshape(batch, length, e))
    if unbatched:
        return out.squeeze(0), None if weights is None else weights.squeeze(0)
    return (out if self.batch_first else out.transpose(0, 1)), weights


def _attention_mask(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    dtype: torch.dtype,
    batch: int,
    heads: int,
    length: int,
    source: int,
) -> torch.Tensor | None:
    """nn.MultiheadAttention's masks (boolean: True is masked out; floating: added) as one additive mask that
    broadcasts over ``(batch, heads, length, source)``."""

    def additive(m: torch.Tensor) -> torch.Tensor:
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(m, float("-inf"))
        return m.to(dtype)

    mask = None
    if attn_mask is not None:
        mask = additive(attn_mask)
        if mask.dim() == 3:  # (batch * heads, length, source)
            mask = mask.view(batch, heads, length, source)
    if key_padding_mask is not None:
        pad = additive(key_padding_mask).view(batch, 1, 1, source)
        mask = pad if mask is None else mask + pad
    return mask


def _conv_geometry(conv: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> tuple[list[int], list[int], list[int]]:
    """Stride, explicit padding and dilation of ``conv`` (``padding="same"`` as the symmetric padding it is)."""
    k, dilation = conv.kernel_size, list(conv.dilation)
    if conv.padding == "valid":
        padding = [0] * len(k)
    elif conv.padding == "same":
        padding = [d * (n - 1) // 2 for d, n in zip(dilation, k, strict=True)]
    else:
        padding = list(conv.padding)  # type: ignore[arg-type]
    return list(conv.stride), padding, dilation


_ROTATED: dict[type, tuple[int, Any]] = {
    nn.Linear: (0, _linear_forward),
    nn.modules.linear.NonDynamicallyQuantizableLinear: (0, _linear_forward),  # MultiheadAttention's out_proj
    nn.MultiheadAttention: (0, _mha_forward),
    nn.Embedding: (1, _embedding_forward),
    nn.Conv1d: (0, _conv_forward),
    nn.Conv2d: (0, _conv_forward),
    nn.Conv3d: (0, _conv_forward),
}
_CLASSES: dict[type, type] = {}


def is_rtp(model: nn.Module) -> bool:
    """Whether :func:`rotated_tensor_parallel` has been applied to ``model`` (or one of its submodules)."""
    return any("_rtp_ring" in m.__dict__ for m in model.modules())


def comm_stats(model: nn.Module) -> CommStats:
    """What ``model``'s rotations sent (weights and gradient buffers, payload bytes; op ``"send"``)."""
    for m in model.modules():
        if "_rtp_ring" in m.__dict__:
            return _ring(m).comm.stats
    raise ValueError("comm_stats() needs a model returned by rotated_tensor_parallel()")


def replicated_traffic(model: nn.Module) -> tuple[int, int]:
    """Payload bytes and number of the all-reduces that backward runs on the replicated parameters of a model
    returned by :func:`rotated_tensor_parallel` (one per parameter; DTensor issues them, so :func:`comm_stats` does not
    count them).

    Args:
        model: the rotated model.
    """
    replicated = [p for p in model.parameters() if p.placements == (Replicate(),)]  # type: ignore[attr-defined]
    return sum(p.numel() * p.element_size() for p in replicated), len(replicated)


def _check(name: str, module: nn.Module, world: int) -> None:
    name = name or "the model"
    if isinstance(module, nn.MultiheadAttention):
        _check_attention(name, module, world)
        return
    dim = _ROTATED[type(module)][0]
    weight = module.weight
    assert isinstance(weight, torch.Tensor), "nn.Linear and nn.Embedding have a weight"
    size = weight.shape[dim]
    what = "out_features" if isinstance(module, nn.Linear) else "embedding_dim" if dim else "out_channels"
    if size % world:
        raise ValueError(
            f"RTP splits {name} ({type(module).__name__}) along {what}={size}, which does not divide over {world} "
            f"ranks: choose a model width divisible by {world}, or run on a world size that divides {size}"
        )
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse or module.scale_grad_by_freq):
        raise ValueError(
            f"RTP cannot rotate {name}: nn.Embedding with max_norm, sparse or scale_grad_by_freq is not supported; "
            "use a plain nn.Embedding"
        )
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        even = module.padding == "same" and any(
            (d * (n - 1)) % 2 for d, n in zip(module.dilation, module.kernel_size, strict=True)
        )
        if module.groups != 1 or module.padding_mode != "zeros" or even:
            raise ValueError(
                f"RTP cannot rotate {name}: {type(module).__name__} with groups={module.groups}, "
                f"padding_mode={module.padding_mode!r}, padding={module.padding!r} is not supported; use groups=1, "
                "zero padding and, with padding='same', an odd (dilated) kernel"
            )


def _check_attention(name: str, module: nn.MultiheadAttention, world: int) -> None:
    if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
        raise ValueError(
            f"RTP cannot rotate {name}: nn.MultiheadAttention with kdim/vdim other than embed_dim, add_bias_kv or "
            "add_zero_attn is not supported; use the packed in-projection (the defaults)"
        )
    if module.embed_dim % world:
        raise ValueError(
            f"RTP splits {name} (MultiheadAttention) along its in-projection rows (3 x embed_dim) and its output "
            f"features (embed_dim={module.embed_dim}), which do not divide over {world} ranks: choose an embed_dim "
            f"divisible by {world}"
        )


def rotated_tensor_parallel(
    model: nn.Module, group: dist.ProcessGroup | None = None, *, overlap: bool = True
) -> nn.Module:
    """Make ``model`` rotated tensor parallel over ``group`` (default: the world), in place; returns ``model``.

    ``model``'s parameters must be identical on every rank (seed the initialisation) and on the group's device
    type, or all on the meta device: then no full weight is ever allocated; call ``model.to_empty(device=...)``
    afterwards (it allocates this rank's shards and the replicated parameters, without values) and fill them, by
    loading a checkpoint (:func:`powertrain.checkpoint.load` and ``set_model_state_dict``) or with your own
    initialisation, which must give the replicated parameters the same values on every rank. Every
    ``nn.Linear``, ``nn.Embedding``, plain convolution and ``nn.MultiheadAttention`` keeps 1/W of its weight and
    rotates the shards; every other parameter is replicated and averaged. Create the optimizer afterwards, on
    ``model.parameters()``. Gradient communication is part of backward: do not wrap the model in DDP or FSDP as well.
    ``overlap`` (the default) hides each hop behind compute; ``overlap=False`` waits for every hop before the compute
    it would hide behind (same results, bitwise; for measuring what the overlap saves).
    """
    if not isinstance(overlap, bool):
        raise ValueError(f"Invalid overlap={overlap!r}: must be True or False")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("rotated_tensor_parallel needs torch.distributed: call init_process_group first")
    if is_rtp(model):
        raise ValueError("rotated_tensor_parallel() was already applied to this model (or one of its submodules)")
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "initialised above"
    params = list(model.parameters())
    if any(p.is_meta for p in params) and not all(p.is_meta for p in params):
        raise ValueError(
            "rotated_tensor_parallel takes a model entirely on the meta device or entirely off it; "
            "move every parameter to one device first"
        )
    on_meta = bool(params) and params[0].is_meta  # then the group's device: NCCL's CUDA, otherwise the CPU
    device = collective_device(pg).type if on_meta else (params[0].device.type if params else "cpu")
    mesh = DeviceMesh.from_group(pg, device)
    comm = Communicator(group)
    ring = _Ring(comm, overlap)
    world = comm.world_size
    rotated = [(n, m) for n, m in model.named_modules() if type(m) in _ROTATED]
    names: dict[int, list[tuple[nn.Module, str]]] = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            names.setdefault(id(p), []).append((module, f"{name}.{pname}"))
    for uses in names.values():
        if len(uses) > 1 and any(type(m) in _ROTATED for m, _ in uses):
            raise ValueError(
                f"RTP cannot rotate a parameter shared between modules ({' is '.join(n for _, n in uses)}): untie them"
            )
    for name, module in rotated:
        _check(name, module, world)
    # every parameter a Replicate DTensor, averaged in backward
    _parametrize(model, mesh, (Replicate(),), allow_meta=True)
    for _, module in rotated:
        original = type(module).__mro__[1]  # data_parallel's subclass sits on top of the module's own class
        dim, forward = _ROTATED[original]
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            full = p.to_local()
            shard = full.chunk(world, dim=0 if pname == "bias" else dim)[comm.rank].clone()
            placement = Shard(0 if pname == "bias" else dim)
            module._parameters[pname] = nn.Parameter(
                DTensor.from_local(shard, mesh, [placement], run_check=False), requires_grad=p.requires_grad
            )
        if original not in _CLASSES:
            _CLASSES[original] = type(f"Rotated{original.__name__}", (original,), {"forward": forward})
        module.__class__ = _CLASSES[original]
        del module._simple_fsdp_gather
        module.__dict__["_rtp_ring"] = ring
    return model
