"""Time to a target loss on a slow link: each phase of a run at its step time measured on an emulated link.

A run is a sequence of phases, each timed on the link as a configuration of its own (:mod:`powertrain.bench.linktime`:
the real overlap, seconds per step):

* PowerSGD's exact warm-up: the fp32 all-reduce's step; then its compressed steps;
* local updates' warm-up of per-step gradient averaging: that compressor's step; then the local updates (their
  seconds per step over whole sync periods: the sync steps and the steps between them).

:func:`seconds_to` adds, for the first ``k`` steps of a run, each phase's steps times its measured seconds per step.
Per-step configurations are timed with one DDP bucket and with 2 MB buckets (which overlap backward), and the faster
counts. What was measured is kept in a JSON file, keyed by what decides a timing (the configuration, the model, the
rate), so a later call times only what is missing.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from powertrain import _json
from powertrain._files import write_atomic
from powertrain.bench.linktime import Timing, seconds_per_step
from powertrain.bench.sidebyside import Spec
from powertrain.models import GPTConfig

__all__ = ["Phase", "measure", "phases_of", "seconds_to", "timing_key"]

BUCKET_MB = 2.0  # the small buckets timed beside one bucket
ONE_BUCKET_MB = 1e6  # a DDP bucket larger than any model here: one message after backward, no overlap


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


#: bytes a file of kept bench results may hold (a row's curves and step times over a run to target take well under
#: 1 MB): a larger one in a reused --out is refused before it is read
KEPT_LIMIT = 16 << 20
SLOW = 5.0  # Mbit/s: below this a dense step takes minutes; fewer rounds, one bucket (the link dominates the step)


def _timing(spec: Spec, rate: float) -> Timing:
    """Rounds to time ``spec`` for at ``rate``: whole sync periods for local updates (from the end of the first; one
    period below :data:`SLOW`), a few steps for per-step configurations (fewer below :data:`SLOW`)."""
    if spec.parallel == "diloco":
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
    in the JSON file ``kept``). Per-step DDP configurations: the faster of one bucket and 2 MB buckets (one bucket
    below :data:`SLOW`). ``model`` None: ``powertrain train``'s 1-D ResNet."""
    shape = "resnet1d" if model is None else json.dumps(dataclasses.asdict(model), sort_keys=True)
    model_id = f"{shape}/b{batch}/w{world}"
    store: dict[str, float] = _json.load(kept, KEPT_LIMIT, "Kept link timings") if kept.exists() else {}
    unique = {timing_key(s): s for s in specs}
    out: dict[float, dict[str, float]] = {}
    for rate in rates:
        todo: list[tuple[str, Spec]] = []
        for key, spec in unique.items():
            for variant in _variants(spec, rate):
                if _store_key(model_id, rate, variant) not in store:
                    todo.append((key, variant))
        if todo:
            print(f"[time to target] {rate:g} Mbit/s: timing {len(todo)} configurations", file=sys.stderr)
        by_timing: dict[Timing, list[Spec]] = {}  # one launch per timing: no row takes another's rounds
        for _, variant in todo:
            by_timing.setdefault(_timing(variant, rate), []).append(variant)
        for timing, group in by_timing.items():
            got = seconds_per_step(
                group, [timing] * len(group), model=model, batch=batch, rate=rate, data_mb=data_mb, world=world
            )
            for variant, t in zip(group, got, strict=True):
                store[_store_key(model_id, rate, variant)] = t
            kept.parent.mkdir(parents=True, exist_ok=True)  # kept after every launch: a stopped call loses one
            write_atomic(kept, _json.dumps(store, indent=1) + "\n")
        out[rate] = {
            key: min(store[_store_key(model_id, rate, v)] for v in _variants(spec, rate))
            for key, spec in unique.items()
        }
    return out


#: PowerSGD's start for a spec timed in its exact phase (it never compresses while timed): :func:`_variants` keeps it
EXACT_ONLY = 1 << 30


def _variants(spec: Spec, rate: float) -> list[Spec]:
    """How ``spec`` is timed: compressing from its first step (PowerSGD's exact steps are a phase of their own,
    timed as a spec whose start is :data:`EXACT_ONLY`), with
    one bucket and (at :data:`SLOW` and above) with 2 MB buckets for a per-step DDP configuration."""
    if spec.kind == "torch_psgd":
        raise ValueError(
            f"{spec.label}: torch's PowerSGD hook needs exact steps first (start_powerSGD_iter > 1) and "
            "is not timed on the link; leave it out of the time to target"
        )
    if spec.kind == "powersgd" and spec.options.get("start_compressing_after_num_steps") != EXACT_ONLY:
        spec = dataclasses.replace(spec, options={**spec.options, "start_compressing_after_num_steps": 0})
    if spec.parallel != "ddp" or spec.bucket_cap_mb is not None or rate < SLOW:
        return [spec]
    return [spec, dataclasses.replace(spec, bucket_cap_mb=BUCKET_MB)]


def _store_key(model_id: str, rate: float, spec: Spec) -> str:
    return f"{model_id}@{rate:g}:{timing_key(spec)}"


def phases_of(spec: Spec, *, exact_warmup: int, exact: Spec) -> list[Phase]:
    """The phases of a run of ``spec``: ``exact_warmup`` steps timed as ``exact`` (PowerSGD's exact all-reduce steps),
    then ``spec`` itself; for local updates with a warm-up, that many steps of its warm-up compressor as a per-step
    configuration, then the local updates (timed without the warm-up)."""
    opts: Mapping[str, Any] = spec.optimizer_options
    if spec.parallel == "diloco" and opts.get("sync_warmup", 0):
        from powertrain.train.config import parse_compressor

        warm = int(opts["sync_warmup"])
        kind, options = parse_compressor(str(opts.get("warmup_compressor", "none")))
        inner = {k: v for k, v in opts.items() if k not in ("sync_warmup", "warmup_compressor")}
        # DiLoCo's warm-up sends the whole model's gradients in one blocking message after backward: one bucket
        per_step = Spec(
            f"{spec.label} warm-up",
            kind,
            options,
            bucket_cap_mb=ONE_BUCKET_MB,
            optimizer=spec.optimizer,
            optimizer_options={k: v for k, v in inner.items() if k in ("adam_freeze", "lr")},
        )
        local = dataclasses.replace(spec, optimizer_options=inner)
        exact_steps = min(warm, int(options.get("start_compressing_after_num_steps", 0))) if kind == "powersgd" else 0
        head = [Phase(exact_steps, exact)] if exact_steps else []
        return [*head, Phase(warm, per_step), Phase(None, local)]
    if exact_warmup:
        return [Phase(exact_warmup, exact), Phase(None, spec)]
    return [Phase(None, spec)]
