"""Train several configurations side by side in one process group, one step of each per round.

Every configuration has its own model (same initial weights), optimizer and DDP instance; each round runs
one step of every configuration on the same batch, so load from other processes hits them alike. Run
inside an initialised process group (``run``), on local workers of :func:`powertrain.train.launch.launch`
(:func:`worker`), or as ``python -m powertrain.bench.sidebyside JSON`` in a worker that reads
RANK/WORLD_SIZE/MASTER_* from the environment and prints its results as JSON. The last two take
:func:`launch_args`; :func:`by_spec` turns what the ranks return into one :class:`SpecResult` per configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from powertrain.bench.rounds import slowest, torch_threads
from powertrain.comm import CommStats
from powertrain.compress import make_compressor
from powertrain.ddp import register_compressor
from powertrain.models import GPT, GPTConfig, ResNet1d
from powertrain.train.config import TrainConfig
from powertrain.train.data import ClassData, TokenData, load_data
from powertrain.train.launch import launch, leave_world
from powertrain.train.optimizers import build_optimizer, build_scheduler
from powertrain.train.strategy import Parallel, build_strategy

__all__ = [
    "RankResult",
    "Spec",
    "SpecResult",
    "by_spec",
    "launch_args",
    "main",
    "run",
    "side_by_side",
    "worker",
]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One configuration: ``kind`` is plain, noop (compute only: no communication), torch_fp16, torch_psgd
    (all DDP), or a powertrain compressor name; ``options`` its options (``rank`` for torch_psgd).
    ``parallel`` runs a powertrain compressor under DDP, FSDP2 or the reference ``optimizer_step`` API."""

    label: str
    kind: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: DDP's bucket size where the runner builds DDP itself (torch's hooks, or no ``optimizer``); None: the run's
    #: (one bucket). A row with an optimizer and a powertrain compressor is built as ``powertrain train`` builds it
    #: (torch's default buckets), and refuses a bucket size rather than ignore it.
    bucket_cap_mb: float | None = None
    parallel: Parallel = "ddp"
    #: "": AdamW(lr=1e-3) as in the compressor benchmarks; else ``powertrain train``'s optimizer of that name
    #: (:func:`powertrain.train.optimizers.build_optimizer`) with ``optimizer_options`` as TrainConfig fields.
    optimizer: str = ""
    optimizer_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: 0: the run takes every round at a constant learning rate. > 0: it stops after ``steps`` steps, and its
    #: learning rate follows ``powertrain train``'s schedule over them (linear warm-up, cosine decay;
    #: ``warmup_steps`` and ``min_lr_ratio`` may be set in ``optimizer_options``). Needs an ``optimizer``.
    steps: int = 0
    #: Run to a target: after its ``steps`` the run goes on for up to this many steps at the schedule's final
    #: learning rate, and stops at the first evaluation from step ``steps`` on whose validation loss is at most
    #: ``stop_below`` (it always completes its schedule, so its loss at ``steps`` is known).
    extra_steps: int = 0
    stop_below: float | None = None

    def __post_init__(self) -> None:
        if self.steps < 0 or (self.steps and not self.optimizer):
            raise ValueError(
                f"Invalid Spec {self.label!r}: steps={self.steps}; use steps >= 0, and > 0 only with "
                "an optimizer (the schedule is powertrain train's)"
            )
        if self.parallel == "tp":
            raise ValueError(
                f"Invalid Spec {self.label!r}: the side-by-side runner gives each rank a batch of its own, and a "
                "tensor-parallel group must read one together; bench parallel times parallel='tp'"
            )
        if self.bucket_cap_mb is not None and (
            self.parallel != "ddp" or (self.optimizer and self.kind not in _TORCH_KINDS)
        ):
            raise ValueError(
                f"Invalid Spec {self.label!r}: bucket_cap_mb={self.bucket_cap_mb} is for DDP the runner builds itself "
                "(torch's hooks, or no optimizer); this one is built as powertrain train builds it: leave it out"
            )
        if self.parallel != "ddp" and self.kind in _TORCH_KINDS:
            raise ValueError(f"Invalid Spec {self.label!r}: kind {self.kind!r} is a DDP hook; use parallel='ddp'")


_TORCH_KINDS = ("plain", "noop", "torch_fp16", "torch_psgd")


class _Run:
    """One configuration's model, optimizer and gradient averaging; ``step`` trains one batch."""

    def __init__(self, spec: Spec, model: GPT | ResNet1d, start: int, bucket_cap_mb: float) -> None:
        self.model = model
        stats: CommStats | None
        self.wrapped: torch.nn.Module
        cfg = None
        if spec.optimizer:  # TrainConfig checks the values (the diloco fields among them)
            # Muon splits its work only where gradients travel whole (the compressor's name is enough to say so)
            named = spec.kind if spec.optimizer == "muon" and spec.kind not in _TORCH_KINDS else "none"
            fields: dict[str, Any] = {"optimizer": spec.optimizer, "parallel": spec.parallel, "compressor": named}
            if spec.steps:
                fields["steps"] = spec.steps
            cfg = TrainConfig(**fields, **spec.optimizer_options)
        if spec.parallel == "ddp" and (spec.kind in _TORCH_KINDS or not spec.optimizer):
            # torch's hooks, or a compressor hook with this run's bucket size
            self.wrapped, stats = _build_ddp(spec, model, start, bucket_cap_mb)
            self.strategy = None
        else:
            opts = dict(spec.options)
            if spec.kind == "powersgd":  # the outer step of local updates compresses from its first sync
                opts.setdefault("start_compressing_after_num_steps", 0 if spec.parallel == "diloco" else start)
            local = None if cfg is None else cfg.local_updates
            self.strategy = build_strategy(
                spec.parallel, model, spec.kind, opts, gradient_sync=cfg is None or cfg.gradient_sync, local=local
            )
            self.wrapped, stats = self.strategy.model, self.strategy.stats
        # After wrapping: fully_shard replaces the parameters with sharded ones.
        self.sources = [stats] if stats is not None else []
        if cfg is not None:
            built = build_optimizer(cfg, model)
            self.opt = built.optimizer
            if self.strategy is not None:
                self.strategy.attach(self.opt)
            self.scheduler = build_scheduler(cfg, self.opt) if spec.steps else None
            self.sources += [built.stats] if built.stats is not None else []
        else:
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            self.scheduler = None
        self.steps_done, self.last_step = 0, spec.steps  # local updates end their schedule with one last sync

    def _scope(self) -> contextlib.AbstractContextManager[None]:
        """Where the loss is computed and differentiated (the strategy's)."""
        return contextlib.nullcontext() if self.strategy is None else self.strategy.loss_scope()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.strategy is None:
            self.opt.zero_grad()
        sync = contextlib.nullcontext() if self.strategy is None else self.strategy.sync(True)
        with sync, self._scope():  # sync: the mode records the traffic it computes rather than counts
            loss = self.wrapped(x, y)
            loss.backward()
        if self.strategy is None:
            self.opt.step()
        else:  # the strategy zeroes gradients after its step (or keeps them: the reference API's residual)
            self.strategy.step(self.opt)
            self.steps_done += 1
            if self.steps_done == self.last_step:
                self.strategy.finish()
        if self.scheduler is not None:
            self.scheduler.step()
        return float(loss.item())

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]], classes: bool) -> tuple[float, float]:
        """Validation loss and, for a classifier (``classes``), accuracy over ``batches`` and over ranks: sample
        means, every sample weighing the same (accuracy NaN for a language model)."""
        self.wrapped.eval()
        sums = torch.zeros(3, dtype=torch.float64)  # loss x samples, correct, samples
        with torch.no_grad(), self._scope():
            for x, y in batches:
                if classes:
                    logits = self.wrapped(x)
                    loss = torch.nn.functional.cross_entropy(logits.float(), y)
                    sums[1] += (logits.argmax(-1) == y).sum().item()
                else:
                    loss = self.wrapped(x, y)
                sums[0] += loss.item() * y.shape[0]
                sums[2] += y.shape[0]
        self.wrapped.train()
        dist.all_reduce(sums)
        return sums[0].item() / sums[2].item(), sums[1].item() / sums[2].item() if classes else math.nan


def _build_ddp(spec: Spec, model: torch.nn.Module, start: int, bucket_cap_mb: float) -> tuple[DDP, Any]:
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


@torch_threads(1)  # given back: a launch of one worker runs in the calling process
def run(
    specs: list[Spec],
    *,
    model: GPTConfig | None,
    batch: int,
    warmup: int,
    timed: int,
    start: int,
    bucket_cap_mb: float = 100,
    data_mb: float = 4.0,
    eval_batches: int = 8,
    eval_every: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    """Per configuration: step times of the timed rounds, all losses, payload bytes per step by collective,
    compression and blocked-communication seconds per step, and validation losses (mean over ranks): the
    final one, plus one every ``eval_every`` steps (``val_curve``: (step, loss) pairs) when > 0. A run with
    ``Spec.steps`` sits out the rounds after its last step (``+ extra_steps``, or its ``stop_below`` target).
    ``seed`` sets the initial weights and the training batches; the validation batches are the same for every
    seed. ``model``: the GPT's shape (on the stdlib corpus), or None for the 1-D ResNet on mnist1d."""
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus: TokenData | ClassData
    build: Callable[[], GPT | ResNet1d]
    if model is None:  # powertrain train --model resnet --data mnist1d
        corpus, block, build = load_data(TrainConfig(model="resnet", data="mnist1d")), 0, ResNet1d
    else:
        corpus, block = load_data(TrainConfig(data_max_mb=data_mb)), model.block_size
        build = functools.partial(GPT, model)
    classes = isinstance(corpus, ClassData)
    if isinstance(corpus, ClassData):  # the whole validation split: a classifier's loss and accuracy, no sampling
        x_val, y_val = corpus.val_shard(rank, world)
        val_batches = list(zip(x_val.split(256), y_val.split(256), strict=True))
    else:
        val_batches = [corpus.batch("val", rank, world, (1, rank, j), batch, block) for j in range(eval_batches)]
    runs = []
    for spec in specs:
        torch.manual_seed(seed)
        runs.append(_Run(spec, build(), start, bucket_cap_mb))
    stopped = [False] * len(specs)
    times: list[list[float]] = [[] for _ in specs]
    losses: list[list[float]] = [[] for _ in specs]
    curves: list[list[tuple[int, float]]] = [[] for _ in specs]
    acc_curves: list[list[tuple[int, float]]] = [[] for _ in specs]
    sent: list[dict[str, int]] = [{} for _ in specs]
    spent = [[0.0, 0] for _ in specs]  # compress_s, collectives over the timed rounds
    for step in range(warmup + timed):
        x, y = corpus.batch("train", rank, world, (seed, rank, step), batch, block)
        for i, r in enumerate(runs):
            if stopped[i] or (specs[i].steps and step >= specs[i].steps + specs[i].extra_steps):
                continue
            before = CommStats.combined(r.sources)
            dist.barrier()
            t0 = time.perf_counter()
            loss = r.step(x, y)
            elapsed = time.perf_counter() - t0
            if step >= warmup:
                times[i].append(elapsed)
                if r.sources:
                    after = CommStats.combined(r.sources)
                    for op, n in after.by_op.items():
                        sent[i][op] = sent[i].get(op, 0) + n - before.by_op.get(op, 0)
                    spent[i][0] += after.compress_s - before.compress_s
                    spent[i][1] += after.num_collectives - before.num_collectives
            losses[i].append(loss)
            if eval_every and (step + 1) % eval_every == 0:
                loss_val, acc = r.evaluate(val_batches, classes)
                curves[i].append((step + 1, loss_val))
                acc_curves[i].append((step + 1, acc))
                target = specs[i].stop_below  # checked from the end of the schedule on: the horizon's loss is kept
                stopped[i] = target is not None and step + 1 >= specs[i].steps and curves[i][-1][1] <= target
    val = [r.evaluate(val_batches, classes)[0] for r in runs]
    timed_steps = [max(len(t), 1) for t in times]
    return {
        "times": times,
        "losses": losses,
        "sent_per_step": [{k: v / timed_steps[i] for k, v in s.items()} for i, s in enumerate(sent)],
        "compress_s": [c / timed_steps[i] for i, (c, _) in enumerate(spent)],
        "collectives": [k / timed_steps[i] for i, (_, k) in enumerate(spent)],
        "measured_stats": [bool(r.sources) for r in runs],
        "val_loss": val,
        "val_curve": curves,
        "acc_curve": acc_curves if classes else None,
        "params": runs[0].model.num_params(),
    }


@dataclasses.dataclass(frozen=True)
class RankResult:
    """One configuration as one rank measured it in :func:`run` (the rank's entry of each of its lists)."""

    times: list[float]  # seconds of each timed step
    losses: list[float]  # training loss of every step taken
    sent_per_step: dict[str, float]  # payload bytes per timed step by collective, as powertrain counted them
    compress_s: float  # compression seconds per timed step
    collectives: float  # per timed step
    measured_stats: bool  # powertrain counted the communication (False: torch's hooks, which count nothing)
    val_loss: float  # the final validation loss (mean over ranks)
    val_curve: list[tuple[int, float]]  # (step, validation loss) every ``eval_every`` steps
    acc_curve: list[tuple[int, float]] | None  # (step, accuracy) likewise, for a classifier; else None


@dataclasses.dataclass(frozen=True)
class SpecResult:
    """One configuration on every rank of a launch."""

    ranks: list[RankResult]  # in rank order

    @property
    def first(self) -> RankResult:
        """Rank 0's result: where to read what every rank has alike (validation losses, which are averaged over
        the ranks; payload bytes)."""
        return self.ranks[0]

    def step_times(self) -> list[float]:
        """Per timed round, the slower rank's step time: a step is over when every rank is done."""
        return slowest([r.times for r in self.ranks])


def by_spec(results: Mapping[int, dict[str, Any]]) -> list[SpecResult]:
    """The ranks' :func:`run` results (rank -> result, as :func:`powertrain.train.launch.launch` returns them or
    as read from :func:`main`'s JSON) as one :class:`SpecResult` per configuration, in the order of the specs."""
    ranks = [results[r] for r in sorted(results)]
    return [SpecResult([_rank_result(res, i) for res in ranks]) for i in range(len(ranks[0]["times"]))]


def _rank_result(res: dict[str, Any], i: int) -> RankResult:
    acc = res["acc_curve"]
    return RankResult(
        times=res["times"][i],
        losses=res["losses"][i],
        sent_per_step=res["sent_per_step"][i],
        compress_s=res["compress_s"][i],
        collectives=res["collectives"][i],
        measured_stats=res["measured_stats"][i],
        val_loss=res["val_loss"][i],
        val_curve=[(step, v) for step, v in res["val_curve"][i]],  # JSON has made the pairs lists
        acc_curve=None if acc is None else [(step, a) for step, a in acc[i]],
    )


def launch_args(specs: Sequence[Spec], *, model: GPTConfig | None, **options: Any) -> dict[str, Any]:
    """:func:`run`'s arguments as plain data (JSON, picklable) for :func:`worker` or :func:`main`: ``options`` are
    its keyword arguments other than ``model``."""
    config = None if model is None else dataclasses.asdict(model)
    return {"specs": [dataclasses.asdict(s) for s in specs], "model": config, **options}


def _run_args(args: dict[str, Any]) -> dict[str, Any]:
    """:func:`run` on :func:`launch_args`' output."""
    args = dict(args)
    specs = [Spec(**s) for s in args.pop("specs")]
    model = args.pop("model")
    return run(specs, model=None if model is None else GPTConfig(**model), **args)


def worker(args: dict[str, Any]) -> dict[str, Any]:
    """One rank of :func:`powertrain.train.launch.launch` running :func:`run` on ``args`` (:func:`launch_args`);
    a single worker (run in the calling process, without the launcher's environment) gets a one-process group of
    its own."""
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = _run_args(args)
    leave_world()
    return out


def side_by_side(
    specs: Sequence[Spec],
    *,
    world: int = 2,
    rate: float | None = None,
    emulate: bool = False,
    check: bool = False,
    timeout: float | None = None,
    **options: Any,
) -> tuple[list[SpecResult], dict[str, float] | None]:
    """:func:`run` of ``specs`` (``options``: :func:`launch_args`' keywords) on ``world`` workers: local ones on
    loopback, or with ``emulate`` each a process in its own network namespace of an emulated cluster whose links run
    at ``rate`` Mbit/s (None: unthrottled; :class:`powertrain.bench.netem.EmulatedCluster`), the emulation validated
    first with ``check`` (:func:`powertrain.bench.netem.validate`); ``timeout``: how long its workers may take, and
    their collectives' timeout, else an hour and :func:`main`'s. Returns one :class:`SpecResult` per spec, in order,
    and the validation (None where none ran)."""
    if not emulate:
        return by_spec(launch(worker, world, launch_args(specs, **options))), None
    from powertrain.bench.netem import EmulatedCluster, validate

    if timeout is not None:
        options["timeout_s"] = timeout
    args = launch_args(specs, **options)
    cmd = [sys.executable, "-m", "powertrain.bench.sidebyside", json.dumps(args)]
    where = "unthrottled" if rate is None else f"at {rate:g} Mbit/s"
    with EmulatedCluster(world, rate) as cluster:
        checked = validate(cluster) if check else None
        procs = [cluster.spawn(r, cmd) for r in range(world)]
        results: dict[int, Any] = {}
        for r, proc in enumerate(procs):
            out, err = proc.communicate(timeout=3600.0 if timeout is None else timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"side-by-side worker {r} {where} failed: {err.strip()[-1500:]}")
            results[r] = json.loads(out.strip().splitlines()[-1])
    return by_spec(results), checked


def main() -> None:
    """Worker entry point: JSON arguments in argv[1] (:func:`launch_args`, optionally with ``timeout_s``), JSON
    results on stdout (rank 0 and others)."""
    import datetime

    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pop("timeout_s", 300)))
    result = _run_args(args)
    print(json.dumps(result), flush=True)
    leave_world()
    # Skip interpreter finalisation: the results are out, and gloo's threads have been seen to abort the
    # process at exit ("terminate called without an active exception"), which would read as a failure.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
