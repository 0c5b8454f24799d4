"""What timing code needs to know about the device: CUDA runs asynchronously, the CPU does not."""

from __future__ import annotations

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait until the work queued on ``device`` is done (CUDA; on the CPU it is done when a call returns): before
    reading a clock around device work."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
