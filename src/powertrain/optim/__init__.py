"""Optimizers: Muon (orthogonalized updates of the hidden matrices, the work split across ranks), Dion (low-rank
orthonormalized updates whose data-parallel messages are factors), Distributed Shampoo
(and its eigenvalue-corrected form), GaLore, DeMo / FlexDeMo, and AdamW with a frozen second moment (the optimizer
side of error feedback).

Each is imported on first use: the command's launcher reads the optimizers' option types without loading
DTensor."""

from __future__ import annotations

from typing import TYPE_CHECKING

from powertrain._lazy import lazy_exports

if TYPE_CHECKING:
    from powertrain.optim.demo import DeMo, FlexDeMo
    from powertrain.optim.dion import Dion
    from powertrain.optim.frozen_adamw import FrozenVarianceAdamW
    from powertrain.optim.galore import GaLoreAdamW
    from powertrain.optim.muon import Muon
    from powertrain.optim.shampoo import DistributedShampoo

__all__ = ["DeMo", "Dion", "DistributedShampoo", "FlexDeMo", "FrozenVarianceAdamW", "GaLoreAdamW", "Muon"]

__getattr__ = lazy_exports(
    __name__,
    {
        "DeMo": "powertrain.optim.demo",
        "Dion": "powertrain.optim.dion",
        "FlexDeMo": "powertrain.optim.demo",
        "FrozenVarianceAdamW": "powertrain.optim.frozen_adamw",
        "GaLoreAdamW": "powertrain.optim.galore",
        "DistributedShampoo": "powertrain.optim.shampoo",
        "Muon": "powertrain.optim.muon",
    },
)
