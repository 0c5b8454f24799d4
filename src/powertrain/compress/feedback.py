"""Shared machinery of compressors that send a function of ``x = gradient + error`` (error feedback).

Per call, the gradients of the selected parameters and their error buffers are summed into one flat
float32 vector ``x``; a subclass's :meth:`ErrorFeedbackCompressor._exchange` sends a compressed form of
``x`` (one collective) and returns what its own message decodes to and the mean over ranks of all decoded
messages. The new error is ``x - own decoded message`` (classic error feedback, Seide et al. 2014;
Karimireddy et al. 2019), so ``mean(x) == returned mean + mean(new errors)``: nothing is lost.
"""

from __future__ import annotations

import abc
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from powertrain._compat import foreach_add_
from powertrain.compress.base import (
    Compressor,
    NonFiniteGradientError,
    Program,
    Request,
    Rows,
    guard_nonfinite,
    slice_rows,
)
from powertrain.ops.finite import all_finite
from powertrain.ops.flat import flat_views, pack

Exchange = Generator[Request, "torch.Tensor | None", tuple[torch.Tensor, torch.Tensor]]


class ErrorFeedbackCompressor(Compressor):
    """Base class: per-parameter error buffers, flat packing, transactions, state.

    Args:
        params: ``model.parameters()`` or ``model.named_parameters()``.
        group: process group (``None``: the default group).
        seed: seed of this compressor's random generator (see ``_shared_randomness``).
        error_dtype: dtype the error buffers are stored in.
    """

    #: True if every rank must draw the same random numbers (random-k); False gives each rank its own
    #: stream (stochastic rounding), seeded with ``seed + rank``.
    _shared_randomness = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
        error_dtype: torch.dtype = torch.float32,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"Invalid seed={seed!r}: must be an integer >= 0")
        self._init_params(params, group)
        self.error_dtype = error_dtype
        self._errors: list[torch.Tensor | None] = [None] * len(self.params)
        self._steps = [0] * len(self.params)
        self._generator = torch.Generator().manual_seed(seed + (0 if self._shared_randomness else self.comm.rank))

    @abc.abstractmethod
    def _exchange(self, x: torch.Tensor) -> Exchange:
        """Send a compressed ``x`` in one collective; return (own message decoded, mean of all decoded)."""

    def _new_error(self, x: torch.Tensor, sent: torch.Tensor, old: torch.Tensor, idx: list[int]) -> torch.Tensor:
        """The error to keep; classic error feedback keeps exactly what was not sent."""
        return x - sent

    @torch.no_grad()
    def program(
        self, grads: Sequence[torch.Tensor], indices: Sequence[int] | None = None, *, rows: Rows = None
    ) -> Program:
        idx = self._resolve(grads, indices)
        x = pack(grads, torch.float32, self.device)
        old = torch.zeros_like(x)
        pairs = [(v, e) for v, i in zip(flat_views(old, [self._shapes[i] for i in idx]), idx, strict=True)
                 if (e := self._errors[i]) is not None]  # fmt: skip
        if pairs:
            foreach_add_([v for v, _ in pairs], [e.view(v.shape) for v, e in pairs])
            x.add_(old)
        rng = self._generator.get_state()
        names = [self.names[i] for i in idx]

        def abort() -> NonFiniteGradientError:
            self._generator.set_state(rng)  # the step did not happen: nor did its random draws
            return self._nonfinite_error(names, grads, [self._errors[i] for i in idx])

        return guard_nonfinite(self._run(x, old, idx, grads, rows), local_ok=all_finite([x]), error=abort)

    def _run(
        self, x: torch.Tensor, old: torch.Tensor, idx: list[int], grads: Sequence[torch.Tensor], rows: Rows
    ) -> Program:
        sent, mean = yield from self._exchange(x)
        new = self._new_error(x, sent, old, idx).to(self.error_dtype)
        for i, e in zip(idx, flat_views(new, [self._shapes[i] for i in idx]), strict=True):
            self._errors[i] = e
            self._steps[i] += 1
        out = [m.to(g.dtype) for m, g in zip(flat_views(mean, [g.shape for g in grads]), grads, strict=True)]
        return slice_rows(out, rows)

    def residuals(self) -> list[torch.Tensor]:
        """Each parameter's error buffer (zeros before its first step), aligned with ``self.params``."""
        return [
            torch.zeros(s, dtype=self.error_dtype, device=self.device) if e is None else e.view(s)
            for s, e in zip(self._shapes, self._errors, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": type(self).__name__,
            "shapes": [list(s) for s in self._shapes],
            "errors": list(self._errors),
            "steps": list(self._steps),
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"kind", "shapes", "errors", "steps", "generator"} - set(state)
        if missing:
            raise ValueError(f"{type(self).__name__} state_dict is missing {sorted(missing)}")
        shapes = [list(s) for s in self._shapes]
        if state["kind"] != type(self).__name__ or [list(s) for s in state["shapes"]] != shapes:
            raise ValueError(
                f"state_dict of a {state['kind']} for shapes {state['shapes']} does not fit this "
                f"{type(self).__name__} for {shapes}"
            )
        self._errors = [None if e is None else e.to(self.device, self.error_dtype, copy=True) for e in state["errors"]]
        self._steps = [int(s) for s in state["steps"]]
        self._generator.set_state(state["generator"])
