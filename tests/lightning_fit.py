"""Run under ``torchrun --nproc-per-node 2`` by test_lightning.py: three Lightning fits of a small MLP on a teacher
task (DDP on gloo): compressed for 4 epochs; compressed for 2 epochs, then resumed from Lightning's last.ckpt to
4; uncompressed for 4. Each rank writes its losses and the bytes its compressor sent to ``OUT/rank<r>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import leave_without_teardown
from powertrain.lightning import GradientCompression

OUT = Path(sys.argv[1])


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 32, generator=g)
    teacher = torch.randn(32, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x @ teacher)), batch_size=16)


def fit(out: Path, epochs: int, compress: bool, ckpt: str | None = None) -> tuple[list[float], int, Any, Any]:
    L.seed_everything(0, verbose=False)
    model = Net()
    compression = GradientCompression("powersgd", rank=4, start_compressing_after_num_steps=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=epochs,
        logger=False,
        callbacks=[*([compression] if compress else []), ModelCheckpoint(dirpath=out, save_last=True)],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(model, data(), ckpt_path=ckpt)
    sent = compression.compressor.comm.stats.bytes_sent if compress and compression.compressor else 0
    return model.losses, sent, compression, (trainer, model)


full, full_sent, callback, (trainer, model) = fit(OUT / "full", 4, True)
hook = callback.hook
trainer.fit(model, data(), ckpt_path=str(OUT / "full" / "last.ckpt"))  # a second fit of the same Trainer (a no-op)
refit = callback.hook is not hook and callback.compressor.comm.stats.bytes_sent == full_sent
first, _, _, _ = fit(OUT / "resumed", 2, True)
rest, _, _, _ = fit(OUT / "resumed", 4, True, ckpt=str(OUT / "resumed" / "last.ckpt"))
plain, _, _, _ = fit(OUT / "plain", 4, False)
state = callback.state_dict()  # a collective: every rank
try:  # a checkpoint of another world size
    callback.load_state_dict({"world_size": 3, "ranks": [torch.zeros(1, dtype=torch.uint8)] * 3})
    refusal = ""
except ValueError as e:
    refusal = str(e)
n_params = sum(p.numel() for p in Net().parameters())
rank = torch.distributed.get_rank()
result = {
    "full": full,
    "resumed": first + rest,
    "plain": plain,
    "sent": full_sent,
    "dense": 4 * n_params * len(full),
    "saved_world": state["world_size"],
    "saved_ranks": len(state["ranks"]),
    "refusal": refusal,
    "refit": refit,
}
(OUT / f"rank{rank}.json").write_text(json.dumps(result))
leave_without_teardown()  # the results are written: no interpreter teardown (pytorch/pytorch#190489)
