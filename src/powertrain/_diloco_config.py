"""The settings of local updates, one type for a script and the command: :class:`DiLoCoConfig`.

``DiLoCo(params, inner)`` and ``powertrain train --parallel diloco`` run the same defaults because both read them
from here; ``powertrain train`` builds this type from its flags (the same names: ``--sync-every`` is ``sync_every``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from powertrain._checks import check_int

if TYPE_CHECKING:
    from powertrain.compress.base import Compressor

__all__ = [
    "DEFAULT_OUTER_COMPRESSOR",
    "DEFAULT_OUTER_LR",
    "DEFAULT_OUTER_MOMENTUM",
    "DEFAULT_SYNC_EVERY",
    "DiLoCoConfig",
    "schedule",
]

#: The defaults of a script and of the command. On the default GPT with 2 replicas (BENCHMARKS.md, "Local updates"),
#: plain averaging (outer lr 1, no momentum) ended far below DiLoCo's Nesterov outer step (lr 0.7, momentum 0.9, tuned
#: for H ~ 500 from a pre-trained start) at H 10-50 from scratch, and int4 with error feedback on the outer step ended
#: where fp32 does at 1/8 of its bytes.
DEFAULT_SYNC_EVERY = 25
DEFAULT_OUTER_LR = 1.0
DEFAULT_OUTER_MOMENTUM = 0.0
DEFAULT_OUTER_COMPRESSOR = "int4"

#: How the outer learning rate moves: held, or scaled by the inner optimizer's schedule
OuterLRSchedule = Literal["constant", "inner"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    """How replicas train locally and meet again (:class:`powertrain.diloco.DiLoCo`); checked when built.

    Args:
        sync_every: H, inner steps between two synchronisations of a fragment (>= 1).
        compressor: how the pseudo-gradients are averaged over the replicas: a name of
            :func:`~powertrain.compress.make_compressor` (built by DiLoCo, with ``compressor_options``, on a process
            group of its own with the replicas' ranks), or a :class:`~powertrain.compress.Compressor` built on the
            parameters (or placeholders of their local shapes) on a process group that nothing else uses while a sync
            is in flight. Default int4 with error feedback ("none": exact fp32).
        compressor_options: the named compressor's options.
        outer_lr: the outer SGD's learning rate on the anchors (1 with ``outer_momentum`` 0 averages the replicas;
            DiLoCo's paper: 0.7).
        outer_momentum: the outer SGD's Nesterov momentum in [0, 1) (0: plain SGD; DiLoCo's paper: 0.9).
        outer_lr_schedule: ``"constant"`` (DiLoCo's) or ``"inner"``: each outer step's rate is ``outer_lr`` times the
            inner schedule's multiplier at that step, the inner optimizer's first parameter group's ``lr`` over its
            ``initial_lr`` (which torch's LR schedulers set), so the outer step decays with the inner rate.
        fragments: F, Streaming DiLoCo's fragments synchronised in turn: an int (consecutive parameters in F groups
            of about equal size, :func:`~powertrain.diloco.split_by_size`) or the groups themselves (lists of
            positions in the parameters, together each position once).
        sync_delay: tau, inner steps a fragment's sync overlaps before its outer update is applied; below the gap
            between two fragments' syncs (H / F), so that one sync is in flight at a time.
        sync_mix: alpha in [0, 1): after a delayed outer update ``local <- alpha * local + (1 - alpha) * anchor``
            (needs ``sync_delay`` > 0).
        sync_warmup: inner steps first whose gradients are averaged every step by ``warmup_compressor`` (its options
            in ``warmup_options``; a name, or a Compressor on the training's group), so that the replicas take the
            same inner steps; the local updates start from the weights they reach. 0: none.
    """

    sync_every: int = DEFAULT_SYNC_EVERY
    compressor: str | Compressor = DEFAULT_OUTER_COMPRESSOR
    compressor_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    outer_lr_schedule: OuterLRSchedule = "constant"
    fragments: int | Sequence[Sequence[int]] = 1
    sync_delay: int = 0
    sync_mix: float = 0.0
    sync_warmup: int = 0
    warmup_compressor: str | Compressor = "none"
    warmup_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_int("sync_every", self.sync_every, 1)
        check_int("sync_delay", self.sync_delay, 0)
        check_int("sync_warmup", self.sync_warmup, 0)
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int | Sequence):
            raise ValueError(f"Invalid fragments={self.fragments!r}: an int or groups of parameter positions")
        if not isinstance(self.fragments, int):  # the groups' cover of the parameters is checked against them
            groups = [list(g) for g in self.fragments]
            ints = all(not isinstance(i, bool) and isinstance(i, int) for g in groups for i in g)
            if not groups or not all(groups) or not ints:
                raise ValueError(
                    f"Invalid fragments={self.fragments!r:.80}: an int, or groups of parameter positions (ints), "
                    "none empty"
                )
        count = self.fragments if isinstance(self.fragments, int) else len(self.fragments)
        schedule(self.sync_every, count, self.sync_delay)
        mix = self.sync_mix
        if isinstance(mix, bool) or not isinstance(mix, int | float) or not 0 <= mix < 1:
            raise ValueError(f"Invalid sync_mix={mix!r}: must be in [0, 1) (0: take the outer update as it is)")
        if mix and not self.sync_delay:
            raise ValueError(
                f"Invalid sync_mix={mix!r} with sync_delay=0: mixing keeps the local progress made while a sync "
                "travels (Streaming DiLoCo's alpha); set sync_delay > 0 or sync_mix=0"
            )
        lr, momentum = self.outer_lr, self.outer_momentum
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr <= 10:  # NaN compares False
            raise ValueError(
                f"Invalid outer_lr={lr!r}: must be in (0, 10] (DiLoCo's is 0.7; 1 with outer_momentum 0 averages "
                "the replicas)"
            )
        if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0 <= momentum < 1:
            raise ValueError(f"Invalid outer_momentum={momentum!r}: must be in [0, 1) (DiLoCo's is 0.9)")
        if self.outer_lr_schedule not in ("constant", "inner"):
            raise ValueError(
                f"Invalid outer_lr_schedule={self.outer_lr_schedule!r}: 'constant', or 'inner' (scaled by the inner "
                "optimizer's schedule)"
            )
        _check_compressor("compressor", self.compressor, self.compressor_options)
        _check_compressor("warmup_compressor", self.warmup_compressor, self.warmup_options)
        if not self.sync_warmup and (self.warmup_compressor != "none" or self.warmup_options):
            given = (
                f"warmup_compressor={self.warmup_compressor!r}"
                if self.warmup_compressor != "none"
                else f"warmup_options={dict(self.warmup_options)!r}"
            )
            warnings.warn(
                f"{given} has no effect without sync_warmup: set sync_warmup (--sync-warmup N) or drop it",
                stacklevel=3,
            )


def _check_compressor(field: str, spec: object, options: Mapping[str, Any]) -> None:
    from powertrain.compress import compressor_class, make_compressor
    from powertrain.compress.base import Compressor

    if not isinstance(options, Mapping):
        raise ValueError(f"Invalid {field} options {options!r}: a mapping of option names to values")
    if isinstance(spec, Compressor):
        if options:
            raise ValueError(f"{field}'s options go with a compressor name; a Compressor instance has its own")
    elif isinstance(spec, str):
        compressor_class(spec)  # an unknown name is refused with the names to choose from
        # its constructor owns the checks of its options: run for no parameters (nothing is allocated), it refuses
        # an unknown option or a bad value now, not after the process groups are built
        auto = spec == "powersgd" and options.get("rank") == "auto"  # chosen at start-up; the rest checked now
        try:
            make_compressor(spec, [], **({**options, "rank": 4} if auto else options))
        except (TypeError, ValueError) as e:
            raise ValueError(f"Bad {field} {spec!r} options {dict(options)!r:.120}: {e}") from None
    else:
        raise ValueError(f"{field} must be a compressor name or a powertrain Compressor, got {type(spec).__name__}")


def schedule(sync_every: int, fragments: int, sync_delay: int) -> list[int]:
    """Each fragment's first sync step, for ``fragments`` (F >= 1) of them (fragment k at
    ``k * sync_every // fragments``; later ones every ``sync_every`` inner steps, never at step 0). ValueError,
    naming the value and the fix, unless at most one fragment starts per inner step and ``sync_delay`` is below the
    gap between two fragments' syncs (one sync in flight at a time)."""
    check_int("sync_every", sync_every, 1)
    check_int("fragments", fragments, 1)
    check_int("sync_delay", sync_delay, 0)
    if fragments > sync_every:
        raise ValueError(
            f"Invalid fragments={fragments} for sync_every={sync_every}: at most one fragment starts its "
            "sync per inner step; use fragments <= sync_every"
        )
    offsets = [k * sync_every // fragments for k in range(fragments)]
    gap = min(b - a for a, b in zip(offsets, [*offsets[1:], sync_every], strict=True))
    if sync_delay >= gap:
        raise ValueError(
            f"Invalid sync_delay={sync_delay}: must be below the {gap} inner steps between two fragments' syncs "
            f"(sync_every / fragments = {sync_every}/{fragments}), so that one sync is in flight at a time"
        )
    return offsets
