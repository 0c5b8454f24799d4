"""``powertrain bench network``: configurations side by side on an emulated bandwidth-limited cluster.

Two parts, one command:

1. **Sweep** (step time). For each link rate, 2 workers run in their own network namespaces
   (:mod:`powertrain.bench.netem`) and train every configuration side by side
   (:mod:`powertrain.bench.sidebyside`) for a few timed rounds. First the emulation is validated: a
   measured all-reduce against bytes / bandwidth, and the per-collective latency (alpha) is measured.
2. **Quality** (loss). A longer run of the configurations whose math differs, on loopback (the network
   changes the time of a step, not its result): validation loss every few steps. Combined with the sweep's
   step times this gives validation loss against wall-clock at each rate, time to a target loss, and
   validation loss against bytes sent.

Per row of the sweep: median step time (the slower rank's) and interquartile range; the split into compute
(the compute-only row: a no-op comm hook), compression (powertrain's own measurement) and exposed
communication (the rest); payload bytes per step; the alpha-beta model and the measured/ideal ratio; speed
against the best fp32 and the best 16-bit all-reduce row at that rate (the well-tuned baselines).

The alpha-beta model of a row is ``compute + compression + latency x collectives + sum(bytes / bandwidth)``
over its collectives (ring factors, TCP framing; gloo runs reduce-scatter as an all-reduce). With no
overlap that is the whole step ("serial"). The "ideal" credits overlap: a row with several buckets (or
FSDP2) can hide communication behind backward, taken as 2/3 of the compute-only step; one bucket cannot.

Configurations whose modelled communication exceeds ``max_comm_s`` per step at a rate are not run there
(fp32 at 10 Mbit/s would take ~11 s a step); their modelled time is shown instead, marked as such. Without
root or iproute2 the sweep falls back to loopback, labelled so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from powertrain.bench import ddp, plots
from powertrain.bench.ddp import computed_bytes
from powertrain.bench.netem import EmulatedCluster, collective_seconds, unavailable, validate
from powertrain.bench.report import machine_info, publish, table
from powertrain.bench.sidebyside import Spec
from powertrain.models import GPT, GPTConfig

START = 2  # PowerSGD's exact warm-up steps (both implementations): expensive on slow links
BUCKET_MB = 2.0  # several buckets: DDP hands each to the hook as backward produces it (overlap)
BACKWARD_SHARE = 2 / 3  # of the compute-only step: what several buckets can hide communication behind

SPECS = [
    Spec("compute only (no communication)", "noop"),
    Spec("DDP fp32", "plain"),
    Spec("DDP fp32, 2 MB buckets", "plain", bucket_cap_mb=BUCKET_MB),
    Spec("torch fp16_compress_hook", "torch_fp16"),
    Spec("torch fp16_compress_hook, 2 MB buckets", "torch_fp16", bucket_cap_mb=BUCKET_MB),
    # torch's PowerSGD hook only runs with one bucket on gloo (several abort with a collective mismatch).
    Spec("torch powerSGD_hook r1", "torch_psgd", {"rank": 1}),
    Spec("torch powerSGD_hook r4", "torch_psgd", {"rank": 4}),
    Spec("powertrain powersgd r4", "powersgd", {"rank": 4, "variant": "alternating"}),
    Spec("powertrain powersgd r1, 2 MB buckets", "powersgd", {"rank": 1, "variant": "alternating"}, BUCKET_MB),
    Spec("powertrain powersgd r4, 2 MB buckets", "powersgd", {"rank": 4, "variant": "alternating"}, BUCKET_MB),
    # Algorithm 1 of the paper (P and Q every step, torch's hook's algorithm): the variant whose quality holds with
    # AdamW (bench quality compares it with the alternating, reference, variant).
    Spec(
        "powertrain powersgd r4 paper, 2 MB buckets",
        "powersgd",
        {"rank": 4, "variant": "paper", "factor_dtype": "fp32"},
        BUCKET_MB,
    ),
    Spec("powertrain int8, 2 MB buckets", "int8", bucket_cap_mb=BUCKET_MB),
    Spec(
        "powertrain powersgd r4, reference optimizer_step",
        "powersgd",
        {"rank": 4, "variant": "alternating"},
        parallel="reference",
    ),
    Spec("FSDP2 fp32", "none", parallel="fsdp"),
    Spec("FSDP2 powertrain powersgd r4", "powersgd", {"rank": 4, "variant": "alternating"}, parallel="fsdp"),
]
FP32 = ("DDP fp32", "DDP fp32, 2 MB buckets")
SIXTEEN = ("torch fp16_compress_hook", "torch fp16_compress_hook, 2 MB buckets")
#: The quality run: one row per distinct update rule (bucketing does not change any of these results).
QUALITY = (
    "DDP fp32, 2 MB buckets",
    "torch fp16_compress_hook, 2 MB buckets",
    "torch powerSGD_hook r1",
    "torch powerSGD_hook r4",
    "powertrain powersgd r1, 2 MB buckets",
    "powertrain powersgd r4, 2 MB buckets",
    "powertrain powersgd r4 paper, 2 MB buckets",
    "powertrain int8, 2 MB buckets",
)
TARGET = 1.01  # time to target: the first evaluation within 1% of fp32's final validation loss


@dataclasses.dataclass(frozen=True)
class Preset(ddp.Preset):
    rates: tuple[float | None, ...]  # Mbit/s; None: unthrottled
    max_comm_s: float  # rows whose modelled communication exceeds this per step are not run
    quality_steps: int  # steps of the quality run (0: skip it)
    eval_every: int


PRESETS = {
    "default": Preset(
        GPTConfig(n_layer=4, n_head=4, d_model=256, block_size=128), 16, START + 2, 10, (None, 1000.0, 100.0, 10.0),
        4.0, 300, 25,
    ),
    "tiny": Preset(
        GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=32), 2, START + 1, 2, (None, 100.0), 4.0, 4, 2
    ),
}  # fmt: skip


def _spec(label: str) -> Spec:
    return next(s for s in SPECS if s.label == label)


def fsdp2_weight_bytes(model: torch.nn.Module, world: int) -> float:
    """Payload (in :func:`powertrain.bench.netem.collective_seconds`' sense: each rank's own part) of FSDP2's
    weight all-gathers per step and rank, with each of ``model.blocks`` and the root wrapped: each block twice
    (forward, and again in backward after resharding), the root's own parameters once (FSDP2 keeps the root
    unsharded between forward and backward). One rule for every benchmark that computes it."""
    blocks = model.get_submodule("blocks")
    in_blocks = sum(p.numel() for p in blocks.parameters())
    rest = sum(p.numel() for p in model.parameters()) - in_blocks
    return 4.0 * (2 * in_blocks + rest) / world


def _model_bytes(spec: Spec, model: torch.nn.Module, world: int = 2) -> dict[str, float]:
    """Payload bytes per step by collective, before running (to decide what is affordable)."""
    if spec.kind in ("plain", "noop", "torch_fp16", "torch_psgd"):
        return computed_bytes(spec, model)
    from powertrain.compress import make_compressor

    numel = sum(p.numel() for p in model.parameters())
    if spec.kind == "powersgd":
        opts = {**spec.options, "start_compressing_after_num_steps": 0}
        comp = make_compressor("powersgd", model.parameters(), **opts)
        out = {"all_reduce": float(comp.bytes_per_step(0) + comp.bytes_per_step(1)) / 2}  # type: ignore[attr-defined]
    elif spec.kind == "int8":
        out = {"all_gather": numel * (1.0 + 4.0 / 1024)}
    else:
        out = {"reduce_scatter" if spec.parallel == "fsdp" else "all_reduce": 4.0 * numel}
    if spec.parallel == "fsdp":
        out["all_gather_weights"] = fsdp2_weight_bytes(model, world)
    return out


def _comm_seconds(by_op: dict[str, float], rate: float | None, world: int = 2) -> float:
    """Bandwidth time of one step's collectives. gloo runs a reduce-scatter as a full all-reduce."""
    if rate is None:
        return 0.0
    cost_op = {"reduce_scatter": "all_reduce", "all_gather_weights": "all_gather"}
    return float(sum(collective_seconds(cost_op.get(op, op), n, world, rate) for op, n in by_op.items()))


def _torch_collectives(spec: Spec, model: GPT) -> float:
    """Collectives per step of torch's hooks (they are not counted): one per bucket; PowerSGD's hook sends
    the uncompressed tensors, P and Q: three."""
    if spec.kind == "noop":
        return 0.0
    if spec.kind == "torch_psgd":
        return 3.0
    numel = sum(p.numel() for p in model.parameters())
    return float(max(1, math.ceil(4 * numel / ((spec.bucket_cap_mb or 100) * 2**20))))


def _overlaps(spec: Spec) -> bool:
    return spec.parallel == "fsdp" or (spec.parallel == "ddp" and spec.bucket_cap_mb is not None)


def _launch_args(p: Preset, specs: list[Spec], steps: int | None = None) -> dict[str, Any]:
    quality = steps is not None
    return {
        "specs": [dataclasses.asdict(s) for s in specs],
        "model": dataclasses.asdict(p.model),
        "batch": p.batch,
        "warmup": 0 if quality else p.warmup,
        "timed": steps if quality else p.timed,
        "start": START,
        "eval_every": p.eval_every if quality else 0,
    }


def _loopback_worker(args: dict[str, Any]) -> dict[str, Any]:
    """One rank under :func:`powertrain.train.launch.launch`; a single worker (run in this process, without
    the launcher's environment) gets a one-process group of its own."""
    import os

    import torch.distributed as dist

    from powertrain.bench import sidebyside
    from powertrain.train.launch import leave_world

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    args = dict(args)
    specs = [Spec(**s) for s in args.pop("specs")]
    out = sidebyside.run(specs, model=sidebyside.model_config(args.pop("model")), **args)
    leave_world()
    return out


def _run_rate(
    p: Preset, rate: float | None, specs: list[Spec], *, emulate: bool, steps: int | None = None
) -> tuple[dict[int, Any], dict[str, float] | None]:
    """Run ``specs`` side by side at ``rate``: the sweep's timed rounds, or ``steps`` steps with validation."""
    args = _launch_args(p, specs, steps)
    if not emulate:
        from powertrain.train.launch import launch

        return launch(_loopback_worker, 2, args), None
    cmd = [sys.executable, "-m", "powertrain.bench.sidebyside", json.dumps(args)]
    with EmulatedCluster(2, rate) as cluster:
        check = validate(cluster, megabytes=4.0) if rate is not None else None
        procs = [cluster.spawn(r, cmd) for r in range(2)]
        results = {}
        for r, proc in enumerate(procs):
            out, err = proc.communicate(timeout=3600)
            if proc.returncode != 0:
                raise RuntimeError(f"benchmark worker {r} at {rate} Mbit/s failed: {err.strip()[-1500:]}")
            results[r] = json.loads(out.strip().splitlines()[-1])
    return results, check


def _rows(rate: float | None, results: dict[int, Any], runnable: list[Spec], model: GPT,
          latency: float) -> list[dict[str, Any]]:  # fmt: skip
    """One dict per configuration at this rate: measured (or modelled, for rows not run) and the model."""
    ranks = sorted(results)
    rows: dict[str, dict[str, Any]] = {}
    for i, spec in enumerate(runnable):
        per_round = [max(results[r]["times"][i][j] for r in ranks) for j in range(len(results[ranks[0]]["times"][i]))]
        ts = sorted(per_round)
        r0 = results[ranks[0]]
        measured_stats = r0["measured_stats"][i]
        by_op = dict(r0["sent_per_step"][i]) if measured_stats else _model_bytes(spec, model)
        if spec.parallel == "fsdp":  # FSDP2's weight all-gathers are not ours to count: computed
            by_op["all_gather_weights"] = fsdp2_weight_bytes(model, 2)
        compress = max(results[r]["compress_s"][i] for r in ranks) if measured_stats else None
        rows[spec.label] = {
            "label": spec.label, "kind": spec.kind, "measured": True, "median_s": statistics.median(ts),
            "q1": ts[len(ts) // 4], "q3": ts[(3 * len(ts)) // 4], "by_op": by_op, "bytes": sum(by_op.values()),
            "compress_s": compress,
            "collectives": r0["collectives"][i] if measured_stats else _torch_collectives(spec, model),
            "val_loss": sum(results[r]["val_loss"][i] for r in ranks) / len(ranks),
        }  # fmt: skip
    compute = rows[SPECS[0].label]["median_s"]
    for spec in SPECS:
        if spec.label not in rows:
            b = _model_bytes(spec, model)
            n = _torch_collectives(spec, model) if spec.kind in ("plain", "torch_fp16", "torch_psgd") else 2.0
            rows[spec.label] = {"label": spec.label, "kind": spec.kind, "measured": False, "by_op": b,
                                "bytes": sum(b.values()), "compress_s": None, "collectives": n}  # fmt: skip
    for spec in SPECS:
        row = rows[spec.label]
        comm = _comm_seconds(row["by_op"], rate) + latency * row["collectives"]
        work = compute + (row["compress_s"] or 0.0)
        row["model_s"] = work + comm
        row["ideal_s"] = work + max(0.0, comm - (BACKWARD_SHARE * compute if _overlaps(spec) else 0.0))
        if not row["measured"]:
            row["median_s"] = row["model_s"]
    return [rows[s.label] for s in SPECS]


def _break_even(unthrottled: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per compressing row, the link rate (Mbit/s) above which the best 16-bit all-reduce row is faster in the
    serial alpha-beta model built on the unthrottled step times: T_c + k_c / B = T_16 + k_16 / B. None when
    compression is not slower even without a network (it then pays at every bandwidth)."""
    rows = {r["label"]: r for r in unthrottled}
    base = min((rows[label] for label in SIXTEEN), key=lambda r: r["median_s"])
    k16 = _comm_seconds(base["by_op"], 1.0)
    out: dict[str, float | None] = {}
    for r in unthrottled:
        if r["kind"] in ("noop", "plain", "torch_fp16", "none"):
            continue
        extra = r["median_s"] - base["median_s"]
        saved = k16 - _comm_seconds(r["by_op"], 1.0)
        out[r["label"]] = saved / extra if extra > 0 and saved > 0 else (None if saved > 0 else 0.0)
    return out


def _quality(p: Preset) -> dict[str, Any] | None:
    if not p.quality_steps:
        return None
    from powertrain.train.launch import launch

    specs = [_spec(label) for label in QUALITY]
    print(f"[bench network] quality: {len(specs)} configurations x {p.quality_steps} steps (loopback)", file=sys.stderr)
    results = launch(_loopback_worker, 2, _launch_args(p, specs, p.quality_steps))
    ranks = sorted(results)
    model = GPT(p.model)
    rows = []
    for i, spec in enumerate(specs):
        losses = [sum(results[r]["losses"][i][j] for r in ranks) / len(ranks) for j in range(p.quality_steps)]
        r0 = results[ranks[0]]
        by_op = r0["sent_per_step"][i] if r0["measured_stats"][i] else _model_bytes(spec, model)
        rows.append({"label": spec.label, "val_curve": r0["val_curve"][i], "val_loss": r0["val_loss"][i],
                     "train_loss": sum(losses[-10:]) / min(10, len(losses)),
                     "bytes_per_step": sum(by_op.values())})  # fmt: skip
    fp32 = rows[0]["val_loss"]
    for row in rows:
        row["vs_fp32"] = row["val_loss"] / fp32 - 1
        hit = [step for step, v in row["val_curve"] if v <= TARGET * fp32]
        row["steps_to_target"] = hit[0] if hit else None
    return {"steps": p.quality_steps, "eval_every": p.eval_every, "target": TARGET * fp32, "rows": rows}


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _rate_name(rate: float | None) -> str:
    return "unthrottled" if rate is None else f"{rate:g} Mbit/s"


def _rate_section(entry: dict[str, Any]) -> str:
    rows, check = entry["rows"], entry["check"]
    compute = rows[0]["median_s"]
    cells = []
    for r in rows:
        m = r["measured"]
        exposed = r["median_s"] - compute - (r["compress_s"] or 0.0) if m and r["kind"] != "noop" else None
        cells.append([
            r["label"] + ("" if m else " (model, not run)"), f"{r['median_s']:.3f}",
            f"{r['q1']:.3f}-{r['q3']:.3f}" if m else "-", f"{compute:.3f}", _fmt(r["compress_s"]), _fmt(exposed),
            f"{r['bytes'] / 1e6:.3f}", f"{r['model_s']:.3f}", f"{r['ideal_s']:.3f}",
            f"{r['median_s'] / r['ideal_s']:.2f}" if m and r["kind"] != "noop" else "-",
            f"{entry['best_fp32_s'] / r['median_s']:.2f}x", f"{entry['best_16_s'] / r['median_s']:.2f}x",
            _fmt(r.get("val_loss"), ".4f") if m else "-",
        ])  # fmt: skip
    head = f"### {_rate_name(entry['rate_mbit'])}"
    if check:
        head += (
            f"\n\nEmulation check: a {check['bytes'] / 1e6:.0f} MB all-reduce took {check['measured_s']:.3f} s, "
            f"the model says {check['expected_s']:.3f} s (ratio {check['ratio']:.2f}); "
            f"latency (4-byte all-reduce) {1e3 * check['latency_s']:.2f} ms."
        )
    headers = ["configuration", "s/step", "IQR", "compute", "compress", "exposed comm", "MB/step", "model (serial)",
               "ideal (overlap)", "measured/ideal", "vs fp32", "vs 16-bit", "val loss"]  # fmt: skip
    return f"{head}\n\n{table(headers, cells)}"


def _quality_section(quality: dict[str, Any], rates: list[dict[str, Any]]) -> str:
    headers = ["configuration", "train loss", "val loss", "val vs fp32", "steps to target"]
    headers += [f"time to target @ {_rate_name(e['rate_mbit'])}" for e in rates]
    cells = []
    for q in quality["rows"]:
        n = q["steps_to_target"]
        times = [f"{n * e['step_s'][q['label']]:.3g} s" if n else "not reached" for e in rates]
        cells.append([q["label"], f"{q['train_loss']:.4f}", f"{q['val_loss']:.4f}", f"{100 * q['vs_fp32']:+.2f}%",
                      n or "not reached", *times])  # fmt: skip
    return (
        f"### Quality: {quality['steps']} steps, validation every {quality['eval_every']}\n\n"
        f"Same model, data order and seed for every row; train loss is the mean of the last 10 steps. Target: "
        f"validation loss {quality['target']:.4f} (fp32's final value + {100 * (TARGET - 1):g}%). Time to target is "
        "the steps to reach it times the median step time measured at that rate in the sweep (evaluation "
        "excluded; rows not run at a rate use their model).\n\n" + table(headers, cells)
    )


def run_network_bench(*, preset: str = "default", out: str | None = None, write: str | None = "BENCHMARKS.md") -> dict:
    p = PRESETS[preset]
    reason = unavailable()
    emulate = reason is None
    if not emulate:
        print(f"No emulated network ({reason}): running unthrottled on loopback only.", file=sys.stderr)
    model = GPT(p.model)
    rates = p.rates if emulate else (None,)
    report: dict[str, Any] = {"preset": preset, "emulated": emulate, "rates": []}
    latency = 0.0
    for rate in rates:
        runnable = [s for s in SPECS if _comm_seconds(_model_bytes(s, model), rate) <= p.max_comm_s]
        print(f"[bench network] {_rate_name(rate)}: {len(runnable)} configurations", file=sys.stderr)
        results, check = _run_rate(p, rate, runnable, emulate=emulate)
        latency = check["latency_s"] if check else latency
        rows = _rows(rate, results, runnable, model, latency)
        by = {r["label"]: r for r in rows}
        report["rates"].append({
            "rate_mbit": rate, "check": check, "rows": rows,
            "best_fp32_s": min(by[label]["median_s"] for label in FP32),
            "best_16_s": min(by[label]["median_s"] for label in SIXTEEN),
            "step_s": {r["label"]: r["median_s"] for r in rows},
        })  # fmt: skip
    unthrottled = next(e for e in report["rates"] if e["rate_mbit"] is None)
    report["break_even_mbit"] = _break_even(unthrottled["rows"])
    report["quality"] = _quality(p)

    sections = [_rate_section(e) for e in report["rates"]]
    throttled = [e for e in report["rates"] if e["rate_mbit"] is not None]
    be_cells = []
    for label, b in report["break_even_mbit"].items():
        wins = [_rate_name(e["rate_mbit"]) for e in throttled if e["step_s"][label] < e["best_16_s"]]
        model_says = "every rate" if b is None else ("none" if b == 0 else f"{b:,.0f} Mbit/s")
        be_cells.append([label, model_says, ", ".join(wins) or "none"])
    sections.append(
        "### Where compression stops paying off\n\nBreak-even link rate against the best 16-bit all-reduce row, "
        "from the serial alpha-beta model on the unthrottled step times (above it, 16-bit all-reduce is faster), "
        "and the swept rates at which the row was measured faster than the best 16-bit row.\n\n"
        + table(["configuration", "break-even (model)", "measured faster than 16-bit at"], be_cells)
    )
    if report["quality"]:
        sections.append(_quality_section(report["quality"], report["rates"]))
    text = (
        "## Side by side on an emulated network (2 workers in network namespaces, tc tbf on every link)\n\n"
        f"GPT {p.model.n_layer} layers x d_model {p.model.d_model} ({model.num_params() / 1e6:.2f}M parameters), "
        f"{p.batch}x{p.model.block_size} tokens per worker, AdamW lr 1e-3, one torch thread per worker; DDP with "
        "one bucket unless the row says otherwise. "
        f"PowerSGD starts compressing after {START} exact steps (both implementations); {p.timed} timed rounds "
        f"after {p.warmup} warm-up rounds, each round one step of every configuration on the same batch; step "
        "time is the slower rank's. Columns: compute = the compute-only row; compress = powertrain's measured "
        "compression time ('-': torch's hooks, not measurable from outside, so it is in their exposed comm); "
        "model (serial) = compute + compress + latency x collectives + bytes / bandwidth (ring factors, TCP "
        "framing, gloo's reduce-scatter = all-reduce, FSDP2's weight all-gathers computed); ideal (overlap) = the "
        f"same with up to {BACKWARD_SHARE:.2f} x compute of communication hidden behind backward for rows with "
        "several buckets or FSDP2. vs fp32 / vs 16-bit: speed against the fastest fp32 / 16-bit row at that rate. "
        f"Rows whose modelled communication exceeds {p.max_comm_s:g} s a step are not run at that rate. "
        + ("" if emulate else "**No emulated network was available: loopback only.** ")
        + "\n\n" + "\n\n".join(sections)
        + f"\n\nMachine: {machine_info()}.\n\nCommand: `powertrain bench network"
        + ("" if preset == "default" else f" --preset {preset}") + (f" --out {out}" if out else "") + "`\n"
    )  # fmt: skip
    if out:
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "results.json").write_text(json.dumps(report, indent=2) + "\n")
        (d / "table.md").write_text(text)
        plots.speedup_vs_bandwidth(report, d / "speedup_vs_bandwidth.png")
        if report["quality"]:
            plots.val_loss_curves(report["quality"], report["rates"], d / "val_loss.png")
    publish(text, write, "network" if preset == "default" else f"network-{preset}")
    return report
