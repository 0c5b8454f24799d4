"""``powertrain train``: its flags (:func:`add_arguments`) and what it does (:func:`run`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import importlib.util
import os
import shutil
import signal
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from powertrain.train.config import (
    DEFAULT_OUTER_COMPRESSOR,
    DEFAULT_START,
    MATRIX_LR,
    POWERSGD_ADAM_FREEZE,
    PRESETS,
    RECOMMENDED_POWERSGD,
    WIDTH_PER_RANK,
    TrainConfig,
    load_toml,
    resolve,
    to_toml,
)

_HELP = {
    "model": "gpt (text) or resnet (mnist1d)",
    "gpt_size": "GPT shape: tiny, small, default (3.3M params), medium, gpt2 (GPT-2 small)",
    "data": "stdlib (Python's own sources), textdir, bin (nanoGPT uint16 tokens) or mnist1d",
    "data_path": "directory of text files (textdir) or .bin file / directory with train.bin, val.bin (bin)",
    "batch_size": "sequences or samples per worker per micro-step",
    "grad_accum": "micro-steps per optimizer step (gradient accumulation)",
    "parallel": "reference (optimizer_step API), ddp, fsdp (FSDP2), simple_fsdp (DTensor parametrization), rtp "
    "(rotated tensor parallelism: each rank stores 1/W of every Linear and Embedding weight), tp (2-D) or diloco "
    "(local updates: each worker trains alone for --sync-every steps, then the compressor sends the pseudo-gradients "
    "and an outer SGD step (averaging by default) moves the shared weights; for slow links)",
    "compile": "torch.compile the model (fullgraph with simple_fsdp)",
    "optimizer": "adamw, sgd, muon (Muon on the hidden matrices at --muon-lr, AdamW at --lr on embeddings, head, "
    "norms and biases), dion (Dion: low-rank; under reference and ddp it sends its own factors), shampoo "
    "(DistributedShampoo), galore (GaLoreAdamW on the blocks' 2-D weights) or demo "
    "(DeMo: no gradient all-reduce; reference or ddp; sign updates want a smaller --lr, e.g. 3e-4)",
    "muon_lr": f"optimizer muon or dion: the hidden matrices' learning rate (Muon: {MATRIX_LR['muon']:g}, scaled by "
    f"sqrt(max(1, rows / cols)) per matrix; Dion: {MATRIX_LR['dion']:g}, scaled by sqrt(rows / cols))",
    "dion_rank": "optimizer dion: each matrix's rank as a fraction of its smaller side (Dion sends (rows + cols) x "
    "rank numbers per matrix instead of rows x cols)",
    "adam_freeze": "fraction of the steps after which AdamW's second moment freezes (0: never, torch's AdamW); with "
    "PowerSGD's error feedback a frozen second moment counts the delayed gradient components in full",
    "shampoo_frequency": "steps between Shampoo's inverse-root (or eigenbasis) computations",
    "shampoo_max_dim": "largest Shampoo factor dimension (blocks are cut to it)",
    "shampoo_preconditioner": "shampoo (inverse roots) or eigenvalue_corrected (SOAP: Adam in the factors' eigenbasis)",
    "shampoo_comm_dtype": "dtype of the all-gathered search directions under ddp/reference: fp32 (bitwise the "
    "single-process optimizer) or bf16 (half the bytes)",
    "shampoo_vectors": "how Shampoo updates 1-D blocks (biases, norm gains): graft (Adam alone, as SOAP does; a tenth "
    "less optimizer time on the default GPT) or shampoo (a full d x d factor, the reference implementation's way)",
    "galore_rank": "GaLore projection rank (d_model / 4 on the default GPT)",
    "galore_gap": "steps between GaLore subspace refreshes (update_proj_gap)",
    "galore_scale": "GaLore's scale of the projected-back update",
    "galore_svd": "GaLore subspace refresh: randomized (GaLore 2) or exact SVD",
    "demo_topk": "DeMo: DCT coefficients sent per chunk",
    "demo_chunk": "DeMo: chunk size per dimension of the DCT",
    "demo_decay": "DeMo: momentum decay (compression_decay)",
    "compressor": "NAME[:key=value,...] with NAME in none, fp16, bf16, powersgd, int8, int4, topk, randk, sign; "
    "e.g. powersgd:rank=4,iters=2  topk:ratio=0.01 (with diloco: what compresses each sync's pseudo-gradients)",
    "sync_every": "diloco: inner steps between two syncs (H)",
    "fragments": "diloco: Streaming DiLoCo's fragments (F), consecutive layers of about equal size synced in turn",
    "sync_delay": "diloco: inner steps a sync overlaps before its outer update is applied (below sync_every / "
    "fragments)",
    "sync_mix": "diloco: share of the local weights kept after a delayed outer update (0: take the update as is)",
    "outer_lr": "diloco: the outer SGD's learning rate (1 with --outer-momentum 0: plain averaging, the measured "
    "default; DiLoCo's paper: 0.7 with momentum 0.9)",
    "outer_momentum": "diloco: the outer SGD's Nesterov momentum (0: plain SGD)",
    "outer_lr_schedule": "diloco: constant, or inner: each outer step at --outer-lr times the inner schedule's "
    "multiplier then (warm-up and decay)",
    "sync_warmup": "diloco: steps first whose gradients are averaged every step (by --warmup-compressor), so that the "
    "replicas start their local updates as one model, with one optimizer state",
    "warmup_compressor": "diloco: what averages the warm-up's gradients (a --compressor spec)",
    "hierarchy": "flat (every rank compresses against every other) or node (exact mean inside each node, the "
    "compressor only between nodes; with fsdp: HSDP, sharded inside a node, the compressor over the nodes' "
    "replicas; nodes from torchrun's LOCAL_WORLD_SIZE)",
    "nproc": "local workers to launch (ignored under torchrun, which sets the world)",
    "threads": "torch threads per worker",
    "timeout_s": "how long a collective may wait for a peer before the run fails",
    "out": "run directory (default: runs/<timestamp>)",
    "eval_every": "validate every N steps (0: only at the end)",
    "checkpoint_every": "save a checkpoint every N steps (0: never)",
    "resume": "continue from a run directory (its latest checkpoint) or a checkpoint directory",
    "quiet": "no progress output, only the summary",
    "tensorboard": "also write the logged scalars as TensorBoard events to <out>/tensorboard (needs "
    "powertrain[tensorboard])",
}


#: What an empty or None default means, for --help.
_DEFAULT_TEXT = {
    "compressor": f"{RECOMMENDED_POWERSGD},start={DEFAULT_START} on the default GPT: the rank is the "
    f"model's width / {WIDTH_PER_RANK} (none with simple_fsdp, rtp, tp and optimizer demo; "
    f"{DEFAULT_OUTER_COMPRESSOR} with diloco)",
    "adam_freeze": f"{POWERSGD_ADAM_FREEZE} with compressor powersgd and optimizer adamw, else 0",
    "out": "runs/<timestamp>",
}


def _help(f: dataclasses.Field[Any]) -> str:
    """The flag's help with the default the command uses when neither the flag nor a config file sets it (the
    default preset's value)."""
    default = _DEFAULT_TEXT.get(f.name, f.default)
    text = _HELP.get(f.name, "")
    if isinstance(default, bool) or default is None or default == "":
        return text
    return f"{text} (default: {default})" if text else f"default: {default}"


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        base = args[0] if len(args) == 1 else hint
        if base is bool:
            p.add_argument(flag, action="store_true", default=None, help=_HELP.get(f.name))
        elif typing.get_origin(base) is Literal:
            p.add_argument(flag, choices=typing.get_args(base), default=None, help=_help(f))
        else:
            p.add_argument(flag, type=base, default=None, help=_help(f))


def add_arguments(train: argparse.ArgumentParser) -> None:
    """``powertrain train``'s flags: a preset, a TOML file, and one flag per TrainConfig field."""
    train.add_argument("--preset", choices=sorted(PRESETS), default="default", help="base settings (tiny: seconds)")
    train.add_argument("--config", help="TOML file with any of the keys below (flags override it)")
    _add_train_flags(train)


def _default_out() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")  # identical on every rank under torchrun
    stamp = run_id or datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    return str(Path("runs") / stamp)


LOCK = ".lock"


def _continues_in_place(cfg: TrainConfig) -> Literal["checkpoint", "start over", False]:
    """Whether ``cfg.out`` already holds this run, which then continues there with no flag changed: from its latest
    complete checkpoint (``"checkpoint"``: the same command again, or torchrun restarting the workers after one
    died), or from the start (``"start over"``: torchrun restarting a run that died before its first checkpoint,
    whose saved config.toml has the same settings). Other settings are refused with a one-line error."""
    out = Path(str(cfg.out))
    if (out / "checkpoints" / "latest").is_file():
        return "checkpoint"
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and (out / "config.toml").is_file():
        from powertrain.train.checkpoint import config_changes  # DCP: imported where a run continues only

        diffs = config_changes(load_toml(out / "config.toml"), dataclasses.asdict(cfg))
        if diffs:
            raise ValueError(f"out={cfg.out!r} holds a run with other settings ({diffs}): choose another --out")
        return "start over"
    return False


def _prepare_out(path: str, *, resume: Path | None, restart: bool = False) -> Path:
    """The run directory: created if needed, writable, and empty unless this run continues one of its own
    checkpoints (``OUT/checkpoints/step_*``) or torchrun restarts it (``restart``)."""
    if not path.strip():
        raise ValueError("out='' is not a directory: give --out a path")
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"Cannot write to out={path!r}: {e.strerror or e}; choose another --out") from None
    if not _own(out, resume, restart) and any(p.name != LOCK for p in out.iterdir()) and not _unstarted(out):
        hint = f", or continue it with --resume {path}" if (out / "checkpoints" / "latest").is_file() else ""
        raise ValueError(f"out={path!r} is not empty (it holds another run): choose a new --out{hint}")
    return out


def _own(out: Path, resume: Path | None, restart: bool) -> bool:
    """Whether the run continues in ``out`` (one of its checkpoints, or torchrun restarting it)."""
    return restart or (resume is not None and resume.parent.resolve() == (out / "checkpoints").resolve())


#: What a run writes before its first logged step (metrics.jsonl still empty): an ``--out`` holding these only
#: holds a run that failed or was stopped before it produced anything, and a new run takes it over.
UNSTARTED = frozenset({LOCK, "config.toml", "metrics.jsonl", "pids", "logs", "tensorboard"})


def _unstarted(out: Path) -> list[str]:
    """The names in ``out`` (.lock aside) when it holds only what a run leaves before its first logged step, else
    an empty list. Links never count: they are not what a run writes."""
    entries = list(out.iterdir())
    if not entries or any(p.name not in UNSTARTED or p.is_symlink() for p in entries):
        return []
    config, metrics = out / "config.toml", out / "metrics.jsonl"
    if not config.is_file() or (metrics.exists() and (not metrics.is_file() or metrics.stat().st_size)):
        return []
    return sorted(p.name for p in entries if p.name != LOCK)


def _clear_unstarted(out: Path, quiet: bool) -> None:
    """Remove what a run that never logged a step left in ``out`` (called with ``out``'s lock held, so that a run
    starting there right now is never touched)."""
    names = _unstarted(out)
    if not names:
        return
    for name in names:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    if not quiet:
        print(
            f"out={str(out)!r} held only a run that ended before its first logged step ({', '.join(names)}): "
            "starting afresh there",
            flush=True,
        )


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """Hold ``OUT/.lock`` for the run: a second run in the same directory is refused, not interleaved."""
    with (out / LOCK).open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ValueError(
                f"Another run is using out={str(out)!r} right now: wait for it, or choose another --out"
            ) from None
        yield


def _config_path(out: Path, resumed: bool) -> Path:
    """config.toml for a new run; a resume keeps it and records its own settings beside it, never overwriting."""
    config = out / "config.toml"
    if not resumed or not config.exists():
        return config
    n = 1
    while (out / f"config.resume{n}.toml").exists():
        n += 1
    return out / f"config.resume{n}.toml"


def run(args: argparse.Namespace) -> int:
    from powertrain.train.data import check_sizes, check_source
    from powertrain.train.launch import torchrun_shared_store, under_torchrun
    from powertrain.train.metrics import supersede

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    flags: dict[str, Any] = {k: v for k, v in vars(args).items() if k in names and v is not None}
    toml = load_toml(args.config) if args.config else None
    cfg = resolve(args.preset, toml, flags)
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=_default_out())
    rank0 = int(os.environ.get("RANK", "0")) == 0
    check_source(cfg)
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard needs the tensorboard package: pip install 'powertrain[tensorboard]'")
    ckpt, world = None, int(os.environ["WORLD_SIZE"]) if under_torchrun() else cfg.nproc
    check_sizes(cfg, world)  # before --out exists: a run refused here leaves nothing behind
    restart = cfg.resume is None and _continues_in_place(cfg)
    if restart == "checkpoint":
        cfg = dataclasses.replace(cfg, resume=cfg.out)
        if rank0:
            print(f"out={cfg.out!r} holds this run's checkpoints: continuing from the latest", flush=True)
    if cfg.resume is not None:  # every check a worker would make, here, once, with a one-line error
        from powertrain.checkpoint import CheckpointError  # DCP: imported by runs that resume only
        from powertrain.train.checkpoint import check_resumable, check_settings, find_checkpoint, resume_changes

        ckpt = find_checkpoint(cfg.resume)
        try:
            manifest = check_resumable(ckpt, world)
            # what the run keeps from its checkpoint first (a default that depends on --steps must not differ)
            cfg = _continued(cfg, manifest.get("config", {}), {**(toml or {}), **flags})
            check_settings(ckpt, manifest, dataclasses.asdict(cfg))
            changed = resume_changes(manifest, dataclasses.asdict(cfg))
        except CheckpointError as e:
            if restart != "checkpoint":
                raise
            raise ValueError(f"out={cfg.out!r} holds a run that this command would continue, but {e}") from None
        if int(manifest.get("step", -1)) >= cfg.steps:
            print(
                f"Nothing to do: the checkpoint has {manifest['step']} steps and --steps is {cfg.steps}; raise "
                "--steps to train further."
            )
            return 0
        if rank0 and changed:
            print(f"Resuming {ckpt} with changed settings: {changed} (from step {manifest.get('step')} on)", flush=True)
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if rank0 and restarts and torchrun_shared_store() == "nodes":  # see powertrain.train.loop._restart_store
        warning = (
            "powertrain train: warning: torchrun --max-restarts across nodes needs "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment: torch shares one store across "
            "restarts (pytorch/pytorch#135712) and the restarted workers would not connect"
        )
        print(warning, file=sys.stderr, flush=True)
    if not rank0:
        return _launch(cfg, Path(str(cfg.out)))
    out = _prepare_out(str(cfg.out), resume=ckpt, restart=restart == "start over")
    with _exclusive(out):
        if not _own(out, ckpt, restart == "start over"):
            _clear_unstarted(out, cfg.quiet)
        if restart == "start over":  # the earlier attempt's rows move to metrics.superseded.jsonl
            print(f"torchrun restarted this run before its first checkpoint: starting it over in {out}", flush=True)
            supersede(out, 0)  # every row (steps start at 1); a new run's log must not exist
            (out / "metrics.jsonl").unlink(missing_ok=True)
        config = _config_path(out, ckpt is not None)
        config.write_text(to_toml(cfg))
        if not cfg.quiet:
            print(f"resolved config (saved to {config}):\n" + to_toml(cfg), flush=True)
        return _launch(cfg, out)


def _continued(cfg: TrainConfig, saved: dict[str, Any], user: dict[str, Any]) -> TrainConfig:
    """The settings a resumed run keeps from its checkpoint's config (``saved``) over what ``cfg`` resolved: rank=auto's
    choice; the compressor, the AdamW freeze and the matrices' rate when the user (``user``: TOML and flags) did not
    set them, so that a run
    continues with its own and not with a default that depends on ``--steps`` or on a later version. A compressor the
    user names that differs from the run's is left for :func:`check_settings` to refuse, never replaced."""
    compressor, freeze = saved.get("compressor"), saved.get("adam_freeze")
    from powertrain.train.config import is_auto, parse_compressor

    given = "compressor" in user and not is_auto(*parse_compressor(cfg.compressor))
    kept: dict[str, Any] = {}
    if compressor != cfg.compressor and isinstance(compressor, str) and not given:
        kept["compressor"] = compressor
    if "adam_freeze" not in user and isinstance(freeze, int | float) and not isinstance(freeze, bool):
        kept["adam_freeze"] = float(freeze)
    matrix_lr = saved.get("muon_lr")  # a default per optimizer and per version: the run's own, unless asked
    if "muon_lr" not in user and isinstance(matrix_lr, int | float) and not isinstance(matrix_lr, bool):
        kept["muon_lr"] = float(matrix_lr)
    try:
        return dataclasses.replace(cfg, **kept)
    except ValueError:  # the run's own do not fit what the user changed (another --optimizer): the settings check
        return cfg  # names that change, not a flag the user never gave


def _again(out: Path) -> str:
    """How to go on after a stopped run: from its last checkpoint, or (none written yet) from the start."""
    if (out / "checkpoints" / "latest").is_file():
        return f"resume from the last checkpoint with: powertrain train ... --resume {out}"
    return "no checkpoint was written yet: the same command starts the run over"


def _launch(cfg: TrainConfig, out: Path) -> int:
    import torch.distributed as dist

    from powertrain.train.launch import Interrupted, WorkerFailed, launch, under_torchrun
    from powertrain.train.loop import run_worker

    try:
        launch(run_worker, cfg.nproc, cfg, trace_dir=out / "logs")
        if under_torchrun() and dist.is_initialized():  # a group with peers must not be destroyed (leave_world)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except WorkerFailed as e:
        print(f"powertrain train: {e.describe()}", file=sys.stderr)
        diverged = all(f.cause.startswith("FloatingPointError") for f in e.failures)  # its line names the checkpoint
        if cfg.checkpoint_every and not diverged:
            again = _again(out)
            print(again[0].upper() + again[1:], file=sys.stderr)
        return 1
    except FloatingPointError as e:  # single process: the worker's own error
        print(f"powertrain train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        how = e.signal_name if isinstance(e, Interrupted) else "SIGINT"
        hint = f"; {_again(out)}" if cfg.checkpoint_every else ""
        print(f"powertrain train: interrupted ({how}), every worker stopped{hint}", file=sys.stderr)
        return 128 + signal.Signals[how].value  # a shell's status for that signal: 130 for SIGINT, 143 for SIGTERM
    return 0
