"""GaLore (Zhao et al., arXiv 2403.03507; GaLore 2, Su et al., arXiv 2504.20437): AdamW with its moments in a
low-rank subspace of each weight's gradient. Layers: :mod:`.projector` (math), :mod:`.distributed`
(communication of a sharded refresh), :mod:`.optimizer` (``GaLoreAdamW``)."""

from powertrain.optim.galore.optimizer import GaLoreAdamW, optimizer_state_bytes

__all__ = ["GaLoreAdamW", "optimizer_state_bytes"]
