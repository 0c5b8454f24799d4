"""Configuration of ``powertrain train``: one flat dataclass, named presets, TOML files, validation.

Every field is a TOML key and a command-line flag (``steps`` <-> ``--steps``). Precedence: defaults <
``--preset`` < ``--config FILE`` < flags. Every value is checked with an error naming the key, the bad
value and what is allowed; unknown TOML keys are errors.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from powertrain._diloco_config import (
    DEFAULT_OUTER_COMPRESSOR,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    DEFAULT_SYNC_EVERY,
    DiLoCoConfig,
    OuterLRSchedule,
)
from powertrain._files import FileTooLarge, read_bounded
from powertrain.compress import COMPRESSORS, make_compressor
from powertrain.compress.powersgd import RECOMMENDED, recommended_options
from powertrain.models import RESNET_WIDTH
from powertrain.optim.galore.projector import SvdMethod
from powertrain.optim.shampoo.preconditioner import Preconditioner
from powertrain.train.strategy import Parallel
from powertrain.train.strategy import check as check_parallel

Data = Literal["stdlib", "textdir", "bin", "mnist1d"]
ModelKind = Literal["gpt", "resnet"]
GPTSize = Literal["tiny", "small", "default", "medium", "gpt2"]
Optimizer = Literal["adamw", "sgd", "muon", "dion", "shampoo", "galore", "demo"]
ShampooVectors = Literal["graft", "shampoo"]
CommDtype = Literal["fp32", "bf16"]
Precision = Literal["fp32", "bf16"]
Hierarchy = Literal["flat", "node"]
Backend = Literal["auto", "gloo", "nccl"]

#: (n_layer, n_head, d_model) of each GPT size; "default" is 3.3M parameters, "gpt2" GPT-2 small's shape.
GPT_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (1, 2, 32),
    "small": (2, 4, 128),
    "default": (4, 4, 256),
    "medium": (6, 6, 384),
    "gpt2": (12, 12, 768),
}


#: The hidden matrices' learning rate when a run does not set --muon-lr (TrainConfig fills it in): for each, the best
#: of the rates bench quality --preset muon sweeps on the default GPT (BENCHMARKS.md, "Muon against a swept AdamW";
#: Dion's at rank 1/4, above microsoft/dion's 0.01).
MATRIX_LR = {"muon": 0.04, "dion": 0.02}

#: The optimizer each optimizer-specific setting belongs to (the settings named ``momentum`` or ``<prefix>_...``)
_OPTION_OWNERS = {"momentum": "sgd", "shampoo": "shampoo", "galore": "galore", "demo": "demo"}


def ignored_by(optimizer: object) -> set[str]:
    """The settings ``optimizer`` does not use (other optimizers' own): refused when given, and not compared on a
    resume (a run written before they were refused may hold one it ignored)."""
    return {
        f.name
        for f in dataclasses.fields(TrainConfig)
        if _OPTION_OWNERS.get(f.name.split("_")[0], optimizer) != optimizer
    }


#: Dion's rank (a fraction of each matrix's smaller side) when a run does not set --dion-rank.
DEFAULT_DION_RANK = 0.25
#: Optimizers that send their own messages instead of averaged gradients (the gradient all-reduce is off; Dion on
#: sharded parameters excepted: TrainConfig.gradient_sync).
OWN_SYNC = ("demo", "dion")

DEFAULT_START = RECOMMENDED["start_compressing_after_num_steps"]  #: exact steps first, when a spec does not say


def _recommended_spec(rank: int) -> str:
    """powertrain.compress.powersgd.RECOMMENDED spelled out as a compressor spec, at ``rank``."""
    return f"powersgd:rank={rank},variant={RECOMMENDED['variant']},factors={RECOMMENDED['factor_dtype']}"


#: The command's PowerSGD on the default GPT when no compressor is named: RECOMMENDED, spelled out.
RECOMMENDED_POWERSGD = _recommended_spec(RECOMMENDED["rank"])
#: What the command's default (RECOMMENDED_POWERSGD with AdamW frozen at POWERSGD_ADAM_FREEZE) costs on the default
#: GPT: bench quality's 300-step section "quality-frozen-bound" (BENCHMARKS.md; docs/compression.md, "What it costs,
#: measured"); the run's summary says it.
RECOMMENDED_COST = (
    "measured by powertrain bench quality on this model over 300 steps (3 seeds, on its own validation batches, so "
    "not comparable with this run's figure), it ends at validation loss 1.9609 (seeds 1.9361-1.9850) against fp32 "
    "all-reduce's 1.9770 with torch's AdamW (-0.82%), with 1/9.5 of its bytes; the gain is the frozen AdamW's: fp32 "
    "all-reduce with the same freeze ends at 1.9532, so against the same optimizer PowerSGD costs +0.39%"
)


#: AdamW's freeze with PowerSGD when the run does not set one (1-bit Adam's 15-25% of exact Adam first): the
#: fraction bench quality chose over a tenth (docs/notes/compression.md, "How the defaults were
#: chosen").
POWERSGD_ADAM_FREEZE = 0.25


#: The fewest AdamW steps before a default freeze: the second moment's own horizon, 1 / (1 - beta2) with the command's
#: beta2 = 0.95. Frozen earlier it holds a few steps' squares: an estimate of the second moment from one or two
#: gradients (docs/notes/compression.md, "The frozen second moment's step bound", has what that did to a tiny run).
MIN_FREEZE_STEPS = 20


def default_adam_freeze(compressor: str, optimizer: str, steps: int, parallel: str = "reference") -> float:
    """``adam_freeze`` when a run does not set it: :data:`POWERSGD_ADAM_FREEZE` for AdamW with PowerSGD on the
    gradients, whose error feedback delivers them late (see powertrain.optim.frozen_adamw), when that leaves AdamW at
    least :data:`MIN_FREEZE_STEPS` steps first; else 0 (torch's AdamW): no other compressor was measured with it, and
    under local updates (diloco) a compressor sends pseudo-gradients, not gradients."""
    if compressor != "powersgd" or optimizer != "adamw" or parallel == "diloco":
        return 0.0
    if POWERSGD_ADAM_FREEZE * steps < MIN_FREEZE_STEPS:
        return 0.0
    return POWERSGD_ADAM_FREEZE


#: The command's PowerSGD rank is the model's width (d_model, the ResNet's channels: its matrices' smaller side)
#: over this, so that the compression ratio stays put as the model widens: 32 on the default GPT, as in
#: :data:`RECOMMENDED_POWERSGD`. bench quality chose it (BENCHMARKS.md: the default and the wide GPT, mnist1d).
WIDTH_PER_RANK = 8


def default_compressor(steps: int, width: int) -> str:
    """The command's compressor when none is asked for: :data:`RECOMMENDED_POWERSGD` at rank ``width`` /
    :data:`WIDTH_PER_RANK`, after DEFAULT_START exact steps, or after half the run when the run is shorter than
    twice that (so that a short run still compresses)."""
    return f"{_recommended_spec(max(1, width // WIDTH_PER_RANK))},start={min(DEFAULT_START, steps // 2)}"


MAX_TIMEOUT_S = 7 * 24 * 3600.0

#: The fields that only ``--parallel diloco`` reads (their defaults: :class:`powertrain.diloco.DiLoCoConfig`'s).
DILOCO_FIELDS = (
    "sync_every",
    "fragments",
    "sync_delay",
    "sync_mix",
    "outer_lr",
    "outer_momentum",
    "outer_lr_schedule",
    "sync_warmup",
    "warmup_compressor",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # what to train on
    model: ModelKind = "gpt"
    gpt_size: GPTSize = "default"
    data: Data = "stdlib"
    data_path: str | None = None
    data_max_mb: float | None = None
    block_size: int = 128
    # how long and how
    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    optimizer: Optimizer = "adamw"
    lr: float = 1e-3  # AdamW's best swept rate on the default GPT (BENCHMARKS.md, "Muon against a swept AdamW")
    #: the hidden matrices' learning rate with optimizer="muon" or "dion" (``lr`` is then the AdamW groups'); None:
    #: :data:`MATRIX_LR`'s
    muon_lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    momentum: float = 0.9
    #: AdamW's second moment freezes after this fraction of the steps (powertrain.optim.FrozenVarianceAdamW; 0:
    #: never, torch's AdamW). None: :func:`default_adam_freeze` of the run's compressor.
    adam_freeze: float | None = None
    # with blocks of 256: tools/bench_optimizers.py's configuration (its overhead: BENCHMARKS.md)
    shampoo_frequency: int = 50
    shampoo_max_dim: int = 256
    shampoo_preconditioner: Preconditioner = "shampoo"
    shampoo_comm_dtype: CommDtype = "fp32"  # fp32: bitwise the single-process optimizer; bf16: half the bytes
    shampoo_vectors: ShampooVectors = "graft"  # 1-D blocks: Adam alone (as SOAP), or full-matrix factors
    galore_rank: int = 64  # d_model / 4 on the default GPT
    galore_gap: int = 200  # update_proj_gap: steps between subspace refreshes
    galore_scale: float = 0.25
    galore_svd: SvdMethod = "randomized"
    demo_topk: int = 32
    demo_chunk: int = 64
    demo_decay: float = 0.999
    dion_rank: float | None = None  # Dion's rank as a fraction of each matrix's smaller side; None: 0.25 with dion
    precision: Precision = "fp32"
    compile: bool = False
    seed: int = 0
    # distribution and compression
    parallel: Parallel = "reference"
    tp: int = 2  # tensor-parallel degree with parallel="tp" (the other nproc / tp ranks are data parallel)
    compressor: str = ""  # "": default_compressor(steps), or none with simple_fsdp, rtp and tp (plain_by_default)
    hierarchy: Hierarchy = "flat"  # node: exact inside a node, the compressor only between nodes
    # local updates (parallel="diloco"): the compressor sends the pseudo-gradients of each sync
    sync_every: int = DEFAULT_SYNC_EVERY  # H: inner steps between two syncs of a fragment
    fragments: int = 1  # F: Streaming DiLoCo's fragments, synced in turn
    sync_delay: int = 0  # tau: inner steps a sync overlaps before its outer update is applied
    sync_mix: float = 0.0  # alpha: the local weights' share after a delayed outer update
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM  # Nesterov; 0: plain SGD (1 and 0: model averaging)
    outer_lr_schedule: OuterLRSchedule = "constant"  # inner: the outer rate scaled as the inner schedule's
    sync_warmup: int = 0  # steps first whose gradients are averaged every step, by warmup_compressor
    warmup_compressor: str = "none"
    nproc: int = 2
    backend: Backend = "auto"
    threads: int = 1
    timeout_s: float = 60.0
    # output
    out: str | None = None
    log_every: int = 25
    eval_every: int = 0
    eval_batches: int = 16
    checkpoint_every: int = 0
    resume: str | None = None
    quiet: bool = False
    tensorboard: bool = False

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(TrainConfig)
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        positive = [
            "block_size",
            "steps",
            "batch_size",
            "grad_accum",
            "nproc",
            "threads",
            "log_every",
            "eval_batches",
            "tp",
            "shampoo_frequency",
            "shampoo_max_dim",
            "galore_rank",
            "galore_gap",
            "demo_topk",
            "demo_chunk",
        ]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: must be >= 1")
        for name in ("warmup_steps", "seed", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: must be >= 0")
        for f in dataclasses.fields(self):  # no value may overflow what it is handed to (torch, timedelta)
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**63:
                raise ValueError(f"Invalid {f.name}={v!r}: must fit in 64 bits")
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"Invalid {f.name}={v!r}: must be a finite number")
        if self.muon_lr is None and self.optimizer in MATRIX_LR:
            object.__setattr__(self, "muon_lr", MATRIX_LR[self.optimizer])
        elif self.muon_lr is not None and self.optimizer not in MATRIX_LR:
            raise ValueError(
                f"muon_lr={self.muon_lr!r} is the learning rate of Muon's or Dion's matrices; optimizer="
                f"{self.optimizer!r} does not use it: drop it, or use optimizer='muon' (--lr is the other optimizers')"
            )
        if self.dion_rank is not None and self.optimizer != "dion":
            raise ValueError(
                f"dion_rank={self.dion_rank!r} applies to optimizer='dion', not {self.optimizer!r}: drop it"
            )
        if self.dion_rank is None and self.optimizer == "dion":
            object.__setattr__(self, "dion_rank", DEFAULT_DION_RANK)
        if self.dion_rank is not None and not 0 < self.dion_rank <= 1:
            raise ValueError(
                f"Invalid dion_rank={self.dion_rank!r}: a fraction of each matrix's smaller side in (0, 1]"
            )
        for name in ("lr", "muon_lr", "timeout_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: must be a number > 0")
        if not 1 <= self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"Invalid timeout_s={self.timeout_s!r}: must be from 1 to {MAX_TIMEOUT_S:g} (a week)")
        tops = {
            "lr": 1e30,
            "muon_lr": 1e30,
            "data_max_mb": 1e7,
            "block_size": 1 << 16,
            "batch_size": 1 << 16,
            "grad_accum": 1 << 16,
            "nproc": 1024,
            "steps": 1 << 40,
        }
        for name, top in tops.items():
            if (v := getattr(self, name)) is not None and v > top:
                raise ValueError(f"Invalid {name}={v!r}: must be at most {top:g}")
        if self.data_max_mb is not None and self.data_max_mb < 0.001:
            raise ValueError(f"Invalid data_max_mb={self.data_max_mb!r}: must be at least 0.001 (a kilobyte)")
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA, which this torch does not have: use backend='gloo' or 'auto'")
        cores = os.cpu_count() or 1
        if self.threads > cores:
            raise ValueError(
                f"Invalid threads={self.threads!r}: this machine has {cores} cores; use at most {cores} threads per "
                "worker (more only slow it down)"
            )
        for name in ("min_lr_ratio", "momentum"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: must be in [0, 1]")
        if not (math.isfinite(self.galore_scale) and self.galore_scale > 0):
            raise ValueError(f"Invalid galore_scale={self.galore_scale!r}: must be > 0")
        if not 0 <= self.demo_decay < 1:
            raise ValueError(f"Invalid demo_decay={self.demo_decay!r}: must be in [0, 1)")
        ignored = ignored_by(self.optimizer)
        for f in dataclasses.fields(self):  # another optimizer's setting would be ignored: refused instead
            value = getattr(self, f.name)
            if f.name in ignored and value != f.default:
                owner = _OPTION_OWNERS[f.name.split("_")[0]]
                raise ValueError(f"{f.name}={value!r} applies to optimizer={owner!r}, not {self.optimizer!r}: drop it")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"Invalid weight_decay={self.weight_decay!r}: must be >= 0")
        if self.data in ("textdir", "bin") and not self.data_path:
            raise ValueError(
                f"data={self.data!r} needs data_path (--data-path): a directory of text files or a .bin file"
            )
        if self.model == "resnet" and self.data != "mnist1d":
            raise ValueError(f"model='resnet' trains on data='mnist1d', got data={self.data!r}")
        if self.model == "resnet" and self.optimizer in MATRIX_LR:
            raise ValueError(
                f"optimizer={self.optimizer!r} steps a model's hidden 2-D matrices; the ResNet's weights are "
                "convolutions and its head (it would train AdamW alone): use optimizer='adamw' or model='gpt'"
            )
        if self.model == "gpt" and self.data == "mnist1d":
            raise ValueError("data='mnist1d' is classification: use model='resnet'")
        if self.optimizer in OWN_SYNC:
            sends = {"demo": "its own compressed momentum", "dion": "its own low-rank factors"}[self.optimizer]
            if not self.gradient_sync and self.compressor not in ("", "none"):
                raise ValueError(
                    f"optimizer={self.optimizer!r} exchanges {sends} and switches the gradient all-reduce off: drop "
                    f"compressor={self.compressor!r}"
                )
            if self.optimizer == "demo" and self.parallel not in ("reference", "ddp"):
                raise ValueError(
                    f"optimizer='demo' runs with parallel='ddp' or 'reference', not {self.parallel!r} (FlexDeMo, DeMo "
                    "across FSDP2 groups, is in the Python API: powertrain.optim.FlexDeMo)"
                )
            if self.optimizer == "dion" and self.parallel not in ("reference", "ddp", "fsdp", "simple_fsdp"):
                raise ValueError(
                    f"optimizer='dion' runs with parallel='ddp' or 'reference' (it sends its own factors) or 'fsdp' / "
                    f"'simple_fsdp' (on the shards of averaged gradients), not {self.parallel!r}"
                )
        if self.parallel in ("rtp", "tp"):
            if self.optimizer not in ("adamw", "sgd"):
                raise ValueError(
                    f"parallel={self.parallel!r} trains with optimizer='adamw' or 'sgd', not {self.optimizer!r}"
                )
            if self.precision != "fp32" or self.compile:
                raise ValueError(
                    f"parallel={self.parallel!r} runs in fp32 and eagerly: drop --precision bf16 and --compile"
                )
        if self.parallel == "tp":
            if self.model != "gpt":
                raise ValueError("parallel='tp' has a plan for the GPT only: use model='gpt', or parallel='rtp'")
            if self.nproc % self.tp:
                raise ValueError(
                    f"tp={self.tp} does not divide nproc={self.nproc}: the world is (nproc / tp) data-parallel x tp "
                    f"tensor-parallel; choose nproc a multiple of {self.tp}"
                )
            if self.gpt_shape[1] % self.tp:
                raise ValueError(
                    f"tp={self.tp} does not divide the {self.gpt_size} GPT's n_head={self.gpt_shape[1]}: choose a tp "
                    "that divides it"
                )
        if not self.compressor:
            plain = plain_by_default(self.optimizer, self.parallel)
            width = self.gpt_shape[2] if self.model == "gpt" else RESNET_WIDTH
            spec = "none" if plain else default_compressor(self.steps, width)
            object.__setattr__(self, "compressor", DEFAULT_OUTER_COMPRESSOR if self.parallel == "diloco" else spec)
        elif self.parallel == "diloco" and _outer_powersgd_without_start(self.compressor):
            # on the outer step PowerSGD compresses from the first sync on (its exact warm-up would send whole
            # pseudo-gradients): a spec that does not say otherwise gets start=0, recorded in the run's config
            spec = self.compressor.rstrip(",") + ("," if ":" in self.compressor else ":") + "start=0"
            object.__setattr__(self, "compressor", spec)
        name, options = parse_compressor(self.compressor)  # validate now, not in the workers
        self._check_local_updates()
        if self.adam_freeze is None:
            freeze = default_adam_freeze(name, self.optimizer, self.steps, self.parallel)
            object.__setattr__(self, "adam_freeze", freeze)
        assert self.adam_freeze is not None
        if not 0 <= self.adam_freeze < 1:
            raise ValueError(f"Invalid adam_freeze={self.adam_freeze!r}: must be a fraction of the steps in [0, 1)")
        if self.adam_freeze and self.optimizer != "adamw":
            raise ValueError(
                f"adam_freeze={self.adam_freeze!r} freezes AdamW's second moment; optimizer={self.optimizer!r} has "
                "none: drop adam_freeze or use optimizer='adamw'"
            )
        if self.hierarchy == "node" and not self.gradient_sync:
            raise ValueError(
                f"hierarchy='node' compresses gradients between nodes; optimizer={self.optimizer!r} sends its own "
                "messages and none of the gradients: use hierarchy='flat'"
            )
        check_parallel(
            self.parallel,
            name,
            options,
            compiled=self.compile,
            gradient_sync=self.gradient_sync,
            hierarchical=self.hierarchy == "node",
        )
        start = options.get("start_compressing_after_num_steps", 0) if name == "powersgd" else 0
        if start >= self.steps and self.parallel != "diloco":
            raise ValueError(
                f"compressor={self.compressor!r} starts compressing after {start} steps and the run has {self.steps}: "
                f"it would send full gradients throughout; lower start= below {self.steps} or raise steps"
            )

    def _check_local_updates(self) -> None:
        """The diloco fields: that only diloco sets them, then what DiLoCoConfig checks, and what the run's length
        decides."""
        if self.parallel != "diloco":
            changed = [
                f.name
                for f in dataclasses.fields(self)
                if f.name in DILOCO_FIELDS and getattr(self, f.name) != f.default
            ]
            if changed:
                raise ValueError(
                    f"{changed[0]}={getattr(self, changed[0])!r} applies to parallel='diloco' (local "
                    f"updates), not {self.parallel!r}: drop it or use --parallel diloco"
                )
            return
        self._diloco_config()  # DiLoCoConfig checks its fields as it is built, and warns of one without effect
        if self.sync_every >= self.steps:
            warnings.warn(
                f"sync_every={self.sync_every} >= steps={self.steps}: the replicas never sync before the "
                "run's end (one sync at the end); lower --sync-every",
                stacklevel=2,
            )
        if self.sync_warmup >= self.steps:
            raise ValueError(
                f"Invalid sync_warmup={self.sync_warmup}: the run has {self.steps} steps; a warm-up "
                "shorter than the run leaves room for local updates"
            )
        if self.optimizer not in ("adamw", "sgd", "muon"):
            raise ValueError(
                f"parallel='diloco' trains with optimizer='adamw', 'sgd' or 'muon' as the inner optimizer, not "
                f"{self.optimizer!r}"
            )
        if self.compile and self.hierarchy == "node":
            raise ValueError(
                "parallel='diloco' with hierarchy='node' runs DDP inside each node, which does not "
                "compile here: drop --compile or use hierarchy='flat'"
            )

    @property
    def local_updates(self) -> DiLoCoConfig | None:
        """The settings of ``parallel="diloco"`` (None for the other modes): the outer step's compressor and the
        warm-up's, parsed from their specs. Checked, and its warnings given, when this config was built."""
        if self.parallel != "diloco":
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return self._diloco_config()

    def _diloco_config(self) -> DiLoCoConfig:
        outer, outer_options = parse_compressor(self.compressor)
        warm, warm_options = parse_compressor(self.warmup_compressor)
        return DiLoCoConfig(
            sync_every=self.sync_every,
            compressor=outer,
            compressor_options=outer_options,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            outer_lr_schedule=self.outer_lr_schedule,
            fragments=self.fragments,
            sync_delay=self.sync_delay,
            sync_mix=self.sync_mix,
            sync_warmup=self.sync_warmup,
            warmup_compressor=warm,
            warmup_options=warm_options,
        )

    @property
    def gradient_sync(self) -> bool:
        """Whether gradients are averaged across ranks (False: the optimizer sends its own messages, :data:`OWN_SYNC`;
        Dion on FSDP2 or SimpleFSDP shards steps the averaged gradients)."""
        return self.optimizer not in OWN_SYNC or (self.optimizer == "dion" and self.parallel in ("fsdp", "simple_fsdp"))

    @property
    def freeze_after(self) -> int:
        """AdamW's steps before its second moment freezes (``adam_freeze`` of the run's steps; 0: never)."""
        return max(1, round(self.adam_freeze * self.steps)) if self.adam_freeze else 0

    @property
    def gpt_shape(self) -> tuple[int, int, int]:
        return GPT_SIZES[self.gpt_size]


def plain_by_default(optimizer: str, parallel: str) -> bool:
    """Whether a run gets no compressor unless it names one: DeMo and Dion send their own messages, SimpleFSDP reduces
    in fp32 (its compressed path runs on eager buckets only), RTP reduces inside backward, and TP's traffic is mostly
    its activations (a compressor there takes FSDP2's gradient reduce-scatter only)."""
    return optimizer in OWN_SYNC or parallel in ("simple_fsdp", "rtp", "tp")


def _outer_powersgd_without_start(spec: str) -> bool:
    """Whether ``spec`` names PowerSGD without giving its exact warm-up (``start`` or its long name)."""
    name, _, rest = spec.partition(":")
    keys = {item.partition("=")[0].strip() for item in rest.split(",")}
    return name.strip().lower() == "powersgd" and not keys & {"start", "start_compressing_after_num_steps"}


def _check_type(name: str, value: Any, hint: Any) -> None:
    """Check ``value`` against a field's annotation (Literal, bool, int, float, str, or X | None)."""
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        if value not in args:
            raise ValueError(f"Invalid {name}={value!r}: must be one of {', '.join(map(repr, args))}")
        return
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[hint]
    if not ok:
        raise ValueError(f"Invalid {name}={value!r}: must be {hint.__name__}")


def parse_compressor(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME[:key=value,...]`` -> (name, options) with values typed (int, float, bool, str).

    PowerSGD's short keys: ``rank``, ``iters`` (num_iters_per_step), ``min_rate`` (min_compression_rate),
    ``start`` (start_compressing_after_num_steps), ``variant``, ``seed``, ``factors`` (factor_dtype). What a
    PowerSGD spec leaves out is :data:`powertrain.compress.powersgd.RECOMMENDED`'s (``powersgd`` alone: rank 32,
    the paper variant, bf16 factors, 5 exact steps); ``variant=alternating`` keeps fp32 factors.
    """
    name, _, rest = spec.partition(":")
    name = name.strip().lower()
    if name not in COMPRESSORS:
        raise ValueError(f"Unknown compressor {name!r} in {spec!r}: choose one of {', '.join(COMPRESSORS)}")
    options: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"Bad compressor option {item!r} in {spec!r}: expected key=value")
        if key.strip() in options:
            raise ValueError(f"Compressor option {key.strip()!r} is given twice in {spec!r}: give it once")
        options[key.strip()] = _typed(value.strip())
    if name == "powersgd":
        aliases = {
            "iters": "num_iters_per_step",
            "min_rate": "min_compression_rate",
            "start": "start_compressing_after_num_steps",
            "factors": "factor_dtype",
        }
        full = {aliases.get(k, k): v for k, v in options.items()}
        if len(full) != len(options):
            raise ValueError(f"{spec!r} gives an option both by its short and its long name: give it once")
        # the measured best for what the spec leaves out, not the reference Config's defaults (its 100 exact
        # steps would leave a short run uncompressed)
        options = recommended_options(full)
    # The compressor's constructor owns the checks of its options: run for no parameters (nothing is allocated), it
    # refuses unknown options and bad values here, with their names. rank=auto is chosen by each run at start-up
    # (powertrain.compress.auto); its other options are checked here.
    try:
        make_compressor(name, [], **({**options, "rank": 4} if is_auto(name, options) else options))
    except ValueError as e:
        raise ValueError(f"Bad compressor {spec!r}: {e}") from None
    return name, options


def is_auto(name: str, options: dict[str, Any]) -> bool:
    """Whether a parsed spec leaves the rank to the link (``powersgd:rank=auto``)."""
    return name == "powersgd" and options.get("rank") == "auto"


def _typed(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    # Seconds, for tests and smoke checks.
    "tiny": dict(
        gpt_size="tiny",
        steps=6,
        batch_size=2,
        block_size=32,
        log_every=1,
        eval_batches=2,
        data_max_mb=0.5,
        warmup_steps=2,
        compressor="powersgd:rank=2,start=2",
    ),
}


#: The most a --config file holds (a few dozen keys take a few KB).
CONFIG_LIMIT = 1 << 20


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config; unknown keys are errors naming them and the valid ones."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"Config file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(read_bounded(p, CONFIG_LIMIT, "Config file").decode())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"Config file {str(p)!r} is not valid TOML: {e}") from None
    except FileTooLarge:
        raise
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"Config file {str(p)!r} cannot be read: {e}") from None
    valid = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(f"Unknown config key(s) {unknown} in {str(p)!r}; valid keys: {', '.join(sorted(valid))}")
    return data


def resolve(preset: str, toml: Mapping[str, Any] | None, flags: Mapping[str, Any]) -> TrainConfig:
    """defaults < preset < TOML < flags."""
    if preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    user = {**(toml or {}), **flags}
    base = dict(PRESETS[preset])
    # A preset's compressor is its choice for runs that compress every step's gradients by default; it yields to what
    # the user asked, and to local updates' outer-step default (a per-step choice such as the tiny preset's
    # powersgd:rank=2 measured badly on the outer step), which the log says.
    if "compressor" not in user and plain_by_default(user.get("optimizer", ""), user.get("parallel", "")):
        base.pop("compressor", None)
    elif "compressor" not in user and user.get("parallel") == "diloco" and "compressor" in base:
        warnings.warn(
            f"--preset {preset} sets compressor={base.pop('compressor')!r} for per-step averaging; with --parallel "
            f"diloco the outer step's default, {DEFAULT_OUTER_COMPRESSOR}, applies (--compressor chooses another)",
            stacklevel=2,
        )
    return TrainConfig(**{**base, **user})


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML (``None`` values are left out: they are the defaults)."""
    lines = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v is None:
            continue
        if isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, int | float):
            text = repr(v)
        else:
            text = '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{f.name} = {text}")
    return "\n".join(lines) + "\n"
