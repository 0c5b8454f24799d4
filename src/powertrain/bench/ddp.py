"""DDP step time: torch's own comm hooks vs powertrain's compressors, side by side in one run.

Two local gloo workers (one torch thread each) train the default GPT. Every configuration has its own model
(same initial weights), optimizer and DDP instance; all are stepped in interleaved rounds, one step of each
per round on the same batch, so load from other processes hits every configuration alike. Reported: median
and interquartile range of the step time over the timed rounds, payload bytes per step, and the final
training loss (mean of the last 5 steps), so speed is compared at equal loss.

torch's ``powerSGD_hook`` only runs on gloo with a single DDP bucket (with several it deadlocks or aborts
with a collective mismatch), so every configuration uses one bucket (``bucket_cap_mb=100``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from powertrain.bench.report import machine_info, publish, table
from powertrain.compress import PowerSGDCompressor, make_compressor
from powertrain.ddp import register_compressor
from powertrain.train.config import TrainConfig
from powertrain.train.data import TokenData, load_data
from powertrain.train.launch import launch
from powertrain.train.model import GPT, GPTConfig

START = 10  # PowerSGD warm-up steps (exact all-reduce), for torch's hook and ours alike

# (label, kind, options)
CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("DDP fp32 (no hook)", "plain", {}),
    ("torch fp16_compress_hook", "torch_fp16", {}),
    ("torch powerSGD_hook r1", "torch_psgd", {"rank": 1}),
    ("torch powerSGD_hook r4", "torch_psgd", {"rank": 4}),
    ("powertrain none (fp32)", "none", {}),
    ("powertrain bf16", "bf16", {}),
    ("powertrain powersgd r1", "powersgd", {"rank": 1}),
    ("powertrain powersgd r4", "powersgd", {"rank": 4}),
    ("powertrain powersgd paper r4", "powersgd", {"rank": 4, "variant": "paper"}),
    ("powertrain int8", "int8", {}),
    ("powertrain topk 1%", "topk", {"ratio": 0.01}),
]


@dataclasses.dataclass(frozen=True)
class Preset:
    model: GPTConfig
    batch: int
    warmup: int
    timed: int


PRESETS = {
    "default": Preset(
        GPTConfig(n_layer=4, n_head=4, d_model=256, block_size=128), batch=16, warmup=START + 2, timed=15
    ),
    "tiny": Preset(GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=32), batch=2, warmup=START + 1, timed=2),
}


def _build(kind: str, opts: dict[str, Any], model: torch.nn.Module) -> tuple[DDP, Any]:
    ddp = DDP(model, bucket_cap_mb=100)
    stats = None
    if kind == "torch_fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "torch_psgd":
        state = torch_powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=opts["rank"], start_powerSGD_iter=START
        )
        ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    elif kind != "plain":
        if kind == "powersgd":
            opts = {**opts, "start_compressing_after_num_steps": START}
        comp = make_compressor(kind, model.named_parameters(), **opts)
        register_compressor(ddp, comp)
        stats = comp.comm.stats
    return ddp, stats


def _bytes_per_step(kind: str, opts: dict[str, Any], model: torch.nn.Module) -> float:
    """Payload bytes per compressed step for configurations whose hook does not count them."""
    numel = sum(p.numel() for p in model.parameters())
    if kind == "plain":
        return 4.0 * numel
    if kind == "torch_fp16":
        return 2.0 * numel
    # torch's hook compresses exactly the matrices the paper variant does (same rate rule) and sends P and Q.
    comp = PowerSGDCompressor(model.parameters(), config=_paper_config(opts["rank"]))
    return float(comp.bytes_per_step(0))


def _paper_config(rank: int) -> Any:
    from powertrain.compress import Config

    return Config(rank=rank, variant="paper", start_compressing_after_num_steps=0)


def _worker(preset_name: str) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    p = PRESETS[preset_name]
    corpus = load_data(TrainConfig(data_max_mb=4.0))
    assert isinstance(corpus, TokenData), "the stdlib corpus is text"
    runs = []
    for _, kind, opts in CONFIGS:
        torch.manual_seed(0)
        model = GPT(p.model)
        ddp, stats = _build(kind, opts, model)
        runs.append({"model": model, "ddp": ddp, "stats": stats, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3)})
    times: list[list[float]] = [[] for _ in CONFIGS]
    losses: list[list[float]] = [[] for _ in CONFIGS]
    sent: list[list[int]] = [[] for _ in CONFIGS]
    for step in range(p.warmup + p.timed):
        x, y = corpus.batch("train", rank, 2, (0, rank, step), p.batch, p.model.block_size)
        for i, run in enumerate(runs):
            before = run["stats"].bytes_sent if run["stats"] else 0
            dist.barrier()
            t0 = time.perf_counter()
            run["opt"].zero_grad()
            loss = run["ddp"](x, y)
            loss.backward()
            run["opt"].step()
            elapsed = time.perf_counter() - t0
            if step >= p.warmup:
                times[i].append(elapsed)
                sent[i].append((run["stats"].bytes_sent if run["stats"] else 0) - before)
            losses[i].append(loss.item())
    out = {"times": times, "losses": losses, "sent": sent, "params": runs[0]["model"].num_params()}
    dist.destroy_process_group()
    return out


def run_ddp_bench(*, preset: str = "default", write: str | None = "BENCHMARKS.md") -> str:
    p = PRESETS[preset]
    results = launch(_worker, 2, preset)
    r0 = results[0]
    model = GPT(p.model)
    rows = []
    base = statistics.median(r0["times"][0])
    for i, (label, kind, opts) in enumerate(CONFIGS):
        ts = sorted(max(results[r]["times"][i][j] for r in results) for j in range(len(r0["times"][i])))
        med = statistics.median(ts)
        q1, q3 = ts[len(ts) // 4], ts[(3 * len(ts)) // 4]
        if kind in ("plain", "torch_fp16", "torch_psgd"):
            sent, how = _bytes_per_step(kind, opts, model), " (computed)"
        else:
            sent, how = statistics.median(r0["sent"][i]), ""
        final = sum(sum(results[r]["losses"][i][-5:]) / 5 for r in results) / len(results)
        rows.append(
            [label, f"{med:.3f}", f"{q1:.3f}-{q3:.3f}", f"{base / med:.2f}x", f"{sent / 1e6:.3f}{how}", f"{final:.4f}"]
        )
    headers = ["configuration", "s/step (median)", "IQR", "speed vs DDP fp32", "MB sent per step", "final loss"]
    text = (
        "## DDP step time: torch hooks vs powertrain (2 gloo workers on loopback)\n\n"
        f"GPT {p.model.n_layer} layers x d_model {p.model.d_model} ({r0['params'] / 1e6:.2f}M parameters), "
        f"{p.batch}x{p.model.block_size} tokens per worker, AdamW, one torch thread per worker, one DDP bucket. "
        f"PowerSGD uses exact all-reduce for the first {START} steps in both implementations; the "
        f"{len(r0['times'][0])} timed rounds follow {p.warmup} warm-up rounds, each round one step of every "
        "configuration on the same batch. Step time is the slower rank's. Loopback is fast (~1.5 GB/s), so this "
        "table shows compute overhead, not network savings (see the emulated-network benchmark for that).\n\n"
        f"{table(headers, rows)}\n\nMachine: {machine_info()}.\n\n"
        f"Command: `powertrain bench ddp{'' if preset == 'default' else ' --preset ' + preset}`\n"
    )
    publish(text, write, "ddp" if preset == "default" else f"ddp-{preset}")
    return text
