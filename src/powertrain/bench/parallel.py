"""``powertrain bench parallel``: DDP, FSDP2, SimpleFSDP and RTP side by side: memory per rank, step time, bytes.

For each model size and world size, local gloo workers (one thread each) build every configuration in turn and
measure, per rank:

* **state**: heap bytes that the wrapped model and its AdamW hold between steps (parameters, gradients, optimizer
  state), relative to the heap before the model was built (glibc's counter, :mod:`powertrain.bench.memory`);
* **peak**: state plus the most tensor memory one training step allocates on top of it at any moment
  (activations, gathered or received weights, gradient buffers, communication buffers): the profiler's allocation
  events in order (:func:`powertrain.bench.memory.peak_allocated`). What a rank must have free to train.

then trains all configurations interleaved (one step of each per round, on the same batch, after a barrier) for
the step time, the slower rank's per round. Bytes per step: a rank's payload, counted by powertrain's
communicator for RTP (its ring hops and the replicated parameters' all-reduce), computed for the others from
their collectives as what a rank hands to each (the network bench's cost model: the full tensor for an all-reduce
or a reduce-scatter, the rank's own shard for an all-gather). DDP: the gradients' all-reduce; FSDP2 and
SimpleFSDP: the gradients' reduce-scatter and the weights' all-gathers, each block's twice (forward, and backward
after resharding) and the root's once (:func:`powertrain.bench.network.fsdp2_weight_bytes`).

Overlap (RTP): ``rtp (no overlap)`` waits for every hop before computing with the shard, so its step time minus
the overlapped one is the communication the rotation hides.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import statistics
from typing import Any

import torch
import torch.distributed as dist

from powertrain.bench.memory import available, heap_in_use, peak_allocated
from powertrain.bench.network import fsdp2_weight_bytes
from powertrain.bench.report import machine_info, publish, table
from powertrain.bench.rounds import interleaved
from powertrain.models import GPT, GPTConfig
from powertrain.tp import local_numel, traffic
from powertrain.train.config import GPT_SIZES, TrainConfig
from powertrain.train.data import TokenData, load_data
from powertrain.train.launch import launch, leave_world

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


def _build(kind: str, cfg: GPTConfig) -> tuple[torch.nn.Module, Any]:
    """The wrapped model and, for RTP, its byte counter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from powertrain.rtp import comm_stats, rotated_tensor_parallel
    from powertrain.simple_fsdp import data_parallel

    torch.manual_seed(0)
    model = GPT(cfg)
    if kind == "ddp":
        return DistributedDataParallel(model), None
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if kind == "fsdp2":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, None
    if kind == "simple_fsdp":
        return data_parallel(model, mesh, buckets=[*model.blocks, model]), None
    if kind.startswith("tp"):
        from powertrain.tp import tensor_parallel

        world = dist.get_world_size()
        return tensor_parallel(model, init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))), None
    rtp = rotated_tensor_parallel(model, overlap=kind == "rtp")
    return rtp, comm_stats(rtp)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return float(loss.item())


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
    for kind in KINDS:  # memory: one configuration at a time, nothing else alive
        gc.collect()
        base = heap_in_use() if measure else 0
        model, stats = _build(kind, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):  # steady state: DDP rebuilds its buckets in its second step
            _step(model, opt, *batch(step, kind))
        if measure:
            out["state"][kind] = heap_in_use() - base

        def one_step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt, kind: str = kind) -> None:
            _step(model, opt, *batch(2, kind))  # the batch is made inside, as in every training step

        out["peak"][kind] = peak_allocated(one_step)
        if stats is not None:
            stats.reset()
            _step(model, opt, *batch(3, kind))
            out["bytes"][kind] = stats.bytes_sent
        del model, opt, stats, one_step  # nothing of this configuration stays alive
    runs = []
    for kind in KINDS:
        model, _ = _build(kind, cfg)
        runs.append((kind, model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    batches = {(step, kind): batch(10 + step, kind) for step in range(p.warmup + p.timed) for kind in KINDS}

    def timed_step(kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        out["loss"][kind] = _step(model, opt, *batches[step, kind])

    steps = [functools.partial(timed_step, kind, model, opt) for kind, model, opt in runs]
    for (kind, _, _), times in zip(runs, interleaved(steps, warmup=p.warmup, timed=p.timed), strict=True):
        out["times"][kind] = times
    leave_world()
    return out


def _computed_bytes(kind: str, model: GPT, world: int, cfg: GPTConfig, tokens: int) -> float:
    """A rank's payload per step (what it hands to each collective, as the network bench's cost model counts it)."""
    full = 4.0 * model.num_params()
    if kind == "ddp":
        return full  # the gradients' all-reduce
    if kind.startswith("tp"):  # pairs: tensor and sequence parallel traffic, FSDP2's reduce-scatter over the pairs
        dp = world // 2
        grads = sum(b for b, _ in traffic(cfg, 2, dp, tokens // cfg.block_size, cfg.block_size).values())
        return float(grads + (2 * 4 * local_numel(cfg, 2) / dp if dp > 1 else 0))  # + the pair's weight all-gathers
    return full + fsdp2_weight_bytes(model, world)  # fsdp2, simple_fsdp: gradients' reduce-scatter, weights' gathers


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
                rounds = [max(res[r]["times"][kind][j] for r in ranks) for j in range(p.timed)]
                med = statistics.median(rounds)
                fsdp_t = med if kind == "fsdp2" else fsdp_t
                state = max(res[r]["state"].get(kind, 0) for r in ranks) if res[0]["state"] else None
                peak = None if state is None else max(state + res[r]["peak"][kind] for r in ranks)
                sent = (
                    statistics.mean(res[r]["bytes"][kind] for r in ranks)
                    if kind in res[0]["bytes"]
                    else _computed_bytes(kind, gpt, world, cfg, p.batch * p.block)
                )
                cells.append(
                    [
                        world,
                        kind,
                        "-" if state is None else f"{state / 1e6:.1f}",
                        "-" if state is None or not ddp_state else f"{state / ddp_state:.2f} (1/W = {1 / world:.2f})",
                        "-" if peak is None else f"{peak / 1e6:.1f}",
                        f"{med:.3f}",
                        "-" if fsdp_t is None else f"{med / fsdp_t:.2f}x",
                        f"{sent / 1e6:.1f}" + ("" if kind in res[0]["bytes"] else " (computed)"),
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
        f"{p.timed} interleaved rounds after {p.warmup}, the slower rank's. RTP's bytes are counted (ring hops "
        "of weights and gradients plus the replicated LayerNorms' all-reduce); the others' are computed, as what "
        "a rank hands to each collective (an all-gather: its own shard). 'rtp "
        "(no overlap)' waits for each hop before computing: its extra time is what the overlap hides. 'tp 2 x "
        "fsdp2': tensor parallel in pairs (which read the same batch: half as many tokens per step), FSDP2 across "
        "the pairs.\n\n" + "\n\n".join(parts) + f"\n\nMachine: {machine_info()}.\n\n"
        f"Command: `powertrain bench parallel{'' if preset == 'default' else ' --preset ' + preset}`\n"
    )
    print(text)
    publish(text, write, "parallel" if preset == "default" else f"parallel-{preset}")
    return text
