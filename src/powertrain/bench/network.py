"""``powertrain bench network``: configurations side by side on an emulated bandwidth-limited cluster.

For each link rate, 2 workers run in their own network namespaces (:mod:`powertrain.bench.netem`) and train every
configuration side by side (:mod:`powertrain.bench.sidebyside`) for a few timed rounds. First the emulation is
validated: a measured all-reduce against bytes / bandwidth, and the per-collective latency (alpha) is measured. What a
configuration costs in loss, and its time to a target loss with the real overlap on the link, is ``powertrain bench
quality``'s (:mod:`powertrain.bench.quality`).

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

The other benchmarks use :func:`modelled_bytes` and :func:`fsdp2_weight_bytes`; :func:`run_network_bench` returns a
typed :class:`Report`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import torch

from powertrain import _json
from powertrain.bench import plots
from powertrain.bench.netem import comm_seconds, unavailable
from powertrain.bench.report import cell, command, footer, publish, quartiles, rate_name, section, table
from powertrain.bench.rounds import Workload
from powertrain.bench.sidebyside import Spec, SpecResult, side_by_side
from powertrain.compress import make_compressor
from powertrain.models import GPT, GPTConfig

__all__ = [
    "PRESETS",
    "START",
    "Preset",
    "Report",
    "fsdp2_weight_bytes",
    "modelled_bytes",
    "run_network_bench",
]

START = 2  # PowerSGD's exact warm-up steps (both implementations): expensive on slow links
BUCKET_MB = 2.0  # several buckets: DDP hands each to the hook as backward produces it (overlap)
BACKWARD_SHARE = 2 / 3  # of the compute-only step: what several buckets can hide communication behind

#: The sweep's configurations in table order, by a stable key: the groups below and the results name them by it.
SPECS: dict[str, Spec] = {
    "compute": Spec("compute only (no communication)", "noop"),
    "fp32": Spec("DDP fp32", "plain"),
    "fp32-2mb": Spec("DDP fp32, 2 MB buckets", "plain", bucket_cap_mb=BUCKET_MB),
    "fp16": Spec("torch fp16_compress_hook", "torch_fp16"),
    "fp16-2mb": Spec("torch fp16_compress_hook, 2 MB buckets", "torch_fp16", bucket_cap_mb=BUCKET_MB),
    # torch's PowerSGD hook only runs with one bucket on gloo (several abort with a collective mismatch).
    "torch-r1": Spec("torch powerSGD_hook r1", "torch_psgd", {"rank": 1}),
    "torch-r4": Spec("torch powerSGD_hook r4", "torch_psgd", {"rank": 4}),
    "r4": Spec("powertrain powersgd r4", "powersgd", {"rank": 4, "variant": "alternating"}),
    "r1-2mb": Spec(
        "powertrain powersgd r1, 2 MB buckets", "powersgd", {"rank": 1, "variant": "alternating"}, BUCKET_MB
    ),
    "r4-2mb": Spec(
        "powertrain powersgd r4, 2 MB buckets", "powersgd", {"rank": 4, "variant": "alternating"}, BUCKET_MB
    ),
    # Algorithm 1 of the paper (P and Q every step, torch's hook's algorithm): the variant whose quality holds with
    # AdamW (bench quality compares it with the alternating, reference, variant).
    "r4-paper-2mb": Spec(
        "powertrain powersgd r4 paper, 2 MB buckets",
        "powersgd",
        {"rank": 4, "variant": "paper", "factor_dtype": "fp32"},
        BUCKET_MB,
    ),
    "int8-2mb": Spec("powertrain int8, 2 MB buckets", "int8", bucket_cap_mb=BUCKET_MB),
    "r4-reference": Spec(
        "powertrain powersgd r4, reference optimizer_step",
        "powersgd",
        {"rank": 4, "variant": "alternating"},
        parallel="reference",
    ),
    "fsdp-fp32": Spec("FSDP2 fp32", "none", parallel="fsdp"),
    "fsdp-r4": Spec("FSDP2 powertrain powersgd r4", "powersgd", {"rank": 4, "variant": "alternating"}, parallel="fsdp"),
}
COMPUTE = "compute"  # the compute-only row: every row's compute time
FP32 = ("fp32", "fp32-2mb")
SIXTEEN = ("fp16", "fp16-2mb")
_TORCH_HOOKS = ("plain", "torch_fp16", "torch_psgd")  # the DDP hooks that count nothing they send


@dataclasses.dataclass(frozen=True)
class Preset(Workload):
    rates: tuple[float | None, ...]  # Mbit/s; None: unthrottled
    max_comm_s: float  # rows whose modelled communication exceeds this per step are not run


PRESETS = {
    "default": Preset(
        GPTConfig(n_layer=4, n_head=4, d_model=256, block_size=128),
        16,
        START + 2,
        10,
        (None, 1000.0, 100.0, 10.0),
        4.0,
    ),
    "tiny": Preset(GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=32), 2, START + 1, 2, (None, 100.0), 4.0),
}


def fsdp2_weight_bytes(model: torch.nn.Module, world: int) -> float:
    """Payload (in :func:`powertrain.bench.netem.collective_seconds`' sense: each rank's own part) of FSDP2's
    weight all-gathers per step and rank, with each of ``model.blocks`` and the root wrapped: each block twice
    (forward, and again in backward after resharding), the root's own parameters once (FSDP2 keeps the root
    unsharded between forward and backward). One rule for every benchmark that computes it."""
    blocks = model.get_submodule("blocks")
    in_blocks = sum(p.numel() for p in blocks.parameters())
    rest = sum(p.numel() for p in model.parameters()) - in_blocks
    return 4.0 * (2 * in_blocks + rest) / world


def modelled_bytes(spec: Spec, model: torch.nn.Module, world: int = 2) -> dict[str, float]:
    """Payload bytes per step of ``spec`` by collective, computed before running: to decide what is affordable at a
    rate, and for torch's DDP hooks, which count nothing (all all-reduce)."""
    numel = sum(p.numel() for p in model.parameters())
    if spec.kind == "noop":
        return {}
    if spec.kind in ("plain", "torch_fp16"):
        return {"all_reduce": (4.0 if spec.kind == "plain" else 2.0) * numel}
    if spec.kind in ("powersgd", "torch_psgd"):
        # torch's hook compresses exactly the matrices the paper variant does (same rate rule) and sends P and Q, fp32
        hook = {"variant": "paper", "factor_dtype": "fp32"} if spec.kind == "torch_psgd" else {}
        opts = {**spec.options, **hook, "start_compressing_after_num_steps": 0}
        comp = make_compressor("powersgd", model.parameters(), **opts)
        out = {"all_reduce": float(comp.bytes_per_step(0) + comp.bytes_per_step(1)) / 2}  # type: ignore[attr-defined]
    elif spec.kind == "int8":
        out = {"all_gather": numel * (1.0 + 4.0 / 1024)}
    else:
        out = {"reduce_scatter" if spec.parallel == "fsdp" else "all_reduce": 4.0 * numel}
    if spec.parallel == "fsdp":
        out["all_gather_weights"] = fsdp2_weight_bytes(model, world)
    return out


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


@dataclasses.dataclass(frozen=True)
class Measured:
    """A configuration's step as the sweep measured it at one rate, over the timed rounds (each the slower rank's)."""

    median_s: float
    q1: float
    q3: float
    val_loss: float  # final, mean over ranks


@dataclasses.dataclass(frozen=True)
class Row:
    """A configuration at one rate: its payload, collectives and alpha-beta model, and its step as measured (None:
    not run there, its modelled communication too long; its step time is then the model's)."""

    spec: Spec
    by_op: dict[str, float]  # payload bytes per step by collective
    collectives: float  # per step
    compress_s: float | None  # powertrain's measurement; None: torch's hooks, or not run
    model_s: float  # serial: compute + compress + latency x collectives + bytes / bandwidth
    ideal_s: float  # the same, less what several buckets (or FSDP2) can hide behind backward
    measured: Measured | None

    @property
    def median_s(self) -> float:
        return self.model_s if self.measured is None else self.measured.median_s

    @property
    def total_bytes(self) -> float:
        return sum(self.by_op.values())

    def to_json(self) -> dict[str, Any]:
        m = self.measured
        timing = {} if m is None else {"q1": m.q1, "q3": m.q3, "val_loss": m.val_loss}
        return {
            "label": self.spec.label,
            "kind": self.spec.kind,
            "measured": m is not None,
            "median_s": self.median_s,
            **timing,
            "by_op": self.by_op,
            "bytes": self.total_bytes,
            "compress_s": self.compress_s,
            "collectives": self.collectives,
            "model_s": self.model_s,
            "ideal_s": self.ideal_s,
        }


@dataclasses.dataclass(frozen=True)
class RateResult:
    """The sweep at one link rate."""

    rate_mbit: float | None  # None: unthrottled
    check: dict[str, float] | None  # the emulation's validation; None unthrottled or on loopback
    rows: dict[str, Row]  # every configuration of SPECS, by key, in its order

    def best_s(self, keys: tuple[str, ...]) -> float:
        """The fastest step time of the rows ``keys``: the best fp32 (FP32) or 16-bit (SIXTEEN) baseline."""
        return min(self.rows[key].median_s for key in keys)

    def to_json(self) -> dict[str, Any]:
        """As in ``results.json``, and as :mod:`powertrain.bench.plots` reads it (step times by label)."""
        return {
            "rate_mbit": self.rate_mbit,
            "check": self.check,
            "rows": [r.to_json() for r in self.rows.values()],
            "best_fp32_s": self.best_s(FP32),
            "best_16_s": self.best_s(SIXTEEN),
            "step_s": {r.spec.label: r.median_s for r in self.rows.values()},
        }


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`run_network_bench` measured; ``to_json()`` is what it writes to ``results.json``."""

    preset: str
    emulated: bool  # False: loopback only
    rates: list[RateResult]
    break_even_mbit: dict[str, float | None]  # by key of SPECS, the compressing rows (see _break_even)

    def to_json(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "emulated": self.emulated,
            "rates": [e.to_json() for e in self.rates],
            "break_even_mbit": {SPECS[key].label: b for key, b in self.break_even_mbit.items()},
        }


def _measured(res: SpecResult) -> Measured:
    return Measured(*quartiles(res.step_times()), sum(r.val_loss for r in res.ranks) / len(res.ranks))


def _row(spec: Spec, res: SpecResult | None, model: GPT, rate: float | None, compute: float, latency: float) -> Row:
    """``spec`` at ``rate``: as it ran there (``res``), or modelled where it was not run. ``compute``: the compute-only
    row's median step time; ``latency``: seconds per collective."""
    compress: float | None = None
    measured: Measured | None = None
    if res is None:
        by_op = modelled_bytes(spec, model)
        collectives = _torch_collectives(spec, model) if spec.kind in _TORCH_HOOKS else 2.0
    else:
        counted = res.first.measured_stats  # powertrain counted its bytes, collectives and compression time
        by_op = dict(res.first.sent_per_step) if counted else modelled_bytes(spec, model)
        if spec.parallel == "fsdp":  # FSDP2's weight all-gathers are not ours to count: computed
            by_op["all_gather_weights"] = fsdp2_weight_bytes(model, 2)
        collectives = res.first.collectives if counted else _torch_collectives(spec, model)
        compress = max(r.compress_s for r in res.ranks) if counted else None
        measured = _measured(res)
    comm = comm_seconds(by_op, rate) + latency * collectives
    work = compute + (compress or 0.0)
    hidden = BACKWARD_SHARE * compute if _overlaps(spec) else 0.0
    return Row(spec, by_op, collectives, compress, work + comm, work + max(0.0, comm - hidden), measured)


def _break_even(unthrottled: dict[str, Row]) -> dict[str, float | None]:
    """Per compressing row (by key), the link rate (Mbit/s) above which the best 16-bit all-reduce row is faster in
    the serial alpha-beta model built on the unthrottled step times: T_c + k_c / B = T_16 + k_16 / B. None when
    compression is not slower even without a network (it then pays at every bandwidth)."""
    base = min((unthrottled[key] for key in SIXTEEN), key=lambda r: r.median_s)
    k16 = comm_seconds(base.by_op, 1.0)
    out: dict[str, float | None] = {}
    for key, r in unthrottled.items():
        if r.spec.kind in ("noop", "plain", "torch_fp16", "none"):
            continue
        extra = r.median_s - base.median_s
        saved = k16 - comm_seconds(r.by_op, 1.0)
        out[key] = saved / extra if extra > 0 and saved > 0 else (None if saved > 0 else 0.0)
    return out


def _sweep(p: Preset, model: GPT, emulate: bool) -> list[RateResult]:
    """Every rate of the preset (only unthrottled without ``emulate``): the affordable rows run, the others are
    modelled."""
    out = []
    latency = 0.0  # alpha, from the latest emulation check (an unthrottled run has none)
    for rate in p.rates if emulate else (None,):
        runnable = {k: s for k, s in SPECS.items() if comm_seconds(modelled_bytes(s, model), rate) <= p.max_comm_s}
        print(f"[bench network] {rate_name(rate)}: {len(runnable)} configurations", file=sys.stderr)
        ran, check = side_by_side(
            list(runnable.values()),
            rate=rate,
            emulate=emulate,
            check=rate is not None,  # validated first at a finite rate on an emulated cluster
            model=p.model,
            batch=p.batch,
            warmup=p.warmup,
            timed=p.timed,
            start=START,
        )
        latency = check["latency_s"] if check else latency
        results = dict(zip(runnable, ran, strict=True))
        compute = _measured(results[COMPUTE]).median_s  # every row's compute; the rows not run there are modelled
        rows = {key: _row(spec, results.get(key), model, rate, compute, latency) for key, spec in SPECS.items()}
        out.append(RateResult(rate, check, rows))
    return out


def _rate_section(e: RateResult) -> str:
    compute = e.rows[COMPUTE].median_s
    best_fp32, best_16 = e.best_s(FP32), e.best_s(SIXTEEN)
    cells = []
    for r in e.rows.values():
        m = r.measured
        communicates = m is not None and r.spec.kind != "noop"  # measured, with communication to expose
        exposed = r.median_s - compute - (r.compress_s or 0.0) if communicates else None
        cells.append(
            [
                r.spec.label + ("" if m else " (model, not run)"),
                f"{r.median_s:.3f}",
                f"{m.q1:.3f}-{m.q3:.3f}" if m else "-",
                f"{compute:.3f}",
                cell(r.compress_s),
                cell(exposed),
                f"{r.total_bytes / 1e6:.3f}",
                f"{r.model_s:.3f}",
                f"{r.ideal_s:.3f}",
                f"{r.median_s / r.ideal_s:.2f}" if communicates else "-",
                f"{best_fp32 / r.median_s:.2f}x",
                f"{best_16 / r.median_s:.2f}x",
                f"{m.val_loss:.4f}" if m else "-",
            ]
        )
    head = f"### {rate_name(e.rate_mbit)}"
    if e.check:
        head += (
            f"\n\nEmulation check: a {e.check['bytes'] / 1e6:.0f} MB all-reduce took {e.check['measured_s']:.3f} s, "
            f"the model says {e.check['expected_s']:.3f} s (ratio {e.check['ratio']:.2f}); "
            f"latency (4-byte all-reduce) {1e3 * e.check['latency_s']:.2f} ms."
        )
    headers = [
        "configuration",
        "s/step",
        "IQR",
        "compute",
        "compress",
        "exposed comm",
        "MB/step",
        "model (serial)",
        "ideal (overlap)",
        "measured/ideal",
        "vs fp32",
        "vs 16-bit",
        "val loss",
    ]
    return f"{head}\n\n{table(headers, cells)}"


def _break_even_section(report: Report) -> str:
    throttled = [e for e in report.rates if e.rate_mbit is not None]
    cells = []
    for key, b in report.break_even_mbit.items():
        wins = [rate_name(e.rate_mbit) for e in throttled if e.rows[key].median_s < e.best_s(SIXTEEN)]
        model_says = "every rate" if b is None else ("none" if b == 0 else f"{b:,.0f} Mbit/s")
        cells.append([SPECS[key].label, model_says, ", ".join(wins) or "none"])
    return (
        "### Where compression stops paying off\n\nBreak-even link rate against the best 16-bit all-reduce row, "
        "from the serial alpha-beta model on the unthrottled step times (above it, 16-bit all-reduce is faster), "
        "and the swept rates at which the row was measured faster than the best 16-bit row.\n\n"
        + table(["configuration", "break-even (model)", "measured faster than 16-bit at"], cells)
    )


def _markdown(report: Report, model: GPT, out: str | None) -> str:
    p = PRESETS[report.preset]
    sections = [_rate_section(e) for e in report.rates] + [_break_even_section(report)]
    return (
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
        + ("" if report.emulated else "**No emulated network was available: loopback only.** ")
        + "\n\n"
        + "\n\n".join(sections)
        + "\n\n"
        + footer(command("network", report.preset, *(["--out", out] if out else [])))
    )


def _write_out(d: Path, report: Report, text: str) -> None:
    """results.json, table.md and the plot (which reads the JSON form) in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    data = report.to_json()
    (d / "results.json").write_text(_json.dumps(data, indent=2) + "\n")
    (d / "table.md").write_text(text)
    plots.speedup_vs_bandwidth(data, d / "speedup_vs_bandwidth.png")


def run_network_bench(
    *, preset: str = "default", out: str | None = None, write: str | None = "BENCHMARKS.md"
) -> Report:
    """Run ``preset``'s sweep; write results.json, table.md and the plot to ``out`` (if given)
    and publish the Markdown section to ``write`` (if given)."""
    p = PRESETS[preset]
    reason = unavailable()
    emulate = reason is None
    if not emulate:
        print(f"No emulated network ({reason}): running unthrottled on loopback only.", file=sys.stderr)
    model = GPT(p.model)
    rates = _sweep(p, model, emulate)
    unthrottled = next(e for e in rates if e.rate_mbit is None)
    report = Report(preset, emulate, rates, _break_even(unthrottled.rows))
    text = _markdown(report, model, out)
    if out:
        _write_out(Path(out), report, text)
    publish(text, write, section("network", preset))
    return report
