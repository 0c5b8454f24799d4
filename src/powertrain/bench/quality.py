"""``powertrain bench quality``: what gradient compression costs in validation loss, and the time to a target loss.

For each horizon (a number of steps) and each seed, every row trains ``powertrain train``'s default GPT on 2
workers with the command's schedule over that horizon (AdamW, lr 1e-3, 20 warm-up steps, cosine to 0.1x), side by
side with the other rows of its launch (:mod:`powertrain.bench.sidebyside`: the same batches in the same order; the
seed sets the initial weights and the training batches; the validation batches are the same for every seed).

1. fp32 all-reduce runs first, every seed: its mean final validation loss + 1% is the **target**.
2. Every other row runs its horizon, then goes on at the schedule's final learning rate until an evaluation is at
   or below the target, for at most ``CAP`` x the horizon in all (run to target).

Per row: the validation loss at the horizon (mean over seeds and min-max), the bytes a worker sent over the horizon
(warm-up included) against fp32's, the steps to the target (the first evaluation at or below it) and the time to
the target at each link rate: each phase of those steps (PowerSGD's exact warm-up, the rest; a local-update row's
per-step warm-up, its exact steps apart) at its seconds per step
**measured on an emulated link** of that rate (:mod:`powertrain.bench.timetotarget`: the real overlap with backward,
the syncs of local updates amortised over whole periods; needs root for the network namespaces). torch's PowerSGD
hook is not timed on the link.

Local updates (``parallel="diloco"``: :class:`powertrain.diloco.DiLoCo`, the compressor on the outer step) are rows
like any other: ``--preset local`` runs the recommended configuration beside fp32, bf16, the per-step default and
DiLoCo at the paper's outer step (which torchft's DiLoCo matches bitwise, ``tests/test_bench_torchft.py``; the
repository's tools/torchft_diloco.py times the two on the link); the ``h<H>-<compressor>`` rows (:data:`GRID`) sweep
H and the outer compressor.

Every row's result is kept in ``out`` (one JSON file per horizon, seed and row, with the row's definition and the
preset; the timing launch in one more): a later call with more rows, seeds or horizons runs only what is missing,
and a run that was stopped continues where it was. A kept result is reused while its definition is unchanged and its
validation curve decides the current target (it reached it, or ran to the cap).
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from powertrain import _json
from powertrain._checks import check_int
from powertrain.bench import timetotarget
from powertrain.bench.network import modelled_bytes
from powertrain.bench.quality_text import markdown
from powertrain.bench.report import publish
from powertrain.bench.report import section as report_section
from powertrain.bench.sidebyside import Spec, SpecResult, side_by_side
from powertrain.models import GPT, GPTConfig, ResNet1d
from powertrain.train.config import (
    DEFAULT_OUTER_COMPRESSOR,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    DEFAULT_START,
    DEFAULT_SYNC_EVERY,
    POWERSGD_ADAM_FREEZE,
    parse_compressor,
)
from powertrain.train.strategy import Parallel

TARGET = 1.01
RATES = (1.0, 10.0, 100.0)  # Mbit/s
CAP = 3  # run to target: at most this many times the horizon in all
KEPT_FORMAT = 2  # kept results of another format are run again


@dataclasses.dataclass(frozen=True)
class Row:
    key: str  # names the row on the command line and in the kept results
    label: str
    kind: str  # a powertrain compressor name, or torch_psgd (torch's DDP hook)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: TrainConfig fields of the row's optimizer (AdamW with the command's schedule), e.g. {"adam_freeze": 0.1}; for
    #: local updates also the diloco fields (sync_every, fragments, sync_delay, sync_mix, outer_lr, outer_momentum)
    optimizer_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: ddp: the compressor averages every step's gradients; diloco: local updates, the compressor on the outer step
    parallel: Parallel = "ddp"
    #: False: the row trains its horizon only (its loss and bytes; a time to target only if it got there and is timed
    #: on the link), for rows known to end far above the target, which would otherwise train CAP x the horizon for
    #: nothing, and for local updates with a warm-up (whose bytes a run on to the target would spread)
    to_target: bool = True
    #: ``powertrain train``'s optimizer of the row (its options, e.g. ``lr`` or ``muon_lr``, in optimizer_options)
    optimizer: str = "adamw"


_R32 = {"rank": 32, "variant": "paper", "factor_dtype": "bf16"}
ADAM_FREEZE = POWERSGD_ADAM_FREEZE  # the command's with PowerSGD; the rows set it (or 0) themselves
_FROZEN = {"adam_freeze": ADAM_FREEZE}


def _powersgd(rank: int, *, frozen: bool = False, note: str = "") -> Row:
    """PowerSGD's paper variant at ``rank`` with bf16 factors, under torch's AdamW or (``frozen``) the command's."""
    optimizer = f"AdamW frozen at {ADAM_FREEZE:g}" if frozen else "torch's AdamW"
    return Row(
        f"r{rank}{'-frozen' if frozen else ''}",
        f"powertrain powersgd r{rank} paper, bf16 factors, {optimizer}{note}",
        "powersgd",
        {**_R32, "rank": rank},
        optimizer_options=_FROZEN if frozen else {},
    )


FP32 = Row("fp32", "fp32 all-reduce", "none")
ROWS = [
    FP32,
    Row("bf16", "bf16 all-reduce", "bf16"),
    Row("torch-r4", "torch powerSGD_hook r4", "torch_psgd", {"rank": 4}),
    Row("torch-r32", "torch powerSGD_hook r32", "torch_psgd", {"rank": 32}),
    _powersgd(8),
    _powersgd(8, frozen=True),
    _powersgd(16, frozen=True),
    _powersgd(32),
    _powersgd(48, frozen=True, note=" (the default at d_model 384)"),
    _powersgd(32, frozen=True, note=" (the default at d_model 256)"),
    Row("fp32-frozen", f"fp32 all-reduce, AdamW frozen at {ADAM_FREEZE:g}", "none", optimizer_options=_FROZEN),
    Row("int4", "powertrain int4", "int4"),
    Row(
        "alt-r4",
        "powertrain powersgd r4 (alternating, the reference's algorithm)",
        "powersgd",
        {"rank": 4, "variant": "alternating"},
    ),
]

#: local updates: averaged every H steps, what ``powertrain train --parallel diloco`` does by default
_AVG = {"outer_lr": DEFAULT_OUTER_LR, "outer_momentum": DEFAULT_OUTER_MOMENTUM}
_OUTER = {"none": ("none", {}), "int8": ("int8", {}), "int4": ("int4", {}), "r4": ("powersgd", {"rank": 4})}
LOCAL = Row(
    "local",
    f"powertrain local updates, the default (H {DEFAULT_SYNC_EVERY}, {DEFAULT_OUTER_COMPRESSOR} outer with error "
    f"feedback, outer lr {DEFAULT_OUTER_LR:g}, momentum {DEFAULT_OUTER_MOMENTUM:g})",
    *parse_compressor(DEFAULT_OUTER_COMPRESSOR),
    optimizer_options={"sync_every": DEFAULT_SYNC_EVERY, **_AVG},
    parallel="diloco",
)
STREAMING = dataclasses.replace(
    LOCAL,
    key="local-streaming",
    label=LOCAL.label[:-1] + ", streamed: 5 fragments, each sync overlapping 4 steps, half the local progress kept)",
    optimizer_options={**LOCAL.optimizer_options, "fragments": 5, "sync_delay": 4, "sync_mix": 0.5},
)
PAPER = Row(
    "diloco-paper",
    f"DiLoCo, the paper's outer step (Nesterov lr 0.7, momentum 0.9), fp32, H "
    f"{DEFAULT_SYNC_EVERY} (torchft's DiLoCo: the same run)",
    "none",
    optimizer_options={"sync_every": DEFAULT_SYNC_EVERY, "outer_lr": 0.7, "outer_momentum": 0.9},
    parallel="diloco",
    to_target=False,
)
#: the sweep of local updates: H x the outer step's compressor (with error feedback), averaging as the default does
GRID = [
    Row(
        f"h{h}-{c}",
        f"local updates H {h}, {c if c != 'none' else 'fp32'} outer",
        kind,
        opts,
        optimizer_options={"sync_every": h, **_AVG},
        parallel="diloco",
    )
    for h in (10, 25, 50, 100)
    for c, (kind, opts) in _OUTER.items()
]
#: what closes AdamW's gap to its own per-step DDP (issue 48; docs/notes/local-updates.md): the replicas train as one
#: for the first quarter (every step's gradients averaged by PowerSGD: r32, the paper variant, bf16 factors), AdamW's
#: second moment freezes at its end so that every replica keeps the same normaliser (that of per-step PowerSGD's
#: training), then short periods (H 5) keep the drift small. Its ``sync_warmup`` is a fraction of the horizon
#: (:func:`_spec` makes it steps); trained to its horizon only
WARM = Row(
    "local-h5-warm",
    f"local updates H 5, {DEFAULT_OUTER_COMPRESSOR} outer, the first {ADAM_FREEZE:.0%} of the steps averaged every "
    f"step (powersgd r32 paper, bf16 factors), AdamW frozen at {ADAM_FREEZE:g}",
    *parse_compressor(DEFAULT_OUTER_COMPRESSOR),
    optimizer_options={
        "sync_every": 5,
        **_AVG,
        "sync_warmup": ADAM_FREEZE,
        "warmup_compressor": "powersgd",
        **_FROZEN,
    },
    parallel="diloco",
    to_target=False,
)


#: the optimizer comparison (issue 47): AdamW's learning rate swept (fp32 is its 1e-3, the command's), the best
#: setting the target; Muon at a small sweep of its rate (AdamW at the command's 1e-3 on the rest), and behind
#: compressors (each rank then orthogonalizes every matrix: no all-gather of the results)
ADAMW_LRS = (5e-4, 2e-3, 3e-3)
MUON_LRS = (0.01, 0.02, 0.04, 0.08)
MUON_LR = 0.02  # of the compressed Muon rows
OPTIMIZER_ROWS = [
    *(
        Row(f"adamw-{lr:g}", f"fp32 all-reduce, AdamW lr {lr:g}", "none", optimizer_options={"lr": lr})
        for lr in ADAMW_LRS
    ),
    *(
        Row(
            f"muon-{lr:g}",
            f"fp32 all-reduce, Muon lr {lr:g}",
            "none",
            optimizer="muon",
            optimizer_options={"muon_lr": lr},
        )
        for lr in MUON_LRS
    ),
    Row("muon-int8", f"int8, Muon lr {MUON_LR:g}", "int8", optimizer="muon", optimizer_options={"muon_lr": MUON_LR}),
    *(
        Row(
            f"muon-r{rank}",
            f"powersgd r{rank} paper, bf16 factors, Muon lr {MUON_LR:g}",
            "powersgd",
            {**_R32, "rank": rank},
            optimizer="muon",
            optimizer_options={"muon_lr": MUON_LR},
        )
        for rank in (32, 8)
    ),
    # at uncompressed Muon's best rate and compressing from the first step: PowerSGD's exact warm-up is there for
    # AdamW's sake, and on a slow link its full-size steps weigh on the time to target
    *(
        Row(
            f"muon-r{rank}-0.04-start0",
            f"powersgd r{rank} paper, bf16 factors from step 0, Muon lr 0.04",
            "powersgd",
            {**_R32, "rank": rank, "start_compressing_after_num_steps": 0},
            optimizer="muon",
            optimizer_options={"muon_lr": 0.04},
        )
        for rank in (32, 16)
    ),
    # MuLoCo (arXiv 2505.23725): local updates with Muon inside, the command's default outer step
    dataclasses.replace(
        LOCAL,
        key="muon-local",
        label=LOCAL.label.replace("powertrain local updates, the default", "local updates with Muon lr 0.04 inside"),
        optimizer="muon",
        optimizer_options={**LOCAL.optimizer_options, "muon_lr": 0.04},
    ),
    # Dion sends its own factors (no gradient all-reduce). Its update P Q^T has Frobenius norm sqrt(r) against
    # Muon's sqrt(min(m, n)) (at rank 1/4 of the smaller side half of Muon's per entry, at 1/16 a quarter), which
    # suggested rates 2-4x Muon's; the first seed ended lowest at the sweep's lowest rate, so it reaches down to 0.01.
    # At full rank Dion's error feedback is plain momentum and its update tends to Muon's: that row tells what the
    # rank costs from what the algorithm does
    *(
        Row(
            f"dion-{frac:g}-{lr:g}",
            f"Dion {'full rank' if frac == 1 else f'rank 1/{1 / frac:g}'}, lr {lr:g} (its own factors)",
            "none",
            optimizer="dion",
            optimizer_options={"dion_rank": frac, "muon_lr": lr},
            to_target=False,  # compared with Muon at the horizon (loss and bytes): running on would cost hours here
        )
        for frac, lrs in ((1.0, (0.04,)), (0.25, (0.01, 0.02, 0.04, 0.08)), (0.0625, (0.02, 0.04, 0.08, 0.16)))
        for lr in lrs
    ),
]


#: the outer step across inner recipes (issue 48): Nesterov between plain averaging (``local``, lr 1, momentum 0) and
#: DiLoCo's paper (lr 0.7, momentum 0.9), each behind the default int4 outer compressor with error feedback, with AdamW
#: and with Muon inside, the rate held or (AdamW inside) following the inner schedule; a steady Nesterov step
#: multiplies the averaged progress by about lr / (1 - momentum): 2x, 3.5x and 7x here against averaging's 1x
OUTER_STEPS = ((1.0, 0.5), (0.7, 0.8), (0.7, 0.9))
_OUTER_INT4 = f"{DEFAULT_OUTER_COMPRESSOR} outer"
_MUON_LOCAL = next(r for r in OPTIMIZER_ROWS if r.key == "muon-local")


def _outer_row(prefix: str, inside: str, base: Row, lr: float, m: float, schedule: str = "constant") -> Row:
    tied = schedule == "inner"
    return dataclasses.replace(
        base,
        key=f"{prefix}outer-{'inner-' if tied else ''}{lr:g}-{m:g}",
        label=f"{inside} H {DEFAULT_SYNC_EVERY}, {_OUTER_INT4}, Nesterov lr {lr:g}"
        + (" x the inner schedule" if tied else "")
        + f", momentum {m:g}",
        optimizer_options={**base.optimizer_options, "outer_lr": lr, "outer_momentum": m}
        | ({"outer_lr_schedule": schedule} if tied else {}),
    )


_MUON_INSIDE = "local updates, Muon lr 0.04 inside,"
#: SparseLoCo's outer step (arXiv 2508.15706): top-k at 2% with 2-bit values, error feedback decayed by 0.95 in place
#: of outer momentum, the average applied as it is
SPARSELOCO = dataclasses.replace(
    LOCAL,
    key="outer-sparseloco",
    label=f"local updates H {DEFAULT_SYNC_EVERY}, SparseLoCo's outer (top-k 2%, 2-bit values, error feedback x 0.95)",
    kind="topk",
    options={"ratio": 0.02, "bits": 2, "error_decay": 0.95},
)
OUTER_ROWS = [
    SPARSELOCO,
    *(_outer_row("", "local updates", LOCAL, lr, m) for lr, m in OUTER_STEPS),
    *(_outer_row("", "local updates", LOCAL, lr, m, "inner") for lr, m in OUTER_STEPS),
    *(_outer_row("muon-", _MUON_INSIDE, _MUON_LOCAL, lr, m) for lr, m in OUTER_STEPS),
]
#: what the study runs on each recipe (an outer rate tied to a constant inner rate is the held one: not run again)
_OUTER_HELD = (
    "local",
    *(f"outer-{lr:g}-{m:g}" for lr, m in OUTER_STEPS),
    "diloco-paper",
    "outer-sparseloco",
    "muon-0.04",
    "muon-local",
    "muon-outer-1-0.5",
    "muon-outer-0.7-0.9",
)
_OUTER_TIED = ("outer-inner-1-0.5", "outer-inner-0.7-0.9")


@dataclasses.dataclass(frozen=True)
class Preset:
    model: GPTConfig | None  # the GPT's shape (stdlib corpus), or None: powertrain train's 1-D ResNet on mnist1d
    batch: int
    horizons: tuple[int, ...]
    seeds: int
    eval_every: int
    data_mb: float
    start: int  # exact warm-up steps of the PowerSGD rows (powertrain train's default: DEFAULT_START)
    #: horizon -> the only rows (keys) run at it besides fp32 (the long horizon costs hours); others: every row
    rows_at: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    workers: int = 2  # data-parallel workers (replicas, for local updates)
    rows: tuple[str, ...] | None = None  # the rows run when none are named (None: every row of ROWS)
    rates: tuple[float, ...] = RATES  # Mbit/s: the emulated links the time to target is measured on
    #: horizons at which no row runs on to the target (their loss and bytes at the horizon only): where the rows are
    #: known to end far above it and running on would cost CAP x hours
    horizon_only_at: tuple[int, ...] = ()
    #: the rows (keys) that set the target, each trained its horizon first: the lowest of their mean validation losses
    #: at the horizon, times ``target``. fp32 alone by default; a learning-rate sweep of the baseline's optimizer for
    #: the optimizer comparison (a baseline is tuned, never one setting)
    baseline: tuple[str, ...] = ("fp32",)
    target: float = TARGET
    #: TrainConfig fields every row of the preset trains with, fp32 included (a row's own options win): another
    #: inner recipe than the command's schedule, e.g. a constant learning rate
    recipe: dict[str, Any] = dataclasses.field(default_factory=dict)


#: the default GPT on the stdlib corpus, 2 x 16 sequences a step, 3 seeds at 300 and 1,000 steps: what most presets vary
_GPT = Preset(GPTConfig(256, 128, 4, 4, 256), 16, (300, 1000), 3, 25, 32.0, DEFAULT_START)
#: the outer-step study on the command's schedule (a study of losses: no time to target)
_OUTER_PRESET = dataclasses.replace(
    _GPT, horizons=(300,), rows=(*_OUTER_HELD, *_OUTER_TIED), horizon_only_at=(300,), rates=()
)

PRESETS = {
    "default": dataclasses.replace(_GPT, rows_at={1000: ("r32-frozen",)}),
    "tiny": Preset(GPTConfig(256, 32, 1, 2, 32), 2, (8,), 2, 2, 0.5, 2, rates=(1.0, 100.0)),
    # the second workload (issue 18): convolutions, classification; 2 x 32 samples a step, 16 epochs of mnist1d's 4,000
    "mnist1d": Preset(None, 32, (1000,), 5, 50, 0.0, DEFAULT_START),
    # a second text shape (issue 18): wider and shallower than the default, about as many parameters and FLOPs
    "wide": dataclasses.replace(_GPT, model=GPTConfig(256, 128, 2, 6, 384), horizons=(300,)),
    # local updates (issue 34) on the default GPT, beside the per-step rows they compete with
    "local": dataclasses.replace(
        _GPT,
        # the warm-up row beside the frozen-AdamW DDP it is measured against (issue 48's 1,000-step AdamW gap), and
        # bf16, the all-reduce the time to target is compared with
        rows_at={1000: ("bf16", "local", "fp32-frozen", "local-h5-warm")},
        # the local row ends 8.39% above fp32 there (the 1,000-step table): it would run CAP x the horizon in vain
        horizon_only_at=(1000,),
        rows=("bf16", "r32-frozen", "local", "local-streaming", "diloco-paper"),
    ),
    # Muon against a swept AdamW (issue 47): the target is the best AdamW's loss itself
    "muon": dataclasses.replace(
        _GPT,
        rows=("bf16", "local", *(r.key for r in OPTIMIZER_ROWS)),  # local: AdamW inside, beside Muon inside
        baseline=("fp32", *(f"adamw-{lr:g}" for lr in ADAMW_LRS)),
        target=1.0,
        # the long horizon: the AdamW sweep, Muon's best rate, local updates with AdamW and Muon inside (issue 48
        # names its targets at 1,000 steps), and the per-step compressed Muon rows
        rows_at={
            1000: (
                *(f"adamw-{lr:g}" for lr in ADAMW_LRS),
                "bf16",
                "muon-0.02",
                "muon-0.04",
                "muon-int8",
                "muon-r32",
                "muon-r16-0.04-start0",
                "muon-local",
                "local",
                "dion-0.25-0.02",
            )
        },
    ),
    # the outer step on two inner recipes (issue 48): the command's schedule, and a constant-rate AdamW (lr 3e-4, no
    # warm-up or decay, torch's default weight decay) on which DiLoCo's Nesterov outer step was seen to do better
    "outer": _OUTER_PRESET,
    "outer-const": dataclasses.replace(
        _OUTER_PRESET,
        rows=_OUTER_HELD,
        recipe={"lr": 3e-4, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.01},
    ),
}


def select_rows(keys: Sequence[str] | None) -> list[Row]:
    """The rows named by ``keys`` (all of :data:`ROWS` for None), fp32 first: it sets the target."""
    by_key = {r.key: r for r in [*ROWS, LOCAL, STREAMING, PAPER, *GRID, WARM, *OPTIMIZER_ROWS, *OUTER_ROWS]}
    if keys is None:
        return list(ROWS)
    unknown = [k for k in keys if k not in by_key]
    if unknown:
        raise ValueError(f"Unknown quality row(s) {', '.join(unknown)}: choose from {', '.join(by_key)}")
    return [FP32] + [by_key[k] for k in dict.fromkeys(keys) if k != FP32.key]


def rows_at(p: Preset, chosen: list[Row], steps: int) -> list[Row]:
    """The rows of ``chosen`` that run at horizon ``steps`` (the preset's ``rows_at``; fp32 always), none of them on
    to the target where the preset's ``horizon_only_at`` says so."""
    only = p.rows_at.get(steps)
    here = [r for r in chosen if only is None or r.key == FP32.key or r.key in only]
    if steps in p.horizon_only_at:
        here = [r if r.key == FP32.key else dataclasses.replace(r, to_target=False) for r in here]
    return here


def _spec(row: Row, steps: int, start: int, target: float | None) -> Spec:
    if row.optimizer_options.get("sync_warmup") and target is not None:
        raise ValueError(
            f"Row {row.key}: a local-update warm-up's bytes are not counted apart from the syncs' "
            "yet (they would be spread over a run to target): train it to its horizon only (to_target=False)"
        )
    optimizer_options = dict(row.optimizer_options)
    if isinstance(optimizer_options.get("sync_warmup"), float):  # a fraction of the horizon
        optimizer_options["sync_warmup"] = round(optimizer_options["sync_warmup"] * steps)
        if not optimizer_options["sync_warmup"]:  # e.g. a spec for the link (steps 0): it would time no warm-up
            raise ValueError(f"Row {row.key}: its warm-up is a fraction of the horizon, and {steps} steps leave none")
    opts = dict(row.options)
    if row.kind == "powersgd":  # local updates compress from their first sync
        opts.setdefault("start_compressing_after_num_steps", 0 if row.parallel == "diloco" else start)
    extra = 0 if target is None else (CAP - 1) * steps
    return Spec(
        row.key,
        row.kind,
        opts,
        steps=steps,
        optimizer=row.optimizer,
        extra_steps=extra,
        optimizer_options=optimizer_options,
        stop_below=target,
        parallel=row.parallel,
    )


def _launch(p: Preset, rows: list[Row], steps: int, seed: int, target: float | None) -> list[SpecResult]:
    """Train ``rows`` side by side over ``steps`` (to ``target``, if given)."""
    specs = [_spec(r, steps, p.start, target if r.to_target else None) for r in rows]
    print(
        f"[bench quality] {steps} steps, seed {seed}: {', '.join(r.key for r in rows)}"
        + (f", to target {target:.4f}" if target else ""),
        file=sys.stderr,
    )
    rounds = max(s.steps + s.extra_steps for s in specs)
    return side_by_side(
        specs,
        world=p.workers,
        model=p.model,
        batch=p.batch,
        warmup=0,
        timed=rounds,
        start=p.start,
        eval_every=p.eval_every,
        data_mb=p.data_mb,
        seed=seed,
    )[0]


#: A warm-up phase's link timing: a warm-up longer than any timing's rounds (a few steps: :func:`timetotarget.measure`
#: times a spec in its warm-up per step), so that every timed step averages its gradients (below the command's
#: default 300 steps, which the timing's specs run at)
WARMUP_ONLY = 100


def _warm_phases(p: Preset, row: Row, steps: int) -> list[timetotarget.Phase]:
    """The phases of a local-update row with a per-step warm-up, over a horizon of ``steps``: the warm-up
    compressor's exact steps, its compressed steps (each averaged after backward, by the compressor's program), then
    local updates. Each is timed as a spec that runs only that phase (a warm-up longer than its timing, or none)."""
    opts = dict(row.optimizer_options)
    frac_or_steps = opts.pop("sync_warmup")
    warm = round(frac_or_steps * steps) if isinstance(frac_or_steps, float) else int(frac_or_steps)
    name, warm_opts = parse_compressor(opts.pop("warmup_compressor", "none"))
    exact = min(warm, int(warm_opts.get("start_compressing_after_num_steps", 0))) if name == "powersgd" else 0
    local = _spec(dataclasses.replace(row, optimizer_options=opts), 0, p.start, None)

    def warming(start: int) -> Spec:
        given = {**warm_opts, "start_compressing_after_num_steps": start} if name == "powersgd" else warm_opts
        spec = f"{name}:" + ",".join(f"{k}={v}" for k, v in given.items()) if given else name
        options = {**opts, "sync_warmup": WARMUP_ONLY, "warmup_compressor": spec}
        return dataclasses.replace(local, optimizer_options=options)

    phases = [timetotarget.Phase(exact, warming(timetotarget.EXACT_ONLY))] if exact else []
    return [*phases, timetotarget.Phase(warm, warming(0)), timetotarget.Phase(None, local)]


def _phases(p: Preset, row: Row, steps: int) -> list[timetotarget.Phase] | None:
    """How a row's steps are timed on the link, over a horizon of ``steps`` (a local-update warm-up is a fraction of
    it); None: not timed (torch's hook)."""
    if row.kind == "torch_psgd":
        return None
    if row.optimizer_options.get("sync_warmup"):
        return _warm_phases(p, row, steps)
    spec = _spec(row, 0, p.start, None)
    warm = spec.options.get("start_compressing_after_num_steps", 0) if row.kind == "powersgd" else 0
    if row.optimizer == "muon" and warm:
        # the row's own exact steps: PowerSGD before it compresses, with Muon as the row runs it (behind a lossy
        # compressor every rank orthogonalizes every matrix: no all-gather, which fp32's Muon row sends)
        own = dataclasses.replace(
            spec, options={**spec.options, "start_compressing_after_num_steps": timetotarget.EXACT_ONLY}
        )
        return timetotarget.phases_of(spec, exact_warmup=int(warm), exact=own)
    # fp32's exact all-reduce behind the row's own optimizer (the same timing as fp32's row for AdamW rows)
    exact = dataclasses.replace(FP32, optimizer=row.optimizer, optimizer_options=dict(row.optimizer_options))
    return timetotarget.phases_of(spec, exact_warmup=int(warm), exact=_spec(exact, 0, p.start, None))


def _link(p: Preset, phases: dict[str, list[timetotarget.Phase] | None], kept: Path) -> dict[float, dict[str, float]]:
    """Seconds per step on the emulated link, at each rate, of every phase of every row (by timing key; a phase's
    timing does not depend on the horizon it was built for, only where it ends does)."""
    specs = [ph.spec for row_phases in phases.values() for ph in row_phases or []]
    return timetotarget.measure(
        specs, p.rates, model=p.model, batch=p.batch, data_mb=p.data_mb, kept=kept, world=p.workers
    )


def _measured(row: Row, res: SpecResult, p: Preset, model: GPT | ResNet1d) -> dict[str, Any]:
    """What the launch measured of ``row`` (``res``): validation curve, steps taken, bytes per exact and compressed
    step (by collective)."""
    r0 = res.first
    n = len(r0.losses)
    warm = (
        0
        if row.parallel == "diloco"
        else row.options.get("start_compressing_after_num_steps", p.start)
        if row.kind == "powersgd"
        else p.start
        if row.kind == "torch_psgd"
        else 0
    )
    warm = min(warm, n)
    dense = {"all_reduce": 4.0 * model.num_params()}
    if row.kind == "torch_psgd":  # torch's hook counts nothing: its exact warm-up, then the paper variant's P and Q
        low = modelled_bytes(Spec(row.key, "torch_psgd", row.options), model)
    else:  # counted as sent: the warm-up's dense all-reduces, then the compressor's messages
        total = {op: b * n for op, b in r0.sent_per_step.items()}
        low = {op: (b - warm * dense.get(op, 0.0)) / max(1, n - warm) for op, b in total.items()}
        low = {op: b for op, b in low.items() if b > 0.5}
    out = {"curve": r0.val_curve, "steps_run": n, "warm": warm, "dense": dense if warm else {}, "low": low}
    if r0.acc_curve is not None:  # a classifier
        out["acc_curve"] = r0.acc_curve
    return out


def _identity(row: Row, p: Preset) -> dict[str, Any]:
    """What decides a row's run: its kind and options, and the preset's model and data (not labels, horizons or
    seed counts)."""
    run = {k: v for k, v in dataclasses.asdict(row).items() if k != "label"}
    # the recipe is in every row's options already (an identity without it stays the one kept before it existed)
    labels = ("horizons", "seeds", "rows_at", "rows", "rates", "horizon_only_at", "recipe")
    preset = {k: v for k, v in dataclasses.asdict(p).items() if k not in labels}
    if p.model is None:  # since format 2, a classifier is evaluated on the whole validation split, with accuracy
        preset["eval"] = "val split, loss and accuracy"
    return json.loads(json.dumps({"format": KEPT_FORMAT, "row": run, "preset": preset}))


class _Kept:
    """The results kept in ``root``: one JSON file per (horizon, seed, row)."""

    def __init__(self, root: Path, p: Preset) -> None:
        self.root, self.preset = root, p

    def _path(self, steps: int, seed: int, row: Row) -> Path:
        return self.root / f"h{steps}" / f"s{seed}" / f"{row.key}.json"

    def get(self, steps: int, seed: int, row: Row, target: float | None) -> dict[str, Any] | None:
        """The kept result, if it is still this row's and its curve decides ``target`` (None: any curve does)."""
        path = self._path(steps, seed, row)
        if not path.exists():
            return None
        kept = _json.load(path, timetotarget.KEPT_LIMIT, "Kept quality result")
        if kept.get("identity") != _identity(row, self.preset):
            return None  # the row, the preset or the format changed since: run it again
        m = kept["measured"]
        if m["steps_run"] > CAP * steps:
            return None  # it ran past today's cap
        if target is not None and not (any(v <= target for _, v in m["curve"]) or m["steps_run"] >= CAP * steps):
            return None  # it stopped at an earlier, higher target
        return m

    def put(self, steps: int, seed: int, row: Row, measured: dict[str, Any]) -> None:
        kept = {"identity": _identity(row, self.preset), "label": row.label, "measured": measured}
        timetotarget.write_kept(self._path(steps, seed, row), kept)


#: where the results are kept without ``out``
KEPT = "runs/bench-quality"


def run_name(preset: str, workers: int) -> str:
    """A run's name, of its directory under ``out`` and of its section: the preset's, ``-w<workers>`` beyond 2."""
    return preset if workers == 2 else f"{preset}-w{workers}"


def run_quality_bench(
    *,
    preset: str = "default",
    rows: Sequence[str] | None = None,
    horizons: Sequence[int] | None = None,
    seeds: int | None = None,
    workers: int | None = None,
    rates: Sequence[float] | None = None,
    out: str | None = None,
    write: str | None = "BENCHMARKS.md",
    horizon_only: bool = False,
    section: str | None = None,
) -> dict[str, Any]:
    """Run what is missing of ``rows`` (keys of the rows :func:`select_rows` knows; the preset's by default) at
    ``horizons`` over ``seeds`` seeds on ``workers`` workers, the time to target at ``rates`` Mbit/s (the preset's by
    default; empty: no time to target, and no root needed), keeping results in ``out`` (default
    ``runs/bench-quality``), and publish the tables. Returns the report (also written to
    ``out/<preset>[-w<workers>]/report.json``). ``horizon_only``: no row runs on to the target (a quick comparison
    of losses and bytes; steps and time to target only for rows that reach it within the horizon). ``section``: the
    section of ``write`` to replace (default ``quality-<preset>[-w<workers>]``, ``quality`` for the default)."""
    if section is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", section):
        raise ValueError(
            f"Invalid section={section!r}: use lower-case letters, digits and '-', e.g. quality-local-warm"
        )
    p = PRESETS[preset]
    if workers is not None:
        check_int("workers", workers, 2, " (bench quality)")
        p = dataclasses.replace(p, workers=workers)
    if rates is not None:
        if any(isinstance(r, bool) or not isinstance(r, int | float) or not 0 < r < float("inf") for r in rates):
            raise ValueError(f"Invalid rates={list(rates)!r}: link rates are positive Mbit/s, e.g. 1,10,100")
        p = dataclasses.replace(p, rates=tuple(float(r) for r in rates))
    chosen = select_rows(p.rows if rows is None else rows)
    if p.recipe:
        chosen = [dataclasses.replace(r, optimizer_options={**p.recipe, **r.optimizer_options}) for r in chosen]
    if horizon_only:  # the baseline's rows train their horizon only anyway: their kept results stay theirs
        chosen = [r if r.key in p.baseline else dataclasses.replace(r, to_target=False) for r in chosen]
    horizons = tuple(horizons or p.horizons)
    n_seeds = p.seeds if seeds is None else seeds
    bad = [h for h in horizons if h < 1 or h % p.eval_every]
    if bad or n_seeds < 1:
        raise ValueError(
            f"Invalid horizons={list(horizons)} or seeds={n_seeds}: horizons must be positive multiples "
            f"of the preset's eval_every ({p.eval_every}), seeds >= 1"
        )
    model: GPT | ResNet1d = ResNet1d() if p.model is None else GPT(p.model)
    name = run_name(preset, p.workers)
    kept = _Kept(Path(out or KEPT) / name, p)
    report: dict[str, Any] = {"preset": preset, "workers": p.workers, "params": model.num_params(), "horizons": []}
    phases = {r.key: _phases(p, r, max(horizons)) for r in chosen}
    link = _link(p, phases, kept.root / "linktime.json")
    report["link_s"] = {
        str(rate): {
            r.key: [link[rate][timetotarget.timing_key(ph.spec)] for ph in phases[r.key] or []]
            for r in chosen
            if phases[r.key]
        }
        for rate in p.rates
    }
    for steps in horizons:
        here = rows_at(p, chosen, steps)
        base = [r for r in here if r.key in p.baseline]
        for seed in range(n_seeds):
            todo = [r for r in base if kept.get(steps, seed, r, None) is None]
            if todo:
                res = _launch(p, todo, steps, seed, None)
                for r, measured in zip(todo, res, strict=True):
                    kept.put(steps, seed, r, _measured(r, measured, p, model))
        means = {r.key: statistics.mean(_at(kept.get(steps, s, r, None), steps) for s in range(n_seeds)) for r in base}
        best = min(means, key=means.__getitem__)
        target = p.target * means[best]
        for seed in range(n_seeds):
            todo = [
                r for r in here if r not in base and kept.get(steps, seed, r, target if r.to_target else None) is None
            ]
            if todo:
                res = _launch(p, todo, steps, seed, target)
                for r, measured in zip(todo, res, strict=True):
                    kept.put(steps, seed, r, _measured(r, measured, p, model))
        # fp32 ran its horizon only: a seed that ended above the target has no curve that decides it, and needs none
        runs = {
            r.key: [kept.get(steps, s, r, target if r.to_target and r not in base else None) for s in range(n_seeds)]
            for r in here
        }
        phases = {r.key: _phases(p, r, steps) for r in here}
        summary = _summarise(here, runs, steps, target, p, phases, link)
        report["horizons"].append({**summary, "baseline": best, "baseline_rows": [r.key for r in base]})
    (kept.root / "report.json").write_text(_json.dumps(report, indent=1) + "\n")
    publish(markdown(report, p, n_seeds, CAP), write, section or report_section("quality", name))
    return report


def _at(m: dict[str, Any] | None, steps: int, curve: str = "curve") -> float:
    assert m is not None, "kept just now"
    return next(v for k, v in m[curve] if k == steps)


def _bytes(m: dict[str, Any], k: float) -> float:
    """Bytes a worker sends in a row's first k steps (a local-update row's warm-up is in its ``low``, an average over
    all its steps: exact at its horizon, the only k such a row is read at, as it never runs on to a target)."""
    warm = min(k, m["warm"])
    return warm * sum(m["dense"].values()) + (k - warm) * sum(m["low"].values())


def _summarise(
    rows: list[Row],
    runs: dict[str, list[Any]],
    steps: int,
    target: float,
    p: Preset,
    phases: dict[str, list[timetotarget.Phase] | None],
    link: dict[float, dict[str, float]],
) -> dict[str, Any]:
    fp32_bytes = statistics.mean(_bytes(m, steps) for m in runs[FP32.key])
    out: dict[str, Any] = {"steps": steps, "target": target, "rows": []}
    for row in rows:
        ms = runs[row.key]
        vals = [_at(m, steps) for m in ms]
        hits = [next((k for k, v in m["curve"] if v <= target), None) for m in ms]
        res: dict[str, Any] = {
            "key": row.key,
            "label": row.label,
            "to_target": row.to_target,
            "hits": hits,
            "ran": min(m["steps_run"] for m in ms),  # a row that trained its horizon only was not run on
            "val_mean": statistics.mean(vals),
            "val_min": min(vals),
            "val_max": max(vals),
            "fraction": statistics.mean(_bytes(m, steps) for m in ms) / fp32_bytes,
        }
        if "acc_curve" in ms[0]:
            accs = [_at(m, steps, "acc_curve") for m in ms]
            res.update(acc_mean=statistics.mean(accs), acc_min=min(accs), acc_max=max(accs))
        ph = phases[row.key]
        k = timetotarget.median_steps(hits)
        if k is not None and ph is not None:  # the median seed's steps
            res["seconds"] = {str(rate): timetotarget.seconds_to(k, ph, link[rate]) for rate in p.rates}
        out["rows"].append(res)
    return out
