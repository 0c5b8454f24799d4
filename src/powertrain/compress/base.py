"""The compressor interface every gradient compressor implements, and its error type."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from powertrain.comm import Communicator

__all__ = ["Compressor", "NonFiniteGradientError", "named_trainable"]


class NonFiniteGradientError(FloatingPointError):
    """A gradient on some rank held NaN or Inf.

    Raised on *every* rank of the group (the check runs on the all-reduced buffers, which are identical
    everywhere), before the compressor changes any of its state, so catching it and skipping the
    optimizer step is safe: :meth:`Compressor.reduce_gradients` does that with ``skip_nonfinite=True``.
    """


def named_trainable(
    params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[torch.Tensor]]:
    """Accept ``model.parameters()`` or ``model.named_parameters()``; keep those that require grad."""
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    for i, item in enumerate(params):
        name, p = item if isinstance(item, tuple) else (f"param[{i}]", item)
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"Expected parameters (tensors), got {type(p).__name__} for {name}")
        if p.requires_grad:
            names.append(name)
            tensors.append(p)
    return names, tensors


class Compressor(abc.ABC):
    """Averages gradients over the ranks of a process group, lossily, with error feedback.

    A compressor is built for a fixed list of trainable parameters and owns all of its state: its
    error buffers (what it failed to send so far), factors, counters and random generators. Each
    implementation reports the bytes it sends through ``self.comm.stats``.
    """

    comm: Communicator
    params: list[torch.Tensor]
    names: list[str]

    @abc.abstractmethod
    def aggregate(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Return the (approximate) mean over ranks of ``grads``, aligned with ``self.params``.

        ``grads`` are not modified. What the approximation leaves out is added to the compressor's
        error buffers and sent in later steps (error feedback).

        Raises:
            NonFiniteGradientError: on every rank, with all state untouched, if a gradient on any rank
                is non-finite.
        """

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically: tensors, ints and strings only."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; raises ValueError if it does not fit."""

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
            if p.grad is None:
                p.grad = avg.to(p.dtype)
            else:
                p.grad.copy_(avg)
        return True
