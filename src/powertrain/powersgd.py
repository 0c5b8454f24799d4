"""Drop-in replacement for the reference PowerSGD API (github.com/epfml/powersgd).

Usage, unchanged from the reference README::

    from powertrain.powersgd import PowerSGD, Config, optimizer_step

    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    powersgd = PowerSGD(params, config=Config(rank=1, min_compression_rate=10,
                                              num_iters_per_step=2, start_compressing_after_num_steps=0))
    for batch in loader:
        loss = ...
        loss.backward()                      # no optimizer.zero_grad(): p.grad holds the residual
        optimizer_step(optimizer, powersgd)

In this API the error-feedback residual lives in ``p.grad`` between steps, as in the reference. To
checkpoint it, save ``powersgd.state_dict()``: it holds the factors, counters, generator state *and* a
copy of the residuals, and ``load_state_dict`` puts the residuals back into ``p.grad``.

Differences from the reference, all fixes:

* bf16/fp16 parameters work (factors and communication in fp32; the reference crashes);
* a parameter list with nothing worth compressing works (the reference raises IndexError);
* exactly low-rank gradients never give NaN (Householder QR, not Gram-Schmidt with epsilon 0);
* uncompressed tensors are averaged exactly and their residual is zero (no error growth);
* the compression rate is judged on the matrix actually compressed (conv weights as
  ``out x in*kh*kw``); 1-D tensors are never compressed;
* parameters that do not require grad are left out, and a trainable parameter whose ``.grad`` is None
  counts as a zero gradient, so all ranks always run the same collectives;
* a NaN/Inf gradient on any rank raises :class:`~powertrain.compress.NonFiniteGradientError` on every rank before any
  factor changes, instead of spreading into all models. (In this API the residual in ``p.grad`` has
  already been summed with the bad gradient by ``backward``, so a step cannot simply be skipped: use
  :class:`~powertrain.compress.PowerSGDCompressor`, which keeps its residual apart, for that.)
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from powertrain.comm import Communicator
from powertrain.compress.base import check_state_tensors, run_program
from powertrain.compress.powersgd import Config, PowerSGDCompressor
from powertrain.ops.flat import flat_views, pack

__all__ = ["Aggregator", "AllReduce", "Config", "PowerSGD", "optimizer_step"]


class Aggregator(abc.ABC):
    """The reference's one-method interface for what averages gradients over ranks (:class:`AllReduce` exactly,
    :class:`PowerSGD` compressed): subclass it to plug another into code written against the reference."""

    @abc.abstractmethod
    def aggregate(self, gradients: list[torch.Tensor]) -> list[torch.Tensor]:
        """Average ``gradients`` over ranks; overwrite each input with what was not sent (or zero)."""


class AllReduce(Aggregator):
    """Exact averaging in one flat all-reduce; sets its inputs to zero, as the reference does.

    Args:
        group: process group to average over (keyword-only; ``None``, the default, is the default group).
    """

    def __init__(self, *, group: dist.ProcessGroup | None = None) -> None:
        self.comm = Communicator(group)

    @torch.no_grad()
    def aggregate(self, gradients: list[torch.Tensor]) -> list[torch.Tensor]:
        """The exact mean over ranks (new tensors, each in its input's dtype; summed in float32, float64 if any input
        is); each input is then zeroed: nothing is owed."""
        if not gradients:
            return []
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in gradients) else torch.float32
        buf = pack(gradients, dtype, gradients[0].device)
        self.comm.all_reduce_mean_(buf)
        out = [v.to(g.dtype) for v, g in zip(flat_views(buf, [g.shape for g in gradients]), gradients, strict=True)]
        for g in gradients:
            g.zero_()
        return out


class PowerSGD(Aggregator):
    """PowerSGD with the reference API: the residual is kept in the gradients passed to ``aggregate``.

    Args:
        params: the parameters, in the order their gradients will be passed to :meth:`aggregate`.
        config: see :class:`~powertrain.compress.powersgd.Config` (reference defaults).
        group: process group to average over (keyword-only; ``None`` is the default group).
    """

    def __init__(
        self, params: Iterable[torch.Tensor], config: Config, *, group: dist.ProcessGroup | None = None
    ) -> None:
        self.params = list(params)
        self.config = config
        self._trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        # the exactly averaged tensors get their own all-reduce, as in the reference
        self.compressor = PowerSGDCompressor(
            [(f"param[{i}]", p) for i, p in enumerate(self.params)], config=config, group=group, fuse_exact=False
        )

    @property
    def step_counter(self) -> int:
        """Steps averaged so far (the compressor's ``num_steps``), as the reference counts them for its warm-up."""
        return self.compressor.num_steps

    @property
    def comm(self) -> Communicator:
        """The compressor's communicator; its ``stats`` count the bytes and collectives sent."""
        return self.compressor.comm

    def aggregate(self, gradients: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:  # type: ignore[override]
        """Approximate mean over ranks; each input gradient is overwritten with its new residual.

        ``gradients`` align with the constructor's ``params``; entries of parameters that do not
        require grad are ignored (pass None) and come back as None.
        """
        if len(gradients) != len(self.params):
            raise ValueError(
                f"Got {len(gradients)} gradients for the {len(self.params)} parameters PowerSGD was built with"
            )
        grads = []
        for i in self._trainable:
            g = gradients[i]
            if g is None:
                raise ValueError(
                    f"Gradient of param[{i}] (shape {tuple(self.params[i].shape)}) is None; pass zeros for "
                    "unused parameters, or use optimizer_step, which does"
                )
            grads.append(g)
        # The gradients already hold last step's residual (p.grad accumulates into it) and the compressor owes
        # nothing of its own; its new residual goes back into them (zero where a tensor was averaged exactly).
        averaged = run_program(self.compressor.program(grads), self.compressor.comm)
        self.compressor.pop_residuals(into=grads)
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for i, a in zip(self._trainable, averaged, strict=True):
            out[i] = a
        return out

    def state_dict(self) -> dict[str, Any]:
        """Compressor state plus a copy of the residuals currently in ``p.grad``."""
        residuals = [None if p.grad is None else p.grad.detach().clone() for p in self.compressor.params]
        return {"compressor": self.compressor.state_dict(), "residuals": residuals}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the compressor and put the saved residuals back into ``p.grad``."""
        missing = {"compressor", "residuals"} - set(state)
        if missing:
            raise ValueError(f"PowerSGD state_dict is missing {sorted(missing)}")
        residuals = state["residuals"]
        # checked before anything changes: a state that does not fit leaves this PowerSGD as it was
        check_state_tensors("PowerSGD", "residuals", residuals, [p.shape for p in self.compressor.params])
        self.compressor.load_state_dict(state["compressor"])
        for p, r in zip(self.compressor.params, residuals, strict=True):
            p.grad = None if r is None else r.to(p.device, p.dtype, copy=True)


def _params_in_optimizer(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_step(optimizer: torch.optim.Optimizer, aggregator: Aggregator) -> None:
    """Average the gradients with ``aggregator``, take an optimizer step, then restore the residuals.

    With :class:`PowerSGD`, gradients are gathered in the order the aggregator was built with (so an
    optimizer listing its parameters in another order, or in several groups, is fine) and a trainable
    parameter with no ``.grad`` gets a zero one.

    Args:
        optimizer: steps on the averaged gradients (in ``p.grad`` during the step); with :class:`PowerSGD`, its
            trainable parameters must all be ones PowerSGD was built with (else ValueError).
        aggregator: what averages the gradients: :class:`PowerSGD`, :class:`AllReduce` or another :class:`Aggregator`.
    """
    if isinstance(aggregator, PowerSGD):
        params = aggregator.params
        known = {id(p) for p in params}
        for j, p in enumerate(_params_in_optimizer(optimizer)):
            if id(p) not in known and p.requires_grad:
                raise ValueError(
                    f"Optimizer parameter #{j} (shape {tuple(p.shape)}) was not given to PowerSGD(params, ...); "
                    "build both from the same parameter list"
                )
        grads: list[torch.Tensor | None] = []
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad if p.requires_grad else None)
        averaged: list[torch.Tensor | None] = aggregator.aggregate(grads)
    else:
        params = _params_in_optimizer(optimizer)
        grads = [p.grad for p in params]
        averaged = list(aggregator.aggregate(grads))  # type: ignore[arg-type]
    for p, a in zip(params, averaged, strict=True):
        if a is not None:
            p.grad = a
    try:
        optimizer.step()
    finally:
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                p.grad = g
