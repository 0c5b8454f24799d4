"""``powertrain bench network``: DDP configurations side by side on an emulated bandwidth-limited cluster.

For each link rate, 2 workers run in their own network namespaces (:mod:`powertrain.bench.netem`) and
train every configuration side by side (:mod:`powertrain.bench.sidebyside`). First the emulation is
validated: a measured all-reduce against bytes / bandwidth. Each row then shows:

* the median step time (the slower rank's), its interquartile range and payload bytes per step;
* the alpha-beta model, i.e. the compute-only step (a no-op comm hook) plus the modelled time of the
  row's collectives, with no credit for overlap, and the measured/model ratio;
* speed against fp32 all-reduce and against 16-bit all-reduce, and the validation loss.

Configurations whose modelled communication exceeds ``max_comm_s`` per step at a rate are not run
there (fp32 at 10 Mbit/s would take ~11 s a step); their modelled time is shown instead, marked as such.
Without root or iproute2 the sweep falls back to loopback, labelled so.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from powertrain.bench import ddp
from powertrain.bench.ddp import computed_bytes
from powertrain.bench.netem import EmulatedCluster, collective_seconds, unavailable, validate
from powertrain.bench.report import machine_info, publish, table
from powertrain.bench.sidebyside import Spec
from powertrain.train.model import GPT, GPTConfig

START = 2  # PowerSGD's exact warm-up steps (both implementations): expensive on slow links

SPECS = [
    Spec("compute only (no communication)", "noop"),
    Spec("DDP fp32", "plain"),
    Spec("torch fp16_compress_hook", "torch_fp16"),
    Spec("torch powerSGD_hook r4", "torch_psgd", {"rank": 4}),
    Spec("powertrain powersgd r4", "powersgd", {"rank": 4}),
    # Several buckets: DDP hands each to the hook as backward produces it, so compression and communication
    # of the last layers overlap the backward of the first ones (torch's hook cannot: one bucket on gloo).
    Spec("powertrain powersgd r4, 2 MB buckets", "powersgd", {"rank": 4}, 2.0),
    Spec("powertrain int8", "int8"),
]


@dataclasses.dataclass(frozen=True)
class Preset(ddp.Preset):
    rates: tuple[float | None, ...]  # Mbit/s; None: unthrottled
    max_comm_s: float  # rows whose modelled communication exceeds this per step are not run


PRESETS = {
    "default": Preset(
        GPTConfig(n_layer=4, n_head=4, d_model=256, block_size=128), 16, START + 2, 8, (None, 1000.0, 100.0, 10.0), 4.0
    ),
    "tiny": Preset(GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=32), 2, START + 1, 2, (None, 100.0), 4.0),
}


def _model_bytes(spec: Spec, model: GPT) -> dict[str, float]:
    """Payload bytes per step by collective, before running (to decide what is affordable)."""
    if spec.kind in ("plain", "noop", "torch_fp16", "torch_psgd"):
        return computed_bytes(spec, model)
    from powertrain.compress import make_compressor

    opts = dict(spec.options)
    if spec.kind == "powersgd":
        opts["start_compressing_after_num_steps"] = 0
        comp = make_compressor("powersgd", model.parameters(), **opts)
        return {"all_reduce": float(comp.bytes_per_step(0) + comp.bytes_per_step(1)) / 2}  # type: ignore[attr-defined]
    numel = sum(p.numel() for p in model.parameters())
    return {"all_gather": numel * (1.0 + 4.0 / 1024)} if spec.kind == "int8" else {"all_reduce": 4.0 * numel}


def _comm_model(by_op: dict[str, float], rate: float | None) -> float:
    if rate is None:
        return 0.0
    return float(sum(collective_seconds(op, n, 2, rate) for op, n in by_op.items()))


def _run_rate(
    p: Preset, rate: float | None, specs: list[Spec], *, emulate: bool
) -> tuple[dict[int, Any], dict[str, float] | None]:
    args = {
        "specs": [dataclasses.asdict(s) for s in specs],
        "model": dataclasses.asdict(p.model),
        "batch": p.batch,
        "warmup": p.warmup,
        "timed": p.timed,
        "start": START,
    }
    cmd = [sys.executable, "-m", "powertrain.bench.sidebyside", json.dumps(args)]
    if not emulate:
        from powertrain.train.launch import launch

        return launch(_loopback_worker, 2, specs, p), None
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


def _loopback_worker(specs: list[Spec], p: Preset) -> dict[str, Any]:
    import torch.distributed as dist

    from powertrain.bench import sidebyside

    dist.init_process_group("gloo")
    out = sidebyside.run(specs, model=p.model, batch=p.batch, warmup=p.warmup, timed=p.timed, start=START)
    dist.destroy_process_group()
    return out


def run_network_bench(*, preset: str = "default", out: str | None = None, write: str | None = "BENCHMARKS.md") -> dict:
    p = PRESETS[preset]
    reason = unavailable()
    emulate = reason is None
    if not emulate:
        print(f"No emulated network ({reason}): running unthrottled on loopback only.", file=sys.stderr)
    model = GPT(p.model)
    rates = p.rates if emulate else (None,)
    report: dict[str, Any] = {"preset": preset, "emulated": emulate, "rates": []}
    sections = []
    for rate in rates:
        modelled = {s.label: _model_bytes(s, model) for s in SPECS}
        runnable = [s for s in SPECS if _comm_model(modelled[s.label], rate) <= p.max_comm_s]
        print(f"[bench network] {rate or 'unthrottled'} Mbit/s: {len(runnable)} configurations", file=sys.stderr)
        results, check = _run_rate(p, rate, runnable, emulate=emulate)
        ranks = sorted(results)
        med: dict[str, float] = {}
        rows: list[dict[str, Any]] = []
        for i, spec in enumerate(runnable):
            ts = sorted(
                max(results[r]["times"][i][j] for r in ranks) for j in range(len(results[ranks[0]]["times"][i]))
            )
            sent = results[ranks[0]]["sent_per_step"][i] or modelled[spec.label]
            med[spec.label] = statistics.median(ts)
            val = sum(results[r]["val_loss"][i] for r in ranks) / len(ranks)
            rows.append({"label": spec.label, "median_s": med[spec.label], "q1": ts[len(ts) // 4],
                         "q3": ts[(3 * len(ts)) // 4], "bytes": sum(sent.values()), "by_op": sent,
                         "val_loss": val, "measured": True})  # fmt: skip
        compute = med[SPECS[0].label]
        for spec in SPECS:
            if spec not in runnable:
                b = modelled[spec.label]
                rows.append({"label": spec.label, "median_s": compute + _comm_model(b, rate), "bytes": sum(b.values()),
                             "by_op": b, "measured": False})  # fmt: skip
        for row in rows:
            row["model_s"] = compute + _comm_model(row["by_op"], rate)
        by_label = {r["label"]: r for r in rows}
        fp32, fp16 = by_label["DDP fp32"]["median_s"], by_label["torch fp16_compress_hook"]["median_s"]
        cells = []
        for spec in SPECS:
            r = by_label[spec.label]
            tag = "" if r["measured"] else " (model, not run)"
            spread = f"{r['q1']:.3f}-{r['q3']:.3f}" if r["measured"] else "-"
            val = f"{r['val_loss']:.4f}" if r["measured"] else "-"
            ratio = f"{r['median_s'] / r['model_s']:.2f}" if r["measured"] and spec.kind != "noop" else "-"
            cells.append([spec.label + tag, f"{r['median_s']:.3f}", spread, f"{r['bytes'] / 1e6:.3f}",
                          f"{r['model_s']:.3f}", ratio, f"{fp32 / r['median_s']:.2f}x", f"{fp16 / r['median_s']:.2f}x",
                          val])  # fmt: skip
        head = f"### {'unthrottled (no tbf)' if rate is None else f'{rate:g} Mbit/s'}"
        if check:
            head += (
                f"\n\nEmulation check: a {check['bytes'] / 1e6:.0f} MB all-reduce took {check['measured_s']:.3f} s, "
                f"the model says {check['expected_s']:.3f} s (ratio {check['ratio']:.2f})."
            )
        headers = ["configuration", "s/step", "IQR", "MB/step", "model s/step", "measured/model", "vs fp32",
                   "vs 16-bit", "val loss"]  # fmt: skip
        sections.append(f"{head}\n\n{table(headers, cells)}")
        report["rates"].append({"rate_mbit": rate, "check": check, "rows": rows})
    text = (
        "## DDP on an emulated network (2 workers in network namespaces, tc tbf on every link)\n\n"
        f"GPT {p.model.n_layer} layers x d_model {p.model.d_model} ({model.num_params() / 1e6:.2f}M parameters), "
        f"{p.batch}x{p.model.block_size} tokens per worker, AdamW, one torch thread per worker, one DDP bucket "
        "unless the row says otherwise. "
        f"PowerSGD starts compressing after {START} exact steps (both implementations); {p.timed} timed rounds "
        f"after {p.warmup} warm-up rounds, each round one step of every configuration on the same batch. "
        "'model' is the alpha-beta estimate: the compute-only step plus bytes / bandwidth of the row's collectives "
        "(ring factors, TCP framing), no credit for overlap, so measured/model below 1 is communication hidden "
        "behind backward. Rows whose modelled communication exceeds "
        f"{p.max_comm_s:g} s a step are not run at that rate. "
        + ("" if emulate else "**No emulated network was available: loopback only.** ")
        + "\n\n" + "\n\n".join(sections)
        + f"\n\nMachine: {machine_info()}.\n\nCommand: `powertrain bench network"
        + ("" if preset == "default" else f" --preset {preset}") + "`\n"
    )  # fmt: skip
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "results.json").write_text(json.dumps(report, indent=2) + "\n")
        (Path(out) / "table.md").write_text(text)
    publish(text, write, "network" if preset == "default" else f"network-{preset}")
    return report
