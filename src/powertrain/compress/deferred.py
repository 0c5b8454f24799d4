"""Running a compressor's program where the host must not wait for the device: its finiteness is read later, once.

FSDP2 runs a module's reduce-scatter inside backward, synchronously, on a stream of its own, and records an event
right after the call; SimpleFSDP's backward calls it the same way. A program run there whose last result is read on
the host (:func:`~powertrain.compress.base.guard_nonfinite`) holds backward's thread until the device has done
everything queued before it: on CUDA backward launches nothing more while the collective runs. No other thread can
take that read over, as :mod:`powertrain.compress.chain` does for DDP's hooks, since the caller's stream must hold
the whole program when the call returns. :func:`run_deferred` defers the read instead:

* the program runs to its end, commit included, with the flag its guard would read handed over instead (``Verdict``);
* the commit is masked on the device: each state tensor the commit replaced takes the old one's values back where
  the flag is False (``torch.where``, read by nothing), so a call with a non-finite input leaves the compressor's
  tensors as they were without the host knowing yet;
* at the end of backward (an autograd final callback, after FSDP2's own) every deferred flag of that backward is
  read, once. Each is the result of a collective, the same on every rank, so if one is False every rank puts back
  what the host changed (the per-parameter counters, state entries that were None) and raises
  :class:`~powertrain.compress.NonFiniteGradientError`, out of ``loss.backward()``, before any optimizer step.

The price: one pass over the replaced state tensors per call (PowerSGD's and the quantizers' error buffers), and an
error that names the call's parameters and whether this rank's input was finite, but not which gradient held NaN
(the inputs are freed by then; a synchronous :meth:`~powertrain.compress.Compressor.aggregate` names it).

Outside backward (no autograd graph task) and for compressors whose commit cannot be undone
(:attr:`~powertrain.compress.Compressor.replaced_state` None) the flag is read at once, as ``aggregate`` does.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from powertrain.compress.base import (
    _VERDICT,
    Compressor,
    NonFiniteGradientError,
    Rows,
    Verdict,
    run_program,
)
from powertrain.ops.finite import read_flag

__all__ = ["Transaction", "run_deferred"]

_T = TypeVar("_T")


class Transaction:
    """One call of ``compressor`` on parameters ``indices`` whose commit can be undone: :meth:`run` advances its
    program with the guard's flag handed here instead of read (``Verdict``), :meth:`mask` keeps the commit's state
    tensors only where that flag is True (on the device), :meth:`undo` puts back what the host changed (counters,
    entries that were None). Needs ``compressor.replaced_state``."""

    def __init__(self, compressor: Compressor, indices: Sequence[int]) -> None:
        fields = compressor.replaced_state
        if fields is None:
            raise ValueError(f"{type(compressor).__name__} cannot undo a commit (its replaced_state is None)")
        self.compressor, self.indices, self.verdict = compressor, list(indices), Verdict()
        self._before = {name: [getattr(compressor, name)[i] for i in self.indices] for name in fields}
        self._counts = [(name, i, getattr(compressor, name)[i]) for name in compressor.counted_state for i in indices]
        self._unset: list[tuple[str, int]] = []

    def run(self, step: Callable[[], _T]) -> _T:
        """``step()`` (an advance of the call's program) with its guard's read handed to this transaction."""
        token = _VERDICT.set(self.verdict)
        try:
            return step()
        finally:
            _VERDICT.reset(token)

    def mask(self) -> None:
        """The program ended: each state tensor its commit replaced takes the old one's values where the flag is
        False (nothing is read on the host)."""
        ok = self.verdict.ok
        assert ok is not None, "mask() follows a program that handed its flag over"
        for name, before in self._before.items():
            state = getattr(self.compressor, name)
            for i, old in zip(self.indices, before, strict=True):
                new = state[i]
                if new is old:
                    continue
                if old is None:
                    self._unset.append((name, i))
                else:
                    torch.where(ok, new, old, out=new)
        self._before.clear()  # the old tensors are not needed any more

    def undo(self) -> None:
        """The flag was False: the host's side of the commit is put back too (after :meth:`mask`)."""
        for name, i, count in self._counts:
            getattr(self.compressor, name)[i] = count
        for name, i in self._unset:
            getattr(self.compressor, name)[i] = None


_LOCK = threading.Lock()
_PENDING: dict[int, list[Transaction]] = {}  # autograd graph task -> its deferred calls, in call order


def run_deferred(
    compressor: Compressor, grads: Sequence[torch.Tensor], indices: Sequence[int] | None = None, *, rows: Rows = None
) -> list[torch.Tensor]:
    """``compressor.aggregate(grads, indices, rows=rows)`` whose finiteness check is left to the end of the
    backward this call runs in (see the module); the same outputs, state and collectives."""
    task = torch._C._current_graph_task_id()
    if compressor.replaced_state is None or task < 0:
        return compressor.aggregate(grads, indices, rows=rows)
    txn = Transaction(compressor, range(len(compressor.params)) if indices is None else indices)
    out = txn.run(lambda: run_program(compressor.program(grads, indices, rows=rows), compressor.comm))
    if txn.verdict.ok is None:  # decided on the host without waiting (a Python bool: no collective, or a known failure)
        return out
    txn.mask()
    with _LOCK:
        stale = [t for t in _PENDING if t != task]
        abandoned = [c for t in stale for c in _PENDING.pop(t)]
        calls = _PENDING.setdefault(task, [])
        first = not calls
        calls.append(txn)
    if abandoned:  # a backward that raised before its end: undo what failed, as its end would have
        _settle(abandoned)
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_resolve, task))
    return out


def _settle(calls: list[Transaction]) -> list[Transaction]:
    """Read the calls' flags (one host read per device when all are finite) and undo every call if one is not; return
    the calls whose flag was False."""
    flags = [c.verdict.ok for c in calls if c.verdict.ok is not None]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    if all(read_flag(torch.stack(flags).all()) for flags in by_device.values()):
        return []
    for c in reversed(calls):
        c.undo()
    return [c for c in calls if c.verdict.ok is not None and not read_flag(c.verdict.ok)]


def _resolve(task: int) -> None:
    """Backward ``task`` ended: raise on every rank if a deferred call's flag is False (its commits undone)."""
    with _LOCK:
        calls = _PENDING.pop(task, [])
    failed = _settle(calls)
    if not failed:
        return
    here = [c for c in failed if not read_flag(c.verdict.local)]
    first = (here or failed)[0]
    names = [c.compressor.names[i] for c in (here or failed) for i in c.indices]
    what = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    where = (
        f"a non-finite gradient (or one too large to compress) among {what} on rank {first.compressor.comm.rank}"
        if here
        else f"gradients on rank {first.compressor.comm.rank} are finite: another rank's among {what} were not (or "
        "too large to compress), or a sum overflowed"
    )
    raise NonFiniteGradientError(
        f"{type(first.compressor).__name__}: {where}; every rank raises at the end of backward, with the compressor "
        "state as it was before it: skip the optimizer step (zero the gradients), lower the learning rate, or check "
        "the loss for overflow"
    )
