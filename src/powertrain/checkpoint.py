"""Checkpointing compressor state with torch.distributed.checkpoint (DCP).

A compressor's state differs on every rank (each rank's error buffers hold what *its* gradients still
owe). DCP treats tensors saved under the same name on several ranks as replicas and keeps one copy, which
would silently drop the others. :class:`CompressorState` therefore stores each rank's state under its own
key, as one serialized blob, and reads it back with ``torch.load(weights_only=True)``. Resuming needs the
same world size (the error buffers cannot be redistributed meaningfully).

Usage::

    import torch.distributed.checkpoint as dcp
    from powertrain.checkpoint import CompressorState

    dcp.save({"model": model.state_dict(), "compressor": CompressorState(compressor)}, checkpoint_id=path)
    ...
    dcp.load({"model": model.state_dict(), "compressor": CompressorState(compressor)}, checkpoint_id=path)
"""

from __future__ import annotations

import io
from typing import Any

import torch

from powertrain.comm import Communicator
from powertrain.compress.base import Compressor

__all__ = ["CompressorState"]


class CompressorState:
    """A DCP ``Stateful`` wrapper around a compressor (or anything with state_dict/load_state_dict)."""

    def __init__(self, compressor: Compressor | Any) -> None:
        self.compressor = compressor

    def _key(self) -> str:
        comm = Communicator()  # rank and world size of the default group, with the world-size-1 fallback
        return f"rank{comm.rank}_of_{comm.world_size}"

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.compressor.state_dict(), buf)
        buf.seek(0)
        return {self._key(): buf}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        key = self._key()
        if key not in state:
            raise ValueError(
                f"The checkpoint holds compressor state for {sorted(state)}, not for {key}: resume with the "
                "world size it was saved with"
            )
        buf = state[key]
        buf.seek(0)
        self.compressor.load_state_dict(torch.load(buf, weights_only=True))
