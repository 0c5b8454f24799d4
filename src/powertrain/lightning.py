"""PyTorch Lightning: gradient compression as a callback (``pip install 'powertrain[lightning]'``).

    trainer = L.Trainer(strategy="ddp", callbacks=[GradientCompression("powersgd")])
    trainer.fit(model)                        # DDP's all-reduce replaced by the compressor
    trainer.fit(model, ckpt_path="last")      # resumes it, error feedback included

When the fit starts (Lightning has wrapped the module in ``DistributedDataParallel``), the callback builds the
compressor from the module's parameters and registers it on the DDP model (:func:`powertrain.ddp.register_compressor`:
overlapped with backward, any compressor). Its state travels in Lightning's checkpoint: every worker's own state
(error-feedback buffers differ per worker), gathered to rank 0 (on the CPU), which writes the checkpoint, as byte
tensors in :mod:`powertrain.serialize`'s format (loading runs no code); on resume each worker takes back its own.
A resume with another number of workers is refused with a one-line error; a resume from a checkpoint without the
callback's state warns that error feedback starts empty. A later fit of the same Trainer (Lightning's Tuner runs
fits too) registers the same compressor, state kept, on the new DDP wrapper.

Saving is a collective (every rank hands over its state): save checkpoints from every rank, as Lightning's
``ModelCheckpoint`` and ``trainer.save_checkpoint`` do; a checkpoint written by one rank alone
(``OnExceptionCheckpoint`` on the failing rank) would wait for the others. The checkpoint holds world size x the
compressor state (for PowerSGD about one fp32 copy of the trainable parameters per worker).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from powertrain import serialize
from powertrain.ddp import Rewrapped

__all__ = ["GradientCompression"]


class GradientCompression(Callback, Rewrapped):
    """Replace DDP's gradient all-reduce with the compressor ``name`` and its keyword ``options`` (see
    :func:`powertrain.compress.make_compressor`: ``powersgd`` gets the measured recommended config for every option
    not given) under ``strategy="ddp"``."""

    def __init__(self, name: str = "powersgd", **options: Any) -> None:
        Rewrapped.__init__(self, name, options)  # a later fit of the same Trainer wraps the module again
        self._pending: dict[str, Any] | None = None  # a checkpoint's state, loaded before the compressor exists
        self._cpu_group: dist.ProcessGroup | None = None  # the state's gather, on the CPU whatever the backend

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint: made from the compressor's name only, so a resume with
        other options still finds the state (which then says itself whether it fits)."""
        # the name only: options may change between a run and its resume, the state itself says whether it fits
        return self._generate_state_key(name=self.name)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Register on the strategy's DDP wrapper (again on a new one, the compressor and its state kept) and restore
        a checkpoint's state loaded before the compressor existed; ValueError without ``strategy="ddp"``, a warning
        when resuming from a checkpoint that holds no compressor state."""
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            raise ValueError(
                f"GradientCompression needs Trainer(strategy='ddp'), got {type(trainer.strategy).__name__} wrapping "
                f"{type(ddp).__name__}: compression replaces DDP's all-reduce"
            )
        if self.registered_on(ddp):
            return
        compressor, built = self.register(ddp, pl_module.named_parameters())
        if built:
            group = compressor.comm.group
            on_cpu = dist.get_backend(group) == "gloo"
            self._cpu_group = group if on_cpu else dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None
        elif trainer.ckpt_path is not None:
            rank_zero_warn(
                f"GradientCompression: the checkpoint {trainer.ckpt_path} has no compressor state (saved "
                "without this callback, or with another compressor name): error feedback starts "
                "empty"
            )

    def state_dict(self) -> dict[str, Any]:
        """Every worker's compressor state, on rank 0 (a collective: Lightning calls this on every rank)."""
        if self.compressor is None:
            return {}
        blob = torch.frombuffer(bytearray(serialize.dumps(self.compressor.state_dict())), dtype=torch.uint8)
        return {"world_size": dist.get_world_size(self._cpu_group), "ranks": _gather(blob, self._cpu_group)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's compressor state from what :meth:`state_dict` wrote, or keep it until
        :meth:`on_fit_start` builds the compressor. ValueError for a malformed state or one written by another
        number of workers."""
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
        saved, ranks = (state.get("world_size"), state.get("ranks")) if isinstance(state, dict) else (None, None)
        if not (
            type(saved) is int
            and saved >= 1
            and isinstance(ranks, list | tuple)
            and len(ranks) == saved
            and all(isinstance(b, torch.Tensor) and b.dtype == torch.uint8 and b.dim() == 1 for b in ranks)
        ):
            raise ValueError(
                f"The checkpoint's {self.state_key} state is not what GradientCompression writes (world_size "
                f"{repr(saved)[:40]}, ranks {type(ranks).__name__}): the checkpoint is damaged, or was written by "
                "another callback"
            )
        if saved != world:
            raise ValueError(
                f"The checkpoint's compressor state was written by {saved} workers and this fit has {world}: resume "
                f"with {saved} (each worker's error feedback is its own)"
            )
        blob = ranks[rank]
        self.compressor.load_state_dict(serialize.loads(blob.numpy().tobytes()))


def _gather(blob: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's ``blob`` on the group's first rank (others get an empty list), on the CPU (``group``: gloo):
    sizes first, then padded bytes."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    size = torch.tensor([blob.numel()], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(world)] if rank == 0 else None
    dist.gather(size, sizes, dst=dst, group=group)
    longest = torch.tensor([max(int(s) for s in sizes) if sizes else 0])
    dist.broadcast(longest, src=dst, group=group)
    padded = torch.zeros(int(longest), dtype=torch.uint8)
    padded[: blob.numel()] = blob
    out = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, out, dst=dst, group=group)
    if out is None or sizes is None:
        return []
    return [o[: int(s)] for o, s in zip(out, sizes, strict=True)]
