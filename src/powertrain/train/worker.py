"""One training worker (one rank): byte-level GPT on the stdlib corpus with the reference PowerSGD API."""

from __future__ import annotations

import datetime
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from powertrain.comm import Communicator
from powertrain.powersgd import PowerSGD, optimizer_step
from powertrain.train.config import TrainConfig
from powertrain.train.data import load_stdlib_corpus, sample_batch
from powertrain.train.model import GPT, GPTConfig

MB = 1e6


def _init_distributed(cfg: TrainConfig) -> None:
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return  # single process: no group, the communication layer degrades to no-ops
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout_s))


def _lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def run_worker(cfg: TrainConfig) -> dict[str, Any]:
    _init_distributed(cfg)
    metrics = Communicator()  # loss averaging; kept apart from the gradient byte counts
    rank, world = metrics.rank, metrics.world_size
    torch.set_num_threads(cfg.threads)
    device = (
        torch.device(f"cuda:{torch.cuda.current_device()}")
        if dist.is_initialized() and dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    say = print if rank == 0 else (lambda *a, **k: None)

    max_bytes = None if cfg.data_max_mb is None else int(cfg.data_max_mb * MB)
    corpus = load_stdlib_corpus(max_bytes)
    torch.manual_seed(cfg.seed)  # identical initial model on every rank
    model = GPT(GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model)).to(
        device
    )
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, cfg))
    aggregator = cfg.compressor.build(params)
    comm = aggregator.comm
    dense_bytes = sum(p.numel() for p in params) * 4  # plain fp32 all-reduce of every gradient
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + rank)  # each rank its own stream of windows

    say(
        f"powertrain train: {world} worker(s), GPT {cfg.n_layer}x{cfg.d_model} "
        f"({model.num_params() / 1e6:.2f}M params), "
        f"{corpus.description}, compressor {cfg.compressor}, {cfg.steps} steps of {cfg.batch_size}x{cfg.block_size} "
        "tokens per worker"
    )
    if isinstance(aggregator, PowerSGD):
        c = aggregator.compressor
        say(
            f"  PowerSGD compresses {len(c.compressed_names)} of {len(c.params)} tensors; "
            f"exact all-reduce for the first {c.config.start_compressing_after_num_steps} steps"
        )

    t_start = time.perf_counter()
    first_loss = last_loss = float("nan")
    window: list[float] = []
    comm_time = 0.0
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        x, y = sample_batch(corpus.train, cfg.batch_size, cfg.block_size, gen)
        loss = model(x.to(device), y.to(device))
        loss.backward()  # no zero_grad: with PowerSGD, p.grad holds the residual (error feedback)
        sent_before = comm.stats.bytes_sent
        t1 = time.perf_counter()
        optimizer_step(optimizer, aggregator)
        comm_time += time.perf_counter() - t1
        scheduler.step()
        window.append(loss.item())
        if not math.isfinite(window[-1]):
            raise FloatingPointError(f"rank {rank}: loss is {window[-1]} at step {step}; stopping")
        if (step + 1) % cfg.log_every == 0 or step == cfg.steps - 1:
            avg = torch.tensor([sum(window) / len(window)], dtype=torch.float64)
            metrics.all_reduce_mean_(avg)
            last_loss = avg.item()
            if math.isnan(first_loss):
                first_loss = last_loss  # the first logged window's mean
            window.clear()
            sent = comm.stats.bytes_sent - sent_before
            say(
                f"step {step + 1:5d}/{cfg.steps}  loss {last_loss:.4f}  sent {sent / MB:7.3f} MB "
                f"(all-reduce {dense_bytes / MB:.3f} MB, {dense_bytes / max(sent, 1):6.1f}x less)  "
                f"{time.perf_counter() - t0:.3f} s/step"
            )
    wall = time.perf_counter() - t_start

    model.eval()
    val_gen = torch.Generator().manual_seed(10_000 + rank)
    with torch.no_grad():
        vals = [
            model(*(t.to(device) for t in sample_batch(corpus.val, cfg.batch_size, cfg.block_size, val_gen))).item()
            for _ in range(cfg.eval_batches)
        ]
    val = torch.tensor([sum(vals) / len(vals)], dtype=torch.float64)
    metrics.all_reduce_mean_(val)

    total_sent = comm.stats.bytes_sent
    total_dense = dense_bytes * cfg.steps if world > 1 else 0
    summary = {
        "world_size": world,
        "steps": cfg.steps,
        "first_loss": first_loss,
        "final_loss": last_loss,
        "val_loss": val.item(),
        "bytes_sent": total_sent,
        "bytes_allreduce": total_dense,
        "wall_s": wall,
        "comm_s": comm_time,
        "params": model.num_params(),
    }
    ratio = f"{total_dense / total_sent:.1f}x less" if total_sent else "nothing to send with one worker"
    say(
        f"\nSummary: {world} worker(s) trained a {model.num_params() / 1e6:.2f}M-parameter byte-level GPT for "
        f"{cfg.steps} steps ({cfg.steps * cfg.batch_size * cfg.block_size * world / 1e3:.0f}k tokens) on the "
        f"{corpus.description} in {wall:.1f} s. The training loss went from {first_loss:.3f} to {last_loss:.3f} and "
        f"the held-out validation loss is {val.item():.3f} (a uniform guess over bytes scores {math.log(256):.3f}). "
        f"Gradient communication ({cfg.compressor}) sent {total_sent / MB:.1f} MB per worker where plain fp32 "
        f"all-reduce would have sent {total_dense / MB:.1f} MB ({ratio}); the optimizer step including "
        f"compression and communication took {comm_time:.1f} s of the {wall:.1f} s."
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary
