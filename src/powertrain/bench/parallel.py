"""``powertrain bench parallel``: DDP, FSDP2, SimpleFSDP and RTP side by side: memory per rank, step time, bytes.

For each model size and world size, local gloo workers (one thread each) build every configuration in turn and
measure, per rank:

* **state**: heap bytes that the wrapped model and its AdamW hold between steps (parameters, gradients, optimizer
  state), relative to the heap before the model was built (glibc's counter, :mod:`powertrain.bench.memory`);
* **peak**: state plus the most tensor memory one training step allocates on top of it at any moment
  (activations, gathered or received weights, gradient buffers, communication buffers): the profiler's allocation
  events in order (:func:`powertrain.bench.memory.peak_allocated`). What a rank must have free to train.

then trains all configurations interleaved (one step of each per round, on the same batch, after a barrier) for
the step time, the slower rank's per round. Every configuration is a ``--parallel`` mode of ``powertrain train``
built by the command's own code (:data:`MODES`), so the bench measures what the command runs ('state' then holds
the mode's hooks and compressor too). Bytes per step: a rank's payload as the mode's communicator counts it (the
collectives powertrain issues) or computes it (those torch issues: SimpleFSDP's reduce-scatters, tensor parallelism's,
the replicated parameters' all-reduce under RTP), plus the weights' all-gathers of the sharded modes, computed: FSDP2's
and SimpleFSDP's each block's twice (forward, and backward after resharding) and the root's once
(:func:`powertrain.bench.network.fsdp2_weight_bytes`), the tensor-parallel pairs' every weight twice across the pairs.
An all-reduce or a reduce-scatter counts its whole input, an all-gather the rank's own shard (the network bench's cost
model).

Overlap (RTP): ``rtp (no overlap)`` waits for every hop before computing with the shard, so its step time minus
the overlapped one is the communication the rotation hides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import statistics
from typing import Any

import torch
import torch.distributed as dist

from powertrain.bench.memory import available, heap_in_use, peak_allocated
from powertrain.bench.network import fsdp2_weight_bytes
from powertrain.bench.report import command, footer, publish, section, table
from powertrain.bench.rounds import interleaved, slowest
from powertrain.comm import CommStats
from powertrain.models import GPT, GPTConfig
from powertrain.tp import local_numel
from powertrain.train.config import GPT_SIZES, TrainConfig
from powertrain.train.data import TokenData, load_data
from powertrain.train.launch import launch, leave_world
from powertrain.train.strategy import Parallel, Strategy, build_strategy

KINDS = ("ddp", "fsdp2", "simple_fsdp", "rtp", "rtp (no overlap)", "tp 2 x fsdp2")


@dataclasses.dataclass(frozen=True)
class Preset:
    sizes: tuple[str, ...]  # GPT sizes of powertrain train
    worlds: tuple[int, ...]
    batch: int
    block: int
    warmup: int
    timed: int


PRESETS = {
    "default": Preset(("default", "medium"), (2, 4), 8, 128, 2, 8),
    "tiny": Preset(("tiny",), (2,), 2, 32, 1, 2),
}


def _config(p: Preset, size: str) -> GPTConfig:
    return GPTConfig(256, p.block, *GPT_SIZES[size])


#: The ``--parallel`` mode of ``powertrain train`` behind each configuration, built by the command's own code
#: (:func:`powertrain.train.strategy.build_strategy`, fp32: compressor ``none``); "rtp (no overlap)" is RTP with the
#: rotation's overlap off, the one knob the command does not expose.
MODES: dict[str, Parallel] = {
    "ddp": "ddp",
    "fsdp2": "fsdp",
    "simple_fsdp": "simple_fsdp",
    "rtp": "rtp",
    "tp 2 x fsdp2": "tp",
}


@dataclasses.dataclass
class _Run:
    model: torch.nn.Module  # what forward runs on
    opt: torch.optim.Optimizer
    stats: CommStats  # the traffic the mode counts, with what it computes (recorded by its sync)
    strategy: Strategy | None  # None: rtp (no overlap)
    #: per step, computed here: the weights' all-gathers (rtp (no overlap): its replicated all-reduce)
    extra_bytes: float

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        sync = self.strategy.sync(True) if self.strategy else contextlib.nullcontext()
        scope = self.strategy.loss_scope() if self.strategy else contextlib.nullcontext()
        with sync, scope:
            loss = self.model(x, y)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)  # the gradients stay allocated: part of the state between steps
        return float(loss.item())


def _build(kind: str, cfg: GPTConfig, batch: int) -> _Run:
    from powertrain.rtp import comm_stats, replicated_traffic, rotated_tensor_parallel

    torch.manual_seed(0)
    model = GPT(cfg)
    world = dist.get_world_size()
    if kind == "rtp (no overlap)":  # computed as the rtp mode computes it: its replicated parameters' all-reduce
        rtp = rotated_tensor_parallel(model, overlap=False)
        replicated = float(replicated_traffic(rtp)[0])
        return _Run(rtp, torch.optim.AdamW(rtp.parameters(), lr=1e-3), comm_stats(rtp), None, replicated)
    strategy = build_strategy(MODES[kind], model, "none", {}, tp=2, batch=batch)
    extra = 0.0
    if kind in ("fsdp2", "simple_fsdp"):
        extra = fsdp2_weight_bytes(model, world)
    elif kind.startswith("tp") and world > 2:  # the pair's weights gathered over the data-parallel ranks
        extra = 2 * 4 * local_numel(cfg, 2) / (world // 2)
    opt = torch.optim.AdamW(strategy.model.parameters(), lr=1e-3)
    return _Run(strategy.model, opt, strategy.stats, strategy, extra)


def _worker(preset: str, size: str) -> dict[str, Any]:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    p = PRESETS[preset]
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(p, size)
    corpus = load_data(TrainConfig(data_max_mb=4.0))
    assert isinstance(corpus, TokenData), "the stdlib corpus is text"

    def batch(step: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        r, w = (rank // 2, world // 2) if kind.startswith("tp") else (rank, world)  # a tp pair reads one batch
        return corpus.batch("train", r, w, (0, r, step), p.batch, p.block)

    out: dict[str, Any] = {"state": {}, "peak": {}, "times": {k: [] for k in KINDS}, "bytes": {}, "loss": {}}
    measure = available()
    for kind in KINDS:  # once each first: the imports and first-use caches a build brings stay out of 'state'
        _build(kind, cfg, p.batch)
    for kind in KINDS:  # memory: one configuration at a time, nothing else alive
        gc.collect()
        base = heap_in_use() if measure else 0
        run = _build(kind, cfg, p.batch)
        for step in range(2):  # steady state: DDP rebuilds its buckets in its second step
            run.step(*batch(step, kind))
        if measure:
            out["state"][kind] = heap_in_use() - base

        def one_step(run: _Run = run, kind: str = kind) -> None:
            run.step(*batch(2, kind))  # the batch is made inside, as in every training step

        out["peak"][kind] = peak_allocated(one_step)
        run.stats.reset()
        run.step(*batch(3, kind))
        out["bytes"][kind] = run.stats.bytes_sent + run.extra_bytes
        del run, one_step  # nothing of this configuration stays alive
    runs = [_build(kind, cfg, p.batch) for kind in KINDS]
    batches = {(step, kind): batch(10 + step, kind) for step in range(p.warmup + p.timed) for kind in KINDS}

    def timed_step(kind: str, run: _Run, step: int) -> None:
        out["loss"][kind] = run.step(*batches[step, kind])

    steps = [functools.partial(timed_step, kind, run) for kind, run in zip(KINDS, runs, strict=True)]
    for kind, times in zip(KINDS, interleaved(steps, warmup=p.warmup, timed=p.timed), strict=True):
        out["times"][kind] = times
    leave_world()
    return out


def run_parallel_bench(*, preset: str = "default", write: str | None = "BENCHMARKS.md") -> str:
    p = PRESETS[preset]
    parts = []
    for size in p.sizes:
        cfg = _config(p, size)
        gpt = GPT(cfg)
        cells = []
        for world in p.worlds:
            res = launch(_worker, world, preset, size)
            ranks = sorted(res)
            ddp_state = max(res[r]["state"].get("ddp", 0) for r in ranks)
            fsdp_t = None
            for kind in KINDS:
                med = statistics.median(slowest([res[r]["times"][kind] for r in ranks]))
                fsdp_t = med if kind == "fsdp2" else fsdp_t
                state = max(res[r]["state"].get(kind, 0) for r in ranks) if res[0]["state"] else None
                peak = None if state is None else max(state + res[r]["peak"][kind] for r in ranks)
                sent = statistics.mean(res[r]["bytes"][kind] for r in ranks)
                cells.append(
                    [
                        world,
                        kind,
                        "-" if state is None else f"{state / 1e6:.1f}",
                        "-" if state is None or not ddp_state else f"{state / ddp_state:.2f} (1/W = {1 / world:.2f})",
                        "-" if peak is None else f"{peak / 1e6:.1f}",
                        f"{med:.3f}",
                        "-" if fsdp_t is None else f"{med / fsdp_t:.2f}x",
                        f"{sent / 1e6:.1f}",
                        f"{statistics.mean(res[r]['loss'][kind] for r in ranks):.4f}",
                    ]
                )
        headers = [
            "W",
            "configuration",
            "state MB/rank",
            "vs DDP",
            "peak MB/rank",
            "s/step",
            "vs FSDP2",
            "MB sent/step/rank",
            "last loss",
        ]
        n = gpt.num_params() / 1e6
        title = f"### GPT `{size}`: {cfg.n_layer} layers x d_model {cfg.d_model} ({n:.2f}M parameters)"
        parts.append(f"{title}\n\n" + table(headers, cells))
    text = (
        "## Parallel modes: DDP, FSDP2, SimpleFSDP and RTP (gloo workers on loopback, CPU)\n\n"
        f"{p.batch}x{p.block} tokens per worker, AdamW, one torch thread per worker (4 workers share 2 cores: "
        "their step times are not comparable with 2 workers'). 'state': heap bytes the wrapped model and its "
        "optimizer hold between steps (parameters, gradients, AdamW state), the larger rank's, measured; 'peak': "
        "state plus the most tensor memory a training step allocates on top of it at any moment (activations, "
        "gathered or received weights, gradients, communication buffers), from the profiler's allocation events, "
        "the larger rank's. Step time: median over "
        f"{p.timed} interleaved rounds after {p.warmup}, the slower rank's. Each configuration is the "
        "`--parallel` mode of `powertrain train` (fp32: compressor none), built by the command's code. Bytes: "
        "what a rank hands to each collective (an all-gather: its own shard), as the mode counts or computes "
        "it, plus the sharded modes' weight all-gathers (computed). 'rtp "
        "(no overlap)' waits for each hop before computing: its extra time is what the overlap hides. 'tp 2 x "
        "fsdp2': tensor parallel in pairs (which read the same batch: half as many tokens per step), FSDP2 across "
        "the pairs.\n\n" + "\n\n".join(parts) + f"\n\n{footer(command('parallel', preset))}"
    )
    publish(text, write, section("parallel", preset))
    return text
