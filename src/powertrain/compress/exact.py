"""Exact averaging in fp32, bf16 or fp16: the baselines every compressor must beat."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from powertrain.compress.base import Compressor, Program, ReduceRequest, Rows, guard_nonfinite, slice_rows
from powertrain.ops.finite import finite_flag
from powertrain.ops.flat import flat_views, pack

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AllReduceCompressor(Compressor):
    """One flat all-reduce of all gradients of a call, in ``dtype``.

    With float32 this is plain data parallelism (bitwise what DDP's default hook computes). With bf16 or
    fp16 each rank's gradient is rounded to 16 bits, divided by the world size (so fp16 cannot overflow in
    the sum) and summed in that dtype by the backend, as torch's ``fp16_compress_hook`` does; the rounding
    error is dropped, not fed back. gloo on torch >= 2.11 sums bf16 and fp16 natively, so nothing is cast
    behind the user's back.

    Args:
        params: ``model.parameters()`` or ``model.named_parameters()``; all on one device.
        dtype: what the gradients are summed in: float32 (the default), bfloat16 or float16.
        group: process group to average over (``None``, the default: the default group).
    """

    reduce_scatter = True
    replaced_state = ()  # nothing to undo

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        dtype: torch.dtype = torch.float32,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"Invalid dtype={dtype}: AllReduceCompressor supports {', '.join(map(str, _DTYPES))}")
        super().__init__(params, group=group)
        self.dtype = dtype
        self.lossy = dtype != torch.float32

    @torch.no_grad()
    def program(
        self, grads: Sequence[torch.Tensor], indices: Sequence[int] | None = None, *, rows: Rows = None
    ) -> Program:
        """One all-reduce (mean) of ``grads`` packed into one ``dtype`` buffer, cast back to each gradient's dtype;
        with ``rows`` only those rows of each average are returned. Nothing is kept between calls."""
        idx = self._resolve(grads, indices, rows)
        buf = pack(grads, self.dtype, self.device)
        names = [self.names[i] for i in idx]

        def run() -> Program:
            yield ReduceRequest(buf, "mean")
            dtypes = {g.dtype for g in grads}
            if len(dtypes) == 1:  # one cast of the buffer, not one per gradient
                out = flat_views(buf.to(dtypes.pop()), [g.shape for g in grads])
            else:
                out = [v.to(g.dtype) for v, g in zip(flat_views(buf, [g.shape for g in grads]), grads, strict=True)]
            return slice_rows(out, rows)

        return guard_nonfinite(run(), local_ok=finite_flag([buf]), error=lambda: self._nonfinite_error(names, grads))

    def state_dict(self) -> dict[str, Any]:
        """Only the class name and ``dtype``: nothing is owed between steps, so there is nothing else to resume."""
        return {"kind": type(self).__name__, "dtype": str(self.dtype)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check that ``state`` is an AllReduceCompressor's with this ``dtype`` (ValueError if not); nothing to
        restore."""
        if state.get("kind") != type(self).__name__ or state.get("dtype") != str(self.dtype):
            kind = state.get("kind")
            kind = kind[:60] if isinstance(kind, str) else "another compressor"
            raise ValueError(f"A state_dict of {kind} does not fit an AllReduceCompressor with dtype {self.dtype}")
