"""``FlexDeMo`` (From et al., arXiv 2502.06728): full synchronisation inside a node group, DeMo across groups.

On a 2-D device mesh ``(replicate, shard)``, shard the model with FSDP2 over the shard dimension only::

    mesh = init_device_mesh("cuda", (num_groups, group_size), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = FlexDeMo(model.parameters(), mesh, lr=...)

1. Inside a shard group FSDP2 all-gathers parameters and reduce-scatters gradients as usual: after backward,
   every rank holds the group's mean gradient for its own shard (fast intra-node links).
2. Across groups nothing is all-reduced: :class:`.DeMo` runs on each rank's local shard and all-gathers its
   compressed fast components over ``mesh["replicate"]`` (the ranks holding the same shard in other groups).
3. Every rank of a replicate group decodes the same gathered buffer, so they keep equal shards; the shard
   group's parameters therefore stay one consistent model.

Why ``fully_shard(mesh=mesh["shard"])`` rather than HSDP (``fully_shard`` on the 2-D mesh with
``set_requires_all_reduce(False)``): the 1-D FSDP2 averages each gradient over exactly the ranks that
reduced it, with no cross-group collective to switch off; HSDP divides by the size of the whole mesh, so
skipping its all-reduce would leave a gradient scaled by ``1 / num_groups``, and the option is meant for
gradient accumulation, not to be left off.

Chunks are cut from the local shard (FSDP2 shards dimension 0, padded: a ``7 x 15`` weight on two ranks
becomes ``4 x 15`` and ``3 x 15``), so the result equals plain DeMo on the shard-shaped pieces. When shard
boundaries fall on chunk boundaries it equals plain DeMo on the full parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from powertrain.optim.demo.optimizer import DeMo

__all__ = ["FlexDeMo"]


class FlexDeMo(DeMo):
    """DeMo across the replicate dimension of a 2-D mesh, on parameters FSDP2-sharded over its shard dimension.

    Args:
        params: parameters (or groups) of a model sharded with ``fully_shard(..., mesh=mesh[shard_dim])``.
        mesh: a 2-D :class:`DeviceMesh` with named dimensions.
        replicate_dim: the dimension DeMo communicates over (across node groups).
        shard_dim: the dimension FSDP2 shards and synchronises over (inside a node group).
        **demo_options: :class:`.DeMo`'s options (``lr``, ``compression_decay``, ``compression_topk``,
            ``compression_chunk``, ``weight_decay``, ``comm_dtype``); not ``group``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        mesh: DeviceMesh,
        *,
        replicate_dim: str = "replicate",
        shard_dim: str = "shard",
        **demo_options: Any,
    ) -> None:
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
            raise ValueError(f"Invalid mesh={mesh!r}: FlexDeMo needs a 2-D DeviceMesh (replicate x shard)")
        names = mesh.mesh_dim_names or ()
        for name, dim in (("replicate_dim", replicate_dim), ("shard_dim", shard_dim)):
            if dim not in names:
                raise ValueError(f"Invalid {name}={dim!r}: the mesh's dimensions are named {names}")
        if replicate_dim == shard_dim:
            raise ValueError(f"Invalid shard_dim={shard_dim!r}: must differ from replicate_dim")
        if "group" in demo_options:
            raise ValueError("FlexDeMo takes no group: it communicates over mesh[replicate_dim]")
        params = list(params)
        super().__init__(params, group=mesh[replicate_dim].get_group(), **demo_options)
        shard_mesh = mesh[shard_dim]
        for group in self.param_groups:
            for p in group["params"]:
                if not isinstance(p, DTensor) or p.device_mesh != shard_mesh:
                    where = p.device_mesh if isinstance(p, DTensor) else "a plain tensor"
                    raise ValueError(
                        f"Invalid parameter of shape {tuple(p.shape)} on {where}: FlexDeMo needs every parameter "
                        f"sharded by fully_shard(module, mesh=mesh[{shard_dim!r}]), or its gradient would not be "
                        "synchronised inside the group"
                    )
