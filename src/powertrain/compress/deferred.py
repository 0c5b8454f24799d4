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
  what the host changed for the calls whose flag is False (the per-parameter counters, state entries that were
  None) and raises :class:`~powertrain.compress.NonFiniteGradientError`, out of ``loss.backward()``, before any
  optimizer step. The calls of that backward whose inputs were finite on every rank keep their commits, as the
  buckets of a DDP step do beside a failed one: a parameter's state is always one of a whole call's.

A backward that raises before its end (its final callback never runs) has its calls settled when autograd lets go
of that callback: the failed ones undone, nothing raised (the backward raised already). Nested backwards (reentrant
checkpointing) and backwards in other threads each settle their own calls.

The price: one pass over the replaced state tensors per call (PowerSGD's and the quantizers' error buffers), and an
error that names the call's parameters and whether this rank's input was finite, but not which gradient held NaN
(the inputs are freed by then; a synchronous :meth:`~powertrain.compress.Compressor.aggregate` names it).

Outside backward (no autograd graph task) and for compressors whose commit cannot be undone
(:attr:`~powertrain.compress.Compressor.replaced_state` None) the flag is read at once, as ``aggregate`` does.
"""

from __future__ import annotations

import threading
import weakref
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
    program with the guard's flag handed here instead of read (``Verdict``). Then either :meth:`mask` (the decision
    left to the device: each state tensor the commit replaced keeps its new values only where the flag is True, and
    :meth:`undo` puts back the host's side if it turns out False) or, where the host decides, :meth:`restore` (put
    everything back) or :meth:`release`. Needs ``compressor.replaced_state``; a commit must replace those tensors,
    never write into them (checked: their version counters)."""

    def __init__(self, compressor: Compressor, indices: Sequence[int]) -> None:
        fields = compressor.replaced_state
        if fields is None:
            raise ValueError(f"{type(compressor).__name__} cannot undo a commit (its replaced_state is None)")
        self.compressor, self.indices, self.verdict = compressor, list(indices), Verdict()
        self._before = {name: [getattr(compressor, name)[i] for i in self.indices] for name in fields}
        self._versions = [t._version for old in self._before.values() for t in old if t is not None]
        self._counts = [(name, i, getattr(compressor, name)[i]) for name in compressor.counted_state for i in indices]
        self._unset: list[tuple[str, int]] = []
        self.event: torch.cuda.Event | None = None  # where the flag is made (CUDA): a reader's stream waits for it

    def run(self, step: Callable[[], _T]) -> _T:
        """``step()`` (an advance of the call's program) with its guard's read handed to this transaction."""
        token = _VERDICT.set(self.verdict)
        try:
            return step()
        finally:
            _VERDICT.reset(token)

    def _check_untouched(self) -> None:
        versions = [t._version for old in self._before.values() for t in old if t is not None]
        if versions != self._versions:  # a bug in the compressor: its commit cannot be undone
            raise RuntimeError(
                f"{type(self.compressor).__name__} wrote into its old state during a call: its replaced_state must "
                "hold tensors that a commit replaces"
            )

    def mask(self) -> None:
        """The program ended: each state tensor its commit replaced takes the old one's values where the flag is
        False (nothing is read on the host); the old tensors are let go."""
        ok = self.verdict.ok
        assert ok is not None, "mask() follows a program that handed its flag over"
        self._check_untouched()
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
        self._before.clear()
        if ok.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def undo(self) -> None:
        """The flag was False: the host's side of the commit is put back too (after :meth:`mask`)."""
        for name, i, count in self._counts:
            getattr(self.compressor, name)[i] = count
        for name, i in self._unset:
            getattr(self.compressor, name)[i] = None

    def restore(self) -> None:
        """The host decided against the commit: every state entry and counter as before the call."""
        self._check_untouched()
        for name, before in self._before.items():
            state = getattr(self.compressor, name)
            for i, old in zip(self.indices, before, strict=True):
                state[i] = old
        self._before.clear()
        self.undo()  # the counters (no entry was unset: nothing was masked)

    def release(self) -> None:
        """The host decided for the commit: the old tensors are let go."""
        self._check_untouched()
        self._before.clear()


class _Backward:
    """The deferred calls of one backward (an autograd graph task), settled by its final callback, or, if that never
    runs (the backward raised first), when the graph task lets go of the callback (a finalizer: nothing to raise
    then, the backward already did)."""

    def __init__(self) -> None:
        self.calls: list[Transaction] = []
        self.settled = [False]  # shared with the finalizer, which must not hold this object
        weakref.finalize(self, _settle, self.calls, self.settled).atexit = False  # not at exit: nothing to resume

    def resolve(self) -> None:
        failed = _settle(self.calls, self.settled)
        if failed:
            raise _error(failed)


_LOCK = threading.Lock()
#: each running backward's calls, by graph task id; only its queued callback holds one (weak values: the callback
#: dropped, the entry goes)
_BACKWARDS: weakref.WeakValueDictionary[int, _Backward] = weakref.WeakValueDictionary()


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
        txn.release()
        return out
    txn.mask()
    with _LOCK:
        backward = _BACKWARDS.get(task)
        first = backward is None
        if backward is None:
            backward = _BACKWARDS[task] = _Backward()
        backward.calls.append(txn)
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(backward.resolve)
    return out


def _settle(calls: list[Transaction], settled: list[bool]) -> list[Transaction]:
    """Read the calls' flags (one host read per device when all are finite) and undo each call whose flag is False
    (the others committed, as a DDP bucket's program does beside a failed one); return those. Once."""
    if settled[0]:
        return []
    settled[0] = True
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for c in calls:
        assert c.verdict.ok is not None, "a pending call has its flag"
        if c.event is not None:  # made on another stream (FSDP2's reduce-scatter stream): wait for it there
            torch.cuda.current_stream(c.verdict.ok.device).wait_event(c.event)
        by_device.setdefault(c.verdict.ok.device, []).append(c.verdict.ok)
    if all(read_flag(torch.stack(flags).all()) for flags in by_device.values()):
        return []
    failed = [c for c in calls if not read_flag(c.verdict.ok)]  # type: ignore[arg-type]
    for c in reversed(failed):
        c.undo()
    return failed


def _error(failed: list[Transaction]) -> NonFiniteGradientError:
    here = [c for c in failed if not read_flag(c.verdict.local)]
    first = (here or failed)[0]
    names = [c.compressor.names[i] for c in (here or failed) for i in c.indices]
    what = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    rank = first.compressor.comm.rank
    where = (
        f"a non-finite gradient (or one too large to compress) among {what} on rank {rank}"
        if here
        else f"gradients on rank {rank} are finite: another rank's among {what} were not (or too large to "
        "compress), or a sum overflowed"
    )
    return NonFiniteGradientError(
        f"{type(first.compressor).__name__}: {where}; every rank raises at the end of backward, and the calls that "
        "saw it left the compressor state as it was: skip the optimizer step (zero the gradients), lower the "
        "learning rate, or check the loss for overflow"
    )
