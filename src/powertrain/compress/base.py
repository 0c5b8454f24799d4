"""The compressor interface, the collective programs compressors are written as, and their driver.

A compressor describes one aggregation as a *program*: a generator that yields the collectives it needs
(:class:`ReduceRequest`, :class:`GatherRequest`), receives each result, and returns the averaged
gradients. It commits its state (factors, error buffers, counters) only after its last collective came
back, so a failure part-way leaves the compressor as it was. The same program runs synchronously
(:func:`run_program`, behind :meth:`Compressor.aggregate`) or chained on futures inside a DDP hook
(:mod:`powertrain.ddp`), with no second copy of any algorithm.
"""

from __future__ import annotations

import abc
import contextvars
import dataclasses
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from powertrain.comm import Communicator, ReduceKind
from powertrain.ops.finite import all_finite, finite_flag, read_flag

__all__ = [
    "Compressor",
    "GatherRequest",
    "NonFiniteGradientError",
    "Program",
    "ReduceRequest",
    "check_state_tensors",
    "guard_nonfinite",
    "named_trainable",
    "placeholder",
    "run_program",
    "slice_rows",
]


class NonFiniteGradientError(FloatingPointError):
    """A gradient on some rank held NaN or Inf.

    Raised on *every* rank of the group (each rank that sees NaN/Inf in its input poisons what it sends,
    and all ranks check what they receive), before the compressor changes any of its state, so catching
    it and skipping the optimizer step is safe: :meth:`Compressor.reduce_gradients` does that with
    ``skip_nonfinite=True``.
    """


@dataclasses.dataclass(frozen=True)
class ReduceRequest:
    """All-reduce ``tensor`` in place (``"sum"`` or ``"mean"``); the program receives None. ``comm``: where
    (None: the compressor's own communicator; see :meth:`Compressor.communicators`). ``check``: the program reads the
    result's finiteness on the host as it comes back (:func:`guard_nonfinite`), and issues no collective after it, so
    a driver may finish the program on another thread (:mod:`powertrain.compress.chain`); False: a later collective
    follows, and carries whether this result was finite (a program's last collective is always checked)."""

    tensor: torch.Tensor
    op: ReduceKind
    comm: Communicator | None = None
    check: bool = True


@dataclasses.dataclass(frozen=True)
class GatherRequest:
    """All-gather ``tensor`` (uint8, same size on every rank); the program receives ``(world, size)``.

    The last byte is reserved for :func:`guard_nonfinite`: a rank with non-finite input sets it to 1.
    ``comm`` and ``check`` as for :class:`ReduceRequest`.
    """

    tensor: torch.Tensor
    comm: Communicator | None = None
    check: bool = True


Request = ReduceRequest | GatherRequest
Rows = Sequence[tuple[int, int]] | None


def slice_rows(tensors: list[torch.Tensor], rows: Rows) -> list[torch.Tensor]:
    """Rows ``lo:hi`` of each tensor (all of them when ``rows`` is None; its length checked by the program)."""
    if rows is None:
        return tensors
    return [t[lo:hi] for t, (lo, hi) in zip(tensors, rows, strict=True)]


Program = Generator[Request, "torch.Tensor | None", list[torch.Tensor]]


def run_program(program: Program, comm: Communicator) -> list[torch.Tensor]:
    """Run ``program``'s collectives one after the other on ``comm``; return its result.

    The time spent in the program's own code is added to ``comm.stats.compress_s``.
    """
    result: torch.Tensor | None = None
    math_s = 0.0
    try:
        t0 = time.perf_counter()
        request = next(program)
        while True:
            math_s += time.perf_counter() - t0
            on = request.comm or comm
            if isinstance(request, ReduceRequest):
                on.all_reduce_(request.tensor, request.op)
                result = None
            else:
                result, _ = on.all_gather(request.tensor)
            t0 = time.perf_counter()
            request = program.send(result)
    except StopIteration as stop:
        math_s += time.perf_counter() - t0
        comm.stats.add_time(compress_s=math_s)
        return stop.value


def guard_nonfinite(
    program: Program, *, local_ok: bool | torch.Tensor, error: Callable[[], NonFiniteGradientError]
) -> Program:
    """Make every rank raise ``error()`` when any rank's input was non-finite (``local_ok`` False).

    ``local_ok``: a bool, or a 0-dim bool tensor on the device (:func:`~powertrain.ops.finite.finite_flag`), which
    is never read on the host: the poison is written with ``torch.where``, so computing it waits for nothing.

    The first collective carries the news: a NaN written into a reduced buffer (NaN survives any sum),
    or the reserved last byte of a gathered payload. Every rank checks what comes back, so all raise at
    the same collective, and the wrapped program is abandoned before it commits anything. That check is a
    host synchronisation on CUDA (:func:`~powertrain.ops.finite.read_flag`), and cannot be avoided: whether to raise
    is a decision of the host, and every rank must make it before the program commits. A request with
    ``check=False`` is not read: whether its result is finite stays a device flag, written into the next request as
    the input's is, so the next checked collective raises for both. A program synchronises once, at its last
    collective, which must be checked (the program commits right after it), and only its last is.

    Run by ``powertrain.compress.deferred.run_deferred``, that one read is handed to the driver instead
    (``Verdict``): the program commits at once, and the driver undoes the commit where the flag turns out False.
    """
    local = local_ok
    pending: bool | torch.Tensor = local_ok  # still to be sent: False (or a device flag) poisons the next request
    try:
        request = next(program)
    except StopIteration as stop:
        if pending is not True:
            _decide(pending, local, error)
        return stop.value
    deferred = False  # pending holds an unchecked result's flag
    while True:
        if pending is not True:
            if _poison(request, pending):
                pending, deferred = True, False
            elif deferred:  # nothing else would carry it before the program commits: a bug in the program
                raise AssertionError("the collective after an unchecked one (check=False) must not be empty")
        result = yield request
        ok = _result_ok(request, result)
        if request.check:
            _decide(_and(pending, ok), local, error)  # one decision: an input flag no request carried is in it
            pending = True
        else:
            pending, deferred = _and(pending, ok), True
        last = request
        try:
            request = program.send(result)
            if last.check:  # a driver may have moved the program to a thread that must not issue collectives
                raise AssertionError("a checked collective (check=True) must be the program's last")
        except StopIteration as stop:
            if not last.check:  # the program committed after a result nobody read: a bug in the program
                raise AssertionError("a program's last collective must be checked (check=True)") from None
            if pending is not True:  # the input's flag: every request was empty
                _decide(pending, local, error)
            return stop.value


class Verdict:
    """Where a driver that must not wait for the device (``powertrain.compress.deferred``) receives the flag a
    program's guard would have read on the host: whether every rank's input and every result was finite (``ok``) and
    whether this rank's own input was (``local``), both 0-dim bool tensors on the device, None until handed."""

    def __init__(self) -> None:
        self.ok: torch.Tensor | None = None
        self.local: torch.Tensor | bool = True


#: the verdict of the program this context is running, set by a deferring driver around it (generators run in the
#: context of whoever advances them, so the guard sees it at its read)
_VERDICT: contextvars.ContextVar[Verdict | None] = contextvars.ContextVar("powertrain_verdict", default=None)


def _decide(ok: bool | torch.Tensor, local: bool | torch.Tensor, error: Callable[[], NonFiniteGradientError]) -> None:
    """Raise ``error()`` if ``ok`` is False; a device flag is read on the host, or handed to the deferring driver
    running this program, which then owns the decision (and the undoing of the commit that follows)."""
    verdict = _VERDICT.get()
    if verdict is not None and isinstance(ok, torch.Tensor):
        assert verdict.ok is None, "a deferred program decides once"
        verdict.ok, verdict.local = ok, local
        return
    if not read_flag(ok):
        raise error() from None


def _result_ok(request: Request, result: torch.Tensor | None) -> bool | torch.Tensor:
    """Whether a collective's result is finite, as a device flag: a reduced buffer holds no NaN/Inf, no rank set a
    gathered payload's reserved byte."""
    if isinstance(request, GatherRequest):
        assert result is not None, "a gather must return the gathered payloads"
        return result[:, -1].any().logical_not()
    return finite_flag([request.tensor])


def _and(a: bool | torch.Tensor, b: bool | torch.Tensor) -> bool | torch.Tensor:
    """Both flags, on the device where either is a tensor (nothing is read on the host)."""
    if a is True or b is False:
        return b
    if b is True or a is False:
        return a
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return torch.logical_and(a, b)


def _poison(request: Request, ok: bool | torch.Tensor) -> bool:
    """Mark ``request``'s message as coming from a rank with non-finite input where ``ok`` is False (its bits are
    unchanged where ``ok`` is a True flag); False if it has no room (an empty all-reduce): the next one carries it."""
    if isinstance(request, GatherRequest):
        flag = request.tensor.view(-1)[-1:]  # reserved, zero
        if isinstance(ok, bool):
            flag.fill_(1)
        else:
            flag.copy_(ok.logical_not())
        return True
    if not request.tensor.numel():
        return False
    first = request.tensor.view(-1)[:1]
    if isinstance(ok, bool):
        first.fill_(float("nan"))
    else:
        first.copy_(torch.where(ok, first, float("nan")))
    return True


def check_state_tensors(owner: str, what: str, saved: Any, shapes: Sequence[Sequence[int] | None]) -> None:
    """A saved list of per-parameter tensors fits: one entry per parameter, each None or a finite tensor of
    the expected shape (None in ``shapes``: the entry must be None). Raises ValueError naming the first misfit."""
    if not isinstance(saved, list | tuple) or len(saved) != len(shapes):
        n = len(saved) if isinstance(saved, list | tuple) else type(saved).__name__
        raise ValueError(f"{owner} state_dict has {n} {what}, expected one per parameter ({len(shapes)})")
    for i, (t, shape) in enumerate(zip(saved, shapes, strict=True)):
        if t is None:
            continue
        if shape is None or not isinstance(t, torch.Tensor) or list(t.shape) != list(shape):
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{owner} state_dict's {what}[{i}] is {got}, expected {None if shape is None else list(shape)}"
            )
        if t.is_complex():  # its NaN or Inf would pass the check below and survive the cast to the buffer's dtype
            raise ValueError(f"{owner} state_dict's {what}[{i}] is a {t.dtype} tensor, expected real numbers")
        if t.is_floating_point() and not all_finite([t]):
            raise ValueError(f"{owner} state_dict's {what}[{i}] holds NaN or Inf: refusing to resume from it")


def check_state_counts(owner: str, what: str, saved: Any, n: int) -> list[int]:
    """A saved list of ``n`` step counters (one per parameter): each a non-negative int (not a bool); returns it as
    a new list. Raises ValueError naming the first misfit: a shorter list would fail inside a later step, a negative
    count would restart a warm-up."""
    if not isinstance(saved, list | tuple) or len(saved) != n:
        got = len(saved) if isinstance(saved, list | tuple) else type(saved).__name__
        raise ValueError(f"{owner} state_dict has {got} {what}, expected one per parameter ({n})")
    for i, x in enumerate(saved):
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise ValueError(f"{owner} state_dict's {what}[{i}] is {x!r:.40}, expected a count (an int >= 0)")
    return list(saved)


def named_trainable(
    params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[torch.Tensor]]:
    """Accept ``model.parameters()`` or ``model.named_parameters()``; keep those that require grad."""
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    seen: dict[int, str] = {}
    for i, item in enumerate(params):
        name, p = item if isinstance(item, tuple) else (f"param[{i}]", item)
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"Expected parameters (tensors), got {type(p).__name__} for {name}")
        if id(p) in seen:  # its gradient would be sent, and its error fed back, twice
            raise ValueError(f"Parameter {name} is listed twice (also as {seen[id(p)]}): pass each parameter once")
        seen[id(p)] = name
        if p.requires_grad:
            if not p.is_floating_point():
                raise ValueError(f"Gradient compression needs floating-point parameters; {name} is {p.dtype}")
            names.append(name)
            tensors.append(p)
    return names, tensors


def placeholder(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A trainable tensor of ``shape`` with ``like``'s dtype and device that owns no memory: what a compressor is
    built from when it averages something other than a model's parameters (shards, node means): compressors read
    only the shapes, dtypes and device of their parameters."""
    return torch.zeros((), dtype=like.dtype, device=like.device, requires_grad=True).expand(*shape)


class Compressor(abc.ABC):
    """Averages gradients over the ranks of a process group, lossily, with error feedback.

    A compressor is built for a fixed list of trainable parameters and owns all of its state, kept per
    parameter: error buffers (what it failed to send so far), factors, counters, random generators. Any
    subset of its parameters can be aggregated in one call (a DDP bucket, an FSDP group). Each
    compressor reports the bytes it sends through ``self.comm.stats``.

    Subclasses call ``super().__init__(params, group=group)`` first and implement :meth:`program`,
    :meth:`state_dict` and :meth:`load_state_dict`.
    """

    comm: Communicator
    params: list[torch.Tensor]
    names: list[str]
    #: False where a step can be exact (lossless fp32): then nothing is owed between steps.
    lossy: bool = True
    #: Whether its messages have a reduce-scatter form (each rank can be handed only its rows of the average): what
    #: FSDP2's and SimpleFSDP's sharded gradients need.
    reduce_scatter: bool = False
    #: Its per-parameter state, for drivers that undo a commit (``powertrain.compress.deferred``): the names of
    #: its lists of state tensors (one entry per parameter, None or a tensor that a commit *replaces* and never
    #: writes into), and of its lists of per-parameter counters (ints); None: a commit cannot be undone (a driver
    #: then reads the program's flag on the host, as :meth:`aggregate` does).
    replaced_state: tuple[str, ...] | None = None
    counted_state: tuple[str, ...] = ()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """``params``: the trainable parameters (or ``named_parameters()``) whose gradients it will average, in
        the order calls refer to them; ``group``: the ranks it averages over (default: the world)."""
        self.comm = Communicator(group)
        self.names, self.params = named_trainable(params)
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"All parameters must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self._shapes = [p.shape for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}

    @abc.abstractmethod
    def program(
        self, grads: Sequence[torch.Tensor], indices: Sequence[int] | None = None, *, rows: Rows = None
    ) -> Program:
        """The collectives that average ``grads`` (aligned with ``indices``, default all parameters).

        ``rows``, if given, asks for only rows ``lo:hi`` (dim 0) of each average (a rank's shard under
        FSDP); compressors that can, compute only those.
        """

    def aggregate(
        self, grads: Sequence[torch.Tensor], indices: Sequence[int] | None = None, *, rows: Rows = None
    ) -> list[torch.Tensor]:
        """Return the (approximate) mean over ranks of ``grads``.

        Args:
            grads: one gradient per parameter in ``indices``; not modified.
            indices: positions in ``self.params`` (default: all, in order).
            rows: per gradient, the ``(lo, hi)`` range of dim-0 rows wanted (default: all).

        What the approximation leaves out is kept in the compressor's error buffers and sent in later
        steps (error feedback).

        Raises:
            NonFiniteGradientError: on every rank, with all state untouched, if a gradient on any rank
                is non-finite.
        """
        return run_program(self.program(grads, indices, rows=rows), self.comm)

    def max_collectives_per_call(self) -> int:
        """The most collectives one :meth:`program` issues (hooks give each its own ordering slot)."""
        return 1

    def communicators(self) -> list[Communicator] | None:
        """The communicators a program's requests name (each at most once per call), for compressors that
        spread a call over several process groups; None: every request runs on ``comm`` (a hook gives the c-th
        collective of a call a group of its own)."""
        return None

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically: tensors, numbers, strings, lists, None."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; raises ValueError if it does not fit."""

    def indices_of(self, params: Iterable[torch.Tensor]) -> list[int]:
        """Positions of ``params`` in ``self.params`` (by identity); ValueError for unknown ones."""
        out = []
        for p in params:
            if id(p) not in self._index:
                raise ValueError(
                    f"A parameter of shape {tuple(p.shape)} was not given to this {type(self).__name__} (or "
                    "does not require grad); build the compressor from the same model's parameters"
                )
            out.append(self._index[id(p)])
        return out

    def reduce_gradients(self, *, skip_nonfinite: bool = False) -> bool:
        """Replace each parameter's ``.grad`` by the compressed mean over ranks, in place.

        A parameter whose ``.grad`` is None (unused this step) counts as a zero gradient, so that every
        rank takes part in the same collectives; it gets a ``.grad`` afterwards.

        Args:
            skip_nonfinite: if a gradient on any rank is NaN or Inf, leave the gradients and the
                compressor untouched and return False (skip the optimizer step, as AMP's GradScaler
                does) instead of raising :class:`NonFiniteGradientError`.

        Returns:
            True if the gradients were averaged, False if the step was skipped.
        """
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        try:
            averaged = self.aggregate(grads)
        except NonFiniteGradientError:
            if skip_nonfinite:
                return False
            raise
        for p, avg in zip(self.params, averaged, strict=True):
            if p.grad is None:  # its own storage: an output may be a view of the call's whole buffer
                p.grad = avg.to(p.dtype, copy=True)
            else:
                p.grad.copy_(avg)
        return True

    # ------------------------------------------------------------------ helpers for subclasses

    def _resolve(self, grads: Sequence[torch.Tensor], indices: Sequence[int] | None, rows: Rows = None) -> list[int]:
        """Validate a call's gradients (and ``rows``) against the parameters they belong to; return the
        positions."""
        idx = list(range(len(self.params))) if indices is None else list(indices)
        if len(grads) != len(idx):
            raise ValueError(
                f"Got {len(grads)} gradients for {len(idx)} parameters; pass one gradient per parameter that "
                "requires grad, in the order given to the constructor (or to indices=)"
            )
        if len(set(idx)) != len(idx) or any(not 0 <= i < len(self.params) for i in idx):
            raise ValueError(f"indices must be distinct positions in 0..{len(self.params) - 1}, got {idx}")
        for g, i in zip(grads, idx, strict=True):
            if g is None or g.shape != self._shapes[i]:
                got = None if g is None else tuple(g.shape)
                raise ValueError(f"Gradient for {self.names[i]} has shape {got}, expected {tuple(self._shapes[i])}")
        if rows is not None and len(rows) != len(idx):
            raise ValueError(f"rows= has {len(rows)} ranges for {len(idx)} gradients")
        return idx

    def _nonfinite_error(
        self, names: Sequence[str], grads: Sequence[torch.Tensor], errors: Iterable[torch.Tensor | None] = ()
    ) -> NonFiniteGradientError:
        rank = self.comm.rank
        bad = [name for name, g in zip(names, grads, strict=True) if not all_finite([g])]
        if not all_finite([e for e in errors if e is not None]):
            bad.append("<error buffer>")
        names_ = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        where = (
            f"non-finite gradient in {names_} on rank {rank}"
            if bad
            else f"gradients on rank {rank} are finite: another rank's were non-finite (or too large to compress), or "
            "a sum overflowed"
        )
        return NonFiniteGradientError(
            f"{type(self).__name__}: {where}; nothing was applied and the compressor state is unchanged "
            "(skip the step, lower the learning rate, or check the loss for overflow)"
        )
