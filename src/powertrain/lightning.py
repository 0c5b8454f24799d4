"""PyTorch Lightning: gradient compression as a callback (``pip install 'powertrain[lightning]'``).

    trainer = L.Trainer(strategy="ddp", callbacks=[GradientCompression("powersgd")])
    trainer.fit(model)                        # DDP's all-reduce replaced by the compressor
    trainer.fit(model, ckpt_path="last")      # resumes it, error feedback included

When the fit starts (Lightning has wrapped the module in ``DistributedDataParallel``), the callback builds the
compressor from the module's parameters and registers it on the DDP model (:func:`powertrain.ddp.register_compressor`:
overlapped with backward, any compressor). Its state travels in Lightning's checkpoint: every worker's own state
(error-feedback buffers differ per worker), gathered to rank 0, which writes the checkpoint, as byte tensors in
:mod:`powertrain.serialize`'s format (loading runs no code); on resume each worker takes back its own. A resume
with another number of workers is refused with a one-line error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from powertrain import serialize
from powertrain.compress import Compressor, make_compressor
from powertrain.ddp import DDPCompressionHook, register_compressor

__all__ = ["GradientCompression"]


class GradientCompression(Callback):
    """Replace DDP's gradient all-reduce with the compressor ``name`` (see :func:`powertrain.compress.make_compressor`:
    ``powersgd`` gets the measured recommended config for every option not given) under ``strategy="ddp"``."""

    def __init__(self, name: str = "powersgd", **options: Any) -> None:
        self.name, self.options = name, options
        self.compressor: Compressor | None = None  # built when the fit starts; .comm.stats counts what it sent
        self.hook: DDPCompressionHook | None = None
        self._pending: dict[str, Any] | None = None  # a checkpoint's state, loaded before the compressor exists

    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name, options=sorted(self.options.items()))

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            raise ValueError(
                f"GradientCompression needs Trainer(strategy='ddp'), got {type(trainer.strategy).__name__} wrapping "
                f"{type(ddp).__name__}: compression replaces DDP's all-reduce"
            )
        if self.hook is not None:
            raise ValueError("GradientCompression is already registered on a fit: use a new callback per Trainer")
        self.compressor = make_compressor(self.name, pl_module.named_parameters(), group=ddp.process_group,
                                          **self.options)  # fmt: skip
        self.hook = register_compressor(ddp, self.compressor)
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None

    def state_dict(self) -> dict[str, Any]:
        """Every worker's compressor state, on rank 0 (a collective: Lightning calls this on every rank)."""
        if self.compressor is None:
            return {}
        blob = torch.frombuffer(bytearray(serialize.dumps(self.compressor.state_dict())), dtype=torch.uint8)
        return {"world_size": dist.get_world_size(self.compressor.comm.group), "ranks": _gather(blob, self.compressor)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.compressor is None:
            self._pending = state_dict
        else:
            self._restore(state_dict)

    def _restore(self, state: dict[str, Any]) -> None:
        assert self.compressor is not None
        group = self.compressor.comm.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if state.get("world_size") != world or len(state.get("ranks", [])) != world:
            raise ValueError(
                f"The checkpoint's compressor state was written by {state.get('world_size')} workers and this fit has "
                f"{world}: resume with {state.get('world_size')} (each worker's error feedback is its own)"
            )
        blob = state["ranks"][rank]
        self.compressor.load_state_dict(serialize.loads(blob.numpy().tobytes()))


def _gather(blob: torch.Tensor, compressor: Compressor) -> list[torch.Tensor]:
    """Every rank's ``blob`` on the group's first rank (others get an empty list): sizes first, then padded bytes."""
    group = compressor.comm.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    device = compressor.params[0].device
    size = torch.tensor([blob.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)] if rank == 0 else None
    dist.gather(size, sizes, dst=dst, group=group)
    longest = torch.tensor([max(int(s) for s in sizes) if sizes else 0], device=device)
    dist.broadcast(longest, src=dst, group=group)
    padded = torch.zeros(int(longest), dtype=torch.uint8, device=device)
    padded[: blob.numel()] = blob.to(device)
    out = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, out, dst=dst, group=group)
    if out is None or sizes is None:
        return []
    return [o[: int(s)].cpu() for o, s in zip(out, sizes, strict=True)]
