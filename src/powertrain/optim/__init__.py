"""Optimizers: Distributed Shampoo (and its eigenvalue-corrected form), GaLore, DeMo / FlexDeMo."""

from powertrain.optim.demo import DeMo, FlexDeMo, local_gradients
from powertrain.optim.galore import GaLoreAdamW
from powertrain.optim.shampoo import DistributedShampoo

__all__ = ["DeMo", "DistributedShampoo", "FlexDeMo", "GaLoreAdamW", "local_gradients"]
