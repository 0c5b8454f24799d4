"""Time to a target loss on a slow link: each phase of a run at its seconds per step measured on an emulated link.

A configuration's step on a slow link is not its compute plus its bytes over the link: DDP overlaps its buckets'
collectives with backward, and local updates (``parallel="diloco"``) send a sync every H steps, in the background of
the next steps when it has a delay. So each configuration trains for a while on an emulated cluster
(:class:`powertrain.bench.netem.EmulatedCluster`: one network namespace per worker, ``tc tbf`` on every link) and its
seconds per step are measured there (:func:`seconds_per_step`):

* configurations that finish their communication inside their step (every per-step compressor, local updates
  without a delay) run side by side in one launch, one step of each per round (one load for all of them); a step's
  time is the slower rank's, and a configuration's seconds per step the median over its timed rounds, or the mean
  over whole sync periods for local updates (their steps differ by design);
* local updates with a delay run alone: their syncs travel while later steps compute, and would share the link with
  the other configurations' collectives.

A run is a sequence of phases, each timed as a configuration of its own: PowerSGD's exact warm-up at the fp32
all-reduce's step (timing it compressing would cost minutes a step on a slow link), then its compressed steps.
:func:`seconds_to` adds, for the first ``k`` steps of a run, each phase's steps times its measured seconds per step.
Per-step configurations are timed as ``powertrain train`` builds them (DDP with torch's default buckets: 1 MiB, then
25 MiB). What was measured is kept in a JSON file, keyed by what decides a timing (the configuration, the model, the
rate), so a later call times only what is missing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from powertrain import _json
from powertrain._files import write_atomic
from powertrain.bench.sidebyside import Spec, SpecResult, side_by_side
from powertrain.models import GPTConfig

__all__ = [
    "Phase",
    "Timing",
    "measure",
    "median_steps",
    "overlaps",
    "phases_of",
    "seconds_per_step",
    "seconds_to",
    "timing_key",
]


@dataclasses.dataclass(frozen=True)
class Phase:
    """Steps ``[start, until)`` of a run (``until`` None: to its end), timed as ``spec``."""

    until: int | None
    spec: Spec


#: Optimizer options that do not change a step's time (a learning-rate sweep's rows share one timing).
_UNTIMED_OPTIONS = ("lr", "muon_lr")


def timing_key(spec: Spec) -> str:
    """What decides a configuration's step time (not its label, schedule length, target or learning rates)."""
    keep = dataclasses.asdict(spec)
    for k in ("label", "steps", "extra_steps", "stop_below"):
        keep.pop(k)
    keep["optimizer_options"] = {k: v for k, v in keep["optimizer_options"].items() if k not in _UNTIMED_OPTIONS}
    return json.dumps(keep, sort_keys=True)


def seconds_to(k: float, phases: Sequence[Phase], seconds: Mapping[str, float]) -> float:
    """Wall-clock of a run's first ``k`` steps: each phase's share of them times its seconds per step (``seconds``, by
    :func:`timing_key`)."""
    total, start = 0.0, 0.0
    for ph in phases:
        end = k if ph.until is None else min(k, ph.until)
        if end > start:
            total += (end - start) * seconds[timing_key(ph.spec)]
        start = max(start, end)
    return total


def median_steps(hits: Sequence[int | None]) -> float | None:
    """The median over seeds of the steps to the target, a seed that never reached it counting as more than any that
    did; None where that decides it (the median seed, or one of the two, did not reach it)."""
    ranked = sorted(hits, key=lambda h: math.inf if h is None else h)
    middle = ranked[(len(ranked) - 1) // 2 : len(ranked) // 2 + 1]
    return None if None in middle else statistics.mean(h for h in middle if h is not None)


#: bytes a file of kept bench results may hold (a row's curves and step times over a run to target take well under
#: 1 MB): a larger one in a reused --out is refused before it is read
KEPT_LIMIT = 16 << 20
SLOW = 5.0  # Mbit/s: below this a dense step takes minutes; fewer rounds (the link dominates the step)


def write_kept(path: Path, obj: object) -> None:
    """Kept results (JSON) to ``path`` whole or not at all (a stopped run leaves no half-written result)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, _json.dumps(obj, indent=1) + "\n")


def _periodic(spec: Spec) -> bool:
    """Whether ``spec``'s steps differ by design (local updates: a sync every H steps); a local-update spec with a
    warm-up is timed in it, every step alike (bench quality times a warm-up's phases apart)."""
    return spec.parallel == "diloco" and not spec.optimizer_options.get("sync_warmup")


def _timing(spec: Spec, rate: float) -> Timing:
    """Rounds to time ``spec`` for at ``rate``: whole sync periods for local updates (from the end of the first; one
    period below :data:`SLOW`), a few steps for per-step configurations (fewer below :data:`SLOW`)."""
    if _periodic(spec):
        period = int(spec.optimizer_options.get("sync_every", 1))
        return Timing(period, period if rate < SLOW else 2 * period)
    return Timing(1, 1) if rate < SLOW else Timing(2, 3)


def measure(
    specs: Sequence[Spec],
    rates: Sequence[float],
    *,
    model: GPTConfig | None,
    batch: int,
    data_mb: float,
    kept: Path,
    world: int = 2,
) -> dict[float, dict[str, float]]:
    """Seconds per step of every spec at every rate, by :func:`timing_key` (measured now, or kept from an earlier call
    in the JSON file ``kept``). ``model`` None: ``powertrain train``'s 1-D ResNet."""
    shape = "resnet1d" if model is None else json.dumps(dataclasses.asdict(model), sort_keys=True)
    model_id = f"{shape}/b{batch}/w{world}"
    store: dict[str, float] = _json.load(kept, KEPT_LIMIT, "Kept link timings") if kept.exists() else {}
    unique = {timing_key(s): s for s in specs}
    out: dict[float, dict[str, float]] = {}
    for rate in rates:
        todo = [t for t in (_timed(spec) for spec in unique.values()) if _store_key(model_id, rate, t) not in store]
        if todo:
            print(f"[time to target] {rate:g} Mbit/s: timing {len(todo)} configurations", file=sys.stderr)
        by_timing: dict[Timing, list[Spec]] = {}  # one launch per timing: no row takes another's rounds
        for spec in todo:
            by_timing.setdefault(_timing(spec, rate), []).append(spec)
        for timing, group in by_timing.items():
            got = seconds_per_step(
                group, [timing] * len(group), model=model, batch=batch, rate=rate, data_mb=data_mb, world=world
            )
            for spec, t in zip(group, got, strict=True):
                store[_store_key(model_id, rate, spec)] = t
            write_kept(kept, store)  # after every launch: a stopped call loses one
        out[rate] = {key: store[_store_key(model_id, rate, _timed(spec))] for key, spec in unique.items()}
    return out


#: PowerSGD's start for a spec timed in its exact phase (it never compresses while timed): :func:`_timed` keeps it
EXACT_ONLY = 1 << 30


def _timed(spec: Spec) -> Spec:
    """How ``spec`` is timed: compressing from its first step (PowerSGD's exact steps are a phase of their own, timed
    as a spec whose start is :data:`EXACT_ONLY`)."""
    if spec.kind == "torch_psgd":
        raise ValueError(
            f"{spec.label}: torch's PowerSGD hook needs exact steps first (start_powerSGD_iter > 1) and "
            "is not timed on the link; leave it out of the time to target"
        )
    if spec.kind == "powersgd" and spec.options.get("start_compressing_after_num_steps") != EXACT_ONLY:
        spec = dataclasses.replace(spec, options={**spec.options, "start_compressing_after_num_steps": 0})
    return spec


def _store_key(model_id: str, rate: float, spec: Spec) -> str:
    return f"{model_id}@{rate:g}:{timing_key(spec)}"


def phases_of(spec: Spec, *, exact_warmup: int, exact: Spec) -> list[Phase]:
    """The phases of a run of ``spec``: ``exact_warmup`` steps timed as ``exact`` (PowerSGD's exact all-reduce steps),
    then ``spec`` itself."""
    if exact_warmup:
        return [Phase(exact_warmup, exact), Phase(None, spec)]
    return [Phase(None, spec)]


# ---------------------------------------------------------------- seconds per step on the link


@dataclasses.dataclass(frozen=True)
class Timing:
    """How a configuration is timed: ``warmup`` rounds first (untimed), then ``timed`` rounds."""

    warmup: int
    timed: int


def overlaps(spec: Spec) -> bool:
    """Whether ``spec``'s communication outlives its step (local updates with a delay): it must be timed alone."""
    return spec.parallel == "diloco" and spec.optimizer_options.get("sync_delay", 0) > 0


def _per_step(spec: Spec, res: SpecResult) -> float:
    times = res.step_times()
    if _periodic(spec):  # whole periods: the sync steps and the steps between them
        period = int(spec.optimizer_options.get("sync_every", 1))
        n = len(times) // period * period
        return sum(times[:n]) / n
    return statistics.median(times)


def seconds_per_step(
    specs: list[Spec],
    timings: list[Timing],
    *,
    model: GPTConfig | None,
    batch: int,
    rate: float,
    data_mb: float,
    world: int = 2,
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
        results, _ = side_by_side(
            run,
            world=world,
            rate=rate,
            emulate=True,
            timeout=3600.0,
            model=model,
            batch=batch,
            warmup=warmup,
            timed=timed,
            start=0,
            data_mb=data_mb,
        )
        for i, spec, res in zip(group, run, results, strict=True):
            out[i] = _per_step(spec, res)
    assert all(t is not None for t in out), "every spec was timed"
    return [t for t in out if t is not None]
