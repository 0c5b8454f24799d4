"""Distributed Shampoo (Shi et al., arXiv 2309.06497).

- :mod:`.matrix`: inverse matrix roots and eigenbases (eigh with a float64 retry, coupled Newton).
- :mod:`.blocks`: how a parameter is cut into blocks of at most ``max_preconditioner_dim``, and a block's cost.
- :mod:`.preconditioner`: per-block factor statistics, roots, eigenvalue-corrected (SOAP) rotation.
- :mod:`.optimizer`: :class:`DistributedShampoo`: filtering, grafting, the two preconditioners, the update;
  the blocks spread over ranks by :mod:`powertrain.optim.distributor`.
- :mod:`.stats`: :class:`RootStats`, the counts of root computations, failures and fallbacks to the graft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from powertrain._lazy import lazy_exports

if TYPE_CHECKING:
    from powertrain.optim.shampoo.optimizer import DistributedShampoo
    from powertrain.optim.shampoo.stats import RootStats

__all__ = ["DistributedShampoo", "RootStats"]

__getattr__ = lazy_exports(
    __name__,
    {
        "DistributedShampoo": "powertrain.optim.shampoo.optimizer",
        "RootStats": "powertrain.optim.shampoo.stats",
    },
)
