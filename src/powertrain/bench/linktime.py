"""Seconds per training step on an emulated link, measured with the real overlap: what time to target is made of.

A configuration's step on a slow link is not its compute plus its bytes over the link: DDP overlaps its buckets'
collectives with backward, and local updates (``parallel="diloco"``) send a sync every H steps, in the background of
the next steps when it has a delay. So each configuration trains for a while on an emulated cluster
(:class:`powertrain.bench.netem.EmulatedCluster`: one network namespace per worker, ``tc tbf`` on every link) and its
seconds per step are measured there:

* configurations that finish their communication inside their step (every per-step compressor, local updates
  without a delay) run side by side in one launch, one step of each per round (one load for all of them); a step's
  time is the slower rank's, and a configuration's seconds per step the median over its timed rounds, or the mean
  over whole sync periods for local updates (their steps differ by design);
* local updates with a delay run alone: their syncs travel while later steps compute, and would share the link with
  the other configurations' collectives.

PowerSGD's exact warm-up is not timed (it would cost minutes a step on a slow link): the rows compress from their
first step here, and the exact steps of a run are costed at the fp32 row's measured step time.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

from powertrain.bench.sidebyside import Spec, SpecResult, launch_args, on_cluster
from powertrain.models import GPTConfig

__all__ = ["Timing", "overlaps", "seconds_per_step"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """How a configuration is timed: ``warmup`` rounds first (untimed), then ``timed`` rounds."""

    warmup: int
    timed: int


def overlaps(spec: Spec) -> bool:
    """Whether ``spec``'s communication outlives its step (local updates with a delay): it must be timed alone."""
    return spec.parallel == "diloco" and spec.optimizer_options.get("sync_delay", 0) > 0


def _period(spec: Spec) -> int:
    return int(spec.optimizer_options.get("sync_every", 1)) if spec.parallel == "diloco" else 1


def _per_step(spec: Spec, res: SpecResult) -> float:
    times = res.step_times()
    if spec.parallel == "diloco":  # whole periods: the sync steps and the steps between them
        period = _period(spec)
        n = len(times) // period * period
        return sum(times[:n]) / n
    return statistics.median(times)


def _launch(
    specs: list[Spec],
    *,
    model: GPTConfig | None,
    batch: int,
    rate: float,
    timing: Timing,
    data_mb: float,
    world: int,
    timeout: float,
) -> list[SpecResult]:
    args = launch_args(
        specs,
        model=model,
        batch=batch,
        warmup=timing.warmup,
        timed=timing.timed,
        start=0,
        data_mb=data_mb,
        timeout_s=timeout,
    )
    return on_cluster(args, world, rate, timeout=timeout)[0]


def seconds_per_step(
    specs: list[Spec],
    timings: list[Timing],
    *,
    model: GPTConfig | None,
    batch: int,
    rate: float,
    data_mb: float,
    world: int = 2,
    timeout: float = 3600.0,
) -> list[float]:
    """Each of ``specs`` trained on an emulated cluster of ``world`` workers whose links run at ``rate`` Mbit/s, for
    its :class:`Timing` (side by side where they can be, see the module; rows of one launch take the most rounds any of
    them asks for); returns the measured seconds per step, in order. Local updates should time whole periods
    (``timed`` a multiple of ``sync_every``). Specs train at a constant learning rate here: their schedule
    (``steps``) does not change a step's time."""
    if len(specs) != len(timings):
        raise ValueError(f"Got {len(specs)} specs and {len(timings)} timings: give one timing per spec")
    out: list[float | None] = [None] * len(specs)
    together = [i for i, s in enumerate(specs) if not overlaps(s)]
    groups = [together] if together else []
    groups += [[i] for i, s in enumerate(specs) if overlaps(s)]
    for group in groups:
        warmup = max(timings[i].warmup for i in group)
        timed = max(timings[i].timed for i in group)
        # a constant learning rate and no end of schedule (local updates would end theirs with one more sync)
        run = [dataclasses.replace(specs[i], steps=0, extra_steps=0, stop_below=None) for i in group]
        print(
            f"[link timing] {rate:g} Mbit/s: {', '.join(s.label for s in run)} ({warmup} + {timed} rounds)",
            file=sys.stderr,
        )
        results = _launch(
            run,
            model=model,
            batch=batch,
            rate=rate,
            timing=Timing(warmup, timed),
            data_mb=data_mb,
            world=world,
            timeout=timeout,
        )
        for i, spec, res in zip(group, run, results, strict=True):
            out[i] = _per_step(spec, res)
    assert all(t is not None for t in out), "every spec was timed"
    return [t for t in out if t is not None]
