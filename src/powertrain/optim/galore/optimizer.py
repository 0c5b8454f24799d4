"""``GaLoreAdamW``: AdamW whose moments live in a rank-``r`` subspace of each weight's gradient (GaLore, Zhao et
al., arXiv 2403.03507), refreshed every ``update_proj_gap`` steps by randomized SVD (GaLore 2, Su et al., arXiv
2504.20437) or exact SVD, under DDP, FSDP2 and SimpleFSDP.

Per step, for every parameter with a gradient ``G`` (averaged across data-parallel ranks already) whose group
has a ``rank`` and which has at least 2 dimensions (a conv weight ``(out, in, kh, kw)`` is the matrix
``out x (in kh kw)``; anything 1-D is plain AdamW, as in the reference, which projects 2-D weights only):

1. If ``step % update_proj_gap == 0`` (``step`` counts this parameter's previous steps, so the first step
   refreshes): new bases of the top-``r`` singular subspace of ``G`` on the side ``proj_type`` picks
   (:func:`.projector.projection_side`), by ``svd="randomized"`` (seeded by ``(seed, parameter index,
   step)``: identical on every rank and after a resume) or ``"exact"`` (``torch.linalg.svd``). All
   parameters refreshed in one step share the collectives of a sharded refresh (:mod:`.distributed`).
   With ``moments_on_refresh="project"`` the moments are mapped into the new basis
   (``projector.carry_moments``); with ``"keep"`` (the reference's behaviour, default) they stay as
   they are, now read in the new basis.
2. ``R = project(G)`` (``m x r``, ``r x n`` or ``r x r``).
3. Adam on ``R`` as the reference computes it (HF ``transformers`` AdamW): ``M = b1 M + (1 - b1) R``,
   ``V = b2 V + (1 - b2) R^2``, ``N = M / (sqrt(V) + eps)``, step size ``lr sqrt(1 - b2^t) / (1 - b1^t)``
   (``correct_bias``).
4. ``W -= step_size * scale * project_back(N)``, then decoupled weight decay *after* the update:
   ``W -= lr * weight_decay * W`` (the reference's order; torch's AdamW decays first).

Sharded parameters (DTensor ``Shard(0)``: FSDP2, SimpleFSDP, HSDP) are always projected on their columns,
``G_i V_r`` with ``V_r`` replicated, so steps 2-4 are local and the moments are sharded like the weight.
A ``proj_type`` that would project rows (``left``, ``full``, ``std`` on a wide matrix, ``reverse_std`` on a
tall one) is replaced by ``right`` for such parameters, with a warning; give ``proj_type="right"`` to the
unsharded run you compare with. The refresh needs the right singular subspace of the whole gradient:
randomized SVD all-reduces ``n x k`` sketches (``k = r + oversample``) and ``k x k`` Gram matrices, ``power_iters
+ 2`` collectives for all refreshed parameters together; exact SVD all-gathers the whole gradients (``m x n``
each, every ``update_proj_gap`` steps) and every rank runs the SVD.

Memory: per projected ``m x n`` weight (right side) ``2 m r`` moment values plus ``r n`` for the projector, against
AdamW's ``2 m n`` (``r = n / 4`` on a square weight: 62.5% less). :meth:`GaLoreAdamW.state_bytes` measures it.

Differences from ``galore-torch`` 1.0 (whose math, with ``svd="exact"``, this reproduces bitwise in float32):
defaults for every GaLore key; non-2-D parameters in a ``rank`` group are plain AdamW (the reference
fails on them); conv weights are reshaped; the back-projection side is the one used to project (the
reference's ``reverse_std`` picks it from the shape and fails when ``rank >= min(m, n)``); the state is plain
tensors and numbers (the reference stores a projector object, which ``torch.load(weights_only=True)``
refuses).

GaLore 2 keeps this update rule; what it adds is the randomized SVD (the default here: Halko et al.'s
``oversample`` of 5-10 columns and 1-2 power iterations are enough for a subspace that is refreshed anyway)
and FSDP support. No 8-bit state: the blockwise absmax int8 of :mod:`powertrain.ops.quantize` cannot hold
Adam's second moment (rounding to nearest or up stops small entries from decaying, stochastic rounding sends
some to zero and ``M / eps`` explodes); bitsandbytes uses a non-linear dynamic map for it.

``state_dict()`` is per rank under FSDP (each rank's moment rows): save it per rank (e.g. through
:class:`powertrain.checkpoint.CompressorState` with DCP; DCP's own optimizer state dict would take the
moments, plain tensors of different sizes on each rank, for replicas) and resume with the same sharding.
It holds no RNG state: the sketches are derived from ``seed``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from powertrain._checks import check_int
from powertrain.comm import Communicator
from powertrain.ops.flat import local_tensor
from powertrain.optim.galore import projector as proj
from powertrain.optim.galore.distributed import RowShard, gather_rows, row_shard, sum_shards
from powertrain.optim.galore.projector import ProjType, Side, SvdMethod

__all__ = ["GaLoreAdamW", "MomentsOnRefresh", "optimizer_state_bytes"]

MomentsOnRefresh = Literal["keep", "project"]
_MOMENTS_ON_REFRESH = ("keep", "project")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor] | None = None) -> int:
    """Bytes of every tensor in ``optimizer.state`` on this rank (a DTensor counts its local shard), of all
    parameters or only of ``params``.

    Works for any ``torch.optim.Optimizer`` (e.g. ``torch.optim.AdamW`` for comparison); tensors inside lists,
    dicts and plain objects in the state (galore-torch keeps its projection in a projector object) count too.
    Tensors that share storage are counted once per tensor: GaLoreAdamW keeps none that do.
    """

    def size(v: Any) -> int:
        if isinstance(v, torch.Tensor):
            t = local_tensor(v)
            return t.numel() * t.element_size()
        if isinstance(v, dict):
            return sum(size(x) for x in v.values())
        if isinstance(v, list | tuple):
            return sum(size(x) for x in v)
        if hasattr(v, "__dict__") and not isinstance(v, type):
            return sum(size(x) for x in vars(v).values())
        return 0

    keep = None if params is None else {id(p) for p in params}
    return sum(size(st) for p, st in optimizer.state.items() if keep is None or id(p) in keep)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one parameter is optimised (fixed for the optimizer's life)."""

    index: int  # position in the optimizer's parameter list (seeds the sketches, keys the state dict)
    projected: bool
    side: Side  # meaningful when projected
    rank: int  # effective rank (<= min(m, n)) when projected
    matrix: tuple[int, int]  # this rank's local matrix view (rows, cols) when projected
    shard: RowShard | None  # rows split across ranks (FSDP2/SimpleFSDP), else None


def _check_group(group: dict[str, Any]) -> None:
    def bad(name: str, want: str) -> ValueError:
        return ValueError(f"Invalid {name}={group[name]!r}: must be {want}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not (isinstance(lr, float | int) and lr >= 0):
        raise bad("lr", ">= 0")
    if not (isinstance(betas, tuple | list) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        raise bad("betas", "two numbers in [0, 1)")
    if not eps >= 0:
        raise bad("eps", ">= 0")
    if not wd >= 0:
        raise bad("weight_decay", ">= 0")
    rank = group["rank"]
    if rank is not None and not (is_int(rank) and rank >= 1):
        raise bad("rank", "an integer >= 1, or None for plain AdamW")
    if not (is_int(group["update_proj_gap"]) and group["update_proj_gap"] >= 1):
        raise bad("update_proj_gap", "an integer >= 1")
    scale = group["scale"]
    if isinstance(scale, bool) or not (isinstance(scale, float | int) and scale > 0):
        raise bad("scale", "> 0")
    if group["proj_type"] not in proj.PROJ_TYPES:
        raise bad("proj_type", f"one of {', '.join(proj.PROJ_TYPES)}")
    if group["svd"] not in proj.SVD_METHODS:
        raise bad("svd", f"one of {', '.join(proj.SVD_METHODS)}")
    for name in ("oversample", "power_iters"):
        if not (is_int(group[name]) and group[name] >= 0):
            raise bad(name, "an integer >= 0")
    if group["moments_on_refresh"] not in _MOMENTS_ON_REFRESH:
        raise bad("moments_on_refresh", f"one of {', '.join(_MOMENTS_ON_REFRESH)}")


class GaLoreAdamW(torch.optim.Optimizer):
    """AdamW with GaLore gradient low-rank projection (see the module docstring for the algorithm).

    Every option below is also a param-group key, so groups can differ (e.g. ``rank`` only on the
    transformer blocks' weights: ``[{"params": other}, {"params": blocks, "rank": 128}]``, as with the
    reference, where groups without ``rank`` are plain AdamW).

    Args:
        params: parameters or param groups; gradients must already be averaged across data-parallel ranks.
        lr: learning rate.
        betas: Adam's ``(beta1, beta2)``.
        eps: added to ``sqrt(V)`` (the reference's default 1e-6).
        weight_decay: decoupled weight decay, applied after the update (the reference's order).
        correct_bias: Adam's bias correction, folded into the step size.
        rank: subspace rank ``r`` for parameters with >= 2 dimensions; None (default): plain AdamW for
            groups that do not set it. Capped at ``min(m, n)`` per matrix.
        update_proj_gap: steps between subspace refreshes (``T``; GaLore's 200).
        scale: factor on the projected-back update (GaLore's ``alpha``; the paper's 0.25).
        proj_type: ``std`` (default), ``reverse_std``, ``left``, ``right`` or ``full``, as the reference
            defines them (``galore.projector``). Sharded parameters always use ``right``.
        svd: ``randomized`` (default; GaLore 2) or ``exact`` (``torch.linalg.svd``: the reference's choice).
        oversample: extra sketch columns for randomized SVD (``k = r + oversample``).
        power_iters: power iterations of randomized SVD (each costs one all-reduce when sharded).
        moments_on_refresh: ``keep`` (the reference: moments stay, read in the new basis) or ``project``
            (mapped into the new basis, ``projector.carry_moments``).
        seed: seeds the randomized sketches (with the parameter's index and the step).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        correct_bias: bool = True,
        rank: int | None = None,
        update_proj_gap: int = 200,
        scale: float = 0.25,
        proj_type: ProjType = "std",
        svd: SvdMethod = "randomized",
        oversample: int = 8,
        power_iters: int = 2,
        moments_on_refresh: MomentsOnRefresh = "keep",
        seed: int = 0,
    ) -> None:
        check_int("seed", seed, 0)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            correct_bias=correct_bias,
            rank=rank,
            update_proj_gap=update_proj_gap,
            scale=scale,
            proj_type=proj_type,
            svd=svd,
            oversample=oversample,
            power_iters=power_iters,
            moments_on_refresh=moments_on_refresh,
        )
        super().__init__(params, defaults)
        self.seed = seed
        #: the world's communicator; the communicators of sharded parameters' meshes count into its ``stats``
        #: (bytes and collectives of the sharded refreshes)
        self.comm = Communicator()
        self._comms: dict[int, Communicator] = {}
        self._layouts: dict[int, _Layout] = {}
        if all(g["rank"] is None for g in self.param_groups):
            warnings.warn("GaLoreAdamW: no param group sets a rank, so this is plain AdamW", stacklevel=2)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``Optimizer.add_param_group`` (options not given take the defaults), then the group's options are
        checked as the constructor's are: ValueError for one out of range, and the group is not kept."""
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    # -- layout --------------------------------------------------------------------------------------------

    def _layout(self, p: torch.Tensor, group: dict[str, Any], index: int) -> _Layout:
        lay = self._layouts.get(id(p))
        if lay is not None:
            return lay
        shard = row_shard(p, self._comms, self.comm.stats)
        projected = group["rank"] is not None and p.dim() >= 2
        if not projected:
            lay = _Layout(index, False, "right", 0, (0, 0), shard)
        else:
            rows = p.shape[0] if shard is None else shard.rows
            cols = math.prod(p.shape[1:])
            side = proj.projection_side(p.shape[0], cols, group["proj_type"])
            if shard is not None and side != "right":
                warnings.warn(
                    f"GaLoreAdamW: parameter {index} ({p.shape[0]} x {cols}) is sharded by rows, so it is projected "
                    f"on its columns (proj_type='right') instead of {side!r} as proj_type={group['proj_type']!r} "
                    "would: the step stays local",
                    stacklevel=3,
                )
                side = "right"
            lay = _Layout(index, True, side, proj.effective_rank(group["rank"], p.shape[0], cols), (rows, cols), shard)
        self._layouts[id(p)] = lay
        return lay

    def _indexed(self) -> Iterable[tuple[int, torch.Tensor, dict[str, Any]]]:
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield i, p, group
                i += 1

    # -- refresh -------------------------------------------------------------------------------------------

    def _refresh(self, todo: list[tuple[torch.Tensor, dict[str, Any], _Layout, torch.Tensor]]) -> None:
        """New bases for ``todo`` (param, group, layout, local gradient matrix), sharing collectives."""
        new: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        # Randomized: one batch per (communicator, oversample, power_iters); None: unsharded. A left basis
        # is the right basis of G^T.
        sketches: dict[tuple[int | None, int, int], list[tuple[int, Side, proj.Sketch]]] = {}
        gathers: dict[int, list[tuple[int, _Layout, torch.Tensor]]] = {}
        comms: dict[int, Communicator] = {}
        for p, group, lay, g in todo:
            step = self.state[p]["step"]
            if group["svd"] == "exact":
                if lay.shard is None:
                    new[id(p)] = proj.exact_bases(g, lay.rank, lay.side)
                else:
                    gathers.setdefault(id(lay.shard.comm), []).append((id(p), lay, g))
                continue
            comm = None if lay.shard is None else lay.shard.comm
            key = (None if comm is None else id(comm), group["oversample"], group["power_iters"])
            if comm is not None:
                comms[id(comm)] = comm
            batch = sketches.setdefault(key, [])
            if lay.side in ("right", "full"):
                offset, total = (0, None) if lay.shard is None else (lay.shard.offset, lay.shard.total)
                seed = proj.sketch_seed(self.seed, lay.index, step, 0)
                batch.append((id(p), "right", proj.Sketch(g, lay.rank, seed, offset, total)))
            if lay.side in ("left", "full"):
                assert lay.shard is None, "sharded parameters are projected on the right"
                seed = proj.sketch_seed(self.seed, lay.index, step, 1)
                batch.append((id(p), "left", proj.Sketch(g.t(), lay.rank, seed)))
        for entries in gathers.values():
            shards = [lay.shard for _, lay, _ in entries if lay.shard is not None]
            whole = gather_rows(shards, [g for _, _, g in entries])
            for (pid, lay, _), full in zip(entries, whole, strict=True):
                new[pid] = proj.exact_bases(full, lay.rank, "right")
        for (comm_key, oversample, power_iters), batch in sketches.items():
            comm = None if comm_key is None else comms[comm_key]
            bases = proj.randomized_right_bases(
                [s for _, _, s in batch],
                oversample=oversample,
                power_iters=power_iters,
                sum_shards=(lambda ts: None) if comm is None else functools.partial(sum_shards, comm),
            )
            for (pid, which, _), b in zip(batch, bases, strict=True):
                left, right = new.get(pid, (None, None))
                new[pid] = (b.t().contiguous(), right) if which == "left" else (left, b)
        for p, group, lay, _ in todo:
            st = self.state[p]
            left, right = new[id(p)]
            if group["moments_on_refresh"] == "project" and "exp_avg" in st:
                old = (st.get("proj_left"), st.get("proj_right"))
                st["exp_avg"], st["exp_avg_sq"] = proj.carry_moments(
                    st["exp_avg"], st["exp_avg_sq"], lay.side, old, (left, right)
                )
            for name, basis in (("proj_left", left), ("proj_right", right)):
                if basis is not None:
                    st[name] = basis

    # -- step ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimisation step; returns ``closure()``'s loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for index, p, group in self._indexed():
            if p.grad is None:
                continue
            lay = self._layout(p, group, index)
            st = self.state[p]
            st.setdefault("step", 0)
            g = local_tensor(p.grad)
            if lay.projected:
                g = g.reshape(lay.matrix)
            work.append((p, group, lay, g))
        todo = [(p, group, lay, g) for p, group, lay, g in work if lay.projected and self._due(p, group)]
        self._refresh(todo)
        for p, group, lay, g in work:
            self._update(p, group, lay, g)
        return loss

    def _due(self, p: torch.Tensor, group: dict[str, Any]) -> bool:
        st = self.state[p]
        return st["step"] % group["update_proj_gap"] == 0 or ("proj_left" not in st and "proj_right" not in st)

    def _update(self, p: torch.Tensor, group: dict[str, Any], lay: _Layout, grad: torch.Tensor) -> None:
        st = self.state[p]
        low = proj.project(grad, lay.side, st.get("proj_left"), st.get("proj_right")) if lay.projected else grad
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros_like(low)
            st["exp_avg_sq"] = torch.zeros_like(low)
        exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
        beta1, beta2 = group["betas"]
        st["step"] += 1
        # The reference's operations in its order, so that exact-SVD runs match galore-torch bitwise.
        exp_avg.mul_(beta1).add_(low, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(low, low, value=1.0 - beta2)
        denom = exp_avg_sq.sqrt().add_(group["eps"])
        step_size = group["lr"]
        if group["correct_bias"]:
            step_size = step_size * math.sqrt(1.0 - beta2 ** st["step"]) / (1.0 - beta1 ** st["step"])
        norm = exp_avg / denom
        if lay.projected:
            norm = proj.project_back(norm, lay.side, st.get("proj_left"), st.get("proj_right"), group["scale"])
        w = local_tensor(p)
        w.add_(norm.view(w.shape), alpha=-step_size)
        if group["weight_decay"] > 0.0:
            w.add_(w, alpha=-group["lr"] * group["weight_decay"])

    # -- memory and checkpoints ----------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state (moments and projectors): ``optimizer_state_bytes``."""
        return optimizer_state_bytes(self)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout (state by parameter index, param groups) plus ``"galore": {"seed": ...}``; plain
        tensors, numbers and strings only. Under FSDP each rank's moments are its rows: per rank."""
        out = super().state_dict()
        out["galore"] = {"seed": self.seed}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`, keeping every tensor's dtype (torch's loader would cast them to the
        parameter's) and checking every shape against this rank's parameters."""
        meta = state_dict.get("galore")
        if meta is None:
            raise ValueError("Not a GaLoreAdamW state dict (no 'galore' entry)")
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for g in self.param_groups:
            _check_group(g)
        seed = meta.get("seed") if isinstance(meta, dict) else None
        if type(seed) is not int or seed < 0:
            raise ValueError(f"Invalid GaLoreAdamW state: its seed is {seed!r:.40}, expected an int >= 0")
        self.seed = seed
        self._layouts.clear()
        params = list(self._indexed())
        for key, saved in state_dict["state"].items():
            if type(key) is not int or not 0 <= key < len(params) or not isinstance(saved, dict):
                raise ValueError(
                    f"Invalid GaLoreAdamW state: an entry {key!r:.40} for none of its {len(params)} parameters"
                )
            index = key
            _, p, group = params[index]
            lay = self._layout(p, group, index)
            want = self._state_shapes(p, lay)
            step = saved.get("step")
            if saved and (set(saved) != {"step", *want} or type(step) is not int or step < 0):
                raise ValueError(
                    f"Invalid state for parameter {index}: it holds {sorted(map(str, saved))!s:.120} with step "
                    f"{step!r:.40}, this rank needs {sorted({'step', *want})} and a step count (an int >= 0); resume "
                    "with the same sharding (world size), rank and proj_type"
                )
            st: dict[str, Any] = {}
            for name, value in saved.items():
                if isinstance(value, torch.Tensor):
                    if tuple(value.shape) != want.get(name):
                        need = "none" if name not in want else f"shape {want[name]}"
                        raise ValueError(
                            f"Invalid state for parameter {index}: {name} has shape {tuple(value.shape)}, this rank "
                            f"needs {need}; resume with the same sharding (world size), rank and proj_type"
                        )
                    value = value.to(device=local_tensor(p).device, copy=True)
                st[name] = value
            self.state[p] = st

    def _state_shapes(self, p: torch.Tensor, lay: _Layout) -> dict[str, tuple[int, ...]]:
        if not lay.projected:
            shape = tuple(local_tensor(p).shape)
            return {"exp_avg": shape, "exp_avg_sq": shape}
        (m, n), r = lay.matrix, lay.rank
        moment = {"right": (m, r), "left": (r, n), "full": (r, r)}[lay.side]
        out: dict[str, tuple[int, ...]] = {"exp_avg": moment, "exp_avg_sq": moment}
        if lay.side in ("left", "full"):
            out["proj_left"] = (m, r)
        if lay.side in ("right", "full"):
            out["proj_right"] = (r, n)
        return out
