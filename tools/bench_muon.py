"""``python tools/bench_muon.py [--preset tiny]``: what Muon's optimizer step costs, and what splitting its
Newton-Schulz work saves (a check of the repository's claims, run from a checkout).

On the default GPT (or the tiny preset's), at 1, 2 and 4 loopback workers (one thread each; 4 workers share the 2
cores of the machine the table was made on, so read their ratios, not their times), each worker times, in
alternation round after round on the same gradients:

* ``Muon.step()`` with the work split (``split=True``: each matrix orthogonalized by one owner, the results
  all-gathered), and alone (``split=False``: every rank orthogonalizes every matrix, sends nothing);
* ``torch.optim.AdamW.step()`` on the same parameters;
* a forward and backward pass of one batch (16 x 128 tokens), for the step's share.

A round's time is the slowest worker's (a step is over when every rank is done); the table gives medians over the
rounds and the split's ratio to computing alone, measured side by side.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist

from powertrain.bench.cli import script
from powertrain.bench.report import command, machine_info, publish, section, table
from powertrain.bench.rounds import Workload, interleaved, slowest, torch_threads
from powertrain.models import GPT, GPTConfig
from powertrain.optim.matrices import default_rule
from powertrain.train.launch import launch, leave_world

__all__ = ["run_muon_bench"]


PROG = "tools/bench_muon.py"


@dataclasses.dataclass(frozen=True)
class Preset(Workload):
    worlds: tuple[int, ...] = (1, 2, 4)


PRESETS = {
    "default": Preset(GPTConfig(256, 128, 4, 4, 256), 16, warmup=3, timed=30),
    "tiny": Preset(GPTConfig(256, 32, 1, 2, 32), 2, warmup=1, timed=3, worlds=(1, 2)),
}
_KINDS = ("split", "alone", "adamw", "forward_backward")


@torch_threads(1)  # given back: at one worker this runs in the calling process
def _worker(preset: str) -> dict[str, list[float]]:
    """One rank: every kind's seconds per round (this rank's; the caller takes the slowest rank's)."""
    from powertrain.optim import Muon

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:  # one worker, in the calling process: a group of its own
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    p = PRESETS[preset]
    model = GPT(p.model)
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    x = torch.randint(0, p.model.vocab_size, (p.batch, p.model.block_size))
    model(x, x).backward()  # gradients for every parameter; the optimizers step these same ones
    opts = {
        "split": Muon(named, lr=0.02, split=True),
        "alone": Muon(named, lr=0.02, split=False),
        "adamw": torch.optim.AdamW(model.parameters(), lr=1e-3),
    }

    def timed(kind: str, _round: int) -> None:
        if kind == "forward_backward":
            model.zero_grad(set_to_none=False)
            model(x, x).backward()
        else:
            opts[kind].step()

    steps = [functools.partial(timed, kind) for kind in _KINDS]
    measured = interleaved(steps, warmup=p.warmup, timed=p.timed, rotate=True)  # no kind always first
    leave_world()
    return dict(zip(_KINDS, measured, strict=True))


def _measure(preset: str, world: int) -> dict[str, Any]:
    print(f"[bench muon] {world} worker(s): {PRESETS[preset].timed} rounds", file=sys.stderr)
    ranks = launch(_worker, world, preset)
    per_round = {k: slowest([ranks[i][k] for i in ranks]) for k in _KINDS}
    med = {k: statistics.median(v) for k, v in per_round.items()}
    ratios = [s / a for s, a in zip(per_round["split"], per_round["alone"], strict=True)]
    return {
        "world": world,
        **{f"{k}_s": v for k, v in med.items()},
        "split_over_alone": statistics.median(ratios),
        "split_share": med["split"] / (med["forward_backward"] + med["split"]),
        "alone_share": med["alone"] / (med["forward_backward"] + med["alone"]),
    }


def markdown(report: dict[str, Any], p: Preset, cmd: str) -> str:
    rows = [
        [
            r["world"],
            f"{1e3 * r['forward_backward_s']:.0f}",
            f"{1e3 * r['adamw_s']:.1f}",
            f"{1e3 * r['alone_s']:.0f} ({100 * r['alone_share']:.0f}%)",
            f"{1e3 * r['split_s']:.0f} ({100 * r['split_share']:.0f}%)",
            f"{r['split_over_alone']:.2f}",
        ]
        for r in report["rows"]
    ]
    headers = [
        "workers",
        "forward + backward (ms)",
        "AdamW step (ms)",
        "Muon step, every rank every matrix (ms, share of the step)",
        "Muon step, work split (ms, share)",
        "split / alone (median of rounds)",
    ]
    return (
        "## Muon's optimizer step: the Newton-Schulz share and the work split\n\n"
        f"`{cmd}`: GPT {p.model.n_layer} layers x d_model {p.model.d_model} ({report['params'] / 1e6:.2f}M "
        f"parameters, {report['matrices']} hidden matrices), {p.batch}x{p.model.block_size} tokens per worker, one "
        "thread per worker, float32 Newton-Schulz (5 steps). Medians over "
        f"{p.timed} rounds of the slowest worker's time; each round times every kind in turn on the same gradients "
        "(the order rotating), so the ratios are side by side. A step's share: the optimizer step over forward + "
        "backward + step (the gradient all-reduce not included). With 4 workers on 2 cores two workers share a core: "
        "read the ratio, not the times.\n\n" + table(headers, rows) + f"\n\nMachine: {machine_info()}.\n"
    )


def run_muon_bench(*, preset: str = "default", write: str | None = "BENCHMARKS.md") -> dict[str, Any]:
    p = PRESETS[preset]
    model = GPT(p.model)
    matrices = sum(1 for n, q in model.named_parameters() if default_rule(n, q))
    rows = [_measure(preset, w) for w in p.worlds]
    report = {"preset": preset, "params": model.num_params(), "matrices": matrices, "rows": rows}
    publish(markdown(report, p, command(PROG, preset)), write, section("muon", preset))
    return report


def main(argv: list[str] | None = None) -> int:
    what = "Muon's optimizer step at 1, 2 and 4 workers, its work split against every rank computing alone"
    return script(PROG, what, run_muon_bench, argv)


if __name__ == "__main__":
    sys.exit(main())
