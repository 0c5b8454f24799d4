"""One training worker (one rank) of ``powertrain train``; the parallel modes are in :mod:`.strategy`."""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from powertrain._device import synchronize
from powertrain.comm import CommStats, Communicator, collective_device
from powertrain.compress import NonFiniteGradientError
from powertrain.compress.auto import Choice, choose, measure_link, slowest
from powertrain.models import GPT, GPTConfig, ResNet1d
from powertrain.ops.flat import local_tensor
from powertrain.train.config import (
    POWERSGD_ADAM_FREEZE,
    RECOMMENDED_COST,
    RECOMMENDED_POWERSGD,
    TrainConfig,
    is_auto,
    parse_compressor,
)
from powertrain.train.data import ClassData, TokenData, load_data
from powertrain.train.launch import leave_world, torchrun_shared_store
from powertrain.train.liveness import Heartbeat
from powertrain.train.metrics import Progress, RunWriter
from powertrain.train.optimizers import RankOptimizer, Schedule, build_optimizer, build_scheduler
from powertrain.train.strategy import Strategy, build_strategy

MB = 1e6


def _init_distributed(cfg: TrainConfig) -> torch.device:
    """Join the launcher's world (env://); one worker under ddp/fsdp/simple_fsdp gets a world of one (an
    in-process store: no socket), since those modes need a process group. The run's device: its process group's
    (CUDA under NCCL), and without one (``reference`` alone) the device ``--backend`` would use (``auto``: CUDA
    where there is one)."""
    alone = "WORLD_SIZE" not in os.environ
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        if alone and cfg.parallel == "reference":
            pass  # nothing to communicate: no process group
        elif alone:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        elif (store := _restart_store(timeout)) is not None:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    if dist.is_initialized():
        return collective_device()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _restart_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The store of a worker that torchrun restarted on a single node, or None (use env://).

    torchrun's shared store (:func:`~powertrain.train.launch.torchrun_shared_store`) still holds the dead workers'
    addresses, which restarted gloo workers would read and fail to connect to. On one node every worker has the
    same restart count, which keys a fresh namespace; across nodes torchrun needs
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a store per attempt), which the train command asks for at start-up.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or torchrun_shared_store() != "one node":
        return None
    world = int(os.environ["WORLD_SIZE"])
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"powertrain/attempt_{attempt}", client)


def build_model(cfg: TrainConfig, data: TokenData | ClassData) -> torch.nn.Module:
    if isinstance(data, ClassData):
        return ResNet1d(in_channels=data.x_train.shape[1], num_classes=data.num_classes)
    n_layer, n_head, d_model = cfg.gpt_shape
    return GPT(GPTConfig(data.vocab_size, cfg.block_size, n_layer, n_head, d_model))


@record
def run_worker(cfg: TrainConfig) -> dict[str, Any]:
    device = _init_distributed(cfg)
    heartbeat = _heartbeat(cfg)
    try:
        return _train(cfg, device)
    except RuntimeError as e:  # a failed collective: name the peers that are gone, if any are
        lost = _diagnose(heartbeat)
        if lost:
            e.add_note(f"powertrain: {lost}")  # the error keeps its type and message; tracebacks show the note
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()


def _diagnose(heartbeat: Heartbeat | None) -> str:
    """:meth:`Heartbeat.diagnose`, which explains an error and so must never replace it."""
    if heartbeat is None:
        return ""
    try:
        return heartbeat.diagnose()
    except Exception as e:
        return f"(which peers are lost is unknown: the diagnosis failed with {type(e).__name__})"


def _heartbeat(cfg: TrainConfig) -> Heartbeat | None:
    """A heartbeat in the launcher's store, for a world of several workers (see :mod:`powertrain.train.liveness`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or "MASTER_ADDR" not in os.environ:
        return None
    try:
        return Heartbeat(dist.get_rank(), dist.get_world_size(), cfg.timeout_s)
    except (RuntimeError, OSError) as e:  # a run does not need it: it only names lost peers
        warnings.warn(f"no heartbeat (a lost peer will not be named): {e}", stacklevel=2)
        return None


@dataclasses.dataclass
class _Run:
    """What a worker trains with, built once by :func:`_setup`."""

    cfg: TrainConfig
    device: torch.device
    out: Path
    metrics: Communicator  # loss averaging; kept apart from the gradient byte counts
    data: TokenData | ClassData
    model: torch.nn.Module
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: Schedule
    per_rank: dict[str, Any]  # each rank's own state in a checkpoint
    dcp_optimizer: torch.optim.Optimizer | None  # the optimizer, where DCP saves it (its state is not per rank)
    # what this rank sends and the time it spends on it: the gradients' communication and the optimizer's own
    # (Shampoo's all-gather, DeMo's all-gather and compression, GaLore's refresh)
    sources: list[CommStats]
    n_params: int
    dense_bytes: int  # a plain fp32 all-reduce of the trainable gradients
    autocast: Any

    @property
    def rank(self) -> int:
        return self.metrics.rank

    @property
    def world(self) -> int:
        return self.metrics.world_size

    @property
    def data_group(self) -> tuple[int, int]:
        return self.strategy.data_group or (self.rank, self.world)  # a tp group reads one batch


def _setup(cfg: TrainConfig, device: torch.device) -> _Run:
    metrics = Communicator()
    rank, world = metrics.rank, metrics.world_size
    torch.set_num_threads(cfg.threads)
    out = Path(str(cfg.out))
    if cfg.nproc > 1 or world > 1:
        (out / "pids").mkdir(parents=True, exist_ok=True)
        (out / "pids" / f"rank{rank}").write_text(f"{os.getpid()}\n")  # lets operators (and tests) find us

    data = load_data(cfg)
    data.check(rank, world, cfg.block_size)  # a split too small fails now, not at the first validation
    torch.manual_seed(cfg.seed)  # identical initial model on every rank
    model = build_model(cfg, data).to(device)
    name, options = parse_compressor(cfg.compressor)
    if is_auto(name, options):  # the link chooses; the run (its checkpoints and summary) records the choice
        choice = _auto_compressor(cfg, model, data, metrics, device, options)
        name, options = choice.name, choice.options
        cfg = dataclasses.replace(cfg, compressor=choice.spec)
        if rank == 0:
            print(choice.reason, flush=True)
    strategy = build_strategy(
        cfg.parallel,
        model,
        name,
        options,
        compiled=cfg.compile,
        gradient_sync=cfg.gradient_sync,
        tp=cfg.tp,
        batch=cfg.batch_size,
        hierarchical=cfg.hierarchy == "node",
        local=cfg.local_updates,
    )
    if cfg.compile and cfg.parallel == "simple_fsdp":
        from powertrain.simple_fsdp import compile_model

        strategy.model = compile_model(strategy.model)
    elif cfg.compile:
        strategy.model = torch.compile(strategy.model)  # type: ignore[assignment]
    built = build_optimizer(cfg, model)
    strategy.attach(built.optimizer)
    scheduler = build_scheduler(cfg, built.optimizer)
    per_rank = {"compressor": strategy.state, "scheduler": scheduler, **strategy.own_state}
    own_optimizer = built.per_rank or strategy.own_optimizer  # its state differs per rank
    if own_optimizer:
        per_rank["optimizer"] = RankOptimizer(built.optimizer)  # checked at load
    return _Run(
        cfg,
        device,
        out,
        metrics,
        data,
        model,
        strategy,
        built.optimizer,
        scheduler,
        per_rank,
        None if own_optimizer else built.optimizer,
        [strategy.stats] + ([built.stats] if built.stats is not None else []),
        sum(p.numel() for p in model.parameters()),
        sum(p.numel() for p in model.parameters() if p.requires_grad) * 4,
        torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"),
    )


def _resume(run: _Run) -> tuple[int, dict[str, float]]:
    """The step to start from and the run's counters: from ``--resume``'s checkpoint, or a fresh start."""
    cfg = run.cfg
    if not cfg.resume:
        return 0, {"wall_s": 0.0, "bytes_total": 0.0, "first_loss": math.nan}
    # DCP (and DTensor with it) is imported by runs that resume or save only: ~1 s per worker
    from powertrain.checkpoint import CheckpointError
    from powertrain.train.checkpoint import find_checkpoint, load_checkpoint, set_latest

    ckpt = find_checkpoint(cfg.resume)
    start, counters = load_checkpoint(ckpt, run.model, run.dcp_optimizer, run.per_rank)
    try:
        run.scheduler.resume(start)  # the learning rate from this run's settings (--lr may change on resume)
    except ValueError as e:
        raise CheckpointError(f"Cannot load checkpoint {str(ckpt)!r}: {e}") from None
    if run.rank == 0 and ckpt.parent.resolve() == (run.out / "checkpoints").resolve():
        set_latest(run.out, ckpt)  # it loaded: this run continues from here, later checkpoints in out are superseded
    return start, counters


def _step(run: _Run, step: int) -> tuple[float, float, float]:
    """One optimizer step (its micro-steps, backward's communication, the update): the loss averaged over the
    ranks, the seconds its forward and backward took and the seconds the whole step took (before the loss's
    averaging, which is the log's, not training's)."""
    cfg, data, strategy, out = run.cfg, run.data, run.strategy, run.out
    data_rank, data_world = run.data_group
    t0 = time.perf_counter()
    loss_sum = 0.0
    for micro in range(cfg.grad_accum):
        x, y = data.batch(
            "train", data_rank, data_world, (cfg.seed, data_rank, step, micro), cfg.batch_size, cfg.block_size
        )
        try:
            with strategy.loss_scope():  # forward's loss and its backward
                with strategy.sync(micro == cfg.grad_accum - 1), run.autocast:
                    loss = strategy.model(x.to(run.device), y.to(run.device)) / cfg.grad_accum
                loss.backward()
        except NonFiniteGradientError as e:
            raise FloatingPointError(_nonfinite_message(step, e, out, cfg)) from None
        except RuntimeError:  # DDP reports a failed comm hook as a RuntimeError: what did the hook raise?
            cause = strategy.take_error()
            if isinstance(cause, NonFiniteGradientError):
                raise FloatingPointError(_nonfinite_message(step, cause, out, cfg)) from None
            if cause is not None:  # a lost peer (gloo names its address when the connection was reset)
                raise RuntimeError(f"gradient communication failed at step {step + 1}: {cause}") from None
            raise
        loss_sum += loss.item()
    compute_s = time.perf_counter() - t0
    try:
        strategy.step(run.optimizer)
        if step + 1 == cfg.steps:
            strategy.finish()  # local updates: one last sync, so that the run ends with one model
    except NonFiniteGradientError as e:
        raise FloatingPointError(_nonfinite_message(step, e, out, cfg)) from None
    run.scheduler.step()
    synchronize(run.device)  # CUDA: the step's queued work is part of its time
    step_s = time.perf_counter() - t0
    mean = torch.tensor([loss_sum], dtype=torch.float64, device=run.device)  # NCCL reduces device tensors only
    run.metrics.all_reduce_mean_(mean)
    if not math.isfinite(mean.item()):
        raise FloatingPointError(_nonfinite_message(step, f"loss {mean.item()}", out, cfg))
    return mean.item(), compute_s, step_s


def _train(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    run = _setup(cfg, device)
    cfg, rank, world = run.cfg, run.rank, run.world  # cfg: with rank=auto's choice
    data, out = run.data, run.out
    data_rank, data_world = run.data_group
    start, counters = _resume(run)
    if start >= cfg.steps:
        if rank == 0:
            print(
                f"Nothing to do: the checkpoint has {start} steps and --steps is {cfg.steps}; raise --steps to "
                "train further.",
                flush=True,
            )
        leave_world()
        return {"steps": start}
    writer = (
        RunWriter(out, resume_step=start if cfg.resume else None, tensorboard=cfg.tensorboard) if rank == 0 else None
    )
    progress = Progress(cfg.steps, quiet=cfg.quiet or rank != 0, start=start)
    is_text = isinstance(data, TokenData)
    unit, per_step = ("tok", cfg.batch_size * cfg.block_size) if is_text else ("samples", cfg.batch_size)
    if rank == 0 and not cfg.quiet:
        print(
            f"powertrain train: {world} worker(s), {type(run.model).__name__} ({run.n_params / 1e6:.2f}M params), "
            f"{data.description}, --parallel {cfg.parallel}, --compressor {cfg.compressor}, steps {start}..{cfg.steps} "
            f"of {cfg.grad_accum}x{cfg.batch_size}{'x' + str(cfg.block_size) if is_text else ''} per worker",
            flush=True,
        )

    # the run's counters continue from the checkpoint (not from metrics.jsonl: a resume may use a new --out)
    prev_wall = wall = counters["wall_s"]
    total_sent, first_loss = int(counters["bytes_total"]), counters["first_loss"]
    last_loss, val = math.nan, math.nan
    dense_bytes = run.dense_bytes if world > 1 else 0
    done = start  # steps completed

    def summary(**more: Any) -> dict[str, Any]:
        """summary.json: the run so far, and ``more``."""
        return {
            "world_size": world,
            "parallel": cfg.parallel,
            "compressor": cfg.compressor,
            "hierarchy": cfg.hierarchy,
            "steps": cfg.steps,
            "steps_done": done,
            "first_loss": first_loss,
            "final_loss": last_loss,
            "val_loss": val,
            "wall_s": wall,
            "bytes_sent": total_sent,
            "bytes_uncompressed": dense_bytes * done,
            f"{unit}_per_s": per_step * cfg.grad_accum * data_world * (done - start) / max(wall - prev_wall, 1e-9),
            "params": run.n_params,
            "device": str(device),
            # this rank's most reserved by the caching allocator (what the other processes on the GPU cannot use)
            **({"cuda_max_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9} if device.type == "cuda" else {}),
            **more,
        }

    try:
        for step in range(start, cfg.steps):
            before = CommStats.combined(run.sources)
            last_loss, compute_s, step_time = _step(run, step)
            if math.isnan(first_loss):
                first_loss = last_loss
            after = CommStats.combined(run.sources)
            sent = after.bytes_sent - before.bytes_sent
            wall += step_time
            total_sent += sent
            done = step + 1
            if writer:
                writer.every_step(done, last_loss, wall, total_sent)
            evaluated = bool(cfg.eval_every and done % cfg.eval_every == 0)
            validated = evaluated or done == cfg.steps
            if validated:
                val = _evaluate(run.strategy, data, cfg, data_rank, data_world, run.metrics, device, run.autocast)
            logged = done % cfg.log_every == 0 or validated
            if logged:
                row = {
                    "step": done,
                    "loss": last_loss,
                    "lr": run.scheduler.logged_lr(),
                    "step_time_s": step_time,
                    "compute_s": compute_s,
                    "comm_s": after.comm_s - before.comm_s,
                    "compress_s": after.compress_s - before.compress_s,
                    "bytes_sent": sent,
                    "bytes_uncompressed": dense_bytes,
                    "wall_s": wall,
                    "bytes_total": total_sent,
                    **({"val_loss": val} if validated else {}),
                }
                if writer:
                    writer.log(row)
            if validated and not math.isfinite(val):  # every rank: the mean is the same everywhere
                raise FloatingPointError(_nonfinite_message(step, f"validation loss {val}", out, cfg))
            rate = per_step * cfg.grad_accum * data_world / step_time
            progress.update(done, last_loss, rate, unit, sent / MB, dense_bytes / MB, logged=logged)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                from powertrain.train.checkpoint import save_checkpoint

                _check_weights(run, step)  # a checkpoint is a good one
                counts = {"wall_s": wall, "bytes_total": total_sent, "first_loss": first_loss}
                save_checkpoint(out, done, run.model, run.dcp_optimizer, run.per_rank, counts, dataclasses.asdict(cfg))
    except FloatingPointError as e:  # divergence is never success: summary.json says where it stopped and why
        if writer:
            try:
                writer.finish(summary(status="diverged", stopped=str(e)))
            except Exception as w:  # the report must not replace the error it reports
                e.add_note(f"powertrain: summary.json was not written ({type(w).__name__}: {w})")
        raise

    roots = _root_stats(run.optimizer, device)
    result = summary(
        status="completed", **({"shampoo_roots": roots} if roots is not None else {}), **run.strategy.report()
    )
    if writer:
        writer.finish(result)
        progress.message(_summary_text(result, cfg, data, world, run.n_params, out, wall - prev_wall, start > 0))
    leave_world()
    return result


def _check_weights(run: _Run, step: int) -> None:
    """Raise FloatingPointError (every rank) when a parameter of any rank holds a non-finite number."""
    # .to(run.device): with offloading a parameter may live on any device
    finite = [torch.isfinite(local_tensor(p)).all().to(run.device) for p in run.model.parameters()]
    bad = ~torch.stack(finite).all() if finite else torch.tensor(False)  # one device sync for all, not one each
    flag = bad.to(device=run.device, dtype=torch.float64).reshape(1)
    run.metrics.all_reduce_mean_(flag)
    if flag.item() > 0:
        raise FloatingPointError(_nonfinite_message(step, "non-finite weights after the update", run.out, run.cfg))


def _auto_compressor(
    cfg: TrainConfig,
    model: torch.nn.Module,
    data: TokenData | ClassData,
    comm: Communicator,
    device: torch.device,
    options: dict[str, Any],
) -> Choice:
    """``rank=auto``: time this model's backward pass on a training batch (the second of two: the first warms up;
    the model is left as it was, gradients cleared), measure the link, choose (every rank the same)."""
    x, y = data.batch("train", comm.rank, comm.world_size, (cfg.seed, comm.rank, 0, 0), cfg.batch_size, cfg.block_size)
    x, y = x.to(device), y.to(device)
    for _ in range(2):
        loss = model(x, y)
        synchronize(device)
        t0 = time.perf_counter()
        loss.backward()
        synchronize(device)
        backward = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    others = {k: v for k, v in options.items() if k != "rank"}
    return choose(
        model.named_parameters(),
        backward_s=slowest(comm, backward, device),
        link=measure_link(comm, device=device),
        options=others,
    )


def _root_stats(optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, int] | None:
    """Shampoo's root computations, failures and graft fallbacks summed over ranks (every rank calls this)."""
    from powertrain.optim.shampoo import RootStats

    stats = getattr(optimizer, "root_stats", None)
    if not callable(stats):
        return None
    counts = torch.tensor(list(stats()), dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    return dict(zip(RootStats._fields, counts.tolist(), strict=True))


def _roots_text(roots: dict[str, int] | None) -> str:
    """One sentence when Shampoo fell back to its grafting direction, else nothing."""
    if not roots or not (roots["failed"] or roots["graft_steps"]):
        return ""
    what = f" ({roots['abandoned']} block(s) given up for good)" if roots["abandoned"] else ""
    return (
        f" Shampoo: {roots['failed']} of {roots['failed'] + roots['computed']} root computations failed and "
        f"{roots['graft_steps']} block-steps used the grafting direction instead{what}."
    )


def _evaluate(
    strategy: Strategy,
    data: TokenData | ClassData,
    cfg: TrainConfig,
    rank: int,
    world: int,
    metrics: Communicator,
    device: torch.device,
    autocast: Any,
) -> float:
    model = strategy.model
    model.eval()
    total = 0.0
    with torch.no_grad(), autocast, strategy.loss_scope():
        for i in range(cfg.eval_batches):
            x, y = data.batch("val", rank, world, (cfg.seed, rank, -1, i), cfg.batch_size, cfg.block_size)
            total += model(x.to(device), y.to(device)).item()
    model.train()
    mean = torch.tensor([total / cfg.eval_batches], dtype=torch.float64, device=device)
    metrics.all_reduce_mean_(mean)
    return mean.item()


def _nonfinite_message(step: int, what: Any, out: Path, cfg: TrainConfig) -> str:
    """The one line of a run that diverged at ``step`` (0-based): where, what, and the checkpoint to go back to."""
    if (out / "checkpoints" / "latest").exists():
        from powertrain.checkpoint import CheckpointError
        from powertrain.train.checkpoint import read_latest

        try:
            good: str | None = str(out / "checkpoints" / read_latest(out))
            kept = f"the last good checkpoint is {good}"
        except CheckpointError as e:
            good, kept = None, f"the last good checkpoint cannot be named ({e})"
    elif cfg.resume:
        good, kept = str(cfg.resume), f"the last good checkpoint is the one this run resumed from ({cfg.resume})"
    elif cfg.checkpoint_every:
        good, kept = None, "there is no good checkpoint (none was saved before this step)"
    else:
        good, kept = None, "there is no checkpoint (use --checkpoint-every)"
    what = str(what).rstrip(". ")
    # Muon's and Dion's matrices step at --muon-lr (--lr is AdamW's, on the rest): halve both
    rates = [("lr", cfg.lr)] + ([("muon-lr", cfg.muon_lr)] if cfg.muon_lr is not None else [])
    lower = " ".join(f"--{flag} {rate / 2:g}" for flag, rate in rates)
    advice = (
        f"continue from it at a lower learning rate with the same command and --resume {good} {lower}"
        if good
        else f"try lower rates ({', '.join(f'--{flag} {rate:g}' for flag, rate in rates)} now; e.g. {lower})"
        if len(rates) > 1
        else f"try a lower --lr (now {cfg.lr:g}, e.g. {cfg.lr / 2:g})"
    )
    return f"training stopped at step {step + 1}: {what}; {kept}; {advice}"


def _freeze_text(cfg: TrainConfig) -> str:
    if cfg.optimizer != "adamw" or not cfg.adam_freeze:
        return ""
    return f" AdamW's second moment froze after step {cfg.freeze_after} (--adam-freeze {cfg.adam_freeze:g})."


def _cost_text(cfg: TrainConfig) -> str:
    """What the default compressor costs in loss, where that was measured: the default GPT with the default."""
    measured = cfg.compressor.startswith(RECOMMENDED_POWERSGD + ",") and cfg.adam_freeze == POWERSGD_ADAM_FREEZE
    default = cfg.model == "gpt" and cfg.gpt_size == "default" and cfg.optimizer == "adamw" and measured
    return f"; {RECOMMENDED_COST}" if default else ""


#: Local updates: the share of its training time an unstreamed run waits for syncs past which streaming reached a
#: target loss sooner. Measured on the default GPT (BENCHMARKS.md, "Local updates across slow links": the local and
#: local-streaming rows' steps to the target and seconds per step; derived in docs/notes/local-updates.md).
STREAM_ABOVE = 0.193
#: the streamed configuration it was measured with
STREAMED = "--sync-every 25 --fragments 5 --sync-delay 4 --sync-mix 0.5"


def _wait_text(s: dict[str, Any], cfg: TrainConfig, trained_s: float, resumed: bool) -> str:
    """What the link cost a local-update run's compute (``s``: its summary; ``trained_s``: the training time of this
    process, whose wait ``s`` counts), and what to change if it cost much."""
    if not s["late_syncs"]:
        return "the link kept up: compute never waited for a sync"
    waited = s["waited_s"]
    if cfg.sync_delay:
        return (
            f"compute waited {waited:.1f} s for {s['late_syncs']} of them: the link did not keep up (raise "
            "--sync-every or --sync-delay, or compress more)"
        )
    share = waited / trained_s if trained_s > 0 else 1.0
    since = " since the resume" if resumed else ""
    text = f"compute waited {waited:.1f} s for them, {share:.1%} of the {trained_s:.1f} s it trained{since}"
    if share <= STREAM_ABOVE:
        return text + " (--sync-delay lets a sync overlap the next steps)"
    advice = (
        f": past {STREAM_ABOVE:.1%}, streamed syncs that overlap the next steps reached a target loss sooner on "
        f"the default GPT, although they need more steps ({STREAMED}; docs/notes/local-updates.md)"
    )
    return text + advice


def _summary_text(
    s: dict[str, Any],
    cfg: TrainConfig,
    data: TokenData | ClassData,
    world: int,
    n_params: int,
    out: Path,
    trained_s: float,
    resumed: bool,
) -> str:
    sent, dense = s["bytes_sent"], s["bytes_uncompressed"]
    if not sent:
        ratio = "nothing to send with one worker"
    elif sent <= dense:
        ratio = f"{dense / sent:.1f}x less"
    else:  # Shampoo's all-gather of its directions on top of the gradients; RTP's weights travel too
        ratio = f"{sent / dense:.1f}x more" if dense else "plain all-reduce would send nothing"
    what = {
        "rtp": "RTP's rotations (weights and gradients) and replicated all-reduce",
        "tp": "Sequence/tensor parallelism's activations and FSDP2's gradient reduce-scatter (computed)",
    }.get(cfg.parallel, f"Gradient communication ({cfg.compressor})")
    if cfg.hierarchy == "node":
        what = f"Gradient communication between nodes ({cfg.compressor}; exact inside each node)"
    syncs = ""
    if cfg.parallel == "diloco":
        between = " between nodes" if cfg.hierarchy == "node" else ""
        what = (
            f"Local updates{between} (a sync every {s['sync_every']} steps"
            + (f" of each of {s['fragments']} fragments" if s["fragments"] > 1 else "")
            + f", {cfg.compressor} pseudo-gradients)"
        )
        late = _wait_text(s, cfg, trained_s, resumed)
        per = f"{sent / max(1, s['syncs']) / MB:.2f} MB each on average" + (
            f", the {cfg.sync_warmup} warm-up steps' averaging ({cfg.warmup_compressor}) included"
            if cfg.sync_warmup
            else ""
        )
        syncs = f" It ran {s['syncs']} syncs ({per}); {late}."
    uniform = f" (a uniform guess scores {math.log(data.vocab_size):.3f})" if isinstance(data, TokenData) else ""
    return (
        f"\nSummary: {world} worker(s) trained a {n_params / 1e6:.2f}M-parameter {cfg.model} on the {data.description} "
        f"for {cfg.steps} steps in {s['wall_s']:.1f} s of training time, with --parallel {cfg.parallel}. The training "
        f"loss went from {s['first_loss']:.3f} to {s['final_loss']:.3f} and the held-out validation loss is "
        f"{s['val_loss']:.3f}{uniform}.{_freeze_text(cfg)} {what} sent {sent / MB:.1f} MB per worker "
        f"where plain fp32 all-reduce would have sent {dense / MB:.1f} MB ({ratio}){_cost_text(cfg)}.{syncs}"
        f"{_roots_text(s.get('shampoo_roots'))} Metrics, plots and the resolved config are in {out}."
    )
