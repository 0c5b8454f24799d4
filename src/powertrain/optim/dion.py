"""``Dion``: a low-rank orthonormalized update with error feedback on the momentum, whose data-parallel messages are
``(m + n) r`` numbers per ``m x n`` matrix instead of ``m n`` (Ahn et al., "Dion: Distributed Orthonormalized
Updates", arXiv 2504.05295; reference code: github.com/microsoft/dion).

Dion is PowerSGD applied to the momentum, with an orthonormalized update: each rank keeps its own momentum ``M``
(its local gradients added, what the shared low-rank factors left out kept in it), and only the factors cross the
network. Per step, for every matrix (a ``"dion"`` group's parameter, viewed tall: ``B`` below has at least as many
rows as columns, a wide matrix is transposed), with ``G`` this rank's **local** gradient:

1. ``B = M + G``;
2. ``P = mean over ranks of B Q`` (the first all-reduce), orthonormalized (QR: :func:`~powertrain.ops.lowrank.
   orthonormalize`); ``Q`` is the last step's right factor (warm start: one power iteration per step);
3. ``R = mean over ranks of B^T P`` (the second all-reduce);
4. error feedback: ``M = B - (1 - mu) P R^T``: the part of ``B`` the shared factors carry leaves the momentum at
   rate ``1 - mu``, the rest stays until a later step sends it;
5. ``Q = R / (||R's columns|| + eps)``; the update ``W <- W (1 - lr wd) - lr sqrt(fan_out / fan_in) P Q^T``.

Because every map is linear, the mean over ranks of ``M`` evolves exactly as single-process Dion's momentum on the
averaged gradients, and ``P``, ``R``, ``Q`` and the update are the same on every rank; the ranks' own ``M`` differ
(each holds its own residual), so the state is per rank (:meth:`state_dict` is this rank's; resume each rank from its
own, as ``powertrain train`` does).

On row-sharded matrices (FSDP2 or SimpleFSDP ``fully_shard``: DTensor ``Shard(0)`` on a 1-D mesh), whose gradients
arrive averaged and whose rows the ranks hold apart, Dion runs on ``W^T``, as microsoft/dion's FSDP path does: the
products contract over the rows each rank holds, so ``P = sum over ranks of B_rank^T Q_rank`` is one all-reduce of
``n x r``, ``R = B P`` and the update ``Q P^T`` are this rank's rows, and the column norms of ``R`` one more
all-reduce of ``r`` numbers: no matrix is gathered. (For a tall matrix that is the other orientation than the
replicated path takes, so the two are not the same iterates there.) Each rank keeps its rows of ``M`` and ``Q``.

The other parameters (``"adamw"`` groups: embeddings, the head, norms, biases by
:func:`~powertrain.optim.matrices.default_rule`) are stepped by torch's AdamW on their gradients averaged exactly,
sent with the second all-reduce: Dion owns the step's whole data-parallel communication, two all-reduces, so the
gradients must not be averaged before it (under DDP: :func:`powertrain.ddp.local_gradients`). Both collectives run
as one collective program (:mod:`powertrain.compress.base`): a non-finite gradient on any rank makes every rank raise
:class:`~powertrain.compress.NonFiniteGradientError` before anything changes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from powertrain.comm import Communicator
from powertrain.compress.base import NonFiniteGradientError, Program, ReduceRequest, guard_nonfinite, run_program
from powertrain.ops.finite import finite_flag
from powertrain.ops.flat import flat_views, local_tensor, pack
from powertrain.ops.lowrank import orthonormalize
from powertrain.optim.distributor import shard_ranges
from powertrain.optim.matrices import MatrixOptimizer, Rule, default_rule, row_sharded, step_adamw

__all__ = ["Dion", "dion_rank"]


def dion_rank(shape: tuple[int, int], fraction: float) -> int:
    """The rank of a matrix of ``shape``: ``ceil(fraction x its smaller side)``, at least 1."""
    return max(1, min(math.ceil(fraction * min(shape)), *shape))


@dataclasses.dataclass
class _Batch:
    """Matrices of one step that share their tall shape and rank: one batched computation."""

    params: list[torch.Tensor]
    groups: list[dict[str, Any]]
    wide: bool  # stored transposed: the algorithm runs on B^T
    b_kmn: torch.Tensor  # momentum + gradient, tall
    q_knr: torch.Tensor
    p_kmr: torch.Tensor | None = None
    r_knr: torch.Tensor | None = None


class Dion(MatrixOptimizer):
    """Dion on the hidden matrices, AdamW on every other parameter (see the module for the algorithm).

    Args:
        params: ``model.named_parameters()``: split by ``rule`` into a ``"dion"`` group and an ``"adamw"`` group; or
            parameter groups (dicts), each with ``"algorithm": "dion"`` or ``"adamw"`` and any of the options below.
        lr: the Dion groups' learning rate, scaled per matrix by ``sqrt(fan_out / fan_in)``; the command's default
            (measured on its GPT, docs/optimizers.md; microsoft/dion's is 0.01, its defaults from here to ``eps``).
        mu: the momentum's decay: what the factors carry leaves it at rate ``1 - mu``.
        weight_decay: decoupled weight decay, ``W <- W (1 - lr wd)``.
        rank_fraction: each matrix's rank as a fraction of its smaller side (rounded up; 1: full rank, no saving).
        eps: added to the right factor's column norms.
        adamw_lr: the AdamW groups' learning rate.
        adamw_betas: their ``(beta1, beta2)``.
        adamw_eps: their ``eps``.
        adamw_weight_decay: their decoupled weight decay.
        rule: ``(name, parameter) -> bool``, whether Dion takes a parameter of ``named_parameters()``.
        group: the data-parallel process group (default: the world when initialised; alone: no communication).
        seed: of the right factors' random start (the same on every rank, without communication).
    """

    algorithm = "dion"
    fixed_options = frozenset({"rank_fraction", "eps"})

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        mu: float = 0.95,
        weight_decay: float = 0.01,
        rank_fraction: float = 1.0,
        eps: float = 1e-8,
        *,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        rule: Rule = default_rule,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
    ) -> None:
        dion = {"lr": lr, "mu": mu, "weight_decay": weight_decay, "rank_fraction": rank_fraction, "eps": eps}
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"Invalid seed={seed!r}: must be an integer in [0, 2**63)")
        super().__init__(
            params, dion, (adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay), rule, _check_dion_options
        )
        self._generator = torch.Generator().manual_seed(seed)
        matrices = [p for g in self.param_groups if g["algorithm"] == "dion" for p in g["params"]]
        for p in matrices:
            if p.ndim != 2:
                raise ValueError(
                    f"Dion steps matrices; {self._names.get(id(p), 'a parameter')} has shape {tuple(p.shape)}: "
                    "give it to the 'adamw' group"
                )
        # every parameter decides: a sharded model whose rule took no matrix still steps its AdamW groups on shards
        everything = [p for g in self.param_groups for p in g["params"]]
        mesh_group, self.sharded = row_sharded("Dion", everything, self._names)
        if self.sharded and group is not None:
            raise ValueError("group= was given, but the matrices are sharded DTensors: their mesh's group is used")
        self.comm = Communicator(mesh_group if self.sharded else group)
        # every matrix's state now, in order: each right factor's random start is then the same whichever matrices
        # step first, and a checkpoint taken before a matrix had a gradient resumes it as the run would have gone on
        for g in self.param_groups:
            if g["algorithm"] == "dion":
                for p in g["params"]:
                    self._state_of(p, g)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, keeping each matrix's momentum and right factor in the dtype Dion keeps them in (at least
        float32; torch casts every state tensor to its parameter's dtype, which for a bfloat16 matrix would lose the
        residual the momentum carries)."""
        super().load_state_dict(state_dict)  # checked: every key names a parameter
        params = self._saved_keys(state_dict)
        for index, st in state_dict["state"].items():
            p = params[index]
            for key in ("momentum", "Q"):
                if isinstance(st.get(key), torch.Tensor) and key in self.state[p]:
                    self.state[p][key] = st[key].to(local_tensor(p).device, _state_dtype(p), copy=True)

    @property
    def communicates(self) -> bool:
        """Whether a step sends anything (it does on more than one rank: the factors)."""
        return self.comm.world_size > 1

    def rank_of(self, p: torch.Tensor) -> int:
        """The rank Dion uses for matrix ``p`` (a ``"dion"`` group's)."""
        for g in self.param_groups:
            if g["algorithm"] == "dion" and any(q is p for q in g["params"]):
                return dion_rank(tuple(p.shape), g["rank_fraction"])  # type: ignore[arg-type]
        raise ValueError("not a parameter of this Dion's 'dion' groups")

    def state_shapes(self, p: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The shape of each of ``p``'s state tensors (a ``"dion"`` matrix: the momentum's and ``Q``'s; AdamW's
        moments are the parameter's, its step a scalar): what a loaded state is checked against."""
        local = tuple(local_tensor(p).shape)
        if p.ndim == 2 and any(q is p for g in self.param_groups if g["algorithm"] == "dion" for q in g["params"]):
            return {"momentum": local, "Q": (local[0] if self.sharded else min(p.shape), self.rank_of(p))}
        return super().state_shapes(p)

    def _state_of(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """``p``'s state: the momentum (``p``'s shape, this rank's own; a sharded matrix's rows of it) and the right
        factor ``Q`` (``n x r`` for the tall view ``m x n``, the same on every rank; a sharded matrix's: this rank's
        rows of ``rows x r``)."""
        st = self.state[p]
        if not st:
            r = dion_rank(tuple(p.shape), group["rank_fraction"])  # type: ignore[arg-type]
            dtype = _state_dtype(p)
            local = local_tensor(p)
            st["momentum"] = torch.zeros(local.shape, dtype=dtype, device=local.device)
            if self.sharded:  # Q of W^T's view: a row per row of W, this rank's rows of one draw
                lo, hi = shard_ranges(p.shape[0], self.comm.world_size)[self.comm.rank]
                st["Q"] = torch.randn(p.shape[0], r, generator=self._generator)[lo:hi].to(local.device, dtype)
            else:
                st["Q"] = torch.randn(min(p.shape), r, generator=self._generator).to(p.device, dtype)
        return st

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of every parameter with a gradient: every rank of the group calls it, with gradients for the same
        parameters (its own, not averaged)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_sparse()
        if self.sharded:
            self._step_sharded()
            return loss
        # one batch per tall shape, rank, orientation, dtype and (mu, eps): its arithmetic takes Python scalars (a
        # tensor made from a list of the groups' values would be a host-to-device copy per step on CUDA)
        keys: dict[tuple[Any, ...], list[tuple[torch.Tensor, dict[str, Any]]]] = {}
        exact: list[torch.Tensor] = []
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if g["algorithm"] == "adamw":
                    exact.append(p)
                    continue
                st = self._state_of(p, g)
                wide = p.shape[0] < p.shape[1]
                key = (max(p.shape), min(p.shape), st["Q"].shape[1], wide, st["momentum"].dtype, g["mu"], g["eps"])
                keys.setdefault(key, []).append((p, g))
        # one dtype for the step's arithmetic and messages: float32, or float64 if any parameter is (a buffer of the
        # first batch's dtype refused the others, and rounded a float64 gradient averaged beside float32 ones)
        stepped = [p for items in keys.values() for p, _ in items] + exact
        dtype = functools.reduce(torch.promote_types, [_state_dtype(p) for p in stepped], torch.float32)
        device = stepped[0].device if stepped else torch.device("cpu")
        batches = []
        for (_, _, _, wide, *_), items in keys.items():
            ms = [self.state[p]["momentum"].to(dtype) + p.grad for p, _ in items]  # B = M + G
            b_kmn = torch.stack([m.T if wide else m for m in ms])
            q_knr = torch.stack([self.state[p]["Q"] for p, _ in items]).to(dtype)
            batches.append(_Batch([p for p, _ in items], [g for _, g in items], wide, b_kmn, q_knr))
        grads = pack([p.grad for p in exact], dtype, device)  # type: ignore[misc]
        local_ok = finite_flag([*(b.b_kmn for b in batches), grads])
        program = guard_nonfinite(self._program(batches, grads), local_ok=local_ok, error=self._nonfinite)
        run_program(program, self.comm)
        self._commit(batches)
        for p, avg in zip(exact, flat_views(grads, [p.shape for p in exact]), strict=True):
            p.grad.copy_(avg)  # type: ignore[union-attr]
        for g in self.param_groups:
            if g["algorithm"] == "adamw":
                step_adamw(g, self.state)
        return loss

    def _program(self, batches: list[_Batch], grads: torch.Tensor) -> Program:
        """The step's two all-reduces: the left factors (summed: only their span is used), then the right factors with
        the AdamW parameters' gradients (averaged). Nothing is committed here."""
        p_sizes = [b.b_kmn.shape[0] * b.b_kmn.shape[1] * b.q_knr.shape[2] for b in batches]
        p_buf = torch.empty(sum(p_sizes), dtype=grads.dtype, device=grads.device)
        for b, view in zip(batches, p_buf.split(p_sizes), strict=True):
            k, m, _ = b.b_kmn.shape
            torch.bmm(b.b_kmn, b.q_knr, out=view.view(k, m, -1))
        if batches:
            yield ReduceRequest(p_buf, "sum", check=False)
        r_sizes = [q.numel() for q in (b.q_knr for b in batches)]
        r_buf = torch.empty(sum(r_sizes) + grads.numel(), dtype=grads.dtype, device=grads.device)
        views = r_buf.split([*r_sizes, grads.numel()])
        for b, p_view, r_view in zip(batches, p_buf.split(p_sizes), views[:-1], strict=True):
            k, m, n = b.b_kmn.shape
            b.p_kmr = orthonormalize(p_view.view(k, m, -1))
            b.r_knr = torch.bmm(b.b_kmn.transpose(1, 2), b.p_kmr, out=r_view.view(k, n, -1))
        views[-1].copy_(grads)
        yield ReduceRequest(r_buf, "mean")
        grads.copy_(views[-1])
        return []

    def _commit(self, batches: list[_Batch]) -> None:
        """Every collective came back finite: error feedback into each momentum, the new right factors, the update."""
        for b in batches:
            assert b.p_kmr is not None and b.r_knr is not None, "the program computed both factors"
            shared_kmn = torch.bmm(b.p_kmr, b.r_knr.transpose(1, 2))  # what the factors carried
            mu, eps = b.groups[0]["mu"], b.groups[0]["eps"]  # the batch's (its key)
            residual_kmn = b.b_kmn - (1 - mu) * shared_kmn
            norms = torch.linalg.vector_norm(b.r_knr, dim=1, keepdim=True)  # k x 1 x r
            q_new = b.r_knr / (norms + eps)  # all zero where the momentum was: no update, as the equations say
            update_kmn = torch.bmm(b.p_kmr, q_new.transpose(1, 2))
            # but the next power iteration starts from the old Q there (a zero Q would stay zero for ever)
            q_kept = torch.where((norms == 0).all(dim=2, keepdim=True), b.q_knr, q_new)
            for j, (p, g) in enumerate(zip(b.params, b.groups, strict=True)):
                st = self.state[p]
                st["momentum"].copy_(residual_kmn[j].T if b.wide else residual_kmn[j])
                st["Q"] = q_kept[j].to(st["Q"].dtype, copy=True)
                lr = g["lr"]
                scale = math.sqrt(p.shape[0] / p.shape[1])
                p.mul_(1 - lr * g["weight_decay"])
                p.add_((update_kmn[j].T if b.wide else update_kmn[j]).to(p.dtype), alpha=-lr * scale)

    def _step_sharded(self) -> None:
        """The step on row-sharded matrices (see the module): their gradients are averaged already, the AdamW
        groups step their local shards."""
        work = [
            (p, g) for g in self.param_groups if g["algorithm"] == "dion" for p in g["params"] if p.grad is not None
        ]
        dtype = functools.reduce(torch.promote_types, [_state_dtype(p) for p, _ in work], torch.float32)
        bs = [(self.state[p]["momentum"].to(dtype) + local_tensor(p.grad)) for p, _ in work]  # this rank's rows of B^T
        # the AdamW shards' gradients too: a NaN in one rank's shard must stop every rank, as a matrix's does
        adamw = [p for g in self.param_groups if g["algorithm"] == "adamw" for p in g["params"]]
        rest = [local_tensor(p.grad) for p in adamw if p.grad is not None]
        factors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        program = self._sharded_program(work, bs, dtype, factors)
        run_program(guard_nonfinite(program, local_ok=finite_flag([*bs, *rest]), error=self._nonfinite), self.comm)
        for (p, g), b, (p_nr, r_mr, sq) in zip(work, bs, factors, strict=True):
            st = self.state[p]
            st["momentum"].copy_(b - (1 - g["mu"]) * (r_mr @ p_nr.T))
            norms = sq.sqrt()
            q_new = r_mr / (norms + g["eps"])  # zero where the momentum was: no update; the old Q starts the next
            st["Q"] = torch.where((norms == 0).all(), st["Q"], q_new.to(st["Q"].dtype))
            local, lr = local_tensor(p), g["lr"]
            local.mul_(1 - lr * g["weight_decay"])
            local.add_((q_new @ p_nr.T).to(local.dtype), alpha=-lr * math.sqrt(p.shape[0] / p.shape[1]))
        for g in self.param_groups:
            if g["algorithm"] == "adamw":
                step_adamw(g, self.state, local=True)

    def _sharded_program(
        self,
        work: list[tuple[torch.Tensor, dict[str, Any]]],
        bs: list[torch.Tensor],
        dtype: torch.dtype,
        out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> Program:
        """Two all-reduces over the mesh: every matrix's ``P`` (summed over the ranks' rows), then the column sums of
        squares of every ``R``. Puts ``(P, R's rows, R's column sums of squares)`` per matrix in ``out``."""
        qs = [self.state[p]["Q"].to(dtype) for p, _ in work]
        sizes = [b.shape[1] * q.shape[1] for b, q in zip(bs, qs, strict=True)]
        device = local_tensor(next(p for g in self.param_groups for p in g["params"])).device
        p_buf = torch.empty(sum(sizes), dtype=dtype, device=device)
        for b, q, view in zip(bs, qs, p_buf.split(sizes), strict=True):
            torch.mm(b.T, q, out=view.view(b.shape[1], q.shape[1]))
        yield ReduceRequest(p_buf, "sum", check=False)
        views = zip(bs, qs, p_buf.split(sizes), strict=True)
        ps = [orthonormalize(v.view(b.shape[1], q.shape[1])[None])[0] for b, q, v in views]
        rs = [b @ p_nr for b, p_nr in zip(bs, ps, strict=True)]
        # one more entry, so that a non-finite input on some rank always has a message to travel in
        sq_buf = torch.cat([*(r.pow(2).sum(0) for r in rs), p_buf.new_zeros(1)])
        yield ReduceRequest(sq_buf, "sum")
        out.extend(zip(ps, rs, sq_buf[:-1].split([r.shape[1] for r in rs]), strict=True))
        return []

    def _nonfinite(self) -> NonFiniteGradientError:
        """The error every rank raises, naming this rank's non-finite gradients (or momenta) if it has any."""
        bad = self._nonfinite_names("momentum")
        rank = self.comm.rank
        where = (
            f"non-finite gradient (or momentum) in {', '.join(bad[:4])} on rank {rank}"
            if bad
            else f"gradients on rank {rank} are finite: another rank's were non-finite, or a sum overflowed"
        )
        return NonFiniteGradientError(
            f"Dion: {where}; nothing was applied and the optimizer state is unchanged (skip the step, lower the "
            "learning rate, or check the loss for overflow)"
        )


def _state_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of ``p``'s momentum and right factor: at least float32 (a bfloat16 matrix's residual needs it)."""
    return torch.promote_types(p.dtype, torch.float32)


def _check_dion_options(o: dict[str, Any]) -> None:
    """ValueError in one line for a Dion option out of its range."""
    checks = [
        ("lr", o["lr"], ">= 0", lambda v: v >= 0),
        ("mu", o["mu"], "in [0, 1)", lambda v: 0 <= v < 1),
        ("weight_decay", o["weight_decay"], ">= 0", lambda v: v >= 0),
        ("rank_fraction", o["rank_fraction"], "in (0, 1]", lambda v: 0 < v <= 1),
        ("eps", o["eps"], "> 0", lambda v: v > 0),
    ]
    for name, value, want, ok in checks:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not ok(value):
            raise ValueError(f"Invalid {name}={value!r}: must be a finite number {want}")
