"""Optimizers: Distributed Shampoo (and its eigenvalue-corrected form), GaLore, DeMo / FlexDeMo, and AdamW with a
frozen second moment (the optimizer side of error feedback)."""

from powertrain.optim.demo import DeMo, FlexDeMo
from powertrain.optim.frozen_adamw import FrozenVarianceAdamW
from powertrain.optim.galore import GaLoreAdamW
from powertrain.optim.shampoo import DistributedShampoo

__all__ = ["DeMo", "DistributedShampoo", "FlexDeMo", "FrozenVarianceAdamW", "GaLoreAdamW"]
