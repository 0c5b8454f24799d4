"""Train several DDP configurations side by side in one process group, one step of each per round.

Every configuration has its own model (same initial weights), optimizer and DDP instance; each round runs
one step of every configuration on the same batch, so load from other processes hits them alike. Run
inside an initialised process group (``run``), or as ``python -m powertrain.bench.sidebyside JSON`` in a
worker that reads RANK/WORLD_SIZE/MASTER_* from the environment and prints its results as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from powertrain.compress import make_compressor
from powertrain.ddp import register_compressor
from powertrain.train.config import TrainConfig
from powertrain.train.data import TokenData, load_data
from powertrain.train.model import GPT, GPTConfig


@dataclasses.dataclass(frozen=True)
class Spec:
    """One configuration: ``kind`` is plain, noop (compute only: no communication), torch_fp16, torch_psgd,
    or a powertrain compressor name; ``options`` its options (``rank`` for torch_psgd)."""

    label: str
    kind: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    bucket_cap_mb: float | None = None  # None: the run's default (one bucket for torch's PowerSGD hook)


def _build(spec: Spec, model: torch.nn.Module, start: int, bucket_cap_mb: float) -> tuple[DDP, Any]:
    ddp = DDP(model, bucket_cap_mb=spec.bucket_cap_mb or bucket_cap_mb)
    stats = None
    if spec.kind == "noop":
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
    elif spec.kind == "torch_fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif spec.kind == "torch_psgd":
        state = torch_powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=spec.options["rank"], start_powerSGD_iter=start
        )
        ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    elif spec.kind != "plain":
        opts = dict(spec.options)
        if spec.kind == "powersgd":
            opts.setdefault("start_compressing_after_num_steps", start)
        comp = make_compressor(spec.kind, model.named_parameters(), **opts)
        register_compressor(ddp, comp)
        stats = comp.comm.stats
    return ddp, stats


def run(specs: list[Spec], *, model: GPTConfig, batch: int, warmup: int, timed: int, start: int,
        bucket_cap_mb: float = 100, data_mb: float = 4.0, eval_batches: int = 8) -> dict[str, Any]:  # fmt: skip
    """Per configuration: step times of the timed rounds, all losses, bytes per op and the final
    validation loss (mean over ranks)."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = load_data(TrainConfig(data_max_mb=data_mb))
    assert isinstance(corpus, TokenData), "the stdlib corpus is text"
    runs = []
    for spec in specs:
        torch.manual_seed(0)
        m = GPT(model)
        ddp, stats = _build(spec, m, start, bucket_cap_mb)
        runs.append({"model": m, "ddp": ddp, "stats": stats, "opt": torch.optim.AdamW(m.parameters(), lr=1e-3)})
    times: list[list[float]] = [[] for _ in specs]
    losses: list[list[float]] = [[] for _ in specs]
    sent: list[dict[str, int]] = [{} for _ in specs]
    for step in range(warmup + timed):
        x, y = corpus.batch("train", rank, world, (0, rank, step), batch, model.block_size)
        for i, r in enumerate(runs):
            before = dict(r["stats"].by_op) if r["stats"] else {}
            dist.barrier()
            t0 = time.perf_counter()
            r["opt"].zero_grad()
            loss = r["ddp"](x, y)
            loss.backward()
            r["opt"].step()
            elapsed = time.perf_counter() - t0
            if step >= warmup:
                times[i].append(elapsed)
                if r["stats"]:
                    for op, n in r["stats"].by_op.items():
                        sent[i][op] = sent[i].get(op, 0) + n - before.get(op, 0)
            losses[i].append(loss.item())
    val = []
    for r in runs:
        r["model"].eval()
        with torch.no_grad():
            total = sum(
                r["model"](*corpus.batch("val", rank, world, (1, rank, j), batch, model.block_size)).item()
                for j in range(eval_batches)
            )
        mean = torch.tensor([total / eval_batches], dtype=torch.float64)
        dist.all_reduce(mean)
        val.append(mean.item() / world)
    return {"times": times, "losses": losses, "sent_per_step": [{k: v / timed for k, v in s.items()} for s in sent],
            "val_loss": val, "params": runs[0]["model"].num_params()}  # fmt: skip


def main() -> None:
    """Worker entry point: JSON arguments in argv[1], JSON results on stdout (rank 0 and others)."""
    import datetime

    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pop("timeout_s", 300)))
    specs = [Spec(**s) for s in args.pop("specs")]
    model = GPTConfig(**args.pop("model"))
    result = run(specs, model=model, **args)
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    # Skip interpreter finalisation: the results are out, and gloo's threads have been seen to abort the
    # process at exit ("terminate called without an active exception"), which would read as a failure.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
