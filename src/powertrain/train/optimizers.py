"""The optimizer of ``powertrain train`` (``--optimizer``), built from the config in one place.

* ``adamw``, ``sgd``: torch's; their state is replicated (or DTensor-sharded under FSDP) and goes into the
  DCP checkpoint as usual. With ``adam_freeze`` > 0, ``adamw`` is :class:`powertrain.optim.FrozenVarianceAdamW`
  (AdamW whose second moment freezes after that fraction of the steps; same state keys).
* ``muon``: :class:`powertrain.optim.Muon` (``--muon-lr`` on the hidden matrices, ``--lr`` on the AdamW groups). Its
  state is torch's (replicated, or DTensor-sharded under FSDP2 / SimpleFSDP) and goes into the DCP checkpoint. Each
  matrix is orthogonalized once across ranks (its result all-gathered) when gradients travel uncompressed (``none``)
  or are sharded; with a lossy compressor every rank orthogonalizes every matrix instead: such a run is on a slow
  link, where the all-gather of the results would cost more than the compressed gradients.
* ``shampoo``: :class:`powertrain.optim.DistributedShampoo` (grafting Adam). Under DDP its blocks are spread over
  the ranks; under ``fsdp``/``simple_fsdp`` each rank preconditions its own shards.
* ``galore``: :class:`powertrain.optim.GaLoreAdamW` on the 2-D weights inside the model's blocks (attention and
  MLP, as in the paper); embeddings, head, norms and biases are plain AdamW in a second group.
* ``demo``: :class:`powertrain.optim.DeMo` with the data-parallel gradient all-reduce switched off.
* ``dion``: :class:`powertrain.optim.Dion` (``--muon-lr`` on the hidden matrices at rank ``--dion-rank`` of their
  smaller side, ``--lr`` on the AdamW groups). Under ``reference`` and ``ddp`` the gradient all-reduce is switched
  off: Dion sends its low-rank factors and the AdamW parameters' gradients itself; under ``fsdp`` and
  ``simple_fsdp`` it steps the shards of the averaged gradients, its factors reduced over the shards.

``shampoo``, ``galore``, ``demo`` and ``dion`` keep state that differs per rank (owned blocks, local shards, local
momentum): :attr:`Built.per_rank` tells the checkpoint code to store it under each rank's own key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from powertrain.comm import CommStats

if TYPE_CHECKING:
    from powertrain.train.config import TrainConfig


__all__ = ["Built", "RankOptimizer", "Schedule", "build_optimizer", "build_scheduler", "galore_split", "lr_factor"]


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
        # each group's rate from this run's settings (--lr; Muon's matrices --muon-lr), before a checkpoint's load
        self.base_lrs = list(self.scheduler.base_lrs)

    def step(self) -> None:
        self.scheduler.step()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def logged_lr(self) -> float:
        """The rate a run logs: ``--lr``'s as scheduled, the AdamW groups' for Muon and Dion (whose matrices' rate is
        ``--muon-lr`` times the same factor)."""
        groups = self.optimizer.param_groups
        return float(next((g["lr"] for g in groups if g.get("algorithm", "adamw") == "adamw"), groups[0]["lr"]))

    def state_dict(self) -> dict[str, object]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: object) -> None:
        form = self.scheduler.state_dict()
        state = _check_keys("the schedule's state", state, form)
        for key, like in form.items():
            _check_like(f"the schedule's {key}", state[key], like)
        if state["last_epoch"] < 0 or state["_step_count"] < 1:
            raise ValueError(f"the schedule's state is at step {state['last_epoch']}, expected a count (>= 0)")
        self.scheduler.load_state_dict(state)

    def resume(self, step: int) -> None:
        """After :meth:`load_state_dict`: check that the schedule was saved at ``step`` and set each group's
        learning rate for it from this run's settings (bitwise what the scheduler would set with unchanged
        settings: the group's ``--lr`` or ``--muon-lr`` x ``lr_factor(step)``)."""
        if self.scheduler.last_epoch != step:  # the step the loaded state is at
            raise ValueError(
                f"the schedule's state is at step {self.scheduler.last_epoch} and the checkpoint at {step}"
            )
        for group, lr in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["initial_lr"] = lr
            group["lr"] = lr * lr_factor(step, self.cfg)
        self.scheduler.base_lrs = list(self.base_lrs)


def _check_keys(what: str, state: object, form: dict[str, Any]) -> dict[str, Any]:
    """``state``, a dict with exactly the keys of ``form`` (what this run writes). ValueError in one line."""
    if not isinstance(state, dict) or set(state) != set(form):
        keys = sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{what} holds {keys!s:.200}, expected {sorted(form)}")
    return state


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


class RankOptimizer:
    """An optimizer whose state travels per rank (``shampoo``, ``galore``, ``demo``; local updates' inner optimizer):
    its part of a checkpoint, checked at load against the form this run would write before the optimizer takes it.

    torch's ``Optimizer.load_state_dict`` restores the saved hyperparameters and tensors as they are: a group with
    another ``weight_decay`` (a setting a resume may not change), a string ``lr`` or a momentum of the wrong shape was
    taken, and failed (or silently changed the run) steps later. So the saved state must have this optimizer's
    keys, its parameter groups the same hyperparameters (``lr``, ``initial_lr``: a finite number >= 0, the schedule
    sets the rate; ``freeze_after``: follows ``--steps``, an int >= 1) and each parameter's tensors real, finite and
    of the shape this rank's parameter gives them (GaLore and Shampoo check their own layouts as they load)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, object]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: object) -> None:
        check_optimizer_state(self.optimizer, state)
        self.optimizer.load_state_dict(state)  # type: ignore[arg-type]


#: Per-parameter state of torch-style optimizers: the keys each parameter's entry holds once it stepped ("step" a
#: scalar tensor, the others the shape of the rank's own parameter).
_PARAM_STATE = {
    "AdamW": {"step", "exp_avg", "exp_avg_sq"},
    "FrozenVarianceAdamW": {"step", "exp_avg", "exp_avg_sq"},
    "SGD": {"momentum_buffer"},
    "DeMo": {"momentum"},
    "adamw": {"step", "exp_avg", "exp_avg_sq"},
    "muon": {"momentum_buffer"},
    "dion": {"momentum", "Q"},
}
#: Group entries that follow the schedule, not a fixed setting: their type is checked, their value is this run's.
_SCHEDULED = ("lr", "initial_lr", "freeze_after")
_RENAMED = {"epsilon": "eps", "grafting_epsilon": "grafting_eps"}


def check_optimizer_state(optimizer: torch.optim.Optimizer, state: object) -> None:
    """ValueError in one line unless ``state`` has the form ``optimizer.state_dict()`` writes in this run (see
    :class:`RankOptimizer`)."""
    from powertrain.ops.flat import local_tensor

    form = optimizer.state_dict()
    state = _check_keys("the optimizer's state", state, form)
    check_param_groups(state["param_groups"], form["param_groups"])
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = state["state"]
    if not isinstance(saved, dict):
        raise ValueError(f"the optimizer's state is of type {type(saved).__name__}, expected dict")
    kind = type(optimizer).__name__
    # a composite optimizer's parameter keeps its group's algorithm's state (Muon: momentum; AdamW: moments)
    algorithms = [g.get("algorithm", kind) for g in optimizer.param_groups for _ in g["params"]]
    # a state the optimizer creates with itself (Dion's matrices) is never absent from a state it wrote
    lost = [i for i, per in form["state"].items() if per and not (isinstance(saved.get(i), dict) and saved[i])]
    if lost:
        raise ValueError(
            f"the optimizer's state has no entry for parameter(s) {lost[:5]}, which this optimizer always keeps "
            "state for"
        )
    for index, per in saved.items():
        if type(index) is not int or not 0 <= index < len(params) or not isinstance(per, dict):
            raise ValueError(
                f"the optimizer's state has an entry {index!r:.40} for none of its {len(params)} parameters"
            )
        check_state_values(f"the optimizer's state for parameter {index}", per, kind)
        expected = _PARAM_STATE.get(algorithms[index])
        if expected is None or not per:
            continue
        if set(per) != expected:
            raise ValueError(
                f"the optimizer's state for parameter {index} holds {sorted(map(str, per))!s:.200}, "
                f"expected {sorted(expected)}"
            )
        shape = tuple(local_tensor(params[index]).shape)
        own = getattr(optimizer, "state_shapes", None)  # an optimizer whose state is not all its parameter's shape
        shapes = own(params[index]) if own is not None else {}
        for name, value in per.items():
            want = shapes.get(name, () if name == "step" else shape)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
                shape_got: object = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"the optimizer's {name} for parameter {index} is {shape_got}, expected a tensor of shape {want}"
                )


def check_param_groups(groups: object, mine: list[dict[str, Any]]) -> None:
    """ValueError in one line unless the saved parameter ``groups`` are this run's (``mine``, as the optimizer's
    state_dict writes them): the same keys, the same hyperparameters, and for the entries that follow the schedule
    (:data:`_SCHEDULED`) a value of the same type. Also for the optimizers a checkpoint restores through DCP (adamw,
    sgd), whose groups torch would otherwise take as saved."""
    if not isinstance(groups, list) or len(groups) != len(mine):
        got = len(groups) if isinstance(groups, list) else type(groups).__name__
        raise ValueError(f"the optimizer's state has {got} parameter groups, expected {len(mine)}")
    for i, (group, like) in enumerate(zip(groups, mine, strict=True)):
        if isinstance(group, dict):  # Shampoo's options' names before they followed torch's (its loader renames them)
            group = {_RENAMED.get(k, k) if isinstance(k, str) else k: v for k, v in group.items()}
        if not isinstance(group, dict) or set(group) != set(like):
            keys = sorted(map(str, group))[:12] if isinstance(group, dict) else type(group).__name__
            raise ValueError(f"the optimizer's parameter group {i} holds {keys!s:.300}, expected {sorted(like)}")
        for key, value in like.items():
            what = f"the optimizer's {key} (group {i})"
            _check_like(what, group[key], value)
            if key in _SCHEDULED:
                if group[key] < (key == "freeze_after"):
                    raise ValueError(f"{what} is {group[key]!r:.40}, expected a number >= 0")
            elif group[key] != value:
                raise ValueError(
                    f"{what} is {group[key]!r:.60} and this run's {value!r:.60}: a resume continues "
                    "the run with its settings; drop the flags that change it, or start a new "
                    "run"
                )


def check_state_values(what: str, per: dict[Any, Any], kind: str = "") -> None:
    """ValueError in one line unless one parameter's optimizer state (``per``) holds values an optimizer could have
    written: every tensor real and finite, a step count >= 0, the rest floating point, and AdamW's second moment >= 0
    unless ``kind`` (the optimizer's class name) is FrozenVarianceAdamW, which marks its live entries by their sign (a
    crafted step of -1 divided by zero in AdamW's first step, a negative second moment gave NaN)."""
    _check_tensors(what, per)
    for name, value in per.items():
        if not isinstance(value, torch.Tensor):
            continue
        if name == "step":
            if value.numel() != 1 or bool(value < 0):  # complex ones _check_tensors refused
                raise ValueError(f"{what}: its step is {value.flatten()[:2].tolist()!s:.60}, expected a count >= 0")
        elif not value.is_floating_point():
            raise ValueError(f"{what}: its {name} is a {value.dtype} tensor, expected floating point")
        elif name in ("exp_avg_sq", "max_exp_avg_sq") and kind != "FrozenVarianceAdamW" and bool((value < 0).any()):
            raise ValueError(f"{what}: its {name} holds negative values, which a second moment cannot")


def _check_tensors(what: str, value: object, depth: int = 0) -> None:
    """Every tensor in ``value`` (nested dicts and lists) real and, if floating, finite."""
    if depth > 8:
        raise ValueError(f"{what} is nested deeper than any optimizer's state")
    if isinstance(value, torch.Tensor):
        if value.is_complex() or (value.is_floating_point() and not bool(torch.isfinite(value).all())):
            raise ValueError(f"{what} holds a {value.dtype} tensor with non-finite or complex values")
    elif isinstance(value, dict):
        for v in value.values():
            _check_tensors(what, v, depth + 1)
    elif isinstance(value, list | tuple):
        for v in value:
            _check_tensors(what, v, depth + 1)


def _check_matrices(model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]], optimizer: str) -> None:
    """ValueError unless the rule gives the optimizer some hidden matrices (the 1-D ResNet's are convolutions and its
    head: it would train AdamW alone, under the name of another optimizer)."""
    from powertrain.optim.matrices import default_rule

    if not any(default_rule(n, p) for n, p in named):
        raise ValueError(
            f"optimizer={optimizer!r} steps a model's hidden 2-D matrices, and {type(model).__name__} has none (its "
            "weights are convolutions, embeddings or its head): use optimizer='adamw'"
        )


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
    matrix_lr = 0.0 if cfg.muon_lr is None else cfg.muon_lr  # TrainConfig resolves it for muon and dion
    match cfg.optimizer:
        case "adamw":
            if cfg.adam_freeze:
                from powertrain.optim import FrozenVarianceAdamW

                frozen = FrozenVarianceAdamW(
                    params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), freeze_after=cfg.freeze_after
                )
                return Built(frozen, per_rank=False, stats=None)
            adamw = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
            return Built(adamw, per_rank=False, stats=None)
        case "sgd":
            sgd = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
            return Built(sgd, per_rank=False, stats=None)
        case "muon":
            from powertrain.optim import Muon

            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            # the work split's all-gather sends a whole model's worth of results: worth it where the gradients travel
            # whole too, or where the matrices are sharded (FSDP2, SimpleFSDP: each must meet on one rank anyway)
            # (never under local updates: each replica steps its own gradients)
            split = cfg.parallel in ("fsdp", "simple_fsdp") or (cfg.compressor == "none" and cfg.parallel != "diloco")
            _check_matrices(model, named, "muon")
            muon = Muon(
                named,
                lr=matrix_lr,
                weight_decay=cfg.weight_decay,
                adamw_lr=cfg.lr,
                adamw_betas=(0.9, 0.95),
                adamw_weight_decay=cfg.weight_decay,
                split=split,
            )
            return Built(muon, per_rank=False, stats=muon.comm.stats)
        case "dion":
            from powertrain.optim import Dion

            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            _check_matrices(model, named, "dion")
            dion = Dion(
                named,
                lr=matrix_lr,
                weight_decay=cfg.weight_decay,
                rank_fraction=cfg.dion_rank or 0.0,  # resolved by TrainConfig
                adamw_lr=cfg.lr,
                adamw_betas=(0.9, 0.95),
                adamw_weight_decay=cfg.weight_decay,
            )
            return Built(dion, per_rank=True, stats=dion.comm.stats)
        case "shampoo":
            from powertrain.optim import DistributedShampoo

            eps = 1e-8 if cfg.shampoo_preconditioner == "eigenvalue_corrected" else 1e-12
            # the factors and the Adam graft average over the same horizon as --optimizer adamw's second moment
            # (beta2 0.95, DistributedShampoo's default): on runs this short a 0.999 average still mostly holds
            # the first steps' gradients
            shampoo = DistributedShampoo(
                params,
                lr=cfg.lr,
                betas=(0.9, 0.95),
                eps=eps,
                weight_decay=cfg.weight_decay,
                max_preconditioner_dim=cfg.shampoo_max_dim,
                precondition_frequency=cfg.shampoo_frequency,
                grafting="adam",
                grafting_beta2=0.95,
                preconditioner=cfg.shampoo_preconditioner,
                comm_dtype=torch.bfloat16 if cfg.shampoo_comm_dtype == "bf16" else torch.float32,
                precondition_1d=cfg.shampoo_vectors == "shampoo",
            )
            return Built(shampoo, per_rank=True, stats=shampoo.comm.stats)
        case "galore":
            from powertrain.optim import GaLoreAdamW

            low_rank, rest = galore_split(model, params)
            if not low_rank:
                raise ValueError(f"optimizer='galore' found no 2-D weights in {type(model).__name__}.blocks to project")
            groups = [
                {
                    "params": low_rank,
                    "rank": cfg.galore_rank,
                    "update_proj_gap": cfg.galore_gap,
                    "scale": cfg.galore_scale,
                    "svd": cfg.galore_svd,
                },
                {"params": rest},
            ]
            galore = GaLoreAdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
            return Built(galore, per_rank=True, stats=galore.comm.stats)
        case "demo":
            from powertrain.optim import DeMo

            demo = DeMo(
                params,
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                compression_topk=cfg.demo_topk,
                compression_chunk=cfg.demo_chunk,
                compression_decay=cfg.demo_decay,
            )
            return Built(demo, per_rank=True, stats=demo.comm.stats)
    raise ValueError(f"Invalid optimizer={cfg.optimizer!r}: choose adamw, sgd, muon, dion, shampoo, galore or demo")
