"""Every private or version-dependent torch API powertrain uses, in one place."""

from __future__ import annotations

import torch
import torch.distributed as dist

# Fused in-place list ops (what torch.optim's foreach implementations use); stable since torch 2.0.
foreach_add_ = torch._foreach_add_
foreach_copy_ = torch._foreach_copy_

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; 2.11 has only the old name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["all_gather_single", "foreach_add_", "foreach_copy_"]
