"""powertrain.powersgd against the reference implementation itself (github.com/epfml/powersgd), bitwise.

The reference is on no package index (the ``powersgd`` name on PyPI is an empty placeholder), so this test needs
a local clone: set ``POWERSGD_REFERENCE`` to its path (never clone it into this repository). Without it the test
is skipped and says so. Both implementations train the same model on the same per-rank data with gloo at 2 ranks.

Bitwise, not a tolerance: at rank >= 2 both orthogonalise with Householder QR (``torch.linalg.qr``), and the
reference-compatible wrapper runs the reference's operations on the same buffers in the same order (its flat
buffers, its batched matmuls, its all-reduces), so every step produces the same bits on any CPU. Rank 1 is left
out: there the reference normalises the vector itself while powertrain keeps QR.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_utils import run_ranks

CLONE = os.environ.get("POWERSGD_REFERENCE", "")


def _train(rank: int, world: int, impl: str, rank_r: int, iters: int, steps: int) -> dict[str, Any]:
    if impl == "reference":
        sys.path.insert(0, CLONE)
        from powersgd import Config, PowerSGD, optimizer_step  # type: ignore[import-not-found]
    else:
        from powertrain.powersgd import Config, PowerSGD, optimizer_step
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5)
    )
    teacher = torch.randn(20, 5, generator=torch.Generator().manual_seed(7))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.01)
    cfg = Config(rank=rank_r, min_compression_rate=2, num_iters_per_step=iters, start_compressing_after_num_steps=3)
    agg = PowerSGD(params, config=cfg)
    losses = []
    for step in range(steps):
        x = torch.randn(32, 20, generator=torch.Generator().manual_seed(100 * rank + step))
        loss = torch.nn.functional.mse_loss(model(x), x @ teacher)
        loss.backward()
        optimizer_step(opt, agg)
        losses.append(loss.item())
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in params]),
        "residuals": torch.cat([p.grad.reshape(-1) for p in params]),
        "losses": losses,
    }


@pytest.mark.skipif(
    not (Path(CLONE) / "powersgd" / "powersgd.py").is_file(),
    reason="set POWERSGD_REFERENCE to a clone of github.com/epfml/powersgd (it is on no package index)",
)
@pytest.mark.parametrize(("rank_r", "iters"), [(2, 1), (2, 2), (4, 1)])
def test_bitwise_equal_to_the_reference_implementation(rank_r, iters):
    out = {impl: run_ranks(_train, 2, impl, rank_r, iters, 30, timeout=120) for impl in ("reference", "powertrain")}
    for ref, ours in zip(out["reference"], out["powertrain"], strict=True):
        diff = (ref["params"] - ours["params"]).abs().max().item()
        assert ref["losses"] == ours["losses"], f"losses differ (max |param diff| {diff:.3e})"
        assert torch.equal(ref["params"], ours["params"]) and torch.equal(ref["residuals"], ours["residuals"])
