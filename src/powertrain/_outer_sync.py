"""Local updates' synchronisation, one at a time: the anchors, the outer optimizer, and the compressor's program for
a fragment's pseudo-gradients run as a chain of futures (:mod:`powertrain.compress.chain`) while training goes on.
:class:`powertrain.diloco.DiLoCo` decides when a fragment starts and when its update is applied; this class does both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from powertrain.comm import CommStats
from powertrain.compress.base import Compressor
from powertrain.compress.chain import ChainedCalls, sequencer_for

__all__ = ["OuterSync", "Pending"]


@dataclasses.dataclass
class Pending:
    """A fragment's synchronisation: in flight (``future``), or arrived and not yet applied (``average``)."""

    fragment: int
    due: int  # its outer update is applied after this inner step
    future: torch.futures.Future | None
    average: list[torch.Tensor] | None = None


class OuterSync:
    """The anchors of ``local`` (this rank's tensors), SGD with Nesterov momentum at ``lr`` / ``momentum`` on them, and
    ``compressor`` averaging the pseudo-gradients ``anchor - local`` of one of ``fragments`` (lists of positions) at a
    time over the replicas."""

    def __init__(
        self,
        compressor: Compressor,
        local: Sequence[torch.Tensor],
        fragments: list[list[int]],
        *,
        lr: float,
        momentum: float,
    ) -> None:
        self.compressor = compressor
        self.fragments = fragments
        self._calls = ChainedCalls(sequencer_for(compressor, calls_overlap=False))  # one sync in flight at a time
        with torch.no_grad():
            self.anchors = [t.detach().clone() for t in local]
        self.outer = torch.optim.SGD(self.anchors, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.pending: Pending | None = None
        self.syncs = 0  # fragment synchronisations applied
        self.waited_s = 0.0  # compute time lost waiting for syncs that had not arrived when due
        self.late = 0  # how many syncs had not arrived when due

    @property
    def stats(self) -> CommStats:
        return self.compressor.comm.stats

    @torch.no_grad()
    def reanchor(self, local: Sequence[torch.Tensor]) -> None:
        """Take ``local`` as every anchor (the replicas trained as one until now)."""
        for a, t in zip(self.anchors, local, strict=True):
            a.copy_(t)

    @torch.no_grad()
    def start(self, f: int, local: Sequence[torch.Tensor], due: int) -> None:
        """Launch fragment ``f``'s sync: its first collective is issued now, later ones as earlier ones complete."""
        assert self.pending is None, "one sync in flight at a time (delay < sync_every / fragments)"
        idx = self.fragments[f]
        delta = [self.anchors[i] - local[i] for i in idx]

        def done(average: list[torch.Tensor]) -> None:
            chain.future.set_result(average)

        device = delta[0].device if delta else None  # a CUDA future: its waiter's streams wait for the callbacks'
        chain = self._calls.chain(self.compressor.program(delta, idx), done, device)
        self.pending = Pending(f, due, chain.start())

    def wait(self, *, lost: bool) -> Pending:
        """The sync in flight, arrived (waiting for it if needed; counted as compute lost to the link if ``lost``)."""
        pending = self.pending
        assert pending is not None, "a sync to wait for"
        if pending.future is not None:
            arrived = pending.future.done()
            t0 = time.perf_counter()
            try:
                pending.average = pending.future.wait()
            except BaseException as e:
                error = self._calls.take_error() or e
                self.pending = None
                raise error from None
            if lost and not arrived:
                waited = time.perf_counter() - t0
                self.late += 1
                self.waited_s += waited
                self.stats.add_time(comm_s=waited)
            pending.future = None
        self.pending = None
        return pending

    @torch.no_grad()
    def apply(self, pending: Pending, local: Sequence[torch.Tensor], mix: float, lr_scale: float = 1.0) -> None:
        """The outer step of the fragment's anchors with the averaged pseudo-gradient, at ``lr_scale`` times the outer
        learning rate; ``local`` takes the result, mixed with its own values by ``mix`` (0: the anchors as they
        are)."""
        assert pending.average is not None, "an arrived sync"
        idx = self.fragments[pending.fragment]
        for a in self.anchors:
            a.grad = None
        for i, avg in zip(idx, pending.average, strict=True):
            self.anchors[i].grad = avg.to(self.anchors[i].dtype)
        group = self.outer.param_groups[0]
        lr = group["lr"]
        group["lr"] = lr * lr_scale  # for this step only: the state keeps the configured rate
        try:
            self.outer.step()
        finally:
            group["lr"] = lr
        for i in idx:
            a, t = self.anchors[i], local[i]
            a.grad = None
            if mix:
                t.mul_(mix).add_(a, alpha=1 - mix)
            else:
                t.copy_(a)
        self.syncs += 1

    # ------------------------------------------------------------------ state

    def settled_pending(self) -> dict[str, Any] | None:
        """The sync in flight, waited for and kept (arrived, to be applied when due), as state; None without one."""
        if self.pending is None:
            return None
        got = self.wait(lost=False)
        self.pending = got
        return {"fragment": got.fragment, "due": got.due, "average": list(got.average or [])}

    def drain(self) -> None:
        """Let a sync in flight end before a load: its program would commit the compressor's state over the loaded
        one; what it brings is replaced by the loaded state anyway."""
        in_flight = self.pending.future if self.pending is not None else None
        if in_flight is not None:
            with contextlib.suppress(BaseException):
                in_flight.wait()
            self._calls.take_error()

    @torch.no_grad()
    def restore(self, anchors: Sequence[torch.Tensor], syncs: int, pending: Mapping[str, Any] | None) -> None:
        """Take checked saved anchors, count and sync in flight (the compressor and the outer optimizer load their own
        state); every rank counts its calls afresh."""
        for a, saved in zip(self.anchors, anchors, strict=True):
            a.copy_(saved)
        self.syncs = syncs
        self._calls.restart()  # no sync in their queues
        self.pending = None
        if pending is not None:
            f = pending["fragment"]
            average = [
                t.to(self.anchors[i].device, self.anchors[i].dtype, copy=True)
                for i, t in zip(self.fragments[f], pending["average"], strict=True)
            ]
            self.pending = Pending(f, pending["due"], None, average)
