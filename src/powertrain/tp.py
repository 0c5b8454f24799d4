"""2-D tensor x data parallelism for powertrain's GPT, the torchtitan way: torch's tensor parallelism inside each
row of a ``(dp, tp)`` device mesh, FSDP2 across the rows.

Within a tensor-parallel group every rank sees the same micro-batch. Per block (Megatron's split): the attention's
query, key and value projections are column-parallel (each rank computes ``n_head / tp`` heads), the output
projection row-parallel (an all-reduce of its output), the MLP's first Linear column-parallel and its second
row-parallel. The block's fused ``qkv`` Linear is split into three (``qkv.q``, ``qkv.k``, ``qkv.v``) first, so that
a column shard holds whole heads of each. Embeddings, LayerNorms and the output head are replicated over ``tp``
(DTensors with ``Replicate()``: every rank of the group computes them on the same input, so their gradients agree
without communication). Then FSDP2 shards every block and the root over ``dp``, which averages the gradients
across the data-parallel groups.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from powertrain.train.model import GPT, Block

__all__ = ["tensor_parallel"]


class _QKV(nn.Module):
    """The fused ``qkv`` Linear as three, one per projection (same weights, same output layout)."""

    def __init__(self, fused: nn.Linear) -> None:
        super().__init__()
        d = fused.out_features // 3
        like = {"dtype": fused.weight.dtype, "device": fused.weight.device}
        self.q, self.k, self.v = (nn.Linear(fused.in_features, d, bias=fused.bias is not None, **like)
                                  for _ in range(3))  # fmt: skip
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(fused.weight[i * d : (i + 1) * d])
                if fused.bias is not None:
                    lin.bias.copy_(fused.bias[i * d : (i + 1) * d])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def _to_replicate(module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
    return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor) else t
                 for t in inputs)  # fmt: skip


def _to_local(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


def _replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    """Parameters as Replicate DTensors on ``mesh``; plain tensors in and out (no communication)."""
    distribute_module(module, mesh, input_fn=_to_replicate, output_fn=_to_local)


def tensor_parallel(model: GPT, mesh: DeviceMesh) -> GPT:
    """Make ``model`` (powertrain's :class:`~powertrain.train.model.GPT`) 2-D parallel over ``mesh`` in place.

    ``mesh``: a 2-D device mesh with dimension names ``("dp", "tp")``
    (``init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))``). The ranks of one ``tp`` group must be
    given the same batches. Create the optimizer afterwards, on ``model.parameters()``.
    """
    from torch.distributed.fsdp import fully_shard

    if not isinstance(model, GPT):
        raise ValueError(
            f"tensor_parallel takes powertrain's GPT (its plan names its modules), got {type(model).__name__}"
        )
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or mesh.mesh_dim_names != ("dp", "tp"):
        raise ValueError(f"Invalid mesh={mesh!r}: pass a 2-D DeviceMesh with mesh_dim_names=('dp', 'tp')")
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    tp, cfg = tp_mesh.size(), model.cfg
    if cfg.n_head % tp:
        raise ValueError(
            f"tensor parallelism divides the heads: n_head={cfg.n_head} does not divide by tp={tp}; choose a tp "
            f"that divides {cfg.n_head}"
        )
    plan = {"qkv.q": ColwiseParallel(), "qkv.k": ColwiseParallel(), "qkv.v": ColwiseParallel(),
            "proj": RowwiseParallel(), "fc": ColwiseParallel(), "fc_out": RowwiseParallel()}  # fmt: skip
    blocks: list[Block] = list(model.blocks)  # type: ignore[arg-type]
    for block in blocks:
        block.qkv = _QKV(block.qkv)  # type: ignore[assignment]
        parallelize_module(block, tp_mesh, plan)
        for ln in (block.ln1, block.ln2):
            _replicate(ln, tp_mesh)
    for module in (model.tok, model.pos, model.ln_f, model.head):
        _replicate(module, tp_mesh)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model
