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
early releases its later slots): :mod:`powertrain.compress.chain`, which also drives the outer step of
:mod:`powertrain.diloco`. Compressors with one collective per bucket (all but PowerSGD with
several iterations or the paper variant) need no extra group.

State lives in the compressor, per parameter, so DDP's bucket rebuild after the first iteration, or a
different bucketing on resume, loses nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from powertrain.compress.base import Compressor
from powertrain.compress.chain import ChainedCalls, future_on, sequencer_for

__all__ = ["DDPCompressionHook", "Rewrapped", "local_gradients", "register_compressor"]


@dataclasses.dataclass
class DDPCompressionHook:
    """The state of the hook that :func:`register_compressor` installed.

    Attributes:
        compressor: does the math and owns all state (error buffers, factors, counters).
    """

    compressor: Compressor
    _calls: ChainedCalls
    _inflight: list[torch.futures.Future] = dataclasses.field(default_factory=list)  # the calls not known done

    def take_error(self) -> BaseException | None:
        """The exception a hook call failed with since the last call of this method (e.g. a
        :class:`~powertrain.compress.NonFiniteGradientError`), and forget it.

        DDP turns a failed hook into a ``RuntimeError`` that loses the exception's type (``Unable to cast ...``);
        catch that around ``backward()`` and ask here what happened. Returns once every call still in flight (DDP
        stops waiting at the first bucket that failed: the buckets after it, on gloo's threads or the chain's worker)
        has ended, failed or not, so that nothing writes into the gradients or the compressor's state after it."""
        inflight, self._inflight = self._inflight, []
        for fut in inflight:
            with contextlib.suppress(BaseException):  # a call that failed too: the first error is the one kept
                fut.wait()
        self._calls.seq.worker.wait_idle()
        return self._calls.take_error()

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future:
        # in the compressor's parameter order, not the bucket's: DDP's first step after a (re)start orders a
        # bucket by parameter registration, later ones by backward, and at 3+ ranks a message packed in another
        # order is summed in another order (a resume was 1e-6 off). Which parameters share a bucket can still
        # differ on that first step (DDP rebuilds its buckets after it); measured bitwise for the default GPT at 4.
        order = sorted(
            zip(self.compressor.indices_of(bucket.parameters()), bucket.gradients(), strict=True),
            key=lambda pair: pair[0],
        )
        idx, grads = [i for i, _ in order], [g for _, g in order]
        buffer = bucket.buffer()

        def done(averaged: list[torch.Tensor]) -> None:
            for g, a in zip(grads, averaged, strict=True):
                g.copy_(a)
            chain.future.set_result(buffer)

        chain = self._calls.chain(self.compressor.program(grads, idx), done, buffer.device)
        self._inflight = [f for f in self._inflight if not f.done()] + [chain.future]
        return chain.start()

    def state_dict(self) -> dict[str, Any]:
        """The compressor's ``state_dict()``: the hook keeps no state of its own worth saving."""
        return self.compressor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The compressor's ``load_state_dict``: restores what :meth:`state_dict` returned, or raises ValueError."""
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
    fut: torch.futures.Future[torch.Tensor] = future_on(bucket.buffer().device)
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
    state = DDPCompressionHook(compressor, ChainedCalls(sequencer_for(compressor, calls_overlap=True)))
    ddp_model.register_comm_hook(state, _hook)
    return state


class Rewrapped:
    """One compressor for a model that a framework wraps in a new ``DistributedDataParallel`` now and then
    (Lightning on each fit, Hugging Face's ``Trainer`` on each ``train()`` and retry): built on the first
    wrapper's process group from the model's parameters, registered again on every new wrapper, its state
    (error feedback, step counter) kept. The integrations' callbacks are ``Rewrapped``: their ``compressor`` and
    ``hook`` are its attributes.

    Args:
        name: the compressor's name, as :func:`powertrain.compress.make_compressor` takes it.
        options: its keyword options (copied), as :func:`powertrain.compress.make_compressor` takes them.
    """

    def __init__(self, name: str, options: Mapping[str, Any]) -> None:
        self.name, self.options = name, dict(options)
        self.compressor: Compressor | None = None  # built on the first wrapper; .comm.stats counts what it sent
        self.hook: DDPCompressionHook | None = None
        self._ddp: DistributedDataParallel | None = None

    def registered_on(self, ddp_model: DistributedDataParallel) -> bool:
        """Whether ``ddp_model`` is the wrapper :meth:`register` last registered on (by identity): False for a new
        wrapper, which needs :meth:`register`."""
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
