"""PowerSGD low-rank gradient compression with error feedback.

Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019 (arXiv 1905.13727). Reference code: github.com/epfml/powersgd.

Each gradient with at least two dimensions is viewed as a matrix ``M`` (``n x m``; conv weights as
``out x in*kh*kw``) and, when that pays off, replaced by a rank-``r`` approximation whose factors are
all-reduced instead of ``M``. What the approximation misses stays in an error buffer and is added to the
next step's gradient (error feedback), so nothing is lost, only delayed. Two variants:

``"alternating"`` (the reference implementation's, default)
    One power iteration per ``num_iters_per_step``, alternating sides across iterations and steps:

    1. orthonormalise the factor kept from last time (warm start; never re-randomised), e.g. ``P``;
    2. project: ``Q_local = M^T P``;
    3. subtract the local rank-r part from the residual: ``M <- M - P Q_local^T``;
    4. all-reduce (sum) ``Q`` (the only communication of the iteration); the approximation gains
       ``P Q_sum^T / W``.

    The next iteration starts from ``Q`` and projects the *residual*, so ``k`` iterations at rank 1 reach
    an effective rank of up to ``k``. This matches the reference bit for bit at rank >= 2 (its rank-1
    shortcut divides a whole batch of vectors by one norm, which leaves them shorter than 1 when several
    matrices share a shape, and keeps a factor that once became zero at zero for ever; Householder QR is
    used here at every rank).
``"paper"`` (Algorithm 1 of the paper; what torch's DDP hook implements)
    ``P = M Q``; all-reduce ``P``; orthonormalise ``P``; ``Q = M^T P``; all-reduce ``Q``; the
    approximation is ``P Q^T`` and the error is the local ``M`` minus it. That error is kept as ``M`` itself with
    the factors, and subtracted when the next step adds its gradient (``M' = G + M - P Q^T``): the same sum, and one
    write of the whole matrix fewer a step than writing the residual out (:mod:`powertrain.ops.lowrank_kernels`
    forms it in the pass that adds the gradient).

Either way ``mean_over_ranks(M) == approximation + mean_over_ranks(residual)``: the invariant the tests
check in float64.

Communication: all factors of one iteration go out in one flat all-reduce, all tensors not worth
compressing (biases, small or 1-D tensors) in one more. Same-shape matrices are batched: one ``bmm``
and one batched QR per shape group per iteration.

Non-finite gradients: before anything is sent, each rank checks its inputs; a rank with NaN/Inf
poisons the first buffer it sends, so every rank sees a non-finite all-reduce result and raises
:class:`~powertrain.compress.base.NonFiniteGradientError` together. A step is a transaction: factors,
counters and error buffers are only replaced once all its collectives came back finite.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import torch
import torch.distributed as dist

from powertrain._checks import check_int
from powertrain.comm import ReduceKind
from powertrain.compress.base import (
    Compressor,
    NonFiniteGradientError,
    Program,
    ReduceRequest,
    Rows,
    check_state_counts,
    check_state_tensors,
    guard_nonfinite,
)
from powertrain.ops import fused as fusion
from powertrain.ops import lowrank_kernels
from powertrain.ops.finite import bounded_flag
from powertrain.ops.flat import flat_views, pack
from powertrain.ops.lowrank import (
    add_owed,
    less_low_rank,
    low_rank,
    matrix_shape,
    orthonormalize,
    settled,
    stack_settled,
    unit_scaled,
)

__all__ = ["RECOMMENDED", "Config", "FactorDtype", "PowerSGDCompressor", "Variant", "recommended_config"]

Variant = Literal["alternating", "paper"]
_VARIANTS: tuple[Variant, ...] = ("alternating", "paper")
FactorDtype = Literal["fp32", "bf16"]
_FACTOR_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}  # None: the compressor's


@dataclasses.dataclass(frozen=True)
class Config:
    """PowerSGD settings. Field order and defaults match the reference ``powersgd.Config``."""

    #: Rank of the approximation; lower means more compression. Must be >= 1.
    rank: int
    #: Compress a matrix only if ``numel / (floats sent per step) > min_compression_rate``; >= 0.
    min_compression_rate: float = 2
    #: Power iterations per step; more means a better approximation and more communication. >= 1.
    num_iters_per_step: int = 1
    #: Plain (exact) all-reduce for this many steps first. >= 0.
    start_compressing_after_num_steps: int = 100
    #: ``"alternating"`` (the reference code's) or ``"paper"`` (Algorithm 1, P then Q all-reduced).
    variant: Variant = "alternating"
    #: Seed of the factors' initialisation; identical on every rank, so no communication is needed.
    seed: int = 0
    #: What the factors travel as: ``"fp32"`` (the compressor's own dtype: float32, float64 for float64 models)
    #: or ``"bf16"`` (half the bytes; the error buffers and all arithmetic stay in the compressor's dtype, and the
    #: rounding is part of what error feedback carries). ``"bf16"`` needs ``variant="paper"``.
    factor_dtype: FactorDtype = "fp32"

    def __post_init__(self) -> None:
        check_int("Config.rank", self.rank, 1)
        check_int("Config.num_iters_per_step", self.num_iters_per_step, 1)
        check_int("Config.start_compressing_after_num_steps", self.start_compressing_after_num_steps, 0)
        check_int("Config.seed", self.seed, 0)
        if self.seed >= 2**63:
            raise ValueError(f"Invalid Config.seed={self.seed!r}: must be below 2**63")
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate < 0:
            raise ValueError(
                f"Invalid Config.min_compression_rate={rate!r}: must be a finite number >= 0 "
                "(0 compresses every matrix)"
            )
        if self.variant not in _VARIANTS:
            raise ValueError(f"Invalid Config.variant={self.variant!r}: must be one of {_VARIANTS}")
        if self.factor_dtype not in _FACTOR_DTYPES:
            raise ValueError(
                f"Invalid Config.factor_dtype={self.factor_dtype!r}: must be one of {tuple(_FACTOR_DTYPES)}"
            )
        if self.factor_dtype != "fp32" and self.variant != "paper":
            raise ValueError(
                f"Config.factor_dtype={self.factor_dtype!r} needs variant='paper' (got {self.variant!r}): the "
                "alternating variant keeps each rank's own unrounded factor in its residual, so a rounded sum "
                "would lose the difference"
            )

    def floats_per_step(self, n: int, m: int) -> float:
        """Average number of floats sent per step for an ``n x m`` matrix."""
        r = min(self.rank, n, m)
        if self.variant == "paper":
            return self.num_iters_per_step * r * (n + m)
        return 0.5 * self.num_iters_per_step * r * (n + m)  # alternates between n*r and m*r


#: What ``make_compressor("powersgd")`` and ``powertrain train`` use for every :class:`Config` field not given:
#: the measured best within 1/8 of fp32 all-reduce's bytes on the default GPT (docs/notes/compression.md, "How
#: the defaults were chosen"): rank 32, the paper variant (its error is the gradient minus the *shared*
#: approximation), factors sent as bf16, after 5 exact steps. :class:`Config` itself keeps the reference's
#: defaults (alternating, fp32 factors, 100 exact steps): compatibility is its point.
RECOMMENDED: Mapping[str, Any] = MappingProxyType(
    {"rank": 32, "variant": "paper", "factor_dtype": "bf16", "start_compressing_after_num_steps": 5}
)


def recommended_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with every field it does not give taken from :data:`RECOMMENDED`, except that a variant other
    than the paper's keeps fp32 factors unless ``factor_dtype`` is given (bf16 factors need the paper variant)."""
    full = {**RECOMMENDED, **options}
    if "factor_dtype" not in options and full["variant"] != "paper":
        full["factor_dtype"] = "fp32"
    return full


def recommended_config(**fields: Any) -> Config:
    """:class:`Config` with the given fields and :data:`RECOMMENDED` for the rest (see :func:`recommended_options`)."""
    return Config(**recommended_options(fields))


_Collectives = Generator[ReduceRequest, None, None]


@dataclasses.dataclass
class _Batch:
    """Parameters of one call that share a matrix shape and alternation phase: one batched computation."""

    idx: list[int]  # positions in the call
    params: list[int]  # positions in the compressor
    n: int
    m: int
    rank: int
    phase: int  # compressed steps taken so far, modulo 2
    p_bnr: torch.Tensor
    q_bmr: torch.Tensor
    m_bnm: torch.Tensor  # gradient + residual; the alternating variant makes it the new residual, the paper's keeps it
    rows: tuple[int, int] | None = None  # only these rows of the approximation are wanted (FSDP shard)
    approx_bnm: torch.Tensor | None = None
    extrema: torch.Tensor | None = None  # each matrix's (min, max) of m_bnm, where a fused kernel wrote it
    first_p: torch.Tensor | None = None  # the paper variant's first P = M Q, where the kernel formed it with M


def _residual(e: torch.Tensor | None, kept: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """An error buffer as the residual: ``e - P Q^T`` where it keeps the paper variant's ``M`` and ``kept = (P, Q)``
    (a new tensor, from the factors laid out as the next call's stacks lay them out, so that it is the residual that
    call adds on the eager path, bitwise; the Triton kernel sums the product in another order; see
    :meth:`PowerSGDCompressor._kept`), ``e`` itself otherwise."""
    return e if e is None or kept is None else less_low_rank(e, settled(kept[0]), settled(kept[1]))


def _add_extrema(owed: torch.Tensor, g: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``owed <- g + e`` (``g`` rounded to ``owed``'s dtype first) and ``owed``'s (min, max): fused, one pass that reads
    ``g`` and ``e`` and writes ``owed`` (eager: three passes, and the bound's check one more)."""
    owed.copy_(g.to(owed.dtype) + e)
    return torch.stack(torch.aminmax(owed))


def _add_extrema_eager(owed: torch.Tensor, g: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    add_owed(owed, g, e)
    return torch.stack(torch.aminmax(owed))


class PowerSGDCompressor(Compressor):
    """PowerSGD as a :class:`~powertrain.compress.base.Compressor` that owns its error buffers.

    Use with an ordinary training loop::

        compressor = PowerSGDCompressor(model.named_parameters(), config=Config(rank=4))
        for batch in loader:
            optimizer.zero_grad()
            loss_fn(model(batch)).backward()
            compressor.reduce_gradients()  # p.grad <- compressed mean over ranks
            optimizer.step()

    State (factors, error buffer, step counters) is kept per parameter, so any subset of the parameters
    can be aggregated in one call (a DDP bucket, an FSDP group) and regrouping them later loses nothing;
    within a call, same-shape matrices are computed as one batch.

    Args:
        params: ``model.parameters()`` or ``model.named_parameters()`` (names appear in errors).
            Parameters that do not require grad are ignored.
        config: see :class:`~powertrain.powersgd.Config`.
        group: process group to average over; ``None`` is the default group. Works without an
            initialised process group too (world size 1: no communication).
        fuse_exact: send the exactly averaged tensors (vectors, small matrices, the warm-up) in the step's last
            factor buffer (True) or in an all-reduce of their own (False: the reference implementation's way).

    Error buffers are kept in float32 (float64 if any parameter is float64), also for bf16/fp16
    parameters, and allocated at a parameter's first compressed step.
    """

    reduce_scatter = True
    replaced_state = ("_errors", "_p", "_q")  # a commit stores views of the call's new batches
    counted_state = ("_steps",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        config: Config,
        group: dist.ProcessGroup | None = None,
        fuse_exact: bool = True,
    ) -> None:
        if not isinstance(config, Config):
            raise ValueError(f"config must be a powertrain Config, got {type(config).__name__}")
        if not isinstance(fuse_exact, bool):
            raise ValueError(f"Invalid fuse_exact={fuse_exact!r}: must be True or False")
        self.config, self.fuse_exact = config, fuse_exact
        super().__init__(params, group=group)
        # Arithmetic and error-buffer dtype: at least float32, float64 when the model is float64. Factors travel
        # in it too unless config.factor_dtype says bf16.
        self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        self._wire = _FACTOR_DTYPES[config.factor_dtype] or self.dtype  # what the factors travel as
        # (n, m, rank) of the matrix each gradient is compressed as, or None if it is sent exactly.
        self._mat: list[tuple[int, int, int] | None] = []
        for shape in self._shapes:
            mat = None
            if len(shape) >= 2 and shape.numel() > 0:
                n, m = matrix_shape(shape)
                if n * m / config.floats_per_step(n, m) > config.min_compression_rate:
                    mat = (n, m, min(config.rank, n, m))
            self._mat.append(mat)

        # Identical on every rank without communication: same seed, generated on the CPU (so also the
        # same across device types), in the reference's order: all P batches (one per matrix shape, in
        # order of first appearance), then all Q batches.
        self._generator = torch.Generator().manual_seed(config.seed)
        by_shape: dict[tuple[int, int, int], list[int]] = {}
        for i, mat in enumerate(self._mat):
            if mat is not None:
                by_shape.setdefault(mat, []).append(i)
        self._p: list[torch.Tensor | None] = [None] * len(self.params)
        self._q: list[torch.Tensor | None] = [None] * len(self.params)
        for side, dim in ((self._p, 0), (self._q, 1)):
            for mat, idx in by_shape.items():
                batch = torch.randn((len(idx), mat[dim], mat[2]), generator=self._generator)
                for j, i in enumerate(idx):
                    side[i] = batch[j].to(self.device, self.dtype, copy=True)
        # What each matrix owes (None before its first compressed step): the residual itself (alternating), or the
        # paper variant's last M, whose residual is M - P Q^T with this parameter's _p and _q (see _residual)
        self._errors: list[torch.Tensor | None] = [None] * len(self.params)
        self._steps = [0] * len(self.params)  # aggregations of each parameter (warm-up counts)

    # ------------------------------------------------------------------ introspection

    @property
    def compressed_names(self) -> list[str]:
        """Names of the parameters whose gradients are compressed (the others are sent exactly)."""
        return [name for name, mat in zip(self.names, self._mat, strict=True) if mat is not None]

    @property
    def num_steps(self) -> int:
        """Steps every parameter has been averaged in (a whole-model call is one; DDP's buckets count once all of
        them have been through)."""
        return min(self._steps, default=0)

    def _compressed_steps(self, i: int) -> int:
        """Compressed aggregations of parameter ``i`` so far (its alternation phase): every one after the exact
        warm-up, for a compressed matrix."""
        return 0 if self._mat[i] is None else max(0, self._steps[i] - self.config.start_compressing_after_num_steps)

    @property
    def num_compressed_steps(self) -> int:
        """Compressed steps (those after the exact warm-up) of the parameter furthest along; 0 during the warm-up
        and where no matrix is compressed."""
        return max((self._compressed_steps(i) for i in range(len(self.params))), default=0)

    @property
    def dense_bytes_per_step(self) -> int:
        """Bytes a plain all-reduce of all gradients in this compressor's dtype sends per step."""
        return sum(s.numel() for s in self._shapes) * self._itemsize

    @property
    def _itemsize(self) -> int:
        return self.dtype.itemsize

    def pop_residuals(self, into: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
        """The residuals (None where nothing is owed), aligned with ``self.params``, and forget them: for a caller
        that carries the residual itself (the reference API keeps it in ``p.grad`` and hands it back in the next
        step's gradient). With ``into`` (a tensor shaped as each parameter, e.g. its gradient) each is written there
        instead, zeros where nothing is owed, and those are returned: the paper variant, which keeps ``M`` and
        forms the residual, then allocates nothing for it."""
        if into is not None and [tuple(t.shape) for t in into] != [tuple(s) for s in self._shapes]:
            raise ValueError(
                f"pop_residuals(into=...) takes a tensor shaped as each parameter: got shapes "
                f"{[tuple(t.shape) for t in into]}, the parameters have {[tuple(s) for s in self._shapes]}"
            )
        out: list[torch.Tensor | None] = []
        for i in range(len(self.params)):
            e, kept = self._errors[i], self._kept(i)
            if into is None:
                out.append(_residual(e, kept))
                continue
            t = into[i]
            if e is None:
                t.zero_()
            elif kept is not None and t.dtype == e.dtype and t.is_contiguous():
                less_low_rank(e, settled(kept[0]), settled(kept[1]), out=t.view(e.shape))
            else:
                t.copy_(_residual(e, kept).view(t.shape))  # type: ignore[union-attr]
            out.append(t)
        self._errors = [None] * len(self.params)
        return out

    def residuals(self) -> list[torch.Tensor]:
        """What the compressor still owes for each parameter (its error buffer), aligned with
        ``self.params``; zeros for tensors that are averaged exactly and before the first compressed step.
        """
        return [
            torch.zeros(s, dtype=self.dtype, device=self.device) if e is None else e.view(s)
            for s, e in zip(self._shapes, map(self._residual, range(len(self.params))), strict=True)
        ]

    def _kept(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The factors whose product parameter ``i``'s error buffer still owes back (the paper variant keeps ``M``,
        and the residual is ``M - P Q^T``), or None where the buffer is the residual itself or nothing is owed."""
        if self.config.variant != "paper" or self._errors[i] is None:
            return None
        p, q = self._p[i], self._q[i]
        assert p is not None and q is not None, "a compressed matrix has factors"
        return p, q

    def _residual(self, i: int) -> torch.Tensor | None:
        """Parameter ``i``'s residual as an ``n x m`` matrix (None where nothing is owed), formed where it is kept as
        ``M`` and the factors: a new tensor, the error buffer itself otherwise."""
        return _residual(self._errors[i], self._kept(i))

    def bytes_per_step(self, compressed_step_index: int | None = None) -> int:
        """Payload bytes one step over all parameters sends (exact all-reduce during warm-up).

        Args:
            compressed_step_index: which compressed step (0-based) of every matrix to count, for the alternating
                variant whose message size alternates; ``None`` means each parameter's next step (its own count,
                so that DDP's per-bucket calls advance it too): exact while it warms up.
        """
        k = self.config.num_iters_per_step
        start = self.config.start_compressing_after_num_steps
        exact = factors = 0
        for i, (shape, mat) in enumerate(zip(self._shapes, self._mat, strict=True)):
            if mat is None or (compressed_step_index is None and self._steps[i] < start):
                exact += shape.numel()
                continue
            index = self._compressed_steps(i) if compressed_step_index is None else compressed_step_index
            n, m, r = mat
            for it in range(k):
                if self.config.variant == "paper":
                    factors += r * (n + m)
                else:
                    factors += r * (m if (index * k + it) % 2 == 0 else n)
        return exact * self._itemsize + factors * self._wire.itemsize

    def max_collectives_per_call(self) -> int:
        """``num_iters_per_step`` all-reduces (alternating) or twice that (paper), plus one for the exactly averaged
        tensors where they travel apart (``fuse_exact=False``, or bf16 factors)."""
        # Fused programs: one all-reduce per iteration (alternating) or two (paper); warm-up needs one. Factors
        # sent in 16 bits leave the exactly averaged tensors a collective of their own.
        k = self.config.num_iters_per_step
        own = self._wire != self.dtype or not self.fuse_exact  # the exact tensors' own all-reduce
        return (k if self.config.variant == "alternating" else 2 * k) + own

    # ------------------------------------------------------------------ aggregation

    @torch.no_grad()
    def program(
        self, grads: Sequence[torch.Tensor], indices: Sequence[int] | None = None, *, rows: Rows = None
    ) -> Program:
        """Average ``grads`` + the owned error buffers over ranks; ``grads`` are left alone and the residual goes
        to the error buffers. With ``rows`` only those rows of each approximation are computed (``P[lo:hi]
        Q^T``: a rank's FSDP shard)."""
        idx = self._resolve(grads, indices, rows)
        start = self.config.start_compressing_after_num_steps
        exact = [j for j, i in enumerate(idx) if self._mat[i] is None or self._steps[i] < start]
        batches = self._batches(grads, idx, rows)
        ubuf = pack([grads[j] for j in exact], self.dtype, self.device)
        largest = torch.finfo(self.dtype).max
        checked = [b.m_bnm if b.extrema is None else b.extrema for b in batches]  # extrema: the same bound, no pass
        local_ok = bounded_flag([*checked, ubuf], [*(self._limit(b) for b in batches), largest])
        fuse = self.fuse_exact and batches and self._wire == self.dtype  # 16-bit factors: exact tensors stay exact
        fused = ubuf if fuse else None
        algorithm = self._alternating if self.config.variant == "alternating" else self._paper

        def collectives() -> Program:
            # The host reads finiteness once, at the last collective (the factors' last): the others' results stay
            # device flags passed on in the next message (guard_nonfinite), so the exact part goes first.
            if fused is None and ubuf.numel():
                yield ReduceRequest(ubuf, "mean", check=not batches)
            if batches:
                yield from algorithm(batches, fused)
            out = self._commit(grads, idx, exact, batches, ubuf)
            if rows is not None:  # compressed outputs already hold just their rows
                for j in exact:
                    out[j] = out[j][rows[j][0] : rows[j][1]]
            return out

        names = [self.names[i] for i in idx]
        owed = [(self._errors[i], self._kept(i)) for i in idx]  # the state this call started from, for its error

        def error() -> NonFiniteGradientError:
            errors = [_residual(e, kept) for e, kept in owed]
            return self._too_large(grads, batches, errors) or self._nonfinite_error(names, grads, errors)

        return guard_nonfinite(collectives(), local_ok=local_ok, error=error)

    def _limit(self, b: _Batch) -> float:
        """The largest ``|gradient + residual|`` entry of batch ``b`` that nothing computed from it can overflow.

        With ``a`` the largest such entry on any rank, ``W`` ranks, ``k`` iterations, rank ``r``, ``n x m`` matrices
        and ``N = max(n, m)``: ``P = M Q`` takes ``Q`` scaled to entries <= 1 (:func:`unit_scaled`), so its entries
        are at most ``m a``; every other factor is ``M`` (or a residual, whose Frobenius norm the projections only
        shrink) times orthonormal columns, at most ``sqrt(n m) a``; a sum of ``W`` of them ``W N a``; the
        approximation adds ``k`` products of orthonormal rows (norm <= 1) and factor rows (norm <= ``sqrt(r) N a``);
        the residual is ``M`` less the approximation. All stay below the dtype's (and the wire's) largest number when
        ``a <= max / (2 N (W + k sqrt(r) + 1))``, the 2 for rounding: about 2.3e32 for the 50304 x 768 embedding of a
        GPT-2 at rank 32 over 8 ranks in float32, so only a diverged run gets there."""
        largest = min(torch.finfo(self.dtype).max, torch.finfo(self._wire).max)
        k, world = self.config.num_iters_per_step, self.comm.world_size
        return largest / (2 * max(b.n, b.m) * (world + k * math.sqrt(b.rank) + 1))

    def _too_large(
        self, grads: Sequence[torch.Tensor], batches: list[_Batch], errors: Sequence[torch.Tensor | None]
    ) -> NonFiniteGradientError | None:
        """The error for a finite gradient + residual beyond :meth:`_limit` on this rank, if there is one (the call's
        state is still as before it: computed from ``grads`` and the error buffers)."""
        over, owed_before = [], False
        for b in batches:
            limit = self._limit(b)
            for j, i in zip(b.idx, b.params, strict=True):
                owed = grads[j].reshape(b.n, b.m).to(self.dtype)
                if (e := errors[j]) is not None:
                    owed = owed + e
                    owed_before |= float(e.abs().max()) > limit
                largest = float(owed.abs().max())
                if math.isfinite(largest) and largest > limit:
                    over.append(f"{self.names[i]} reaches {largest:.3g} (limit {limit:.3g})")
        if not over:
            return None
        what = ", ".join(over[:3]) + (f" and {len(over) - 3} more" if len(over) > 3 else "")
        cure = (
            "the residual owed from earlier steps alone is beyond it, so no later step can go through until it is "
            "dropped (compressor.pop_residuals()) or the run resumes from an earlier checkpoint with a lower learning "
            "rate"
            if owed_before
            else "the run has likely diverged (lower the learning rate, clip gradients, or resume from an earlier "
            "checkpoint)"
        )
        return NonFiniteGradientError(
            f"{type(self).__name__}: gradient + residual too large on rank {self.comm.rank}: {what}; beyond that limit "
            f"the low-rank factors or the residual could overflow {self.dtype}, and {cure}; nothing was applied and "
            "the compressor state is unchanged"
        )

    def _commit(
        self,
        grads: Sequence[torch.Tensor],
        idx: list[int],
        exact: list[int],
        batches: list[_Batch],
        ubuf: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Every collective came back finite: store the new state and return the averages."""
        out: list[torch.Tensor | None] = [None] * len(idx)
        for b in batches:
            assert b.approx_bnm is not None, "every batch must have an approximation"
            for j, (call_j, i) in enumerate(zip(b.idx, b.params, strict=True)):
                # views of the batch's factors, as the error buffers are of its M (a clone each would be two small
                # device copies per matrix, a launch each on a GPU): the next call stacks copies of them, and
                # nothing writes into a batch's tensors after this commit
                self._p[i], self._q[i] = b.p_bnr[j], b.q_bmr[j]
                shape = self._shapes[i] if b.rows is None else (b.rows[1] - b.rows[0], *self._shapes[i][1:])
                out[call_j] = b.approx_bnm[j].view(shape).to(grads[call_j].dtype)
                self._errors[i] = b.m_bnm[j]
        for j, u in zip(exact, flat_views(ubuf, [grads[j].shape for j in exact]), strict=True):
            out[j] = u.to(grads[j].dtype)
        for i in idx:
            self._steps[i] += 1
        assert all(o is not None for o in out), "every gradient must get an output"
        return [o for o in out if o is not None]

    def _batches(self, grads: Sequence[torch.Tensor], idx: list[int], rows: Rows = None) -> list[_Batch]:
        """Group the compressed gradients of this call by (matrix shape, phase, rows) and stack them."""
        start = self.config.start_compressing_after_num_steps
        keys: dict[tuple[int, int, int, int, tuple[int, int] | None], tuple[list[int], list[int]]] = {}
        fuse = fusion.enabled(self.device)
        add_extrema = fusion.fused_or_eager("add_extrema", _add_extrema, _add_extrema_eager, self.device)
        # the sum, its extremes and the first product P = M Q in one pass (ops/lowrank_kernels.py)
        project = self.config.variant == "paper" and lowrank_kernels.usable(self.device, self.dtype)
        # the paper variant owes P Q^T back from these stacks (below); the alternating one only starts from them
        stack = stack_settled if self.config.variant == "paper" else torch.stack
        for j, i in enumerate(idx):
            mat = self._mat[i]
            if mat is not None and self._steps[i] >= start:
                row = None if rows is None else (int(rows[j][0]), int(rows[j][1]))
                call_js, params = keys.setdefault((*mat, self._compressed_steps(i) % 2, row), ([], []))
                call_js.append(j)
                params.append(i)
        batches = []
        for (n, m, r, phase, row), (call_js, params) in keys.items():
            # gradient + residual written once into the batch (a stack, then adding the residuals in place, would pass
            # over it three more times); the sum is the same: computed in self.dtype, rounded once
            m_bnm = torch.empty((len(call_js), n, m), dtype=self.dtype, device=self.device)
            p_bnr = stack([self._p[i] for i in params])  # type: ignore[misc]
            q_bmr = stack([self._q[i] for i in params])  # type: ignore[misc]
            batch = _Batch(call_js, params, n, m, r, phase, p_bnr, q_bmr, m_bnm, row)
            batches.append(batch)
            # the factors a kept M owes back, from these stacks: laid out as settled() lays out a tensor however the
            # state was kept (a view into a commit's batch, or one loaded from a checkpoint), as a BLAS may round their
            # product by layout and alignment: a resumed run and residuals() subtract the same P Q^T
            kept = [None if self._kept(i) is None else (p_bnr[k], q_bmr[k]) for k, i in enumerate(params)]
            if project:
                batch.first_p = torch.empty_like(p_bnr)
                units = unit_scaled(q_bmr).unbind(0)
                batch.extrema = torch.stack(
                    [
                        lowrank_kernels.sum_project(owed, grads[j].reshape(n, m), self._errors[i], pq, q, p)
                        for owed, j, i, pq, q, p in zip(m_bnm, call_js, params, kept, units, batch.first_p, strict=True)
                    ]
                )
                continue
            extrema = []
            for owed, j, i, pq in zip(m_bnm.unbind(0), call_js, params, kept, strict=True):
                e = self._errors[i]
                g = grads[j].reshape(n, m)
                if e is None:
                    owed.copy_(g)
                    if fuse:
                        extrema.append(torch.stack(torch.aminmax(owed)))
                elif fuse:  # the sum and its extremes in one pass (the bound's check reads those, not the batch)
                    extrema.append(add_extrema(owed, g, e if pq is None else less_low_rank(e, *pq)))
                else:
                    add_owed(owed, g, e, *(pq or ()))
            if fuse:
                batch.extrema = torch.stack(extrema)
        return batches

    def _send_buffer(
        self, sizes: list[int], fused: torch.Tensor | None, scale: float
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One flat buffer for a collective: views for the factors, then ``fused * scale`` at the end."""
        extra = 0 if fused is None else fused.numel()
        buf = torch.empty(sum(sizes) + extra, dtype=self.dtype, device=self.device)
        views = list(buf.split([*sizes, extra]))
        if fused is not None:
            torch.mul(fused, scale, out=views[-1])
        return buf, views[: len(sizes)]

    def _reduce(self, buf: torch.Tensor, op: ReduceKind, check: bool) -> _Collectives:
        """All-reduce ``buf`` in place, as ``self._wire`` on the wire. In 16 bits every rank gets the same rounded
        result, and what the rounding misses stays in the error buffers (the paper variant's residual is
        ``M`` minus the shared approximation), so the invariant holds as in fp32. ``check``: the request's."""
        if self._wire == buf.dtype:
            yield ReduceRequest(buf, op, check=check)
            return
        wire = (buf / self.comm.world_size if op == "mean" else buf).to(self._wire)  # one rounding, not two
        yield ReduceRequest(wire, "sum", check=check)
        buf.copy_(wire)

    def _alternating(self, batches: list[_Batch], fused: torch.Tensor | None) -> _Collectives:
        k = self.config.num_iters_per_step
        inv_world = 1.0 / self.comm.world_size
        for it in range(k):
            # Even: from P, compute Q = M^T P and send Q. Odd: from Q, compute P = M Q and send P.
            # Written for the row side; the odd case runs the same code on transposed views.
            even = [(b.phase * k + it) % 2 == 0 for b in batches]
            sizes = [(b.m if e else b.n) * b.rank * len(b.params) for b, e in zip(batches, even, strict=True)]
            last = fused if it == k - 1 else None
            send, views = self._send_buffer(sizes, last, inv_world)  # summed: exact part pre-divided
            for b, e, view in zip(batches, even, views, strict=True):
                in_bnr, side_bnm = (b.p_bnr, b.m_bnm) if e else (b.q_bmr, b.m_bnm.transpose(1, 2))
                in_bnr.copy_(orthonormalize(in_bnr))
                out_bmr = view.view(len(b.params), side_bnm.shape[2], b.rank)
                torch.bmm(side_bnm.transpose(1, 2), in_bnr, out=out_bmr)
                side_bnm.baddbmm_(in_bnr, out_bmr.transpose(1, 2), alpha=-1)  # the residual keeps the rest
                if e:
                    b.q_bmr = out_bmr
                else:
                    b.p_bnr = out_bmr
            yield ReduceRequest(send, "sum", check=it == k - 1)
            if last is not None:
                last.copy_(send[sum(sizes) :])
            for b, e in zip(batches, even, strict=True):
                beta = 0 if it == 0 else 1  # the first write ignores the (uninitialised) buffer: no zero-fill
                if b.rows is not None:  # only this rank's rows: P[lo:hi] Q^T, whichever side was sent
                    lo, hi = b.rows
                    if b.approx_bnm is None:
                        b.approx_bnm = b.m_bnm.new_empty((len(b.params), hi - lo, b.m))
                    b.approx_bnm.baddbmm_(b.p_bnr[:, lo:hi], b.q_bmr.transpose(1, 2), beta=beta, alpha=inv_world)
                    continue
                if b.approx_bnm is None:
                    b.approx_bnm = torch.empty_like(b.m_bnm)
                in_bnr, out_bmr = (b.p_bnr, b.q_bmr) if e else (b.q_bmr, b.p_bnr)
                a_side = b.approx_bnm if e else b.approx_bnm.transpose(1, 2)
                a_side.baddbmm_(in_bnr, out_bmr.transpose(1, 2), beta=beta, alpha=inv_world)

    def _paper(self, batches: list[_Batch], fused: torch.Tensor | None) -> _Collectives:
        k = self.config.num_iters_per_step
        for it in range(k):
            p_buf, p_views = self._send_buffer([b.p_bnr.numel() for b in batches], None, 1.0)
            for b, view in zip(batches, p_views, strict=True):  # Q scaled: its size is the last step's gradient's
                if it == 0 and b.first_p is not None:
                    b.p_bnr = view.view_as(b.p_bnr).copy_(b.first_p)
                else:
                    b.p_bnr = torch.bmm(b.m_bnm, unit_scaled(b.q_bmr), out=view.view_as(b.p_bnr))
            yield from self._reduce(p_buf, "sum", False)  # only its span matters: orthonormalised next, no division
            last = fused if it == k - 1 else None
            q_buf, q_views = self._send_buffer([b.q_bmr.numel() for b in batches], last, 1.0)  # mean: as is
            for b, view in zip(batches, q_views, strict=True):
                b.p_bnr = orthonormalize(b.p_bnr)
                b.q_bmr = torch.bmm(b.m_bnm.transpose(1, 2), b.p_bnr, out=view.view_as(b.q_bmr))
            yield from self._reduce(q_buf, "mean", it == k - 1)
            if last is not None:
                last.copy_(q_buf[q_buf.numel() - last.numel() :])
        for b in batches:  # M is kept: the next step subtracts P Q^T from it (_kept), so only the output is written
            p_bnr = b.p_bnr if b.rows is None else b.p_bnr[:, b.rows[0] : b.rows[1]]  # an FSDP shard: its rows
            b.approx_bnm = low_rank(p_bnr, b.q_bmr)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The factors ``p`` and ``q``, the error buffers (the paper variant's kept ``M`` under ``"m"``), each
        parameter's step count, the variant, the ``(n, m, rank)`` layout and the generator's state. The tensors are
        the compressor's own, not copies (a step replaces them, never writes into them)."""
        # Tensors are replaced (never updated in place) at each step, so no clones are needed.
        return {
            "variant": self.config.variant,
            "layout": [None if mat is None else list(mat) for mat in self._mat],
            "steps": list(self._steps),
            "p": list(self._p),
            "q": list(self._q),
            # the paper variant's kept M under a name of its own: a reader that takes "errors" for the residual (one
            # written before it kept M) fails on the missing key rather than owing the approximation twice
            "m" if self.config.variant == "paper" else "errors": list(self._errors),
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, copied to this compressor's device and dtype. ValueError if a key
        is missing, the variant or the ``(n, m, rank)`` layout differs (another model or Config), or a tensor's shape
        or a count does not fit."""
        # "num_steps" and "compressed_steps", in states written before they were derived from "steps", are ignored
        keys = {"variant", "layout", "steps", "p", "q", "generator"}
        missing = keys - set(state)
        if missing:
            raise ValueError(f"PowerSGD state_dict is missing {sorted(missing)}")
        layout = [None if mat is None else list(mat) for mat in self._mat]
        if (
            state["variant"] != self.config.variant
            or [None if x is None else list(x) for x in state["layout"]] != layout
        ):
            raise ValueError(
                f"PowerSGD state_dict does not fit this compressor: saved variant {state['variant']!r} with "
                f"(n, m, rank) per parameter {state['layout']}, this one has {self.config.variant!r} with {layout}; "
                "build it with the same parameters and Config"
            )
        # the paper variant keeps M ("m"); its states written before that hold the residual ("errors"), as the
        # alternating variant's do
        kept = self.config.variant == "paper" and "errors" not in state
        key = "m" if kept else "errors"
        if key not in state:
            raise ValueError(f"PowerSGD state_dict is missing [{key!r}]")
        if "m" in state and "errors" in state:
            raise ValueError(
                "PowerSGD state_dict holds both 'm' (a kept M) and 'errors' (a residual): keep the one it saved"
            )
        check_state_tensors("PowerSGD", "p", state["p"], [None if m is None else (m[0], m[2]) for m in self._mat])
        check_state_tensors("PowerSGD", "q", state["q"], [None if m is None else (m[1], m[2]) for m in self._mat])
        check_state_tensors("PowerSGD", key, state[key], [None if m is None else m[:2] for m in self._mat])
        steps = check_state_counts("PowerSGD", "steps", state["steps"], len(self._mat))
        unfactored = [
            i
            for i, (mat, p, q) in enumerate(zip(self._mat, state["p"], state["q"], strict=True))
            if mat is not None and (p is None or q is None)
        ]
        if unfactored:
            raise ValueError(
                f"PowerSGD state_dict has no factors p and q for the compressed parameters {unfactored} (a state this "
                "compressor saves has both for every compressed matrix): load the state it saved whole"
            )
        # in rows, as a commit stores them: the products formed from them must not depend on how a state was kept
        copy = lambda t: (
            None if t is None else t.to(self.device, self.dtype, copy=True, memory_format=torch.contiguous_format)
        )
        self._steps = steps
        self._p = [copy(t) for t in state["p"]]
        self._q = [copy(t) for t in state["q"]]
        self._errors = [copy(t) for t in state[key]]
        if self.config.variant == "paper" and not kept:  # the residual itself: as M with P = 0 it is owed exactly
            self._p = [
                p if e is None or p is None else torch.zeros_like(p) for p, e in zip(self._p, self._errors, strict=True)
            ]
        self._generator.set_state(state["generator"])
