"""Any compressor as a DistributedDataParallel communication hook, overlapped with backward.

``register_compressor(ddp_model, compressor)`` installs a comm hook (``register_comm_hook`` under the
hood). For each gradient bucket DDP hands over, the compressor's collective program runs as a chain of
futures: the first collective is launched from the hook (so backward goes on computing the next
buckets), every later step runs in the completion callback of the previous collective and never blocks
on a future.

Collective order. Collectives must be issued in the same order on every rank. The first collective of
each bucket is issued from the hook, which DDP calls in bucket order. The c-th collective of a bucket
(c >= 1) is issued from a callback thread, where completion order can differ between ranks: torch's
PowerSGD hook on gloo deadlocks or mismatches exactly there. Here the c-th collectives use a process
group of their own, and a sequencer issues them strictly in bucket order (a bucket whose program ends
early releases its later slots). Compressors with one collective per bucket (all but PowerSGD with
several iterations or the paper variant) need no extra group.

State lives in the compressor, per parameter, so DDP's bucket rebuild after the first iteration, or a
different bucketing on resume, loses nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from powertrain.comm import Communicator
from powertrain.compress.base import Compressor, GatherRequest, Program, Request

__all__ = ["DDPCompressionHook", "Rewrapped", "local_gradients", "register_compressor"]


class _Sequencer:
    """Issues the collectives of every call on each communicator in call order (a call uses each at most once)."""

    def __init__(self, comms: list[Communicator]) -> None:
        self.comms = comms
        self._lock = threading.Lock()
        self._next = [0] * len(comms)  # next call number allowed to issue on each phase
        self._pending: list[dict[int, Callable[[], Callable[[], None]]]] = [{} for _ in comms]
        self._skipped: list[set[int]] = [set() for _ in comms]

    def key(self, comm: Communicator) -> int:
        """The position of ``comm`` (a communicator a request named) in this sequencer's list."""
        for k, c in enumerate(self.comms):
            if c is comm:
                return k
        raise RuntimeError("a compressor's request named a communicator its communicators() does not list")

    def submit(self, phase: int, call: int, launch: Callable[[], Callable[[], None]]) -> None:
        """``launch()`` issues the collective and returns what to run outside the lock (attach its completion
        callback); it must not raise. ``phase``: the communicator's position."""
        with self._lock:
            self._pending[phase][call] = launch
            attach = self._drain(phase)
        for a in attach:  # outside the lock: a completed future runs its callback inline
            a()

    def finish(self, call: int, used: set[int]) -> None:
        """Call ``call`` issued collectives on the communicators ``used`` and will issue no more."""
        attach: list[Callable[[], None]] = []
        with self._lock:
            for phase in set(range(len(self.comms))) - used:
                self._skipped[phase].add(call)
                attach += self._drain(phase)
        for a in attach:
            a()

    def _drain(self, phase: int) -> list[Callable[[], None]]:
        attach = []
        pending, skipped = self._pending[phase], self._skipped[phase]
        while True:
            n = self._next[phase]
            if n in skipped:
                skipped.discard(n)
            elif n in pending:
                attach.append(pending.pop(n)())  # issue now, under the lock: this fixes the order
            else:
                return attach
            self._next[phase] = n + 1


class _Chain:
    """Runs one program: each collective's completion advances the program to the next one."""

    def __init__(self, program: Program, seq: _Sequencer, call: int, done: Callable[[list[torch.Tensor]], None],
                 failed: Callable[[BaseException], None]) -> None:  # fmt: skip
        self.program, self.seq, self.call, self.done, self.failed = program, seq, call, done, failed
        self.future: torch.futures.Future = torch.futures.Future()
        self.phase = 0  # collectives issued so far
        self.used: set[int] = set()  # the communicators they used

    def _fail(self, e: BaseException) -> None:
        # ``failed`` first: a waiter on the future (DDP's backward) may ask what failed as soon as it is set
        self.failed(e)
        self.future.set_exception(e)

    def _abort(self, e: BaseException) -> None:
        """Fail mid-program: its later collective slots are released (other calls go on), then the future fails."""
        with contextlib.suppress(BaseException):  # the program's own clean-up failed too: ``e`` is what to report
            self.program.close()
        self.seq.finish(self.call, self.used)
        self._fail(e)

    def start(self) -> torch.futures.Future:
        self._advance(None)
        return self.future

    def _advance(self, value: torch.Tensor | None) -> None:
        t0 = time.perf_counter()
        try:
            request = next(self.program) if self.phase == 0 else self.program.send(value)
            self.seq.comms[0].stats.add_time(compress_s=time.perf_counter() - t0)
        except StopIteration as stop:
            self.seq.comms[0].stats.add_time(compress_s=time.perf_counter() - t0)
            self.seq.finish(self.call, self.used)
            try:
                self.done(stop.value)
            except BaseException as e:
                self._fail(e)
            return
        except BaseException as e:
            self.seq.finish(self.call, self.used)
            self._fail(e)
            return
        try:
            phase = self.phase if request.comm is None else self.seq.key(request.comm)
            if phase >= len(self.seq.comms) or phase in self.used:
                raise RuntimeError(
                    f"a compressor issued {self.phase + 1} collectives in one call but declared at most "
                    f"{len(self.seq.comms)} (max_collectives_per_call), or named one communicator twice"
                )
        except RuntimeError as e:
            self._abort(e)
            return
        self.phase += 1
        self.used.add(phase)
        self.seq.submit(phase, self.call, lambda: self._launch(phase, request))

    def _launch(self, phase: int, request: Request) -> Callable[[], None]:
        """Issue the collective (under the sequencer's lock); what to run outside it: attach the completion
        callback, or, if issuing failed, fail this call (its slot is used, so the calls after it go on)."""
        comm = self.seq.comms[phase]
        try:
            if isinstance(request, GatherRequest):
                out, fut = comm.all_gather(request.tensor, async_op=True)
            else:
                out, fut = None, comm.all_reduce_(request.tensor, request.op, async_op=True)
            assert fut is not None, "async collectives return a future"
        except BaseException as e:
            return functools.partial(self._abort, e)

        def attach() -> None:
            fut.then(lambda f: self._completed(f, out))

        return attach

    def _completed(self, fut: torch.futures.Future, out: torch.Tensor | None) -> None:
        try:
            fut.value()  # re-raises a failed collective (timeout, lost peer)
        except BaseException as e:
            self._abort(e)
            return
        self._advance(out)


@dataclasses.dataclass
class DDPCompressionHook:
    """The state of the hook that :func:`register_compressor` installed.

    Attributes:
        compressor: does the math and owns all state (error buffers, factors, counters).
    """

    compressor: Compressor
    _seq: _Sequencer
    _calls: int = 0
    _error: BaseException | None = None

    def take_error(self) -> BaseException | None:
        """The exception a hook call failed with since the last call of this method (e.g. a
        :class:`~powertrain.compress.NonFiniteGradientError`), and forget it.

        DDP turns a failed hook into a ``RuntimeError`` that loses the exception's type (``Unable to cast ...``);
        catch that around ``backward()`` and ask here what happened."""
        error, self._error = self._error, None
        return error

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future:
        # in the compressor's parameter order, not the bucket's: DDP's first step after a (re)start orders a
        # bucket by parameter registration, later ones by backward, and at 3+ ranks a message packed in another
        # order is summed in another order (a resume was 1e-6 off). Which parameters share a bucket can still
        # differ on that first step (DDP rebuilds its buckets after it); measured bitwise for the default GPT at 4.
        order = sorted(zip(self.compressor.indices_of(bucket.parameters()), bucket.gradients(), strict=True),
                       key=lambda pair: pair[0])  # fmt: skip
        idx, grads = [i for i, _ in order], [g for _, g in order]
        buffer = bucket.buffer()

        def done(averaged: list[torch.Tensor]) -> None:
            for g, a in zip(grads, averaged, strict=True):
                g.copy_(a)
            chain.future.set_result(buffer)

        def failed(e: BaseException) -> None:
            self._error = self._error or e

        chain = _Chain(self.compressor.program(grads, idx), self._seq, self._calls, done, failed)
        self._calls += 1
        return chain.start()

    def state_dict(self) -> dict[str, Any]:
        return self.compressor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.compressor.load_state_dict(state)


def _comm_hook(fn: Callable[[Any, dist.GradBucket], torch.futures.Future]) -> Callable[..., Any]:
    """``fn`` with its annotations as objects: DDP checks a hook's, and this module's postponed (string)
    annotations would fail that check."""
    fn.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return fn


@_comm_hook
def _hook(state: DDPCompressionHook, bucket: dist.GradBucket) -> torch.futures.Future:
    return state(bucket)


@_comm_hook
def _keep_local(state: object, bucket: dist.GradBucket) -> torch.futures.Future:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def local_gradients(ddp_model: DistributedDataParallel) -> DistributedDataParallel:
    """Make ``ddp_model``'s backward leave every rank's own gradient in ``.grad``: no gradient communication
    (for optimizers that exchange something of their own, such as :class:`powertrain.optim.DeMo`).

    Registers a DDP comm hook that returns each bucket unchanged (DDP does not divide a hooked bucket by the
    world size, so ``.grad`` is exactly the local gradient). DDP still broadcasts parameters at construction
    and buffers before forward (``broadcast_buffers``), and with ``find_unused_parameters=True`` it still
    all-reduces its small bitmap of used parameters. A model without DDP, or ``ddp_model.no_sync()`` around
    every forward and backward (the reference DeMo's advice), has the same effect.

    Args:
        ddp_model: a DistributedDataParallel model without a comm hook yet (DDP allows only one).

    Returns:
        ``ddp_model``, for chaining.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(
            f"Invalid ddp_model of type {type(ddp_model).__name__}: local_gradients needs a "
            "DistributedDataParallel model (a plain model already keeps local gradients)"
        )
    ddp_model.register_comm_hook(None, _keep_local)
    return ddp_model


def register_compressor(ddp_model: DistributedDataParallel, compressor: Compressor) -> DDPCompressionHook:
    """Average ``ddp_model``'s gradients with ``compressor`` from now on (a DDP communication hook).

    Every rank must call this, in the same order as its other process-group creations (it may create
    process groups for compressors that issue several dependent collectives per bucket).

    Args:
        ddp_model: a ``DistributedDataParallel`` module without a comm hook yet.
        compressor: built from ``ddp_model.module``'s parameters (``parameters()`` or
            ``named_parameters()``), on DDP's process group.

    Returns:
        The hook's state; save its ``state_dict()`` with the model and optimizer to resume bit-identically.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(f"register_compressor needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if not isinstance(compressor, Compressor):
        raise ValueError(f"register_compressor needs a powertrain Compressor, got {type(compressor).__name__}")
    trainable = {id(p) for p in ddp_model.module.parameters() if p.requires_grad}
    if {id(p) for p in compressor.params} != trainable:
        raise ValueError(
            f"The compressor covers {len(compressor.params)} parameters but the DDP model trains {len(trainable)}; "
            "build it from ddp_model.module.named_parameters()"
        )
    ddp_group = ddp_model.process_group
    comp_group = compressor.comm.group or dist.group.WORLD
    if comp_group is not ddp_group and dist.get_process_group_ranks(comp_group) != dist.get_process_group_ranks(
        ddp_group
    ):
        raise ValueError("The compressor and the DDP model must use the same process group (pass group= to both)")
    comms = compressor.communicators()
    if comms is None:
        ranks = dist.get_process_group_ranks(ddp_group)
        comms = [compressor.comm] + [
            Communicator(dist.new_group(ranks=ranks), stats=compressor.comm.stats)
            for _ in range(compressor.max_collectives_per_call() - 1)
        ]
    state = DDPCompressionHook(compressor, _Sequencer(comms))
    ddp_model.register_comm_hook(state, _hook)
    return state


class Rewrapped:
    """One compressor for a model that a framework wraps in a new ``DistributedDataParallel`` now and then
    (Lightning on each fit, Hugging Face's ``Trainer`` on each ``train()`` and retry): built on the first
    wrapper's process group from the model's parameters, registered again on every new wrapper, its state
    (error feedback, step counter) kept. The integrations' callbacks are ``Rewrapped``: their ``compressor`` and
    ``hook`` are its attributes.

    Args:
        name, options: the compressor, as :func:`powertrain.compress.make_compressor` takes them.
    """

    def __init__(self, name: str, options: Mapping[str, Any]) -> None:
        self.name, self.options = name, dict(options)
        self.compressor: Compressor | None = None  # built on the first wrapper; .comm.stats counts what it sent
        self.hook: DDPCompressionHook | None = None
        self._ddp: DistributedDataParallel | None = None

    def registered_on(self, ddp_model: DistributedDataParallel) -> bool:
        return ddp_model is self._ddp

    def register(self, ddp_model: DistributedDataParallel, params: Iterable[Any]) -> tuple[Compressor, bool]:
        """Register on ``ddp_model`` (a new wrapper of the model whose ``named_parameters()`` are ``params``);
        returns the compressor and whether this call built it (its state is fresh)."""
        from powertrain.compress import make_compressor  # the registry imports every compressor

        built = self.compressor is None
        if self.compressor is None:
            self.compressor = make_compressor(self.name, params, group=ddp_model.process_group, **self.options)
        self.hook = register_compressor(ddp_model, self.compressor)
        self._ddp = ddp_model
        return self.compressor, built
