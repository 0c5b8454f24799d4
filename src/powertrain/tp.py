"""2-D tensor x data parallelism for powertrain's GPT, the torchtitan way: torch's tensor and sequence parallelism
inside each row of a ``(dp, tp)`` device mesh, FSDP2 across the rows.

Within a tensor-parallel group every rank sees the same micro-batch. Per block (Megatron's split): the attention's
query, key and value projections are column-parallel (each rank computes ``n_head / tp`` heads), the output
projection row-parallel, the MLP's first Linear column-parallel and its second row-parallel. The block's fused
``qkv`` Linear is split into three (``qkv.q``, ``qkv.k``, ``qkv.v``) first, so that a column shard holds whole heads
of each. Sequence parallelism (Korthikanti et al. 2022) keeps the residual stream between them sharded along the
sequence: the LayerNorms run on a rank's ``1 / tp`` of the positions, the attention's and the MLP's input is
all-gathered once, and the row-parallel outputs are reduce-scattered back to sequence shards instead of all-reduced
(the same bytes on a ring, ``1 / tp`` of the activations kept). The token embedding is row-parallel (``vocab / tp``
rows a rank, its output reduce-scattered to sequence shards), the position embedding likewise, and the output head
column-parallel over the vocabulary with its input all-gathered, its logits gathered whole (the loss is computed as
usual); or, with ``loss_parallel=True``, left sharded over the vocabulary: torch's ``loss_parallel()`` then computes
the cross-entropy from the shards (three all-reduces of one float per token instead of all-gathering
``tokens x vocab`` logits, and no rank holds them whole). LayerNorms (gains, biases) and row-parallel biases are
replicated over ``tp``; their gradients are summed over the sequence shards. Then FSDP2 shards every block and the
root over ``dp``, which averages the gradients across the data-parallel groups.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from powertrain.models import GPT, Block, GPTConfig
from powertrain.ops.flat import shard_rows

__all__ = ["local_numel", "tensor_parallel", "traffic"]


class _QKV(nn.Module):
    """The fused ``qkv`` Linear as three, one per projection (same weights, same output layout)."""

    def __init__(self, fused: nn.Linear) -> None:
        super().__init__()
        d = fused.out_features // 3
        like = {"dtype": fused.weight.dtype, "device": fused.weight.device}
        self.q, self.k, self.v = (
            nn.Linear(fused.in_features, d, bias=fused.bias is not None, **like) for _ in range(3)
        )
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(fused.weight[i * d : (i + 1) * d])
                if fused.bias is not None:
                    lin.bias.copy_(fused.bias[i * d : (i + 1) * d])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def tensor_parallel(model: GPT, mesh: DeviceMesh, *, loss_parallel: bool = False) -> GPT:
    """Make ``model`` (powertrain's :class:`~powertrain.models.GPT`) 2-D parallel over ``mesh`` in place.

    ``mesh``: a 2-D device mesh with dimension names ``("dp", "tp")``
    (``init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))``). The ranks of one ``tp`` group must be
    given the same batches. Create the optimizer afterwards, on ``model.parameters()``.

    ``loss_parallel``: the logits stay a DTensor sharded over the vocabulary (``full_tensor()`` gathers them);
    compute the loss and run backward inside ``torch.distributed.tensor.parallel.loss_parallel()``.
    """
    from torch.distributed.fsdp import fully_shard

    if not isinstance(model, GPT):
        raise ValueError(
            f"tensor_parallel takes powertrain's GPT (its plan names its modules), got {type(model).__name__}"
        )
    if not isinstance(loss_parallel, bool):
        raise ValueError(f"Invalid loss_parallel={loss_parallel!r}: must be True or False")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or mesh.mesh_dim_names != ("dp", "tp"):
        raise ValueError(f"Invalid mesh={mesh!r}: pass a 2-D DeviceMesh with mesh_dim_names=('dp', 'tp')")
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    tp, cfg = tp_mesh.size(), model.cfg
    if cfg.n_head % tp:
        raise ValueError(
            f"tensor parallelism divides the heads: n_head={cfg.n_head} does not divide by tp={tp}; choose a tp "
            f"that divides {cfg.n_head}"
        )
    # the residual stream between the sublayers is a DTensor sharded along the sequence (dim 1)
    seq = Shard(1)
    block_plan = {
        "ln1": SequenceParallel(),
        "qkv": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),  # one all-gather
        "qkv.q": ColwiseParallel(),
        "qkv.k": ColwiseParallel(),
        "qkv.v": ColwiseParallel(),
        "proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "ln2": SequenceParallel(),
        "fc": ColwiseParallel(input_layouts=seq),
        "fc_out": RowwiseParallel(output_layouts=seq, use_local_output=False),
    }
    blocks: list[Block] = list(model.blocks)  # type: ignore[arg-type]
    for block in blocks:
        block.qkv = _QKV(block.qkv)  # type: ignore[assignment]
        parallelize_module(block, tp_mesh, block_plan)
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False),
            # positions are (t, d): their sequence dimension is 0, broadcast onto the tokens' dimension 1
            "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0), use_local_output=False),
            "ln_f": SequenceParallel(),
            "head": (
                ColwiseParallel(input_layouts=seq, use_local_output=False)
                if loss_parallel
                else ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
            ),
        },
    )
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def local_numel(cfg: GPTConfig, tp: int) -> int:
    """Parameters a rank of a ``tp`` group holds of a GPT built from ``cfg`` (before FSDP2 shards them over ``dp``):
    every weight matrix's ``1 / tp`` (uneven shards rounded up), the replicated LayerNorms and row-parallel biases
    whole."""
    d, layers = cfg.d_model, cfg.n_layer
    replicated = layers * 6 * d + 2 * d  # ln1, ln2 (gain, bias), proj's and fc_out's biases; ln_f
    rows = [(cfg.vocab_size, d), (cfg.block_size, d), (cfg.vocab_size, d)]  # tok, pos, head: split by rows
    local = sum(shard_rows(n, tp) * w for n, w in rows)
    # per block: q, k, v (weight rows and bias), proj (weight columns), fc (rows and bias), fc_out (columns)
    d_tp, ff_tp = shard_rows(d, tp), shard_rows(4 * d, tp)
    local += layers * (3 * d_tp * (d + 1) + d * d_tp + ff_tp * (d + 1) + d * ff_tp)
    return local + replicated


def traffic(
    cfg: GPTConfig, tp: int, dp: int, batch: int, seq: int, *, itemsize: int = 4, loss_parallel: bool = False
) -> dict[str, tuple[int, int]]:
    """Gradient-step traffic per micro-step and rank of :func:`tensor_parallel`, by collective: payload bytes as
    handed to it (a reduce-scatter's whole input, an all-gather's own part; DTensor pads uneven shards to the
    largest) and the number of collectives, for a GPT built from ``cfg`` on a ``(dp, tp)`` mesh; ``batch`` sequences
    of ``seq`` tokens per ``tp`` group, parameters and activations of ``itemsize`` bytes (fp32: 4, the default).

    Sequence parallelism, per block: the attention's and the MLP's inputs all-gathered (forward) and their gradients
    reduce-scattered (backward), the row-parallel outputs reduce-scattered (forward) and their gradients all-gathered
    (backward); the embeddings' outputs reduce-scattered and the head's input all-gathered likewise, the logits
    all-gathered (with ``loss_parallel``: not gathered; the loss's maximum, sum of exponentials and target logit
    all-reduced instead, one float32 per token each); the LayerNorms' gradients all-reduced. FSDP2 over ``dp``
    (when > 1): each unit's gradients
    reduce-scattered (the blocks and the root), as the command counts FSDP2 elsewhere; its weight all-gathers are
    not gradient traffic and are not in here.
    """
    out: dict[str, tuple[int, int]] = {}
    if tp > 1:
        d, layers = cfg.d_model, cfg.n_layer
        s, v = shard_rows(seq, tp), shard_rows(cfg.vocab_size, tp)  # a rank's positions and vocabulary rows
        wide = 4 * layers + 2  # (b, t, d) activations per direction: the blocks' sublayers, the embedding, the head
        out["reduce_scatter"] = (itemsize * (wide * batch + 1) * tp * s * d, 4 * layers + 3)
        logits = 0 if loss_parallel else batch * seq * v
        out["all_gather"] = (itemsize * ((wide * batch + 1) * s * d + logits), 4 * layers + 4 - loss_parallel)
        out["all_reduce"] = (itemsize * (2 * layers + 1) * 2 * d, 4 * layers + 2)
        if loss_parallel:  # the model computes its loss in float32
            out["all_reduce"] = (out["all_reduce"][0] + 3 * 4 * batch * seq, out["all_reduce"][1] + 3)
    if dp > 1:
        rs = out.get("reduce_scatter", (0, 0))
        out["reduce_scatter"] = (rs[0] + itemsize * local_numel(cfg, tp), rs[1] + cfg.n_layer + 1)
    return out
