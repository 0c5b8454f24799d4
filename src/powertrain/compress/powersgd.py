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
    approximation is ``P Q^T`` and the error is the local ``M`` minus it.

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
from typing import Any, Literal

import torch
import torch.distributed as dist

from powertrain.comm import Communicator
from powertrain.compress.base import Compressor, NonFiniteGradientError, named_trainable
from powertrain.ops.flat import flat_views, pack
from powertrain.ops.lowrank import low_rank, matrix_shape, orthonormalize

__all__ = ["Config", "PowerSGDCompressor", "Variant"]

Variant = Literal["alternating", "paper"]
_VARIANTS: tuple[Variant, ...] = ("alternating", "paper")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Invalid Config.{name}={value!r}: must be an integer >= {minimum}")


@dataclasses.dataclass(frozen=True)
class Config:
    """PowerSGD settings. Field order and defaults match the reference ``powersgd.Config``."""

    rank: int
    """Rank of the approximation; lower means more compression. Must be >= 1."""
    min_compression_rate: float = 2
    """Compress a matrix only if ``numel / (floats sent per step) > min_compression_rate``; >= 0."""
    num_iters_per_step: int = 1
    """Power iterations per step; more means a better approximation and more communication. >= 1."""
    start_compressing_after_num_steps: int = 100
    """Plain (exact) all-reduce for this many steps first. >= 0."""
    variant: Variant = "alternating"
    """``"alternating"`` (the reference code's) or ``"paper"`` (Algorithm 1, P then Q all-reduced)."""
    seed: int = 0
    """Seed of the factors' initialisation; identical on every rank, so no communication is needed."""

    def __post_init__(self) -> None:
        _check_int("rank", self.rank, 1)
        _check_int("num_iters_per_step", self.num_iters_per_step, 1)
        _check_int("start_compressing_after_num_steps", self.start_compressing_after_num_steps, 0)
        _check_int("seed", self.seed, 0)
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate < 0:
            raise ValueError(
                f"Invalid Config.min_compression_rate={rate!r}: must be a finite number >= 0 "
                "(0 compresses every matrix)"
            )
        if self.variant not in _VARIANTS:
            raise ValueError(f"Invalid Config.variant={self.variant!r}: must be one of {_VARIANTS}")

    def floats_per_step(self, n: int, m: int) -> float:
        """Average number of floats sent per step for an ``n x m`` matrix."""
        r = min(self.rank, n, m)
        if self.variant == "paper":
            return self.num_iters_per_step * r * (n + m)
        return 0.5 * self.num_iters_per_step * r * (n + m)  # alternates between n*r and m*r


@dataclasses.dataclass(frozen=True)
class _Group:
    """Compressed parameters sharing one matrix shape; they are processed as one batch."""

    n: int
    m: int
    rank: int
    indices: tuple[int, ...]


Reduce = Literal["sum", "mean"]
_StepGen = Generator[tuple[torch.Tensor, Reduce], None, tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]]


class PowerSGDCompressor(Compressor):
    """PowerSGD as a :class:`~powertrain.compress.base.Compressor` that owns its error buffers.

    Use with an ordinary training loop::

        compressor = PowerSGDCompressor(model.named_parameters(), config=Config(rank=4))
        for batch in loader:
            optimizer.zero_grad()
            loss_fn(model(batch)).backward()
            compressor.reduce_gradients()  # p.grad <- compressed mean over ranks
            optimizer.step()

    Args:
        params: ``model.parameters()`` or ``model.named_parameters()`` (names appear in errors).
            Parameters that do not require grad are ignored.
        config: see :class:`Config`.
        group: process group to average over; ``None`` is the default group. Works without an
            initialised process group too (world size 1: no communication).

    Error buffers are kept in float32 (float64 if any parameter is float64), also for bf16/fp16
    parameters, and allocated at the first compressed step.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        config: Config,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(config, Config):
            raise ValueError(f"config must be a powertrain Config, got {type(config).__name__}")
        self.config = config
        self.comm = Communicator(group)
        self.names, self.params = named_trainable(params)
        for name, p in zip(self.names, self.params, strict=True):
            if not p.is_floating_point():
                raise ValueError(f"PowerSGD needs floating-point parameters; {name} is {p.dtype}")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"All parameters must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        # Communication and factor dtype: at least float32 (gloo cannot sum bf16 everywhere, and low
        # precision factors lose the approximation), float64 when the model is float64.
        self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        self._shapes = [p.shape for p in self.params]

        groups: dict[tuple[int, int], list[int]] = {}
        uncompressed: list[int] = []
        for i, shape in enumerate(self._shapes):
            if len(shape) >= 2 and shape.numel() > 0:
                n, m = matrix_shape(shape)
                if n * m / config.floats_per_step(n, m) > config.min_compression_rate:
                    groups.setdefault((n, m), []).append(i)
                    continue
            uncompressed.append(i)
        self._groups = [_Group(n, m, min(config.rank, n, m), tuple(idx)) for (n, m), idx in groups.items()]
        self._uncompressed = tuple(uncompressed)
        self._p_shapes = [(len(g.indices), g.n, g.rank) for g in self._groups]
        self._q_shapes = [(len(g.indices), g.m, g.rank) for g in self._groups]

        # Identical on every rank without communication: same seed, generated on the CPU (so also the
        # same across device types), in the reference's order (all P batches, then all Q batches).
        self._generator = torch.Generator().manual_seed(config.seed)
        ps = [torch.randn(s, generator=self._generator) for s in self._p_shapes]
        qs = [torch.randn(s, generator=self._generator) for s in self._q_shapes]
        self._p = pack(ps, self.dtype, self.device)
        self._q = pack(qs, self.dtype, self.device)
        self._errors: list[torch.Tensor] | None = None  # per group, (B, n, m); lazily allocated
        self.num_steps = 0
        self.num_compressed_steps = 0

    # ------------------------------------------------------------------ introspection

    @property
    def compressed_names(self) -> list[str]:
        """Names of the parameters whose gradients are compressed (the others are sent exactly)."""
        return [self.names[i] for g in self._groups for i in g.indices]

    @property
    def dense_bytes_per_step(self) -> int:
        """Bytes a plain all-reduce of all gradients in this compressor's dtype sends per step."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return sum(s.numel() for s in self._shapes) * itemsize

    def residuals(self) -> list[torch.Tensor]:
        """What the compressor still owes for each parameter (its error buffer), as views, aligned with
        ``self.params``; zeros for tensors that are averaged exactly and before the first compressed step.
        """
        out = [torch.zeros(s, dtype=self.dtype, device=self.device) for s in self._shapes]
        if self._errors is not None:
            for g, e_bnm in zip(self._groups, self._errors, strict=True):
                for j, i in enumerate(g.indices):
                    out[i] = e_bnm[j].view(self._shapes[i])
        return out

    def bytes_per_step(self, compressed_step_index: int | None = None) -> int:
        """Payload bytes one step sends (exact all-reduce during warm-up).

        Args:
            compressed_step_index: which compressed step (0-based) to count, for the alternating
                variant whose message size alternates; ``None`` means the current step.
        """
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        if compressed_step_index is None:
            if self.num_steps < self.config.start_compressing_after_num_steps:
                return self.dense_bytes_per_step
            compressed_step_index = self.num_compressed_steps
        k = self.config.num_iters_per_step
        floats = sum(self._shapes[i].numel() for i in self._uncompressed)
        for it in range(k):
            even = (compressed_step_index * k + it) % 2 == 0
            for g in self._groups:
                b = len(g.indices)
                if self.config.variant == "paper":
                    floats += b * g.rank * (g.n + g.m)
                else:
                    floats += b * g.rank * (g.m if even else g.n)
        return floats * itemsize

    # ------------------------------------------------------------------ aggregation

    def aggregate(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self._aggregate(grads, residual_in_grads=False)

    @torch.no_grad()
    def _aggregate(self, grads: Sequence[torch.Tensor], *, residual_in_grads: bool) -> list[torch.Tensor]:
        """Mean over ranks of ``grads`` (+ the owned error buffers unless ``residual_in_grads``).

        With ``residual_in_grads`` (the reference API) the inputs already hold last step's residual and
        are overwritten with the new one (zero for exactly averaged tensors); otherwise they are left
        alone and the residual goes to the owned error buffers.
        """
        self._check_grads(grads)
        if self.num_steps < self.config.start_compressing_after_num_steps:
            out = self._exact(grads, residual_in_grads)
        else:
            out = self._compressed(grads, residual_in_grads)
        self.num_steps += 1
        return out

    def _exact(self, grads: Sequence[torch.Tensor], residual_in_grads: bool) -> list[torch.Tensor]:
        buf = pack(grads, self.dtype, self.device)
        self._drive(_single(buf), grads, local_ok=_all_finite([buf]))
        out = _unpack_like(buf, grads)
        if residual_in_grads:
            for g in grads:
                g.zero_()
        return out

    def _compressed(self, grads: Sequence[torch.Tensor], residual_in_grads: bool) -> list[torch.Tensor]:
        # M = gradient + residual, one (B, n, m) workspace per shape group. It becomes the new residual.
        ms: list[torch.Tensor] = []
        for gi, g in enumerate(self._groups):
            m_bnm = torch.stack([grads[i].reshape(g.n, g.m) for i in g.indices]).to(self.dtype)
            if not residual_in_grads and self._errors is not None:
                m_bnm.add_(self._errors[gi])
            ms.append(m_bnm)
        ubuf = pack([grads[i] for i in self._uncompressed], self.dtype, self.device)

        def collectives() -> _StepGen:
            result = yield from (self._alternating(ms) if self.config.variant == "alternating" else self._paper(ms))
            if ubuf.numel():
                yield ubuf, "mean"
            return result

        approx, p_buf, q_buf = self._drive(collectives(), grads, local_ok=_all_finite([*ms, ubuf]))

        # Commit: every collective came back finite.
        self._p, self._q = p_buf, q_buf
        self.num_compressed_steps += 1
        out: list[torch.Tensor | None] = [None] * len(grads)
        for g, a_bnm, r_bnm in zip(self._groups, approx, ms, strict=True):
            for j, i in enumerate(g.indices):
                out[i] = a_bnm[j].view(self._shapes[i]).to(grads[i].dtype)
                if residual_in_grads:
                    grads[i].copy_(r_bnm[j].view(self._shapes[i]))
        u_views = flat_views(ubuf, [self._shapes[i] for i in self._uncompressed])
        for i, u in zip(self._uncompressed, u_views, strict=True):
            out[i] = u.to(grads[i].dtype)
            if residual_in_grads:
                grads[i].zero_()
        if not residual_in_grads:
            self._errors = ms
        assert all(o is not None for o in out), "every gradient must get an output"
        return [o for o in out if o is not None]

    def _alternating(self, ms: list[torch.Tensor]) -> _StepGen:
        k = self.config.num_iters_per_step
        p_buf, q_buf = self._p.clone(), self._q.clone()  # working copies, committed by the caller
        ps, qs = flat_views(p_buf, self._p_shapes), flat_views(q_buf, self._q_shapes)
        approx = [torch.empty_like(m_bnm) for m_bnm in ms]  # written with beta=0 first: no zero-fill pass
        inv_world = 1.0 / self.comm.world_size
        for it in range(k):
            even = (self.num_compressed_steps * k + it) % 2 == 0
            # Even: from P, compute Q = M^T P and send Q. Odd: from Q, compute P = M Q and send P.
            # Written for the row side (even); the odd case runs the same code on transposed views.
            ins, outs, out_buf = (ps, qs, q_buf) if even else (qs, ps, p_buf)
            side = [m_bnm if even else m_bnm.transpose(1, 2) for m_bnm in ms]
            for m_bnm, in_bnr, out_bmr in zip(side, ins, outs, strict=True):
                in_bnr.copy_(orthonormalize(in_bnr))
                torch.bmm(m_bnm.transpose(1, 2), in_bnr, out=out_bmr)
                m_bnm.baddbmm_(in_bnr, out_bmr.transpose(1, 2), alpha=-1)  # residual keeps what is not sent
            yield out_buf, "sum"
            for a_bnm, in_bnr, out_bmr in zip(approx, ins, outs, strict=True):
                a_side = a_bnm if even else a_bnm.transpose(1, 2)
                a_side.baddbmm_(in_bnr, out_bmr.transpose(1, 2), beta=0 if it == 0 else 1, alpha=inv_world)
        return approx, p_buf, q_buf

    def _paper(self, ms: list[torch.Tensor]) -> _StepGen:
        p_buf, q_buf = torch.empty_like(self._p), self._q.clone()
        ps, qs = flat_views(p_buf, self._p_shapes), flat_views(q_buf, self._q_shapes)
        for _ in range(self.config.num_iters_per_step):
            for m_bnm, p_bnr, q_bmr in zip(ms, ps, qs, strict=True):
                torch.bmm(m_bnm, q_bmr, out=p_bnr)
            yield p_buf, "sum"  # only its span matters: orthonormalised next, so no division
            for m_bnm, p_bnr, q_bmr in zip(ms, ps, qs, strict=True):
                p_bnr.copy_(orthonormalize(p_bnr))
                torch.bmm(m_bnm.transpose(1, 2), p_bnr, out=q_bmr)
            yield q_buf, "mean"
        approx = []
        for m_bnm, p_bnr, q_bmr in zip(ms, ps, qs, strict=True):
            a_bnm = low_rank(p_bnr, q_bmr)
            m_bnm.sub_(a_bnm)
            approx.append(a_bnm)
        return approx, p_buf, q_buf

    def _drive(
        self,
        gen: Generator[tuple[torch.Tensor, Reduce], None, Any],
        grads: Sequence[torch.Tensor],
        *,
        local_ok: bool,
    ) -> Any:
        """Run the all-reduces ``gen`` yields (buffer and "sum" or "mean", in place); return its result.

        A rank whose inputs are non-finite poisons the first buffer it sends, so that every rank sees a
        non-finite result and raises at the same collective; the generator is then abandoned before
        it commits anything.
        """
        poison = not local_ok
        try:
            buf, reduce = next(gen)
            while True:
                if poison and buf.numel():
                    buf.view(-1)[0] = float("nan")
                    poison = False
                if reduce == "sum":
                    self.comm.all_reduce_sum_(buf)
                else:
                    self.comm.all_reduce_mean_(buf)
                if not _all_finite([buf]):
                    raise self._nonfinite_error(grads)
                buf, reduce = gen.send(None)
        except StopIteration as stop:
            assert not poison, "non-finite inputs must have been sent in some buffer"
            return stop.value

    def _nonfinite_error(self, grads: Sequence[torch.Tensor]) -> NonFiniteGradientError:
        rank = self.comm.rank
        bad = [self.names[i] for i, g in enumerate(grads) if not _all_finite([g])]
        if self._errors is not None and not _all_finite(self._errors):
            bad.append("<error buffer>")
        where = (
            f"non-finite gradient in {', '.join(bad)} on rank {rank}"
            if bad
            else (f"gradients on rank {rank} are finite, another rank sent non-finite values")
        )
        return NonFiniteGradientError(
            f"PowerSGD step {self.num_steps}: {where}; nothing was applied and the compressor state is "
            "unchanged (skip the step, lower the learning rate, or check the loss for overflow)"
        )

    def _check_grads(self, grads: Sequence[torch.Tensor]) -> None:
        if len(grads) != len(self.params):
            raise ValueError(
                f"Got {len(grads)} gradients for {len(self.params)} parameters; pass one gradient per "
                "parameter that requires grad, in the order given to the constructor"
            )
        for name, g, shape in zip(self.names, grads, self._shapes, strict=True):
            if g is None or g.shape != shape:
                got = None if g is None else tuple(g.shape)
                raise ValueError(f"Gradient for {name} has shape {got}, expected {tuple(shape)}")

    # ------------------------------------------------------------------ state

    def _layout(self) -> list[list[int]]:
        return [[g.n, g.m, g.rank, len(g.indices)] for g in self._groups]

    def state_dict(self) -> dict[str, Any]:
        # Tensors are replaced (never updated in place) at each step, so no clones are needed.
        return {
            "variant": self.config.variant,
            "layout": self._layout(),
            "num_steps": self.num_steps,
            "num_compressed_steps": self.num_compressed_steps,
            "p": self._p,
            "q": self._q,
            "generator": self._generator.get_state(),
            "errors": list(self._errors) if self._errors is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"variant", "layout", "num_steps", "num_compressed_steps", "p", "q", "generator"} - set(state)
        if missing:
            raise ValueError(f"PowerSGD state_dict is missing {sorted(missing)}")
        if state["variant"] != self.config.variant or [list(x) for x in state["layout"]] != self._layout():
            raise ValueError(
                f"PowerSGD state_dict does not fit this compressor: saved variant {state['variant']!r} "
                f"with (n, m, rank, count) groups {state['layout']}, this one has {self.config.variant!r} "
                f"with {self._layout()}; build it with the same parameters and Config"
            )
        self.num_steps = int(state["num_steps"])
        self.num_compressed_steps = int(state["num_compressed_steps"])
        self._p = state["p"].to(self.device, self.dtype, copy=True)
        self._q = state["q"].to(self.device, self.dtype, copy=True)
        self._generator.set_state(state["generator"])
        errors = state.get("errors")
        self._errors = None if errors is None else [e.to(self.device, self.dtype, copy=True) for e in errors]


def _single(buf: torch.Tensor) -> Generator[tuple[torch.Tensor, Reduce], None, None]:
    yield buf, "mean"


def _all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True if no tensor holds NaN or Inf (min/max propagate both; no full-size temporary)."""
    extrema = [torch.stack(torch.aminmax(t)) for t in tensors if t.numel()]
    return not extrema or bool(torch.isfinite(torch.cat(extrema)).all())


def _unpack_like(buf: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [v.to(t.dtype) for v, t in zip(flat_views(buf, [t.shape for t in like]), like, strict=True)]
