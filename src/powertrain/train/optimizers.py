"""The optimizer of ``powertrain train`` (``--optimizer``), built from the config in one place.

* ``adamw``, ``sgd``: torch's; their state is replicated (or DTensor-sharded under FSDP) and goes into the
  DCP checkpoint as usual. With ``adam_freeze`` > 0, ``adamw`` is :class:`powertrain.optim.FrozenVarianceAdamW`
  (AdamW whose second moment freezes after that fraction of the steps; same state keys).
* ``shampoo``: :class:`powertrain.optim.DistributedShampoo` (grafting Adam). Under DDP its blocks are spread over
  the ranks; under ``fsdp``/``simple_fsdp`` each rank preconditions its own shards.
* ``galore``: :class:`powertrain.optim.GaLoreAdamW` on the 2-D weights inside the model's blocks (attention and
  MLP, as in the paper); embeddings, head, norms and biases are plain AdamW in a second group.
* ``demo``: :class:`powertrain.optim.DeMo` with the data-parallel gradient all-reduce switched off.

``shampoo``, ``galore`` and ``demo`` keep state that differs per rank (owned blocks, local shards, local
momentum): :attr:`Built.per_rank` tells the checkpoint code to store it under each rank's own key.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from powertrain.comm import CommStats

if TYPE_CHECKING:
    from powertrain.train.config import TrainConfig

__all__ = ["Built", "Schedule", "build_optimizer", "build_scheduler", "galore_split", "lr_factor"]


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """The learning-rate multiplier at ``step``: linear warm-up over ``cfg.warmup_steps``, then cosine decay to
    ``cfg.min_lr_ratio`` at ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> Schedule:
    """``powertrain train``'s schedule (:func:`lr_factor`) on ``optimizer``; step it once per optimizer step."""
    return Schedule(cfg, optimizer)


class Schedule:
    """``powertrain train``'s learning rate: ``--lr`` x :func:`lr_factor` of the step on every parameter group (a
    LambdaLR underneath), and its part of a checkpoint.

    What it holds is derived from the step and the settings ``--lr``, ``--warmup-steps``, ``--min-lr-ratio`` and
    ``--steps``, which a resume may change (what one changes after a divergence, or to extend a run). So a
    checkpoint's copy is checked, not trusted: :meth:`load_state_dict` accepts only the form this class writes (the
    same keys, each value of the type it has here), :meth:`resume` requires it to be at the checkpoint's step and
    sets the learning rate from this run's settings; a crafted rate in the checkpoint never reaches the optimizer."""

    def __init__(self, cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> None:
        self.cfg, self.optimizer = cfg, optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
        self._loaded_step: int | None = None

    def step(self) -> None:
        self.scheduler.step()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, object]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: object) -> None:
        form = self.scheduler.state_dict()
        if not isinstance(state, dict) or set(state) != set(form):
            keys = sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"the schedule's state holds {keys!s:.200}, expected {sorted(form)}")
        for key, like in form.items():
            _check_like(f"the schedule's {key}", state[key], like)
        if state["last_epoch"] < 0 or state["_step_count"] < 1:
            raise ValueError(f"the schedule's state is at step {state['last_epoch']}, expected a count (>= 0)")
        self.scheduler.load_state_dict(state)
        self._loaded_step = state["last_epoch"]

    def resume(self, step: int) -> None:
        """After :meth:`load_state_dict`: check that the schedule was saved at ``step`` and set each group's
        learning rate for it from this run's settings (bitwise what the scheduler would set with unchanged
        settings: ``--lr`` x ``lr_factor(step)``)."""
        if self._loaded_step != step:
            raise ValueError(f"the schedule's state is at step {self._loaded_step} and the checkpoint at {step}")
        lr = self.cfg.lr
        for group in self.optimizer.param_groups:
            group["initial_lr"] = lr
            group["lr"] = lr * lr_factor(step, self.cfg)
        self.scheduler.base_lrs = [lr for _ in self.optimizer.param_groups]


def _check_like(what: str, value: object, like: object) -> None:
    """``value`` has the form of ``like`` (the value this run would write): the same type (a bool is not an int),
    and for a list the same length with elements of the same types. ValueError in one line otherwise."""
    if type(value) is not type(like):
        raise ValueError(f"{what} is of type {type(value).__name__}, expected {type(like).__name__}")
    if isinstance(like, list) and isinstance(value, list):
        if len(value) != len(like):
            raise ValueError(f"{what} has {len(value)} entries, expected {len(like)} (one per parameter group)")
        for i, (v, w) in enumerate(zip(value, like, strict=True)):
            _check_like(f"{what}[{i}]", v, w)
    elif isinstance(like, float) and isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} is {value}, expected a finite number")


def galore_split(
    model: torch.nn.Module, params: list[torch.nn.Parameter]
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``params`` split into GaLore's projected weights (the 2-D ones inside ``model.blocks``: attention and MLP,
    as in the paper) and the rest (embeddings, head, norms, biases: plain AdamW)."""
    blocks = getattr(model, "blocks", None)
    in_blocks = {id(p) for p in blocks.parameters()} if isinstance(blocks, torch.nn.Module) else set()
    low_rank = [p for p in params if p.ndim == 2 and id(p) in in_blocks]
    chosen = {id(p) for p in low_rank}
    return low_rank, [p for p in params if id(p) not in chosen]


@dataclasses.dataclass
class Built:
    optimizer: torch.optim.Optimizer
    per_rank: bool  # state differs per rank: checkpoint it per rank, not through DCP's optimizer flattening
    stats: CommStats | None  # the optimizer's own communication (None: it sends nothing)


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> Built:
    """The optimizer for ``model`` (already wrapped for ``cfg.parallel``, unwrapped module passed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    match cfg.optimizer:
        case "adamw":
            if cfg.adam_freeze:
                from powertrain.optim import FrozenVarianceAdamW

                frozen = FrozenVarianceAdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                                             freeze_after=cfg.freeze_after)  # fmt: skip
                return Built(frozen, per_rank=False, stats=None)
            adamw = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
            return Built(adamw, per_rank=False, stats=None)
        case "sgd":
            sgd = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
            return Built(sgd, per_rank=False, stats=None)
        case "shampoo":
            from powertrain.optim import DistributedShampoo

            eps = 1e-8 if cfg.shampoo_preconditioner == "eigenvalue_corrected" else 1e-12
            # the factors and the Adam graft average over the same horizon as --optimizer adamw's second moment
            # (beta2 0.95, DistributedShampoo's default): on runs this short a 0.999 average still mostly holds
            # the first steps' gradients
            shampoo = DistributedShampoo(
                params, lr=cfg.lr, betas=(0.9, 0.95), eps=eps, weight_decay=cfg.weight_decay,
                max_preconditioner_dim=cfg.shampoo_max_dim, precondition_frequency=cfg.shampoo_frequency,
                grafting="adam", grafting_beta2=0.95, preconditioner=cfg.shampoo_preconditioner,
                comm_dtype=torch.bfloat16 if cfg.shampoo_comm_dtype == "bf16" else torch.float32,
                precondition_1d=cfg.shampoo_vectors == "shampoo",
            )  # fmt: skip
            return Built(shampoo, per_rank=True, stats=shampoo.comm.stats)
        case "galore":
            from powertrain.optim import GaLoreAdamW

            low_rank, rest = galore_split(model, params)
            if not low_rank:
                raise ValueError(f"optimizer='galore' found no 2-D weights in {type(model).__name__}.blocks to project")
            groups = [
                {"params": low_rank, "rank": cfg.galore_rank, "update_proj_gap": cfg.galore_gap,
                 "scale": cfg.galore_scale, "svd": cfg.galore_svd},
                {"params": rest},
            ]  # fmt: skip
            galore = GaLoreAdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
            return Built(galore, per_rank=True, stats=galore.comm.stats)
        case "demo":
            from powertrain.optim import DeMo

            demo = DeMo(params, lr=cfg.lr, weight_decay=cfg.weight_decay, compression_topk=cfg.demo_topk,
                        compression_chunk=cfg.demo_chunk, compression_decay=cfg.demo_decay)  # fmt: skip
            return Built(demo, per_rank=True, stats=demo.comm.stats)
    raise ValueError(f"Invalid optimizer={cfg.optimizer!r}: choose adamw, sgd, shampoo, galore or demo")
