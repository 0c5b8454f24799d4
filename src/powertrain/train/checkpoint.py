"""Checkpoints of a training run: model, optimizer, scheduler, compressor, step and RNG, via DCP.

Layout: ``OUT/checkpoints/step_00000042/`` (a DCP checkpoint) and ``OUT/checkpoints/latest`` (the name of
the newest complete one). A checkpoint is written to ``step_XXXXXXXX.tmp`` and renamed once every rank has
finished, and ``latest`` is replaced atomically afterwards, so a crash while saving leaves the previous
checkpoint loadable. Per-rank state (compressor error buffers, residuals, RNG) is stored under each rank's
own key (:class:`powertrain.checkpoint.CompressorState`) and loaded with ``weights_only=True``; DCP's own
metadata file (plain pickle in torch) is read with an unpickler that admits only DCP's metadata classes.

Optimizers whose state differs per rank (DistributedShampoo's owned blocks or local shards, DeMo's local
momentum, GaLore's projections of local shards) are passed as ``optimizer=None`` and travel in ``per_rank``
instead: DCP's optimizer flattening assumes replicated or DTensor-sharded state, and would keep one rank's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from powertrain._compat import safe_dcp_reader
from powertrain.checkpoint import CompressorState

__all__ = ["find_checkpoint", "load_checkpoint", "save_checkpoint"]


class _RankState:
    """Everything that differs per rank, as one state_dict."""

    def __init__(self, parts: dict[str, Any]) -> None:
        self.parts = parts  # name -> object with state_dict/load_state_dict
        self.loaded: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        out = {name: obj.state_dict() for name, obj in self.parts.items()}
        out["rng"] = torch.get_rng_state()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, obj in self.parts.items():
            obj.load_state_dict(state[name])
        torch.set_rng_state(state["rng"])
        self.loaded = state


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    if optimizer is None:
        return get_model_state_dict(model), {}
    return get_state_dict(model, optimizer)


def save_checkpoint(out: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    per_rank: dict[str, Any]) -> Path:  # fmt: skip
    """Save after ``step`` completed steps; returns the checkpoint directory."""
    root = out / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    model_sd, optim_sd = _state_dicts(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "rank": CompressorState(_RankState(per_rank)), "step": step}
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.replace(tmp, final)  # a directory rename: atomic
        latest = root / "latest.tmp"
        latest.write_text(final.name + "\n")
        os.replace(latest, root / "latest")
    _barrier()
    return final


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself if it is a checkpoint, else the newest complete one under ``path`` (a run directory)."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    latest = p / "checkpoints" / "latest"
    if latest.is_file():
        ckpt = p / "checkpoints" / latest.read_text().strip()
        if (ckpt / ".metadata").is_file():
            return ckpt
    raise ValueError(f"No checkpoint at {str(p)!r}: pass a run directory with checkpoints/latest, or a checkpoint")


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    per_rank: dict[str, Any]) -> int:  # fmt: skip
    """Restore everything saved by :func:`save_checkpoint`; returns the number of completed steps."""
    model_sd, optim_sd = _state_dicts(model, optimizer)
    saved = set(safe_dcp_reader(str(path)).read_metadata().state_dict_metadata)
    missing = sorted(k for k in (f"model.{k}" for k in model_sd) if k not in saved)
    if missing:
        raise ValueError(f"Checkpoint {str(path)!r} was made for another model: it lacks {missing[:5]}")
    rank_state = _RankState(per_rank)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "rank": CompressorState(rank_state), "step": 0}
    # Optimizer slots of parameters that never had a gradient are absent from the checkpoint: allow that.
    dcp.load(
        state,
        storage_reader=safe_dcp_reader(str(path)),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])
