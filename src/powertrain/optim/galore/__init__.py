"""GaLore (Zhao et al., arXiv 2403.03507; GaLore 2, Su et al., arXiv 2504.20437): AdamW with its moments in a
low-rank subspace of each weight's gradient. Layers: :mod:`.projector` (math), :mod:`.distributed`
(communication of a sharded refresh), :mod:`.optimizer` (``GaLoreAdamW``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from powertrain._lazy import lazy_exports

if TYPE_CHECKING:
    from powertrain.optim.galore.optimizer import GaLoreAdamW, optimizer_state_bytes

__all__ = ["GaLoreAdamW", "optimizer_state_bytes"]

__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "powertrain.optim.galore.optimizer"))
