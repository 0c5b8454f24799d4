"""The Markdown of ``powertrain bench quality``: one table per horizon, the fastest rows per link rate, the link's
seconds per step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from powertrain.bench.report import machine_info, table
from powertrain.bench.timetotarget import median_steps
from powertrain.models import GPTConfig


class Preset(Protocol):
    """What the Markdown says of a :class:`powertrain.bench.quality.Preset` (that module imports this one, so this one
    names the fields it reads rather than import it back)."""

    @property
    def model(self) -> GPTConfig | None: ...
    @property
    def batch(self) -> int: ...
    @property
    def eval_every(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def workers(self) -> int: ...
    @property
    def rates(self) -> tuple[float, ...]: ...
    @property
    def baseline(self) -> tuple[str, ...]: ...
    @property
    def target(self) -> float: ...
    @property
    def recipe(self) -> dict[str, Any]: ...


__all__ = ["markdown"]


def _seconds(t: float) -> str:
    return f"{t:,.0f} s" if t >= 100 else f"{t:.3g} s"


def _hits_text(hits: list[int | None], cap: int) -> str:
    """The median seed's steps to the target (as the time to target takes them), and how many seeds reached it."""
    reached = [h for h in hits if h is not None]
    if not reached:
        return f"not within {cap:,}"
    med = median_steps(hits)
    if len(reached) == len(hits):
        return f"{med:g}"
    return f"{med:g} ({len(reached)}/{len(hits)} seeds)" if med is not None else f"{len(reached)}/{len(hits)} seeds"


def _speedups(h: dict[str, Any], rates: Sequence[float]) -> list[str]:
    """Per rate: the fastest row to the target, and powertrain's fastest against bf16 and the per-step default."""
    lines = []
    timed = [r for r in h["rows"] if "seconds" in r]
    for rate in rates:
        if not timed:
            break
        t = {r["key"]: r["seconds"][str(rate)] for r in timed}
        best = min(timed, key=lambda r: t[r["key"]])
        parts = [f"fastest {best['label']} ({_seconds(t[best['key']])})"]
        ours = [r for r in timed if not r["key"].startswith(("torch-", "fp32", "bf16", "diloco-paper"))]
        if ours:
            mine = min(ours, key=lambda r: t[r["key"]])
            for ref in ("bf16", "r32-frozen", "diloco-paper"):
                if ref in t and ref != mine["key"]:
                    parts.append(f"powertrain's fastest ({mine['key']}) {t[ref] / t[mine['key']]:.2f}x {ref}'s time")
        lines.append(f"- {rate:g} Mbit/s: " + "; ".join(parts))
    return lines


def _link_text(link_s: dict[str, dict[str, list[float]]], rates: Sequence[float]) -> str:
    """Each row's seconds per step on the link (one figure per phase, '/'-separated), at every rate."""
    if not rates:
        return ""
    rows = [
        f"{key} " + ", ".join(f"{'/'.join(f'{t:.3g}' for t in link_s[str(r)][key])} s at {r:g} Mbit/s" for r in rates)
        for key in link_s[str(rates[0])]
    ]
    return "\n\nSeconds per step on the link (per phase, '/'-separated): " + "; ".join(rows) + "."


def _target_text(p: Preset, ran: Sequence[str], margin: str) -> str:
    """What the target is: fp32's mean + 1% (``margin``), or the best of the baseline's sweep (``ran``: its rows that
    ran)."""
    if list(ran) == ["fp32"]:  # no sweep, or only its fp32 row ran
        what = f"fp32's mean validation loss at the horizon{margin}"
    else:
        what = (
            f"the lowest mean validation loss at the horizon of the baseline's learning-rate sweep ({', '.join(ran)}: "
            f"each trained its horizon only){margin}"
        )
    if p.baseline == ("fp32",):
        return what
    return (
        f"{what}; Muon rows: powertrain.optim.Muon on the hidden matrices at the row's rate, AdamW at the command's "
        "--lr on the rest, the same schedule"
    )


def markdown(report: dict[str, Any], p: Preset, seeds: int, cap: int) -> str:
    """The report of :func:`powertrain.bench.quality.run_quality_bench` as BENCHMARKS.md's section."""
    parts = []
    margin = f" + {100 * (p.target - 1):.3g}%" if p.target != 1 else ""
    for h in report["horizons"]:
        base = h.get("baseline", "fp32")  # the row that set the target (the best of a sweep), compared with
        fp32 = next(r for r in h["rows"] if r["key"] == base)
        accuracy = "acc_mean" in fp32  # a classifier
        cells = []
        for r in h["rows"]:
            cap_steps = (cap if r.get("to_target", True) else 1) * h["steps"]
            times = [_seconds(r["seconds"][str(rate)]) if "seconds" in r else "-" for rate in p.rates]
            acc = (
                [
                    f"{100 * r['acc_mean']:.2f}% ({100 * r['acc_min']:.1f}-{100 * r['acc_max']:.1f})",
                    f"{100 * (r['acc_mean'] - fp32['acc_mean']):+.2f}",
                ]
                if accuracy
                else []
            )
            cells.append(
                [
                    r["label"],
                    f"{r['val_mean']:.4f} ({r['val_min']:.4f}-{r['val_max']:.4f})",
                    f"{100 * (r['val_mean'] / fp32['val_mean'] - 1):+.2f}%",
                    *acc,
                    f"1/{1 / r['fraction']:.1f}",
                    _hits_text(r["hits"], min(cap_steps, r.get("ran", cap_steps))),
                    *times,
                ]
            )
        acc_headers = [f"accuracy at {h['steps']}, mean (min-max)", "vs fp32 (points)"] if accuracy else []
        headers = [
            "configuration",
            f"val loss at {h['steps']}, mean (min-max)",
            f"vs {base}",
            *acc_headers,
            "bytes vs fp32",
            "steps to target",
            *[f"time to target @ {rate:g} Mbit/s" for rate in p.rates],
        ]
        swept = h.get("baseline_rows", list(p.baseline))  # the baseline's rows that ran at this horizon
        origin = "fp32's mean" if swept == ["fp32"] else f"the best of {', '.join(swept)}: {base}'s mean"
        fastest = "\n".join(_speedups(h, p.rates))  # none without a link timed
        parts.append(
            f"### {h['steps']} steps (target: validation loss {h['target']:.4f}, {origin}{margin})\n\n"
            + table(headers, cells)
            + (f"\n\n{fastest}" if fastest else "")
        )
    if p.model is None:
        title = "Quality on a second workload: the 1-D ResNet on mnist1d"
        what = (
            f"`powertrain train --model resnet`'s 1-D ResNet ({report['params'] / 1e3:.1f}k parameters, "
            f"convolutions viewed as matrices) on mnist1d, {p.workers} workers, {p.batch} samples per worker per step"
        )
    else:
        title = {
            "wide": "Quality on a second text shape: a wider, shallower GPT",
            "local": f"Local updates across slow links: quality, bytes and time to target ({p.workers} replicas)",
            "muon": "Muon against a swept AdamW: loss, bytes and time to the best AdamW's loss",
            "outer": "The outer step of local updates on the command's schedule",
            "outer-const": "The outer step of local updates on a constant-rate AdamW",
        }.get(report["preset"], "Quality: validation loss, bytes and time to a target loss")
        what = (
            f"GPT {p.model.n_layer} layers x d_model {p.model.d_model} ({report['params'] / 1e6:.2f}M "
            f"parameters), {p.workers} workers, {p.batch}x{p.model.block_size} tokens per worker per step"
        )
    # horizons at which every row but the baseline's (which trains its horizon only anyway) trained its horizon only
    # (--horizon-only, or the preset's horizon_only_at)
    only = [
        h["steps"]
        for h in report["horizons"]
        if len(h["rows"]) > 1 and not any(r.get("to_target", True) for r in h["rows"] if r["key"] not in p.baseline)
    ]
    if only and len(only) == len(report["horizons"]):
        on = "every row trained its horizon only (`--horizon-only`): steps to target where it reached it within that"
    else:
        on = f"rows run on past the horizon at the final learning rate until they reach it (at most {cap}x the horizon)"
        if only:
            at = " and ".join(f"{n:,}" for n in only)
            on += f"; at {at} steps every row trained its horizon only: steps to target where it reached it within it"
    ran = list(dict.fromkeys(k for h in report["horizons"] for k in h.get("baseline_rows", p.baseline)))
    if p.rates:
        timed = (
            "Time to target: those steps, each phase (PowerSGD's exact steps, the rest; a local-update warm-up's "
            "exact and compressed steps, then the local steps) at its seconds per step **measured on an emulated "
            "link** of that rate (a network namespace per worker, tc tbf; the real overlap with backward, DDP's "
            "buckets as `powertrain train` builds them: torch's default; local updates over whole sync periods); "
            "'-' where the median seed did not reach the target or the row is not timed on the link (torch's hook)."
        )
    else:
        timed = "No time to target: this run timed no link (`--rates none`)."
    return (
        f"## {title}\n\n"
        f"{what}, AdamW with `powertrain train`'s schedule{_recipe_text(p)} over each horizon ('AdamW frozen at f': "
        "its second moment frozen after that fraction of the "
        f"steps, powertrain.optim.FrozenVarianceAdamW), {seeds} seed{'' if seeds == 1 else 's'} (initial weights and "
        "training batches), "
        f"validation every {p.eval_every} steps on the same held-out "
        f"{'samples (the whole validation split)' if p.model is None else 'batches'}. "
        f"PowerSGD rows compress after {p.start} exact steps; bytes are a worker's total over the horizon, warm-up "
        f"included. Target: {_target_text(p, ran, margin)}; {on}. Steps to target: the median over "
        "seeds of the first evaluation at or below it. "
        "Local updates ('H n'): each replica trains alone, every n steps the replicas' progress is averaged through "
        "the outer compressor (its error feedback kept) and an outer step (powertrain.diloco.DiLoCo); their bytes "
        f"are amortised over the steps. {timed}\n\n"
        + "\n\n".join(parts)
        + _link_text(report["link_s"], p.rates)
        + f"\n\nMachine: {machine_info()}.\n"
    )


def _recipe_text(p: Preset) -> str:
    """The preset's own training settings, which every row (fp32 included) trains with."""
    if not p.recipe:
        return ""
    return " but " + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in p.recipe.items())
