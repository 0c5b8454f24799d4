"""``Muon``: torch.optim.Muon on a model's hidden matrices and torch.optim.AdamW on the rest, in one optimizer, with
each matrix orthogonalized once across data-parallel ranks.

Per step, for every matrix (a parameter of a ``"muon"`` group) with a gradient ``g``, averaged across data-parallel
ranks already (DDP, FSDP2, SimpleFSDP, or a compressor):

1. momentum: ``B <- B + (1 - mu) (g - B)``; the update ``U = g + mu (B - g)`` (Nesterov) or ``B``;
2. ``O = NS(U)``: five Newton-Schulz iterations (:func:`powertrain.ops.newton_schulz.newton_schulz`) in
   ``ns_dtype`` (bfloat16 on CUDA, float32 elsewhere);
3. ``W <- W (1 - lr wd) - lr' O`` with ``lr'`` the shape-adjusted rate (``adjust_lr_fn``).

These are torch.optim.Muon's operations in its order, so one process with ``ns_dtype=torch.bfloat16`` is bitwise
torch.optim.Muon; the ``"adamw"`` groups are bitwise torch.optim.AdamW (:func:`powertrain.optim.matrices.step_adamw`).

Across ranks the Newton-Schulz work is split (:mod:`powertrain.optim.distributor`), so no matrix is orthogonalized
twice:

* replicated parameters (DDP; SimpleFSDP's ``replicate``): each matrix has an owner rank, chosen to balance
  :func:`~powertrain.ops.newton_schulz.ns_flops`; owners write their results into one all-gather (in ``ns_dtype``)
  and every rank applies every result. Momentum stays replicated (every rank updates every buffer: two elementwise
  passes), so the state is torch's and a checkpoint loads at any world size. ``split=False`` keeps every rank
  computing every matrix instead: no all-gather, for links slower than the compute it saves, and required where the
  ranks' gradients differ (the inner optimizer of local updates, :mod:`powertrain.diloco`);
* row-sharded parameters (FSDP2, SimpleFSDP's ``fully_shard``: DTensor ``Shard(0)`` on a 1-D mesh): each rank
  updates the momentum of its rows; one all-to-all brings every matrix's rows to its owner, which orthogonalizes the
  whole matrix, and a second sends each rank its rows back. The momentum is a DTensor like the parameter (DCP
  reshards it at another world size).

Either way the result equals the single-process optimizer's on the same averaged gradients, bitwise: the owner runs
the same operations on the same values and the results travel in the dtype they were computed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from powertrain._checks import check_int
from powertrain.comm import Communicator
from powertrain.compress.base import NonFiniteGradientError
from powertrain.ops.finite import finite_flag, read_flag
from powertrain.ops.flat import local_tensor
from powertrain.ops.lowrank import matrix_shape
from powertrain.ops.newton_schulz import NS_COEFFICIENTS, AdjustLR, adjusted_lr, newton_schulz, ns_flops
from powertrain.ops.newton_schulz import ns_dtype as default_ns_dtype
from powertrain.optim.distributor import Block, Gather, Local, Shards
from powertrain.optim.matrices import MatrixOptimizer, Rule, default_rule, row_sharded, step_adamw

__all__ = ["Muon"]

#: Per matrix and step, besides the iteration: momentum, update, decay and the elementwise apply (about 8 passes),
#: in multiply-adds; only the balance between ranks depends on it.
_PASS_COST = 8


class Muon(MatrixOptimizer):
    """Muon on the hidden matrices, AdamW on every other parameter (see the module for the algorithm).

    Args:
        params: ``model.named_parameters()``: split by ``rule`` into a ``"muon"`` group and an ``"adamw"`` group;
            or parameter groups (dicts), each with ``"algorithm": "muon"`` or ``"adamw"`` and any of the options
            below for its algorithm (``lr``, ``weight_decay``, ``eps`` are the group's algorithm's). A ``"muon"``
            parameter of more than two dimensions is orthogonalized as ``(shape[0], rest)``.
        lr: the Muon groups' learning rate (torch.optim.Muon's options and defaults from here to ``adjust_lr_fn``).
        weight_decay: decoupled weight decay, ``W <- W (1 - lr wd)``.
        momentum: ``mu`` of the momentum ``B <- B + (1 - mu) (g - B)``.
        nesterov: orthogonalize ``g + mu (B - g)`` (True) or ``B``.
        ns_coefficients: ``(a, b, c)`` of the Newton-Schulz quintic.
        eps: the smallest norm the iteration divides by.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: None or ``"original"`` scales ``lr`` by ``sqrt(max(1, rows / cols))`` per matrix,
            ``"match_rms_adamw"`` by ``0.2 sqrt(max(rows, cols))`` (AdamW's rates then carry over).
        adamw_lr: the AdamW groups' learning rate (torch.optim.AdamW's defaults for the four ``adamw_`` options).
        adamw_betas: their ``(beta1, beta2)``.
        adamw_eps: their ``eps``.
        adamw_weight_decay: their decoupled weight decay.
        rule: ``(name, parameter) -> bool``, whether Muon takes a parameter of ``named_parameters()``
            (:func:`powertrain.optim.matrices.default_rule`: 2-D and not an embedding or output layer).
        ns_dtype: the Newton-Schulz iteration's dtype (default: bfloat16 on CUDA, float32 elsewhere).
        group: the data-parallel process group that shares the work on replicated parameters (default: the world
            when initialised); must be None for sharded (DTensor) parameters, whose mesh is used.
        split: share the Newton-Schulz work over ``group``'s ranks (their gradients must be equal: averaged); False:
            every rank orthogonalizes every matrix, sending nothing (see the module). Sharded parameters need True.
    """

    algorithm = "muon"
    fixed_options = frozenset({"nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"})

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: AdjustLR | None = None,
        *,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        rule: Rule = default_rule,
        ns_dtype: torch.dtype | None = None,
        group: dist.ProcessGroup | None = None,
        split: bool = True,
    ) -> None:
        muon = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients) if isinstance(ns_coefficients, tuple | list) else ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
            raise ValueError(f"Invalid ns_dtype={ns_dtype!r}: a floating dtype (or None for the device's default)")
        if not isinstance(split, bool):
            raise ValueError(f"Invalid split={split!r}: must be True or False")
        super().__init__(
            params, muon, (adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay), rule, _check_muon_options
        )
        matrices = [p for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(matrices)}
        self._shape = [matrix_shape(p.shape) for p in matrices]
        device = matrices[0].device if matrices else torch.device("cpu")
        self.ns_dtype = ns_dtype or default_ns_dtype(device)
        self.split = split
        mesh_group, self.sharded = row_sharded("Muon", matrices, self._names)
        if self.sharded and group is not None:
            raise ValueError("group= was given, but the matrices are sharded DTensors: their mesh's group is used")
        if self.sharded and not split:
            raise ValueError(
                "split=False needs whole matrices on every rank; these are sharded (FSDP2 / SimpleFSDP): each is "
                "orthogonalized on one rank from its shards, so leave split=True"
            )
        self.comm = Communicator(mesh_group if self.sharded else group)
        costs: list[tuple[int, int, tuple[int, ...], float]] = [
            (i, 0, shape, ns_flops(*shape, ns_steps) + _PASS_COST * math.prod(shape))
            for i, shape in enumerate(self._shape)
        ]
        self._dist: Local
        if self.sharded:
            self._dist = Shards(costs, self.comm)
        elif split and self.comm.world_size > 1:
            self._dist = Gather(costs, self.comm, self.ns_dtype)
        else:
            self._dist = Local(costs)

    def state_shapes(self, p: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The shape of each of ``p``'s state tensors (a ``"muon"`` matrix: its momentum, the parameter's local
        shape; AdamW's otherwise): what a loaded state is checked against."""
        if any(q is p for g in self.param_groups if g["algorithm"] == "muon" for q in g["params"]):
            return {"momentum_buffer": tuple(local_tensor(p).shape)}
        return super().state_shapes(p)

    @property
    def communicates(self) -> bool:
        """Whether a step sends anything: the work split's all-gather or all-to-alls, on more than one rank."""
        return type(self._dist) is not Local  # Gather, Shards

    @property
    def owners(self) -> list[Block]:
        """Every matrix (``param``: its position among the Muon groups' parameters) with the rank that orthogonalizes
        it."""
        return self._dist.blocks

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of every parameter with a gradient; every rank of the group calls it, with gradients for the same
        parameters (the split work is shared by collectives)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_sparse()
        self._check_finite()
        work: list[tuple[Block, torch.Tensor, torch.Tensor, dict[str, Any]]] = []  # block, param, update, group
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                step_adamw(group, self.state)
                continue
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                grad, buf = local_tensor(p.grad), local_tensor(st["momentum_buffer"])
                buf.lerp_(grad, 1 - mu)
                update = grad.lerp(buf, mu) if group["nesterov"] else buf
                work.append((self._dist.blocks[self._index[id(p)]], p, update, group))
        if work:
            self._orthogonalize_and_apply(work)
        return loss

    def _check_finite(self) -> None:
        """Raise :class:`~powertrain.compress.NonFiniteGradientError` before anything changes when a gradient this step
        would apply holds NaN or Inf (stepped, it would make the weights and the momenta NaN). One flag read on the
        host (a synchronisation on CUDA: whether to raise is the host's decision). Replicated gradients are the same on
        every rank (averaged), so every rank decides alike; row shards differ, so their flags are combined first, and
        every rank of the mesh raises together."""
        grads = [local_tensor(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]
        ok = finite_flag(grads) if grads else True
        if isinstance(self._dist, Shards):  # every rank of the mesh takes part, with gradients or without
            device = next(p.device for g in self.param_groups for p in g["params"])
            flag = torch.as_tensor(ok, dtype=torch.float32, device=device).reshape(1)
            self.comm.all_reduce_(flag, "sum")  # every rank's 1 when all are finite
            ok = flag == self.comm.world_size
        if read_flag(ok):
            return
        bad = self._nonfinite_names()
        where = f"this rank's {', '.join(bad)}" if bad else "another rank's shard"
        raise NonFiniteGradientError(
            f"Muon: non-finite gradient ({where}); nothing was applied: lower the learning rate or skip the step"
        )

    def _orthogonalize(self, update: torch.Tensor, shape: tuple[int, ...], group: dict[str, Any]) -> torch.Tensor:
        return newton_schulz(
            update.reshape(shape),
            coefficients=group["ns_coefficients"],
            steps=group["ns_steps"],
            eps=group["eps"],
            dtype=self.ns_dtype,
        )

    def _orthogonalize_and_apply(self, work: list[tuple[Block, torch.Tensor, torch.Tensor, dict[str, Any]]]) -> None:
        active = [b for b, _, _, _ in work]
        by_block = {b: (p, u, g) for b, p, u, g in work}
        if isinstance(self._dist, Shards):
            parts = [u.to(self.ns_dtype) for _, _, u, _ in work]  # what the owner would cast to anyway
            whole = self._dist.to_owners(active, parts)
            mine = [
                self._orthogonalize(m, b.shape, by_block[b][2])
                for b, m in zip(self._dist.owned(active), whole, strict=True)
            ]
            for b, rows in zip(active, self._dist.from_owners(active, mine), strict=True):
                _apply(by_block[b][0], rows, by_block[b][2], b.shape)
            return
        owned = self._dist.owned(active)
        slots = self._dist.slots(active, work[0][2].device)
        mine = []
        for b, slot in zip(owned, slots, strict=True):
            o = self._orthogonalize(by_block[b][1], b.shape, by_block[b][2])
            mine.append(o if slot is None else slot.view(b.shape).copy_(o))
        for b, direction in self._dist.exchange(active, mine):
            _apply(by_block[b][0], direction, by_block[b][2], b.shape)


def _apply(p: torch.Tensor, direction: torch.Tensor, group: dict[str, Any], shape: tuple[int, ...]) -> None:
    """torch.optim.Muon's last two operations, on this rank's part of ``p``: decoupled decay with the group's rate,
    then the orthogonalized direction with the shape-adjusted one (from the whole matrix's ``shape``)."""
    local = local_tensor(p)
    lr = group["lr"]
    local.mul_(1 - lr * group["weight_decay"])
    if direction.shape != local.shape:  # a flat slice of the all-gather, rows of the all-to-all, a >2-D parameter
        direction = direction.reshape(local.shape)
    local.add_(direction, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape))


def _check_muon_options(o: dict[str, Any]) -> None:
    """ValueError in one line for a Muon option out of its range."""
    checks = [
        ("lr", o["lr"], ">= 0", lambda v: v >= 0),
        ("weight_decay", o["weight_decay"], ">= 0", lambda v: v >= 0),
        ("momentum", o["momentum"], "in [0, 1)", lambda v: 0 <= v < 1),
        ("eps", o["eps"], "> 0", lambda v: v > 0),
    ]
    for name, value, want, ok in checks:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not ok(value):
            raise ValueError(f"Invalid {name}={value!r}: must be a finite number {want}")
    check_int("ns_steps", o["ns_steps"], 1)
    if o["ns_steps"] >= 100:
        raise ValueError(f"Invalid ns_steps={o['ns_steps']!r}: must be below 100 (5 is Muon's)")
    coefficients = o["ns_coefficients"]
    if (
        not isinstance(coefficients, tuple | list)
        or len(coefficients) != 3
        or not all(isinstance(c, int | float) and not isinstance(c, bool) and math.isfinite(c) for c in coefficients)
    ):
        raise ValueError(f"Invalid ns_coefficients={coefficients!r}: must be three finite numbers (a, b, c)")
    if o["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"Invalid adjust_lr_fn={o['adjust_lr_fn']!r}: choose 'original', 'match_rms_adamw' or None")
    if not isinstance(o["nesterov"], bool):
        raise ValueError(f"Invalid nesterov={o['nesterov']!r}: must be True or False")
