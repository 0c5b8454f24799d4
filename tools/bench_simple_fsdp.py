"""``python tools/bench_simple_fsdp.py [--preset tiny]``: SimpleFSDP against FSDP2, eager and compiled, side by side
(a check of the repository's claims, run from a checkout).

Two local gloo workers (one thread each) train the default GPT in every configuration, interleaved one step of
each per round on the same batch (as the other side-by-side benchmarks). Reported per configuration: median
step time and interquartile range over the timed rounds, and the memory held between forward and backward
(heap bytes allocated by forward and still alive when backward starts: activations plus, without
resharding, the gathered weights; the larger of the two ranks). Parameters, gradients and optimizer states
are sharded the same way in every configuration, so they are not in the comparison.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import torch
import torch.distributed as dist

from powertrain.bench.cli import script
from powertrain.bench.memory import available, heap_in_use
from powertrain.bench.report import command, footer, publish, quartiles, section, table
from powertrain.bench.rounds import Workload, interleaved, slowest
from powertrain.models import GPT, GPTConfig
from powertrain.ops.flat import local_tensor
from powertrain.train.config import TrainConfig
from powertrain.train.data import TokenData, load_data
from powertrain.train.launch import launch, leave_world


@dataclasses.dataclass(frozen=True)
class Setup:
    label: str
    kind: str  # "fsdp2" or "simple"
    compiled: bool
    reshard: bool = True
    bucket: bool = True  # SimpleFSDP: eager buckets per block + root; compiled: inductor's FSDP bucketing


SETUPS = [
    Setup("FSDP2 fully_shard, eager", "fsdp2", False),
    Setup("FSDP2 fully_shard, torch.compile", "fsdp2", True),
    Setup("SimpleFSDP, eager, per parameter", "simple", False, bucket=False),
    Setup("SimpleFSDP, eager, bucketed as FSDP2's units", "simple", False),
    Setup("SimpleFSDP, eager, bucketed, no reshard", "simple", False, reshard=False),
    Setup("SimpleFSDP, compiled, unbucketed", "simple", True, bucket=False),
    Setup("SimpleFSDP, compiled (fullgraph, inductor FSDP bucketing)", "simple", True),
    Setup("SimpleFSDP, compiled, no reshard", "simple", True, reshard=False),
]


#: How far apart two configurations' first gradients may be, in norm, relative: they are the same gradient computed with
#: sums in other orders (compiled kernels fuse and reorder them; the table's text says how far they are); a reduction
#: that sums where it should average, or averages twice, is off by the world size (2), which AdamW's scale-free steps
#: would leave out of the loss
GRAD_NORM_RTOL = 1e-4

PROG = "tools/bench_simple_fsdp.py"

PRESETS = {  # warm-up rounds: compilation happens there
    "default": Workload(GPTConfig(n_layer=4, n_head=4, d_model=256, block_size=128), batch=16, warmup=3, timed=10),
    "tiny": Workload(GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=32), batch=2, warmup=2, timed=2),
}


def _build(setup: Setup, cfg: GPTConfig) -> tuple[GPT, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from powertrain.simple_fsdp import compile_model, data_parallel

    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if setup.kind == "fsdp2":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        eager_buckets = [*model.blocks, model] if setup.bucket and not setup.compiled else []
        data_parallel(model, mesh, reshard_after_forward=setup.reshard, buckets=eager_buckets)
    if not setup.compiled:
        return model, model
    return model, compile_model(model, bucket=setup.bucket) if setup.kind == "simple" else torch.compile(model)


def _grad_norm(model: torch.nn.Module) -> float:
    """The gradient's norm over the whole model: each rank's shards' sum of squares, summed over the ranks (every
    configuration shards every parameter by rows, each row on one rank)."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            sq += local_tensor(p.grad).double().square().sum()
    dist.all_reduce(sq)
    return float(sq.sqrt())


def _worker(preset: str) -> dict[str, Any]:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    p = PRESETS[preset]
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = load_data(TrainConfig(data_max_mb=4.0))
    assert isinstance(corpus, TokenData), "the stdlib corpus is text"
    runs: list[tuple[GPT, Any, torch.optim.Optimizer]] = []
    for s in SETUPS:
        model, run = _build(s, p.model)
        runs.append((model, run, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    held: list[list[int]] = [[] for _ in SETUPS]
    losses: list[float] = [0.0] * len(SETUPS)
    norms: list[float] = [0.0] * len(SETUPS)
    batches = [
        corpus.batch("train", rank, world, (0, rank, step), p.batch, p.model.block_size)
        for step in range(p.warmup + p.timed)
    ]

    def timed_step(i: int, step: int) -> None:
        _, run, opt = runs[i]
        opt.zero_grad()
        loss = run(*batches[step])
        loss.backward()
        if step == 0:  # a warm-up round, untimed
            norms[i] = _grad_norm(runs[i][0])
        opt.step()
        losses[i] = loss.item()

    times = interleaved([functools.partial(timed_step, i) for i in range(len(runs))], warmup=p.warmup, timed=p.timed)
    # Memory: a separate pass per configuration (heap_in_use runs a GC pass: keep it out of the timings);
    # gradients exist already (zero_grad keeps them), so backward allocates nothing new that would count.
    x, y = corpus.batch("train", rank, world, (0, rank, 10_000), p.batch, p.model.block_size)
    for i, (_, run, opt) in enumerate(runs):
        for _ in range(2 if available() else 0):
            opt.zero_grad(set_to_none=False)
            before = heap_in_use()
            loss = run(x, y)
            held[i].append(heap_in_use() - before)
            loss.backward()
    leave_world()
    return {
        "times": times,
        "held": [min(h) if h else None for h in held],
        "loss": losses,
        "grad_norm": norms,
        "params": runs[0][0].num_params(),
    }


def run_simple_fsdp_bench(*, preset: str = "default", write: str | None = "BENCHMARKS.md") -> str:
    p = PRESETS[preset]
    results = launch(_worker, 2, preset)
    ranks = sorted(results)
    norms = results[ranks[0]]["grad_norm"]  # all-reduced: the same on every rank
    for s, norm in zip(SETUPS, norms, strict=True):
        if not abs(norm - norms[0]) <= GRAD_NORM_RTOL * norms[0]:
            raise RuntimeError(
                f"{PROG}: {s.label!r} computed another first gradient than {SETUPS[0].label!r} (norm "
                f"{norm:.7g} against {norms[0]:.7g}): the configurations must train alike for the table to compare them"
            )
    spread = max(abs(n - norms[0]) for n in norms) / norms[0]
    stats = [quartiles(slowest([results[r]["times"][i] for r in ranks])) for i in range(len(SETUPS))]
    held = [[results[r]["held"][i] for r in ranks] for i in range(len(SETUPS))]
    peaks = [None if None in per_rank else max(per_rank) for per_rank in held]
    cells = [
        [
            s.label,
            f"{med:.3f}",
            f"{q1:.3f}-{q3:.3f}",
            f"{stats[0][0] / med:.2f}x",
            "-" if peak is None else f"{peak / 1e6:.1f}",
            "-" if peak is None or not peaks[0] else f"{peak / peaks[0]:.2f}x",
            f"{sum(results[r]['loss'][i] for r in ranks) / len(ranks):.4f}",
        ]
        for i, (s, (med, q1, q3), peak) in enumerate(zip(SETUPS, stats, peaks, strict=True))
    ]
    headers = [
        "configuration",
        "s/step",
        "IQR",
        "throughput vs FSDP2 eager",
        "MB held fwd->bwd",
        "vs FSDP2 eager",
        "last loss",
    ]
    text = (
        "## SimpleFSDP vs FSDP2 (2 gloo workers on loopback, CPU)\n\n"
        f"GPT {p.model.n_layer} layers x d_model {p.model.d_model} ({results[0]['params'] / 1e6:.2f}M parameters), "
        f"{p.batch}x{p.model.block_size} tokens per worker, AdamW, one torch thread per worker; FSDP2 shards every "
        "block and the root, SimpleFSDP every parameter (both reshard after forward unless the row says "
        f"otherwise). {p.timed} timed rounds after {p.warmup} warm-up rounds (compilation happens there), each "
        "round one step of every configuration on the same batch; step time is the slower rank's. 'MB held "
        "fwd->bwd': heap bytes allocated by forward and still alive when backward starts (activations, plus "
        "gathered weights where they are kept), the larger rank's. The configurations' first gradients agree in "
        f"norm within {spread:.1e} relative (refused above {GRAD_NORM_RTOL:g}).\n\n"
        f"{table(headers, cells)}\n\n{footer(command(PROG, preset))}"
    )
    publish(text, write, section("simple_fsdp", preset))
    return text


def main(argv: list[str] | None = None) -> int:
    return script(
        PROG, "SimpleFSDP against FSDP2: step time and memory, eager and compiled", run_simple_fsdp_bench, argv
    )


if __name__ == "__main__":
    sys.exit(main())
