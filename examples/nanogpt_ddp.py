"""A nanoGPT-style DDP training script, in one file, with powertrain's gradient compression: the lines marked
``# powertrain`` are all it takes (build the compressor, register it on DDP, save and restore its state).

    torchrun --nproc-per-node 2 examples/nanogpt_ddp.py --steps 100 --out runs/nanogpt
    torchrun --nproc-per-node 2 examples/nanogpt_ddp.py --steps 200 --out runs/nanogpt --resume
    torchrun --nproc-per-node 2 examples/nanogpt_ddp.py --steps 200 --out runs/plain --no-compress

A character-level GPT learns Python's own standard library sources (no download). Rank 0 prints one JSON line
per logged step (loss averaged over ranks) and, at the end, the bytes the gradients cost. Each rank checkpoints
its own file (the compressor's error feedback differs per rank) in powertrain's state format, which loading parses
and never unpickles (``torch.load(weights_only=True)`` runs no code, but a few bytes of its pickle can allocate
gigabytes), after checking the file's size against what this model's checkpoint can hold.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from powertrain import serialize  # powertrain
from powertrain.compress import make_compressor  # powertrain
from powertrain.ddp import register_compressor  # powertrain


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, block: int = 64, layers: int = 2, heads: int = 4, d: int = 128) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def corpus(max_bytes: int = 2_000_000) -> torch.Tensor:
    """Bytes of the standard library's .py files, in name order: the same text on every machine with this Python."""
    text = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_bytes()
        if len(text) >= max_bytes:
            break
    return torch.frombuffer(text[:max_bytes], dtype=torch.uint8).long()


def batch(data: torch.Tensor, seed: int, rank: int, step: int, size: int, block: int) -> tuple[torch.Tensor, ...]:
    """A batch that depends only on (seed, rank, step): a resumed run draws what the uninterrupted one did."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    starts = torch.randint(0, data.numel() - block - 1, (size,), generator=g)
    x = torch.stack([data[s : s + block] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + block + 1] for s in starts.tolist()])
    return x, y


def load_checkpoint(path: Path, model: nn.Module) -> dict[str, Any]:
    """The state saved at ``path``: its size checked first (weights, AdamW's two moments and the compressor's buffers
    fit in 16 times the weights' bytes), then read within that bound and parsed, never unpickled."""
    limit = 16 * sum(t.numel() * t.element_size() for t in model.state_dict().values()) + (1 << 20)
    if not path.is_file():
        raise ValueError(f"{path} is not a file: resume from an --out that holds this run's checkpoints")
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"{path} is {size:,} bytes, more than this model's checkpoint can be ({limit:,})")
    with path.open("rb") as f:
        return serialize.loads(f.read(limit + 1))  # powertrain: parsed, never unpickled


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="stop after this step")
    p.add_argument("--decay-steps", type=int, default=200, help="cosine decay to 0.1x over this many steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--out", type=Path, default=Path("runs/nanogpt"))
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--no-compress", action="store_true", help="plain DDP (fp32 all-reduce), for comparison")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    data, model = corpus(), GPT()
    ddp = DDP(model)
    compressor = None
    if not args.no_compress:
        compressor = make_compressor("powersgd", model.named_parameters())  # powertrain
        register_compressor(ddp, compressor)  # powertrain
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def lr_factor(s: int) -> float:
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.decay_steps) / args.decay_steps))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    ckpt = args.out / f"ckpt_rank{rank}_of_{world}.pt"
    start = 0
    if args.resume:
        error = ""
        try:
            state = load_checkpoint(ckpt, model)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            if compressor is not None:
                compressor.load_state_dict(state["compressor"])  # powertrain
            start = int(state["step"])
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        # Every rank learns whether all could resume, and from which steps, before any other collective: the ranks
        # stop together, the one that could not with one line (not the others with a traceback from a closed peer).
        status = torch.tensor([int(bool(error)), start, -start])
        dist.all_reduce(status, op=dist.ReduceOp.MAX)
        if error:
            sys.exit(f"rank {rank}: cannot resume from {ckpt}: {error}")
        if status[0]:
            sys.exit(1)  # another rank said why
        if status[1] != -status[2]:
            sys.exit(
                f"rank {rank}: the ranks' checkpoints in {args.out} are from steps {-status[2]}..{status[1]}: a save "
                "was interrupted; restore a consistent set"
            )

    for step in range(start, args.steps):
        x, y = batch(data, args.seed, rank, step, args.batch_size, model.pos.num_embeddings)
        loss = ddp(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        mean = loss.detach().double()
        dist.all_reduce(mean)
        if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            print(json.dumps({"step": step + 1, "loss": mean.item() / world}), flush=True)
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            args.out.mkdir(parents=True, exist_ok=True)
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step + 1,
                "schedule": schedule.state_dict(),
                "compressor": compressor.state_dict() if compressor is not None else {},
            }  # powertrain
            ckpt.with_suffix(".tmp").write_bytes(serialize.dumps(state))  # powertrain: a format loading parses
            ckpt.with_suffix(".tmp").replace(ckpt)  # whole or not at all

    if rank == 0:
        dense = 4 * sum(p.numel() for p in model.parameters()) * (args.steps - start)
        sent = compressor.comm.stats.bytes_sent if compressor is not None else dense
        print(json.dumps({"bytes_sent": sent, "bytes_uncompressed": dense}), flush=True)
    dist.barrier()  # every rank is done before any leaves
    # Leave without the interpreter's teardown: everything is written, and a gloo thread that frees a finished
    # collective's tensor while the interpreter finalises aborts the rank (pytorch/pytorch#190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
