"""``powertrain bench quality``: what gradient compression costs in validation loss, and the fastest way to a target.

For each horizon (a number of steps) and each seed, every row trains ``powertrain train``'s default GPT on 2
workers with the command's schedule over that horizon (AdamW, lr 1e-3, 20 warm-up steps, cosine to 0.1x), side by
side with the other rows (:mod:`powertrain.bench.sidebyside`: the same batches in the same order; the seed sets the
initial weights and the training batches; the validation batches are the same for every seed). Per row:

* final validation loss: mean over seeds and the spread (min-max);
* total bytes a worker sent over the whole run, warm-up included, as a fraction of fp32 all-reduce's;
* steps to the target: the first evaluation at or below fp32's final validation loss (mean over seeds) + 1%;
* time to the target at each link rate: those steps times the row's step time at that rate, from the serial
  alpha-beta model of :mod:`powertrain.bench.network` (compute-only step + the row's compression time, both
  measured here, + its bytes over the link): ``bench network`` measures how close real steps come to it.

Run to target (``run_to_target=True``): a row that has not reached the target at the end of the horizon keeps
training at the schedule's final learning rate, up to 3x the horizon, and stops at the first evaluation at or
below it; the headline table is each row's time to target at each link rate.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from powertrain.bench import network
from powertrain.bench.report import machine_info, publish, table
from powertrain.bench.sidebyside import Spec
from powertrain.train.config import DEFAULT_START
from powertrain.train.launch import launch
from powertrain.train.model import GPT, GPTConfig

TARGET = 1.01
RATES = (10.0, 100.0, 1000.0)  # Mbit/s


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    kind: str  # a powertrain compressor name, or torch_psgd (torch's DDP hook)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: TrainConfig fields of the row's optimizer (AdamW with the command's schedule), e.g. {"adam_freeze": 0.1}
    optimizer_options: dict[str, Any] = dataclasses.field(default_factory=dict)


_R32 = {"rank": 32, "variant": "paper", "factor_dtype": "bf16"}
#: AdamW's second moment frozen after a tenth of the steps (powertrain.optim.FrozenVarianceAdamW): 100 of 1,000 steps
#: closed PowerSGD's gap there; at 300 steps (frozen after 30) it cost far more than it saved (README).
ADAM_FREEZE = 0.1
_FROZEN = {"adam_freeze": ADAM_FREEZE}

ROWS = [
    Row("fp32 all-reduce", "none"),
    Row(f"fp32 all-reduce, AdamW frozen at {ADAM_FREEZE:g}", "none", optimizer_options=_FROZEN),
    Row("bf16 all-reduce", "bf16"),
    Row("torch powerSGD_hook r1", "torch_psgd", {"rank": 1}),
    Row("torch powerSGD_hook r4", "torch_psgd", {"rank": 4}),
    Row("powertrain powersgd r4 (alternating)", "powersgd", {"rank": 4, "variant": "alternating"}),
    Row("powertrain powersgd r32 paper, bf16 factors (the default)", "powersgd", _R32),
    Row(
        f"powertrain powersgd r32 paper, bf16 factors, AdamW frozen at {ADAM_FREEZE:g}",
        "powersgd",
        _R32,
        optimizer_options=_FROZEN,
    ),
    Row("powertrain int4", "int4"),
]


@dataclasses.dataclass(frozen=True)
class Preset:
    model: GPTConfig
    batch: int
    horizons: tuple[int, ...]
    seeds: int
    eval_every: int
    data_mb: float
    start: int  # exact warm-up steps of the PowerSGD rows (powertrain train's default: DEFAULT_START)


PRESETS = {
    "default": Preset(GPTConfig(256, 128, 4, 4, 256), 16, (300, 1000), 3, 25, 32.0, DEFAULT_START),
    "tiny": Preset(GPTConfig(256, 32, 1, 2, 32), 2, (8,), 2, 2, 0.5, 2),
}


def _specs(rows: list[Row], steps: int, start: int, target: float | None) -> list[Spec]:
    out = []
    for i, r in enumerate(rows):
        opts = dict(r.options)
        if r.kind == "powersgd":
            opts.setdefault("start_compressing_after_num_steps", start)
        extra = 0 if target is None or i == 0 else 2 * steps  # the first row, fp32, sets the target
        out.append(Spec(r.label, r.kind, opts, steps=steps, optimizer="adamw", extra_steps=extra,
                        optimizer_options=dict(r.optimizer_options), stop_below=target if extra else None))  # fmt: skip
    return out


def _one_run(p: Preset, rows: list[Row], steps: int, seed: int, target: float | None) -> dict[int, Any]:
    specs = _specs(rows, steps, p.start, target)
    rounds = max(s.steps + s.extra_steps for s in specs)
    args = {"specs": [dataclasses.asdict(s) for s in specs], "model": dataclasses.asdict(p.model), "batch": p.batch,
            "warmup": 0, "timed": rounds, "start": p.start, "eval_every": p.eval_every, "data_mb": p.data_mb,
            "seed": seed}  # fmt: skip
    print(f"[bench quality] {len(rows)} rows x {steps} steps, seed {seed}"
          + (f", to target {target:.4f}" if target else ""), file=sys.stderr)  # fmt: skip
    return launch(network._loopback_worker, 2, args)


def _row_result(row: Row, i: int, results: dict[int, Any], model: GPT, start: int) -> dict[str, Any]:
    r0 = results[0]
    n = len(r0["losses"][i])  # steps this row took
    if r0["measured_stats"][i]:
        total = sum(r0["sent_per_step"][i].values()) * n
        compress = statistics.median([results[r]["compress_s"][i] for r in results])
    else:  # torch's hook does not count: exact warm-up, then P and Q of the paper variant
        dense = network._model_bytes(Spec("fp32", "plain"), model)["all_reduce"]
        low = network._model_bytes(Spec(row.label, "torch_psgd", row.options), model)["all_reduce"]
        total, compress = dense * min(n, start) + low * max(0, n - start), 0.0
    times = [max(results[r]["times"][i][j] for r in results) for j in range(n)]
    return {"val_loss": r0["val_loss"][i], "val_curve": r0["val_curve"][i], "steps": n, "bytes": total,
            "compute_s": statistics.median(times), "compress_s": compress}  # fmt: skip


def seconds_to(k: float, row: dict[str, Any], rate: float) -> float:
    """Wall-clock of a row's first k steps at a link rate: its exact warm-up steps send dense gradients, the
    rest its compressed messages."""
    warm = min(k, row["warm"])
    link = network.collective_seconds
    return (k * row["step_compute_s"] + warm * link("all_reduce", row["dense_per_step"], 2, rate)
            + (k - warm) * link("all_reduce", row["bytes_per_step"], 2, rate))  # fmt: skip


def run_quality_bench(*, preset: str = "default", rows: list[Row] | None = None, out: str | None = None,
                      write: str | None = "BENCHMARKS.md", run_to_target: bool = False) -> dict[str, Any]:  # fmt: skip
    p = PRESETS[preset]
    rows = rows or ROWS
    assert rows[0].kind == "none", "the first row is the fp32 reference"
    model = GPT(p.model)
    report: dict[str, Any] = {"preset": preset, "params": model.num_params(), "horizons": []}
    for steps in p.horizons:
        per_seed = []
        for seed in range(p.seeds):
            results = _one_run(p, rows, steps, seed, None)
            per_seed.append([_row_result(r, i, results, model, p.start) for i, r in enumerate(rows)])
        fp32 = statistics.mean(s[0]["val_loss"] for s in per_seed)
        target = TARGET * fp32
        entry: dict[str, Any] = {"steps": steps, "target": target, "rows": []}
        if run_to_target:
            entry["to_target"] = [[_row_result(r, i, res, model, p.start) for i, r in enumerate(rows)]
                                  for res in (_one_run(p, rows, steps, s, target) for s in range(p.seeds))]  # fmt: skip
        for i, row in enumerate(rows):
            runs = [s[i] for s in per_seed]
            vals = [r["val_loss"] for r in runs]
            hits = [next((st for st, v in r["val_curve"] if v <= target), None) for r in runs]
            # the fp32 row's step on loopback stands for the compute step (its all-reduce there takes ~1-2%)
            compute = statistics.median(s[0]["compute_s"] for s in per_seed)
            # exact steps first (the PowerSGD rows' warm-up), then the row's own messages
            warm = (row.options.get("start_compressing_after_num_steps", p.start) if row.kind == "powersgd"
                    else p.start if row.kind == "torch_psgd" else 0)  # fmt: skip
            dense = statistics.mean(s[0]["bytes"] / s[0]["steps"] for s in per_seed)
            per_step = statistics.mean((r["bytes"] - dense * min(warm, r["steps"])) / max(1, r["steps"] - warm)
                                       for r in runs)  # fmt: skip
            res: dict[str, Any] = {
                "label": row.label, "val_mean": statistics.mean(vals), "val_min": min(vals), "val_max": max(vals),
                "bytes": statistics.mean(r["bytes"] for r in runs), "steps_to_target": hits,
                "compress_s": statistics.mean(r["compress_s"] for r in runs), "bytes_per_step": per_step,
                "warm": warm, "dense_per_step": dense,
            }  # fmt: skip
            res["fraction"] = res["bytes"] / (per_seed[0][0]["bytes"] or 1)
            res["step_compute_s"] = compute + res["compress_s"]
            if run_to_target:
                ran = [s[i] for s in entry["to_target"]]
                res["run_to_target"] = [next((st for st, v in r["val_curve"] if v <= target), None) for r in ran]
            entry["rows"].append(res)
        report["horizons"].append(entry)
    text = markdown(report, p)
    if out:
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    publish(text, write, "quality" if preset == "default" else f"quality-{preset}")
    return report


def _steps_text(hits: list[int | None]) -> str:
    reached = [h for h in hits if h is not None]
    if not reached:
        return "not reached"
    med = statistics.median(reached)
    return f"{med:g}" + (f" ({len(reached)}/{len(hits)} seeds)" if len(reached) < len(hits) else "")


def _seconds(t: float) -> str:
    return f"{t:,.0f} s" if t >= 100 else f"{t:.3g} s"


def markdown(report: dict[str, Any], p: Preset) -> str:
    parts = []
    for h in report["horizons"]:
        cells = []
        for r in h["rows"]:
            hits = r.get("run_to_target", r["steps_to_target"])
            reached = [x for x in hits if x is not None]
            times = [_seconds(seconds_to(statistics.median(reached), r, rate)) if len(reached) == len(hits) else "-"
                     for rate in RATES]  # fmt: skip
            fp32 = h["rows"][0]["val_mean"]
            cells.append([r["label"], f"{r['val_mean']:.4f} ({r['val_min']:.4f}-{r['val_max']:.4f})",
                          f"{100 * (r['val_mean'] / fp32 - 1):+.2f}%", f"1/{1 / r['fraction']:.1f}",
                          _steps_text(hits), *times])  # fmt: skip
        headers = ["configuration", "val loss, mean (min-max)", "vs fp32", "bytes vs fp32", "steps to target",
                   *[f"time to target @ {rate:g} Mbit/s" for rate in RATES]]  # fmt: skip
        parts.append(f"### {h['steps']} steps (target: validation loss {h['target']:.4f}, fp32's + 1%)\n\n"
                     + table(headers, cells))  # fmt: skip
    return (
        "## Quality: validation loss, bytes and time to a target loss\n\n"
        f"GPT {p.model.n_layer} layers x d_model {p.model.d_model} ({report['params'] / 1e6:.2f}M parameters), 2 "
        f"workers, {p.batch}x{p.model.block_size} tokens per worker per step, AdamW with `powertrain train`'s "
        "schedule over each horizon ('AdamW frozen at f': its second moment frozen after that fraction of the "
        f"steps, powertrain.optim.FrozenVarianceAdamW), {p.seeds} seeds (initial weights and training batches), "
        f"validation every {p.eval_every} steps on the same held-out batches. PowerSGD rows compress after {p.start} "
        "exact steps; bytes are a worker's total over the run, warm-up included. Time to target: steps to target x "
        "step time from the serial model (compute-only step and compression time measured here, bytes over a ring "
        "all-reduce), '-' "
        "where some seed did not reach it.\n\n" + "\n\n".join(parts) + f"\n\nMachine: {machine_info()}.\n"
    )
