"""Counts of Shampoo's root (eigenvalue-corrected: eigenbasis) computations, so that failures and fallbacks to the
grafting direction are visible instead of silent: :class:`RootStats` is what the caller reads
(:meth:`DistributedShampoo.root_stats`), :class:`RootCounter` what the optimizer updates and checkpoints."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

__all__ = ["RootCounter", "RootStats"]


class RootStats(NamedTuple):
    """This rank's root computations since the optimizer was created, over all its blocks; kept in
    ``state_dict()``. Under data parallelism every rank counts its own blocks: the run's totals are the sums over
    ranks."""

    computed: int  #: block computations that succeeded (some possibly after the float64 retry)
    failed: int  #: block computations that raised RootFailure (non-finite factor, failed decomposition, no convergence)
    graft_steps: int  #: block-steps whose direction was the graft because of failures (no roots yet, or given up)
    abandoned: int  #: blocks past max_root_failures, which use the graft for good


class RootCounter:
    """The optimizer's running :class:`RootStats`; warns at the first failure and at the first block given up
    (once each per optimizer: the counts say the rest)."""

    def __init__(self, what: str, max_failures: int) -> None:
        self.what, self.max_failures = what, max_failures
        self.counts = dict.fromkeys(RootStats._fields, 0)

    def stats(self) -> RootStats:
        """The counts so far, as a :class:`RootStats` (a snapshot: later counts do not change it)."""
        return RootStats(**self.counts)

    def computed(self) -> None:
        """A block's computation succeeded."""
        self.counts["computed"] += 1

    def graft_step(self) -> None:
        """A block stepped with the grafting direction because of failures (no roots yet, or given up)."""
        self.counts["graft_steps"] += 1

    def failed(self, where: str, error: Exception, failures: int) -> None:
        """A block's computation failed, its ``failures``-th; past ``max_failures`` the block is given up."""
        self.counts["failed"] += 1
        if failures == self.max_failures + 1:
            self.counts["abandoned"] += 1
            if self.counts["abandoned"] == 1:
                warnings.warn(
                    f"DistributedShampoo: the {self.what} of {where} failed {failures} times (more than "
                    f"max_root_failures={self.max_failures}): that block is updated by the grafting method alone "
                    "from now on. root_stats() counts such blocks.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        elif self.counts["failed"] == 1:
            warnings.warn(
                f"DistributedShampoo: the {self.what} of {where} failed ({error}); the block keeps its previous ones "
                "(before its first: the grafting direction) and retries at the next recomputation. root_stats() "
                "counts failures and the steps that fell back to the graft; this warning is shown once.",
                RuntimeWarning,
                stacklevel=3,
            )

    def state_dict(self) -> dict[str, int]:
        """The counts by :class:`RootStats` field name (a copy), for the optimizer's ``state_dict()``."""
        return dict(self.counts)

    @staticmethod
    def check(state: Any) -> None:
        """ValueError in one line unless ``state`` is what :meth:`load_state_dict` takes: None or counts (ints >= 0)."""
        if state is not None and not (
            isinstance(state, dict) and all(type(v) is int and v >= 0 for v in state.values())
        ):
            raise ValueError(f"This DistributedShampoo state's root statistics are {state!r:.60}, expected counts")

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """``None`` (a state written before the counters existed): they start at 0. ValueError (:meth:`check`) for
        anything else that is not counts."""
        self.check(state)
        self.counts = {k: (state or {}).get(k, 0) for k in RootStats._fields}
