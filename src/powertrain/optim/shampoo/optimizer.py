"""``DistributedShampoo``: block-diagonal Shampoo with grafting, spreading its blocks across data-parallel ranks.

Per step, for every parameter with a gradient ``g`` (averaged across ranks already: DDP, or a compressor), and
for each of its blocks (``shampoo.blocks``) that this rank owns:

1. Optional gradient filtering: ``f <- beta1 f + (1 - beta1) g`` (bias-corrected), used as the direction's
   input; the statistics always see the raw ``g``.
2. Factor statistics (:func:`.preconditioner.update_factors`), the grafting statistics, and every
   ``precondition_frequency`` steps (from ``start_preconditioning_step``) the inverse roots. The block's
   direction is the preconditioned ``f`` rescaled to the norm of the grafting method's direction (``adam``,
   ``rmsprop``, ``adagrad``; ``none``: unscaled), or the grafting direction alone before the first roots,
   after ``max_root_failures`` failed root computations, or for good for a vector with ``precondition_1d=False``.
   Failed computations and the steps they send to the graft are counted (:meth:`DistributedShampoo.root_stats`).
3. With a process group of ``W > 1`` ranks the blocks are spread over the ranks and their directions shared by
   one all-gather (:mod:`.distributor`). With fp32 communication the result is bitwise the single-process
   optimizer's.
4. Decoupled weight decay, momentum (optionally Nesterov) on the direction, ``p -= lr * direction``, block by
   block on views of the parameter.

Every rank keeps the statistics of its own blocks only (the memory saving of the distributed version), the
filtered gradient included; ``state_dict()`` is therefore per rank and records the world size it was written
with.

``preconditioner="eigenvalue_corrected"`` replaces step 2's inverse roots by SOAP's eigenbasis and Adam-style
second moment in that basis (see :mod:`.preconditioner`).

Sharded parameters (FSDP2 ``fully_shard`` or :func:`powertrain.simple_fsdp.data_parallel`: DTensor parameters
whose gradients are reduce-scattered already) are preconditioned *per local shard*: every rank blocks its own
rows and computes their directions, with no communication (as the reference implementation's fully-sharded
distributor does). The result therefore depends on the sharding: it equals the single-process optimizer run on
the shards as separate parameters, which is what the tests check."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from powertrain._checks import check_int
from powertrain.comm import Communicator
from powertrain.ops.flat import local_tensor
from powertrain.optim.distributor import Block, Gather, Local
from powertrain.optim.shampoo import blocks as blocking
from powertrain.optim.shampoo.blocks import block_cost
from powertrain.optim.shampoo.matrix import Method, RootFailure
from powertrain.optim.shampoo.preconditioner import (
    Grafting,
    Preconditioner,
    eigenbases,
    init_factors,
    inverse_roots,
    precondition,
    rotate,
    update_factors,
)
from powertrain.optim.shampoo.stats import RootCounter, RootStats

__all__ = ["BlockState", "DistributedShampoo", "RootStats"]

_LAYOUT = 3  # of state_dict(): the version this one reads and writes


def _work(t: torch.Tensor) -> torch.dtype:
    """The dtype of the optimizer's own statistics and directions for a gradient ``t``: at least float32
    (a float64 parameter is optimised in float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _scaled(t: torch.Tensor, c: float | torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``c * t``, or written into the flat slice ``out`` (``c`` a number, or a 0-dim tensor on ``t``'s device)."""
    if out is None:
        unit = not isinstance(c, torch.Tensor) and c == 1.0
        return t if unit else t * c  # t may be state (the filtered gradient): never scaled in place
    return torch.mul(t.reshape(out.shape), c, out=out)


class BlockState(TypedDict, total=False):
    """One block's statistics, as ``state[p]["blocks"][index]`` (plain tensors: a checkpoint holds no objects)."""

    filtered: torch.Tensor  # the EMA of the gradient (betas[0] > 0)
    graft: torch.Tensor  # the grafting method's second moment
    factors: list[torch.Tensor]  # one d_i x d_i statistic per dimension
    failures: torch.Tensor  # failed root or eigenbasis computations (int64 scalar)
    roots: list[torch.Tensor]  # Shampoo: the factors' inverse roots
    bases: list[torch.Tensor]  # eigenvalue-corrected: the factors' eigenvectors
    corrected: torch.Tensor  # eigenvalue-corrected: the second moment in that basis


@dataclasses.dataclass(frozen=True)
class _Shampoo:
    """Inverse roots of the factors; the graft is the direction until the first roots."""

    bias_correction: bool
    rel_eps: float | None
    method: Method
    exponent_multiplier: float
    what = "inverse roots"
    products = 2  # mode products per step, for the balance: the factor update and the preconditioning

    def setup(self, st: BlockState, raw: torch.Tensor) -> None:
        pass

    def refresh(self, st: BlockState, eps: float, beta2: float, step: int) -> None:
        factors = st["factors"]
        if self.bias_correction and beta2 < 1.0:
            # the EMA's bias correction: it sets eps's weight against the statistics early on
            factors = [f / (1.0 - beta2**step) for f in factors]
        st["roots"] = inverse_roots(
            factors, eps=eps, rel_eps=self.rel_eps, method=self.method, exponent_multiplier=self.exponent_multiplier
        )

    def observe(self, st: BlockState, raw: torch.Tensor, beta2: float) -> None:
        pass

    def ready(self, st: BlockState, started: bool) -> bool:
        return started and "roots" in st

    def direction(
        self, st: BlockState, filtered: torch.Tensor, scale: float, eps: float, beta2: float, step: int
    ) -> tuple[torch.Tensor, float]:
        """The preconditioned filtered gradient as ``(t, c)``, direction ``= c * t``."""
        return precondition(filtered, st["roots"]), scale


@dataclasses.dataclass(frozen=True)
class _EigenvalueCorrected:
    """SOAP: Adam in the factors' eigenbasis, in the identity basis until the first eigenbasis (as the reference
    implementation and SOAP itself)."""

    what = "eigenbasis"
    products = 4  # the factor update and three rotations

    def setup(self, st: BlockState, raw: torch.Tensor) -> None:
        if "bases" not in st:
            st["bases"] = [torch.eye(f.shape[0], dtype=f.dtype, device=f.device) for f in st["factors"]]
            st["corrected"] = torch.zeros_like(raw, dtype=st["factors"][0].dtype)

    def refresh(self, st: BlockState, eps: float, beta2: float, step: int) -> None:
        st["bases"] = eigenbases(st["factors"])

    def observe(self, st: BlockState, raw: torch.Tensor, beta2: float) -> None:
        """The second moment follows the current basis every step, also before preconditioning starts."""
        r = rotate(raw, st["bases"])
        d2 = st["corrected"]
        if beta2 == 1.0:
            d2.addcmul_(r, r)
        else:
            d2.mul_(beta2).addcmul_(r, r, value=1.0 - beta2)

    def ready(self, st: BlockState, started: bool) -> bool:
        return True

    def direction(
        self, st: BlockState, filtered: torch.Tensor, scale: float, eps: float, beta2: float, step: int
    ) -> tuple[torch.Tensor, float]:
        bias = 1.0 - beta2**step if beta2 < 1.0 else 1.0
        # the eps compares with the scaled gradient's root second moment, so the filter's scale stays in
        rotated = rotate(filtered, st["bases"]).mul_(scale)
        return rotate(rotated / (st["corrected"] / bias).sqrt_().add_(eps), st["bases"], back=True), 1.0


class DistributedShampoo(torch.optim.Optimizer):
    """Shampoo with grafting, momentum and decoupled weight decay; blocks spread over ``group``'s ranks.

    Args:
        params: parameters (or groups); gradients must already be averaged across data-parallel ranks.
        lr: learning rate.
        betas: ``(beta1, beta2)``: gradient filtering (0: off) and the factor statistics' EMA (1: sum). The
            default beta2 0.95 (and ``grafting_beta2``'s) averages over the horizon of ``powertrain train``'s AdamW:
            on the default GPT it trained to a clearly lower loss than 0.999, and so it did on issue 19's
            ill-conditioned least squares and MLP under a cosine schedule (``tests/test_shampoo_convergence.py``).
        eps: Shampoo: the smallest damping added to every eigenvalue of a (bias-corrected) factor before its
            inverse root, in the factor's units: squared gradient entries summed over the other dimensions
            (``(L + delta I)^(-1/2k)``, ``delta = max(eps, rel_eps * lambda_max(L))``). It bounds the
            weight of a direction the statistics have (almost) not seen to ``delta^(-1/2k)``. Eigenvalue-corrected:
            added to the root of the corrected eigenvalues, like Adam's eps (use e.g. 1e-8 there).
        rel_eps: Shampoo: damping relative to each factor's largest eigenvalue (see ``eps``); None (the
            default): the unit round-off of the factors' dtype (float32: 1.2e-7), below which eigenvalues are
            round-off (``shampoo.matrix``); 0: eps alone (the reference implementation's rule, whose
            preconditioned direction can then be mostly round-off on a rank-deficient factor). Not used by the
            eigenvalue-corrected preconditioner.
        momentum: heavy-ball momentum on the final direction, in [0, 1) (0, the default: none).
        nesterov: Nesterov's form of that momentum (needs ``momentum`` > 0; default False).
        weight_decay: decoupled (AdamW-style) weight decay.
        max_preconditioner_dim: largest factor dimension (see ``shampoo.blocks``).
        precondition_frequency: steps between inverse-root computations.
        start_preconditioning_step: first step that uses Shampoo's direction (default: the frequency).
        grafting: step-size source: ``adam``, ``rmsprop``, ``adagrad`` or ``none``.
        grafting_beta2: the grafting method's second-moment EMA (``adagrad`` sums instead); default 0.95.
        grafting_eps: the grafting method's eps, added to the root of its second moment; default 1e-8.
        root_method: ``eigh`` (float64 retry) or ``newton`` (coupled Newton iteration).
        exponent_multiplier: scales the inverse root's exponent ``-1/(2k)`` (the reference implementation's
            option; e.g. 2 with a matrix gives ``-1/2``); must give an integer root. Shampoo preconditioner only.
        preconditioner: ``shampoo`` (inverse roots of the factors) or ``eigenvalue_corrected`` (SOAP: Adam in
            the factors' eigenbasis; in the identity basis until the first eigenbasis).
        bias_correction: with ``betas[1] < 1``, divide the factors by ``1 - betas[1]^t`` before their roots (the
            reference implementation's default); grafting removes the scale, but not eps's relative weight.
        max_root_failures: failed root computations tolerated per block before it uses the graft for good.
            Failures are counted (:meth:`root_stats`) and the first one, and the first block given up, warn.
        precondition_1d: precondition vector blocks (1-D parameters such as biases and norm gains, and parameters
            whose merged shape is 1-D) with a full ``d x d`` factor, as the reference implementation does; False
            updates them by the grafting method alone (with ``adam``: Adam with the filtered gradient as its first
            moment), as SOAP does by default (their cost on the default GPT:
            docs/optimizers.md).
        group: the data-parallel process group (default: the world when initialised, else one process); not
            used with sharded (DTensor) parameters, whose shards are preconditioned locally.
        comm_dtype: dtype of the all-gathered directions (float32: bitwise the single-process result).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-12,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 10,
        start_preconditioning_step: int | None = None,
        grafting: Grafting = "adam",
        grafting_beta2: float = 0.95,
        grafting_eps: float = 1e-8,
        root_method: Method = "eigh",
        exponent_multiplier: float = 1.0,
        preconditioner: Preconditioner = "shampoo",
        bias_correction: bool = True,
        max_root_failures: int = 3,
        precondition_1d: bool = True,
        group: dist.ProcessGroup | None = None,
        comm_dtype: torch.dtype = torch.float32,
        rel_eps: float | None = None,
    ) -> None:
        checks = [
            ("lr", lr, lr > 0, "> 0"),
            ("betas[0]", betas[0], 0 <= betas[0] < 1, "in [0, 1)"),
            ("betas[1]", betas[1], 0 < betas[1] <= 1, "in (0, 1]"),
            ("eps", eps, eps > 0, "> 0"),
            ("momentum", momentum, 0 <= momentum < 1, "in [0, 1)"),
            ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
            ("grafting_beta2", grafting_beta2, 0 < grafting_beta2 <= 1, "in (0, 1]"),
            ("grafting_eps", grafting_eps, grafting_eps > 0, "> 0"),
            ("max_root_failures", max_root_failures, max_root_failures >= 0, ">= 0"),
        ]
        for name, value, ok, want in checks:
            if not ok:
                raise ValueError(f"Invalid {name}={value!r}: must be {want}")
        check_int("precondition_frequency", precondition_frequency, 1)
        check_int("max_preconditioner_dim", max_preconditioner_dim, 1)
        start = precondition_frequency if start_preconditioning_step is None else start_preconditioning_step
        check_int("start_preconditioning_step", start, 1)
        if grafting not in ("adam", "rmsprop", "adagrad", "none"):
            raise ValueError(f"Invalid grafting={grafting!r}: choose adam, rmsprop, adagrad or none")
        if root_method not in ("eigh", "newton"):
            raise ValueError(f"Invalid root_method={root_method!r}: choose eigh or newton")
        if preconditioner not in ("shampoo", "eigenvalue_corrected"):
            raise ValueError(f"Invalid preconditioner={preconditioner!r}: choose shampoo or eigenvalue_corrected")
        if not (isinstance(exponent_multiplier, int | float) and exponent_multiplier > 0):
            raise ValueError(f"Invalid exponent_multiplier={exponent_multiplier!r}: must be > 0")
        if exponent_multiplier != 1.0 and preconditioner != "shampoo":
            raise ValueError(
                f"exponent_multiplier={exponent_multiplier!r} applies to preconditioner='shampoo' only (the "
                "eigenvalue-corrected preconditioner always takes the square root of its second moment)"
            )
        if rel_eps is not None and not (isinstance(rel_eps, int | float) and 0 <= rel_eps < 1):
            raise ValueError(
                f"Invalid rel_eps={rel_eps!r}: must be in [0, 1) (a fraction of the largest eigenvalue), or "
                "None for the factors' round-off floor"
            )
        if rel_eps is not None and preconditioner != "shampoo":
            warnings.warn(
                f"rel_eps={rel_eps!r} has no effect with preconditioner={preconditioner!r} (it damps "
                "Shampoo's inverse roots; the eigenvalue-corrected preconditioner uses eps alone)",
                stacklevel=2,
            )
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0")
        if comm_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"Invalid comm_dtype={comm_dtype!r}: a floating dtype")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            grafting=grafting,
            grafting_beta2=grafting_beta2,
            grafting_eps=grafting_eps,
        )
        super().__init__(params, defaults)
        self.max_dim, self.frequency, self.start = max_preconditioner_dim, precondition_frequency, start
        self.root_method, self.max_root_failures, self.comm_dtype = root_method, max_root_failures, comm_dtype
        self.exponent_multiplier, self.preconditioner = float(exponent_multiplier), preconditioner
        self.bias_correction, self.precondition_1d = bool(bias_correction), bool(precondition_1d)
        self.rel_eps = None if rel_eps is None else float(rel_eps)
        self._kind: _Shampoo | _EigenvalueCorrected = (
            _EigenvalueCorrected()
            if preconditioner == "eigenvalue_corrected"
            else _Shampoo(self.bias_correction, self.rel_eps, root_method, self.exponent_multiplier)
        )
        self._root_counter = RootCounter(self._kind.what, max_root_failures)
        self._params = [p for g in self.param_groups for p in g["params"]]
        sharded = [isinstance(p, DTensor) for p in self._params]
        self.sharded = any(sharded)
        if self.sharded and not all(sharded):
            raise ValueError(
                "DistributedShampoo got both DTensor (sharded) and plain parameters: pass the parameters of one "
                "fully_shard / data_parallel model, or of a replicated one, not a mix"
            )
        if self.sharded and group is not None:
            raise ValueError(
                "group= was given, but the parameters are sharded DTensors: each rank preconditions its own shard "
                "without communication, so leave group=None"
            )
        # rank and world of the group that shares the work (the world size's record in state_dict); sharded
        # parameters are preconditioned locally
        self.comm = Communicator(group)
        self.world, self.rank = self.comm.world_size, self.comm.rank
        costs = []
        for i, p in enumerate(self._params):
            local = local_tensor(p)
            if local.numel() == 0:
                continue  # an FSDP2 shard with no rows on this rank
            for b, blk in enumerate(blocking.split(torch.empty(local.shape, device="meta"), self.max_dim)):
                shape = tuple(blk.shape)
                cost = block_cost(shape, self._preconditioned(shape), self._kind.products, self.frequency)
                costs.append((i, b, shape, cost))
        self._dist = Local(costs) if self.sharded or self.world == 1 else Gather(costs, self.comm, comm_dtype)
        self.steps = 0

    @property
    def blocks(self) -> list[Block]:
        """Every block of every parameter, with the rank that computes its direction."""
        return self._dist.blocks

    def _preconditioned(self, shape: tuple[int, ...]) -> bool:
        """Whether a block of this shape is preconditioned (else its direction is the graft's alone)."""
        return len(shape) > 1 or self.precondition_1d

    # -- per-block direction -------------------------------------------------------------------------------
    #
    # Scalar factors are kept out of the tensors where the result does not need them: the grafted direction is
    # Shampoo's rescaled to the graft's norm, so neither the filtered gradient's bias correction nor Adam's
    # enters a tensor pass unless the graft itself is the direction (each pass over a block costs about as much
    # as the arithmetic it carries on a CPU, where these steps are memory-bound).

    def _graft(
        self, st: BlockState, g: torch.Tensor, numer: torch.Tensor, scale: float, group: dict[str, Any], step: int
    ) -> tuple[torch.Tensor, float]:
        """The grafting direction as ``(t, c)`` with direction ``= c * t``, given the filtered gradient as
        ``scale * numer``: ``numer`` over the root of the raw gradient's second moment (plus eps)."""
        grafting, eps = group["grafting"], group["grafting_eps"]
        if grafting == "none":
            return numer, scale
        if "graft" not in st:
            st["graft"] = torch.zeros_like(g, dtype=_work(g))
        v = st["graft"]
        g32 = g.to(v.dtype)
        if grafting == "adagrad":
            v.addcmul_(g32, g32)
        else:
            beta2 = group["grafting_beta2"]
            v.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        # Adam: sqrt(v / c) + eps = (sqrt(v) + eps sqrt(c)) / sqrt(c), so the bias correction c is a scalar
        root_corr = math.sqrt(1 - group["grafting_beta2"] ** step) if grafting == "adam" else 1.0
        denom = v.sqrt().add_(eps * root_corr)
        return torch.div(numer.to(v.dtype), denom, out=denom), scale * root_corr

    def _direction(
        self, blk: Block, raw: torch.Tensor, group: dict[str, Any], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This block's direction, written into ``out`` (a flat slice of the all-gather's buffer) when given."""
        st: BlockState = self.state[self._params[blk.param]].setdefault("blocks", {}).setdefault(blk.index, {})
        step, kind = self.steps, self._kind
        preconditioned = self._preconditioned(blk.shape)
        if preconditioned and "factors" not in st:
            st["factors"] = init_factors(raw)
            st["failures"] = torch.zeros((), dtype=torch.int64)
        beta1, beta2 = group["betas"]
        filtered, scale = self._filter(st, raw, beta1, step)  # the filtered gradient is scale * filtered
        graft, graft_scale = self._graft(st, raw, filtered, scale, group, step)
        if not preconditioned:
            return _scaled(graft, graft_scale, out)
        update_factors(st["factors"], raw, beta2)
        kind.setup(st, raw)
        failures = self._refresh(st, blk, group, step)
        kind.observe(st, raw, beta2)
        if failures > self.max_root_failures or not kind.ready(st, step >= self.start):
            if failures > 0:  # before the first roots the graft is the plan; after a failure it is a fallback
                self._root_counter.graft_step()
            return _scaled(graft, graft_scale, out)
        direction, scale = kind.direction(st, filtered, scale, group["eps"], beta2, step)
        direction = direction.to(_work(raw))
        if group["grafting"] == "none":
            return _scaled(direction, scale, out)
        norm = direction.norm()
        # the graft's scale stays a device tensor: reading it on the host would make every step wait (CUDA)
        return _scaled(direction, torch.where(norm > 0, graft.norm() * graft_scale / norm, 0.0), out)

    @staticmethod
    def _filter(st: BlockState, raw: torch.Tensor, beta1: float, step: int) -> tuple[torch.Tensor, float]:
        """The filtered gradient as ``(t, c)``, filtered ``= c * t`` (the EMA's bias correction kept out of ``t``);
        the raw gradient itself when ``beta1`` is 0."""
        if beta1 == 0:
            return raw, 1.0
        if "filtered" not in st:
            st["filtered"] = torch.zeros_like(raw, dtype=_work(raw))
        filtered = st["filtered"]
        filtered.mul_(beta1).add_(raw.to(filtered.dtype), alpha=1 - beta1)
        return filtered, 1.0 / (1 - beta1**step)

    def _refresh(self, st: BlockState, blk: Block, group: dict[str, Any], step: int) -> int:
        """Every ``precondition_frequency`` steps from the start, recompute the block's roots or eigenbasis unless
        it has failed too often; counts failures. Returns the block's failures so far."""
        failures = int(st["failures"])
        if step < self.start or (step - self.start) % self.frequency or failures > self.max_root_failures:
            return failures
        try:
            self._kind.refresh(st, group["eps"], group["betas"][1], step)
        except RootFailure as e:
            st["failures"] += 1
            failures += 1
            where = f"block {blk.index} {blk.shape} of parameter {blk.param} (rank {self.rank})"
            self._root_counter.failed(where, e, failures)
        else:
            self._root_counter.computed()
        return failures

    def root_stats(self) -> RootStats:
        """This rank's counts of root computations, failures and fallbacks to the graft (``RootStats``: counters).
        No communication: under data parallelism sum them over the ranks for the run's totals."""
        return self._root_counter.stats()

    # -- checkpoints ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state (this rank's blocks), with the step counter and the world size it belongs to."""
        out = super().state_dict()
        out["shampoo"] = {
            "steps": self.steps,
            "world": self.world,
            "rank": self.rank,
            "layout": _LAYOUT,
            "owned": self._owned(),
            "root_stats": self._root_counter.state_dict(),
        }
        return out

    def _owned(self) -> list[list[int]]:
        """``[param, block]`` of every block this rank keeps statistics for."""
        return [[b.param, b.index] for b in self._dist.owned(self.blocks)]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's :meth:`state_dict`. ValueError, before any state is replaced, for a state of another
        layout version, rank or world size, whose blocks, factors or tensors' shapes differ from this rank's (other
        parameters or blocking options), or whose counters are not counts; torch's own loader checks the groups
        after that."""
        meta = state_dict.get("shampoo")
        if meta is None:
            raise ValueError("Not a DistributedShampoo state dict (no 'shampoo' entry)")
        if meta.get("layout", 1) != _LAYOUT:
            raise ValueError(
                f"This DistributedShampoo state has layout {meta.get('layout', 1)}, this version reads layout "
                f"{_LAYOUT} (blocks are assigned to ranks by their time per step, and each rank records its own): "
                "it cannot resume it bitwise; restart the optimizer state or resume with the powertrain version "
                "that wrote it"
            )
        if (meta["world"], meta["rank"]) != (self.world, self.rank):
            raise ValueError(
                f"This state was written by rank {meta['rank']} of {meta['world']}, this is rank {self.rank} of "
                f"{self.world}: each rank keeps only its own blocks' statistics, so resume with the same world size"
            )
        if meta["owned"] != self._owned():
            raise ValueError(
                f"This state holds the statistics of other blocks than this rank owns ({len(meta['owned'])} blocks "
                f"against {len(self._owned())}): the parameters or the options that set the blocks and their "
                "assignment (max_preconditioner_dim, precondition_1d, preconditioner, precondition_frequency) "
                "differ from the run that wrote it; resume with the same ones"
            )
        steps = meta.get("steps")
        if type(steps) is not int or steps < 0:
            raise ValueError(f"This DistributedShampoo state's step count is {steps!r:.40}, expected an int >= 0")
        self._check_factors(state_dict)
        self._check_blocks(state_dict)
        root = meta.get("root_stats")  # absent from states written before the counters
        RootCounter.check(root)
        state_dict = {k: v for k, v in state_dict.items() if k != "shampoo"}
        for group in state_dict.get("param_groups", []):  # the options' names before they followed torch's (eps)
            for old, new in (("epsilon", "eps"), ("grafting_epsilon", "grafting_eps")):
                if old in group:
                    group[new] = group.pop(old)
        super().load_state_dict(state_dict)
        self.steps = steps
        self._root_counter.load_state_dict(root)

    def _check_factors(self, state_dict: dict[str, Any]) -> None:
        """Refuse factors that do not fit this rank's blocks, before any state is replaced: e.g. a small matrix's
        single full-matrix factor, written by a version that merged small matrices into vectors (``shampoo.blocks``).
        ``state_dict()`` numbers parameters in the order of :attr:`_params`."""
        state = state_dict.get("state", {})
        for blk in self._dist.owned(self.blocks):
            # a malformed entry is named by _check_blocks, after this: here only well-formed factors are compared
            entry = state.get(blk.param, {}) if isinstance(state, dict) else {}
            blocks = entry.get("blocks", {}) if isinstance(entry, dict) else {}
            st = blocks.get(blk.index, {}) if isinstance(blocks, dict) else {}
            factors = st.get("factors", []) if isinstance(st, dict) else []
            if not (isinstance(factors, list) and all(isinstance(f, torch.Tensor) for f in factors)):
                continue
            shapes = [tuple(f.shape) for f in factors]
            if shapes and shapes != [(d, d) for d in blk.shape]:
                raise ValueError(
                    f"This state's factors for block {blk.index} of parameter {blk.param} have shapes {shapes}, but "
                    f"the block is {blk.shape} here: the state was written for other parameters, or by a powertrain "
                    "version that merged small matrices into one vector (a matrix now keeps one factor per side); "
                    "restart the optimizer state, or resume with the version that wrote it"
                )

    def _check_blocks(self, state_dict: dict[str, Any]) -> None:
        """Refuse, before any state is replaced, per-block state this rank would not write: an entry for a block it
        does not own, a key a block does not keep, a tensor of another shape than the block's (the moments and the
        eigenvalue-corrected second moment: the block's; factors, roots and bases: d x d per dimension; failures: a
        scalar), or factors without their failure count. torch's loader takes any of them, and a step failed later."""
        state = state_dict.get("state", {})
        if not isinstance(state, dict):
            raise ValueError(f"This DistributedShampoo state's 'state' is a {type(state).__name__}, not a dict")
        owned = {(b.param, b.index): b for b in self._dist.owned(self.blocks)}
        per_dim, whole = ("factors", "roots", "bases"), ("filtered", "graft", "corrected")
        for param, entry in state.items():
            if not (
                isinstance(entry, dict)
                and set(entry) <= {"blocks", "momentum"}
                and isinstance(entry.get("blocks", {}), dict)
                and type(param) is int
                and 0 <= param < len(self._params)
            ):
                raise ValueError(
                    f"This DistributedShampoo state's entry {param!r:.40} is not a parameter's blocks and momentum"
                )
            momentum, shape = entry.get("momentum"), tuple(local_tensor(self._params[param]).shape)
            if momentum is not None and not (isinstance(momentum, torch.Tensor) and tuple(momentum.shape) == shape):
                got_m = tuple(momentum.shape) if isinstance(momentum, torch.Tensor) else type(momentum).__name__
                raise ValueError(
                    f"This DistributedShampoo state's momentum of parameter {param} is {got_m}, the "
                    f"parameter is {shape} here"
                )
            blocks = entry.get("blocks", {})
            for index, st in blocks.items():
                blk = owned.get((param, index))
                if blk is None or not isinstance(st, dict):
                    raise ValueError(
                        f"This DistributedShampoo state holds block {index!r:.40} of parameter "
                        f"{param!r:.40}, which this rank does not own; resume with the same "
                        "settings"
                    )
                for name, value in st.items():
                    if name in whole:
                        want: list[tuple[int, ...]] | tuple[int, ...] = tuple(blk.shape)
                        got: Any = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    elif name in per_dim:
                        want = [(d, d) for d in blk.shape]
                        got = (
                            [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in value]
                            if isinstance(value, list)
                            else type(value).__name__
                        )
                    elif name == "failures":
                        want, got = (), tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    else:
                        raise ValueError(
                            f"This DistributedShampoo state's block {index} of parameter {param} holds "
                            f"{name!r:.40}, which no block keeps"
                        )
                    if got != want:
                        raise ValueError(
                            f"This DistributedShampoo state's {name} of block {index} of parameter "
                            f"{param} is {got!s:.80}, the block needs {want!s:.80}"
                        )
                if ("factors" in st) != ("failures" in st):
                    raise ValueError(
                        f"This DistributedShampoo state's block {index} of parameter {param} holds "
                        "factors without their failure count, or the count without them"
                    )
                missing = sorted(self._kept_by_every_block(blk, param) - set(st)) if st else []
                if missing:  # a block that stepped keeps these from its first step: torch would restart them
                    raise ValueError(
                        f"This DistributedShampoo state's block {index} of parameter {param} lacks "
                        f"{missing}, which every block of it keeps from its first step"
                    )

    def _kept_by_every_block(self, blk: Block, param: int) -> set[str]:
        """What a block's state holds from its first step on, whatever the step (roots, bases and the corrected
        second moment come later): the filtered gradient (beta1 > 0), the graft (grafting), the factors and their
        failure count (a preconditioned block)."""
        p = self._params[param]
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        kept = {"filtered"} if group["betas"][0] > 0 else set()
        kept |= {"graft"} if group["grafting"] != "none" else set()
        return kept | ({"factors", "failures"} if self._preconditioned(blk.shape) else set())

    # -- step ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step: this rank filters and preconditions the blocks it owns, the ranks all-gather the directions (a
        collective under data parallelism: every rank of ``group`` calls it), then every parameter with a gradient
        gets weight decay, momentum and ``p -= lr * direction``. Returns ``closure()``'s loss when a closure is
        given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        grads: dict[int, torch.Tensor] = {}
        for i, p in enumerate(self._params):
            if p.grad is None or local_tensor(p).numel() == 0:
                continue
            g = local_tensor(p.grad)
            # FSDP2 gradient shards are views at arbitrary offsets of one flat buffer, and vectorised kernels
            # round differently on differently aligned memory: a fresh copy makes a shard's result bitwise the
            # single-process optimizer's on the same rows
            grads[i] = g.clone() if self.sharded else g.contiguous()
        # Which blocks have gradients is the same on every rank (gradients are averaged). Only this rank's blocks
        # are filtered and preconditioned, their directions written into the slots the distributor gives.
        active = [b for b in self.blocks if b.param in grads]
        owned = self._dist.owned(active)
        slots = self._dist.slots(active, self._params[0].device)
        split: dict[int, list[torch.Tensor]] = {}
        mine: list[torch.Tensor] = []
        for blk, out in zip(owned, slots, strict=True):
            if blk.param not in split:
                split[blk.param] = blocking.split(grads[blk.param], self.max_dim)
            grp = group_of[id(self._params[blk.param])]
            mine.append(self._direction(blk, split[blk.param][blk.index], grp, out))
        # weight decay, momentum and p -= lr * direction, block by block on views of the parameters (no
        # reassembled copy of a direction), as each block's direction becomes available here
        targets: dict[int, _Target] = {}
        for blk, d in self._dist.exchange(active, mine):
            if blk.param not in targets:
                targets[blk.param] = _Target(self, self._params[blk.param], group_of[id(self._params[blk.param])])
            targets[blk.param].add(blk.index, d)
        for t in targets.values():
            t.finish()
        return loss


class _Target:
    """One parameter being updated block by block: decayed on creation, then ``add`` per block direction."""

    def __init__(self, opt: DistributedShampoo, p: torch.Tensor, grp: dict[str, Any]) -> None:
        self.w = local_tensor(p)
        self.grp = grp
        # split's blocks must be views to write through: a non-contiguous parameter is updated in a copy
        self.target = self.w if self.w.is_contiguous() else self.w.contiguous()
        self.views = blocking.split(self.target, opt.max_dim)
        self.bufs: list[torch.Tensor] | None = None
        if grp["momentum"] > 0:
            st = opt.state[p]
            if "momentum" not in st:
                st["momentum"] = torch.zeros(self.w.shape, dtype=self.w.dtype, device=self.w.device)
            self.bufs = blocking.split(st["momentum"], opt.max_dim)
        if grp["weight_decay"] > 0:
            self.target.mul_(1 - grp["lr"] * grp["weight_decay"])

    def add(self, index: int, d: torch.Tensor) -> None:
        grp, view = self.grp, self.views[index]
        d = d.view(view.shape).to(self.w.dtype)
        if self.bufs is not None:
            buf = self.bufs[index]
            buf.mul_(grp["momentum"]).add_(d)
            d = d.add(buf, alpha=grp["momentum"]) if grp["nesterov"] else buf
        view.add_(d, alpha=-grp["lr"])

    def finish(self) -> None:
        if self.target is not self.w:
            self.w.copy_(self.target)
