"""Every private or version-dependent torch API powertrain uses, in one place."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# Fused in-place list ops (what torch.optim's foreach implementations use); stable since torch 2.0.
foreach_add_ = torch._foreach_add_
foreach_copy_ = torch._foreach_copy_

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; 2.11 has only the old name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["all_gather_single", "foreach_add_", "foreach_copy_"]


def fsdp_managed_params(module: Any) -> list[tuple[torch.nn.Parameter, torch.Size, int]]:
    """(sharded parameter, unsharded size, shard dim) for each parameter one ``fully_shard`` module
    manages, in the order its reduce-scatter lays them out. FSDP2 has no public accessor for this."""
    state = module._get_fsdp_state()
    out = []
    for group in state._fsdp_param_groups:
        for p in group.fsdp_params:
            out.append((p.sharded_param, p._orig_size, p.fsdp_placement.dim))
    return out


def fsdp_param_group_count(module: Any) -> int:
    return len(module._get_fsdp_state()._fsdp_param_groups)
