"""Run under ``torchrun --nproc-per-node 2`` by test_hf.py: a randomly initialised tiny GPT-2 trained by Hugging
Face's Trainer on CPU (DDP on gloo) for STEPS steps, checkpointing every HALF: compressed; resumed from the
compressed run's checkpoint at HALF (a new Trainer, same output_dir); uncompressed. Then an accelerate loop,
compressed and not. Rank 0 writes the logged losses and the bytes the compressors sent to ``OUT/result.json``."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from dist_utils import leave_without_teardown
from powertrain.hf import compress_gradients

OUT = Path(sys.argv[1])
STEPS, HALF, BLOCK = 20, 10, 32


class Text(Dataset):
    """Blocks of the standard library's bytes (no download, no tokenizer: byte-level ids)."""

    def __init__(self) -> None:
        raw = bytearray()
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]:
            raw += path.read_bytes()
        ids = torch.tensor(list(raw[: 1024 * BLOCK]), dtype=torch.long)
        self.blocks = ids.view(-1, BLOCK)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def train(out: Path, compress: bool, resume: str | None = None) -> tuple[list[float], int]:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_positions=BLOCK,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        save_steps=HALF,
        logging_steps=1,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        use_cpu=True,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Text())
    callback = (
        compress_gradients(trainer, "powersgd", rank=4, start_compressing_after_num_steps=2) if compress else None
    )
    trainer.train(resume_from_checkpoint=resume)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    sent = callback.compressor.comm.stats.bytes_sent if callback and callback.compressor else 0
    return losses, sent


def accelerate_loop(compress: bool) -> tuple[list[float], int]:
    """A hand-written accelerate loop: ``accelerator.prepare`` returns torch's DDP, register_compressor applies."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from powertrain.compress import make_compressor
    from powertrain.ddp import register_compressor

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, data = accelerator.prepare(model, optimizer, DataLoader(Text(), batch_size=8))
    compressor = None
    if compress:
        compressor = make_compressor(
            "powersgd", model.module.named_parameters(), rank=4, start_compressing_after_num_steps=2
        )
        register_compressor(model, compressor)
    losses = []
    for _, batch in zip(range(STEPS), data, strict=False):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses, compressor.comm.stats.bytes_sent if compressor is not None else 0


full, sent = train(OUT / "run", True)
resumed, _ = train(OUT / "run", True, resume=str(OUT / "run" / f"checkpoint-{HALF}"))
plain, _ = train(OUT / "plain", False)
acc, acc_sent = accelerate_loop(True)
acc_plain, _ = accelerate_loop(False)
n_params = sum(
    p.numel()
    for p in GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=2)).parameters()
)
if dist.get_rank() == 0:
    result = {
        "full": full,
        "resumed": resumed,
        "plain": plain,
        "sent": sent,
        "dense": 4 * n_params * STEPS,
        "accelerate": acc,
        "accelerate_plain": acc_plain,
        "accelerate_sent": acc_sent,
    }
    (OUT / "result.json").write_text(json.dumps(result))
leave_without_teardown()  # the results are written: no interpreter teardown (pytorch/pytorch#190489)
