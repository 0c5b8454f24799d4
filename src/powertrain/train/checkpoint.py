"""Checkpoints of a training run: model, optimizer, scheduler, compressor, step, progress and RNG, via DCP.

Layout: ``OUT/checkpoints/step_00000042/`` (a DCP checkpoint with a ``manifest.json`` of checksums) and
``OUT/checkpoints/latest`` (the name of the newest complete one). A checkpoint is written to
``step_XXXXXXXX.tmp`` and renamed once every rank has finished and the manifest is written, and ``latest`` is
replaced atomically afterwards, so a crash while saving leaves the previous checkpoint loadable. A step
directory that already exists (a save that was renamed but never became ``latest``, or one from a run this run
resumed before) is replaced.

Everything is stored as tensors except the optimizer's hyperparameters (numbers, read with
``weights_only=True``); loading goes through :func:`powertrain.checkpoint.load`, which cannot run code, verifies
the checksums and refuses to leave anything out. Per-rank state (compressor error buffers, residuals, RNG, the
scheduler) travels in :class:`powertrain.checkpoint.CompressorState` under each rank's own key, so resuming
needs the world size the checkpoint was written with; :func:`check_resumable` says so before any worker starts.

Optimizers whose state differs per rank (DistributedShampoo's owned blocks or local shards, DeMo's local
momentum, GaLore's projections of local shards) are passed as ``optimizer=None`` and travel in ``per_rank``
instead: DCP's optimizer flattening assumes replicated or DTensor-sharded state, and would keep one rank's.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from powertrain import checkpoint
from powertrain._files import quote, write_atomic
from powertrain.checkpoint import CheckpointError, CompressorState
from powertrain.train.config import DILOCO_FIELDS

__all__ = [
    "check_resumable",
    "check_settings",
    "find_checkpoint",
    "load_checkpoint",
    "read_latest",
    "resume_changes",
    "save_checkpoint",
]

#: The most ``checkpoints/latest`` holds: a checkpoint's directory name (``step_00000042``) and a newline.
LATEST_LIMIT = 256

#: Run-level counters a resume continues from (so a resume into a new directory reports the whole run).
PROGRESS = ("wall_s", "bytes_total", "first_loss")


class _RankState:
    """Everything that differs per rank, as one state_dict."""

    def __init__(self, parts: dict[str, Any]) -> None:
        self.parts = parts  # name -> object with state_dict/load_state_dict

    def state_dict(self) -> dict[str, Any]:
        out = {name: obj.state_dict() for name, obj in self.parts.items()}
        out["rng"] = torch.get_rng_state()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise CheckpointError("The checkpoint's per-rank state is not a dict of named parts")
        absent = sorted(set(self.parts) - set(state))
        if absent:
            raise CheckpointError(f"The checkpoint's per-rank state lacks {absent}")
        for name, obj in self.parts.items():
            obj.load_state_dict(state[name])
        torch.set_rng_state(state["rng"])


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    if optimizer is None:
        return get_model_state_dict(model), {}
    return get_state_dict(model, optimizer)


def _state(
    model_sd: dict, optim_sd: dict, per_rank: dict[str, Any], step: int, progress: dict[str, float]
) -> dict[str, Any]:
    return {
        "model": model_sd,
        "optim": optim_sd,
        "rank": CompressorState(_RankState(per_rank)),
        "step": torch.tensor(step, dtype=torch.int64),
        "progress": {k: torch.tensor(float(progress.get(k, 0.0)), dtype=torch.float64) for k in PROGRESS},
    }


def save_checkpoint(
    out: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    per_rank: dict[str, Any],
    progress: dict[str, float] | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """Save after ``step`` completed steps; returns the checkpoint directory. Every rank must call it. ``config``
    (JSON values: the run's resolved configuration) goes into the manifest, for :func:`check_settings`."""
    root = out / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if _rank0() and tmp.exists():  # left by a save that died: its files must not mix with ours
        shutil.rmtree(tmp)
    _barrier()
    model_sd, optim_sd = _state_dicts(model, optimizer)
    extra = {"step": step, **({"config": config} if config is not None else {})}
    checkpoint.save(_state(model_sd, optim_sd, per_rank, step, progress or {}), tmp, extra=extra)
    if _rank0():
        if final.exists():  # an earlier save of this step that is not (or no longer) the one to continue from
            stale = root / f"{final.name}.stale-{uuid.uuid4().hex[:8]}"
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(tmp, final)  # a directory rename: atomic
        set_latest(out, final)
    _barrier()
    return final


def set_latest(out: Path, ckpt: Path) -> None:
    """Point ``out/checkpoints/latest`` at ``ckpt`` (a directory in it), atomically."""
    write_atomic(out / "checkpoints" / "latest", ckpt.name + "\n")


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself if it is a checkpoint, else the newest complete one under ``path`` (a run directory)."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    latest = p / "checkpoints" / "latest"
    if latest.is_file():
        name = read_latest(p)
        ckpt = p / "checkpoints" / name
        if name and "/" not in name and (ckpt / ".metadata").is_file():
            return ckpt
        raise CheckpointError(f"{str(latest)!r} names {quote(name)}, which is not a complete checkpoint in {str(p)!r}")
    raise CheckpointError(f"No checkpoint at {str(p)!r}: pass a run directory with checkpoints/latest, or a checkpoint")


def read_latest(run: Path) -> str:
    """The checkpoint name in ``run/checkpoints/latest``, read within :data:`LATEST_LIMIT` bytes (the size is checked
    first); :class:`CheckpointError` in one line otherwise."""
    latest = run / "checkpoints" / "latest"
    damaged = "it names a checkpoint (step_00000042); the run directory is damaged"
    raw = checkpoint.read_checkpoint_file(latest, LATEST_LIMIT, "The checkpoint pointer", damaged)
    try:
        return raw.decode().strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{str(latest)!r} holds {quote(raw)}, not a checkpoint name") from None


def _older_than(ckpt: Path) -> str:
    """' (an older complete checkpoint: PATH)' where one exists beside ``ckpt``."""
    older = sorted(
        (p for p in ckpt.parent.glob("step_*") if p.is_dir() and p.name < ckpt.name and p.suffix == ""),
        reverse=True,
    )
    for p in older:
        try:
            checkpoint.verify(p)
        except CheckpointError:
            continue
        return f"; an older complete checkpoint is {p}"
    return ""


#: Settings a resume may change; every other one is part of what the run is (the model, the data, the optimizer's
#: other hyperparameters, which the checkpoint restores anyway), so a resume asking for another value is refused.
#: The learning rate and its schedule (lr, warmup_steps, min_lr_ratio, steps) may change: a lower --lr is what one
#: tries after a divergence, more --steps extend a run; the schedule is a function of the step and these settings
#: (:class:`powertrain.train.optimizers.Schedule`), so the change takes effect from the resumed step on.
#: backend: a run saved on GPUs (nccl) may continue on CPUs (gloo) and back; checkpoints hold CPU-loadable tensors.
RESUME_MAY_CHANGE = frozenset(
    {
        "steps",
        "lr",
        "muon_lr",
        "warmup_steps",
        "min_lr_ratio",
        "out",
        "resume",
        "log_every",
        "eval_every",
        "eval_batches",
        "checkpoint_every",
        "quiet",
        "tensorboard",
        "timeout_s",
        "threads",
        "nproc",
        "backend",
    }
)
#: What a resume refuses to change. Every field of :class:`powertrain.train.config.TrainConfig` is in exactly one of
#: the two sets (a test in tests/test_cli.py walks them), so a new setting is placed on purpose; one that is in
#: neither is refused too.
RESUME_REFUSED = frozenset(
    {
        # the model and its data
        "model",
        "gpt_size",
        "data",
        "data_path",
        "data_max_mb",
        "block_size",
        "batch_size",
        "grad_accum",
        "seed",
        "precision",
        "compile",
        # the optimizer (the checkpoint restores its state, which these shape or give meaning to)
        "optimizer",
        "weight_decay",
        "momentum",
        "adam_freeze",
        "shampoo_frequency",
        "shampoo_max_dim",
        "shampoo_preconditioner",
        "shampoo_comm_dtype",
        "shampoo_vectors",
        "galore_rank",
        "galore_gap",
        "galore_scale",
        "galore_svd",
        "demo_topk",
        "demo_chunk",
        "demo_decay",
        "dion_rank",
        # how the workers share the work, and what each keeps of it (error feedback, local weights, the outer step)
        "parallel",
        "tp",
        "compressor",
        "hierarchy",
        *DILOCO_FIELDS,
    }
)


def check_resumable(path: Path, world_size: int) -> dict[str, Any]:
    """Verify the checkpoint at ``path`` (checksums, format) and that ``world_size`` workers can resume it; returns
    its manifest (:func:`check_settings` then compares the new run's settings with it). Raises
    :class:`CheckpointError` with a one-line reason."""
    try:
        manifest = checkpoint.verify(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}{_older_than(path)}") from None
    saved = checkpoint.saved_world_size(path)
    if saved != world_size:
        raise CheckpointError(
            f"Checkpoint {str(path)!r} was written by {saved} worker(s) and this run has {world_size}: resume with "
            f"{saved} (--nproc {saved}, or torchrun with --nnodes x --nproc-per-node = {saved}); a resume continues "
            f"the run bit for bit and what belongs to each worker is not redistributed: "
            f"{_per_worker(manifest.get('config'))}"
        )
    # the step is read from the checkpoint's data (its checksums verified just now), not believed from the manifest:
    # whether there is anything left to do is decided from it
    stored = {"step": torch.tensor(0, dtype=torch.int64)}
    with warnings.catch_warnings():  # read in the launcher, alone, as it should be: DCP warns that it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        checkpoint.load(stored, path, manifest=manifest)
    _checked_step(path, stored["step"], manifest)
    return manifest


def _per_worker(config: Any) -> str:
    """What a run with ``config`` (a manifest's) keeps per worker, which another world size cannot take over."""
    config = config if isinstance(config, dict) else {}
    kept = ["each worker's stream of batches (its rank and the world size choose them)"]
    compressor = str(config.get("compressor", "none")).split(":")[0]
    if compressor not in ("none", "fp16", "bf16"):
        kept.append(f"the {compressor} compressor's state of each worker (error-feedback buffers)")
    if config.get("optimizer") in ("shampoo", "galore", "demo", "dion"):
        kept.append(f"{config['optimizer']}'s state of each worker")
    if config.get("parallel") == "diloco":
        kept.append("each worker's own weights and inner optimizer state (local updates)")
    return ", ".join(kept)


def check_settings(path: Path, manifest: dict[str, Any], config: dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` when ``config`` changes settings of the run that wrote ``manifest`` other than
    :data:`RESUME_MAY_CHANGE`."""
    saved_cfg = manifest.get("config")
    diffs = config_changes(saved_cfg, config) if isinstance(saved_cfg, dict) else ""
    if diffs:
        raise CheckpointError(
            f"Checkpoint {str(path)!r} belongs to a run with other settings ({diffs}): a resume continues that run "
            "(the checkpoint restores its optimizer and schedule); drop those flags, or start a new run"
        )


def resume_changes(manifest: dict[str, Any], config: dict[str, Any]) -> str:
    """The settings of :data:`RESUME_MAY_CHANGE` that ``config`` changes from the run that wrote ``manifest``, as
    ``"lr=0.001 -> 0.0005, ..."`` in ``config``'s order, or ``""``: every one but where the run is (``out``,
    ``resume``), so that a resume's log says each setting it applies anew."""
    saved = manifest.get("config")
    saved = saved if isinstance(saved, dict) else {}
    said = RESUME_MAY_CHANGE - {"out", "resume"}
    changed = [k for k, v in config.items() if k in said and k in saved and saved[k] != v]
    return ", ".join(f"{k}={saved[k]!r:.40} -> {config[k]!r}" for k in changed)


def config_changes(saved: dict[str, Any], config: dict[str, Any]) -> str:
    """The settings of ``config`` that a continuation of the run with ``saved`` settings may not change, as
    ``"key=old -> new, ..."`` (up to four), or ``""``."""
    from powertrain.train.config import ignored_by

    ignored = ignored_by(saved.get("optimizer"))  # another optimizer's setting, which that run never used
    changed = [
        k
        for k, v in config.items()
        if k not in RESUME_MAY_CHANGE
        and k not in ignored
        and k in saved
        and saved[k] != v
        and not (k == "compressor" and _auto(v))
    ]  # rank=auto continues with what it chose (the caller)
    return ", ".join(f"{k}={saved[k]!r} -> {config[k]!r}" for k in changed[:4])


def _auto(spec: Any) -> bool:
    from powertrain.train.config import is_auto, parse_compressor

    return isinstance(spec, str) and is_auto(*parse_compressor(spec))


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, per_rank: dict[str, Any]
) -> tuple[int, dict[str, float]]:
    """Restore everything saved by :func:`save_checkpoint`; returns the number of completed steps and the run's
    progress counters (:data:`PROGRESS`) at that step."""
    model_sd, optim_sd = _state_dicts(model, optimizer)
    manifest = checkpoint.verify(path)
    saved = set(checkpoint.read_metadata(path, manifest).state_dict_metadata)
    missing = sorted(k for k in (f"model.{k}" for k in model_sd) if k not in saved)
    if missing:
        raise CheckpointError(f"Checkpoint {str(path)!r} was made for another model: it lacks {missing[:5]}")
    ranks = _Deferred()  # the per-rank parts load after the model: a replica's own weights (local updates) win
    groups = copy.deepcopy(optim_sd.get("param_groups"))  # this run's, to compare the saved ones with
    state = _state(model_sd, optim_sd, {}, 0, {})
    state["rank"] = CompressorState(ranks)
    checkpoint.load(state, path, optional=checkpoint.never_stepped("optim"), manifest=manifest)
    try:
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            from powertrain.train.optimizers import check_param_groups, check_state_values

            # torch would take the saved hyperparameters as they are (weight_decay=50 included), and the state's
            # values too (a NaN momentum, a step of -1)
            check_param_groups(state["optim"].get("param_groups"), groups or [])
            kind = type(optimizer).__name__
            for fqn, per in (state["optim"].get("state") or {}).items():
                check_state_values(f"the optimizer's state for {fqn}", per if isinstance(per, dict) else {}, kind)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"Checkpoint {str(path)!r} does not fit this model or optimizer: {e}"[:400]) from None
    try:
        _RankState(per_rank).load_state_dict(ranks.state)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, RuntimeError, MemoryError) as e:  # a state that does not fit
        reason = " ".join(str(e).split())[:300]  # one bounded line: a message may quote what a crafted state holds
        raise CheckpointError(f"Cannot load checkpoint {str(path)!r}: {type(e).__name__}: {reason}") from None
    return _checked_step(path, state["step"], manifest), _checked_progress(path, state["progress"])


def _checked_step(path: Path, value: torch.Tensor, manifest: dict[str, Any]) -> int:
    """The checkpoint's step: a count of completed steps (>= 1: a run saves after a step), the one its manifest
    names. A crafted -3 would otherwise train steps -2 ... and name checkpoints step_-0000002."""
    step = int(value)
    named = manifest.get("step")
    if step < 1:
        why = f"holds step {step}, which no run saves (a run saves after a step)"
    elif named is not None and named != step:
        why = f"holds step {step} and its manifest names step {quote(str(named))}"
    else:
        return step
    raise CheckpointError(f"Checkpoint {str(path)!r} {why}: it is damaged; resume from another checkpoint")


def _checked_progress(path: Path, progress: dict[str, torch.Tensor]) -> dict[str, float]:
    """The run's counters at the checkpoint: time and bytes finite and >= 0, the first loss finite (or NaN: not
    logged yet)."""
    out = {k: float(v) for k, v in progress.items()}
    for k, v in out.items():
        if (math.isnan(v) and k != "first_loss") or math.isinf(v) or (k != "first_loss" and v < 0):
            raise CheckpointError(
                f"Checkpoint {str(path)!r} holds {k}={v}, which no run writes: it is damaged; "
                "resume from another checkpoint"
            )
    return out


class _Deferred:
    """Takes a per-rank state when DCP loads it, for :class:`_RankState` to apply later."""

    state: Any = None

    def load_state_dict(self, state: Any) -> None:
        self.state = state
