"""Side-by-side check of powertrain.powersgd against the reference implementation (epfml/powersgd).

The reference is not on any package index (the `powersgd` name on PyPI is an empty placeholder), so it is
not part of the test suite. Clone it anywhere (never into this repository) and run:

    python tools/compare_reference.py /path/to/epfml-powersgd-clone [--world-size 2] [--steps 30]

Both implementations train the same model on the same per-rank data with gloo; the script prints the
largest differences in parameters, losses and residuals (p.grad), and whether the parameters are
bitwise equal. Both use Householder QR at rank >= 2, which is where bitwise agreement is expected.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dist_utils import run_ranks


def train(rank: int, world_size: int, impl: str, ref_path: str, rank_r: int, iters: int, steps: int) -> dict:
    if impl == "reference":
        sys.path.insert(0, ref_path)
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
        "losses": torch.tensor(losses, dtype=torch.float64),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference_path", help="a local clone of github.com/epfml/powersgd")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    if not (Path(args.reference_path) / "powersgd" / "powersgd.py").exists():
        raise SystemExit(f"{args.reference_path} does not look like a clone of epfml/powersgd")
    for rank_r, iters in [(2, 1), (2, 2), (4, 1)]:
        out = {
            impl: run_ranks(train, args.world_size, impl, args.reference_path, rank_r, iters, args.steps, timeout=120)[
                0
            ]
            for impl in ("reference", "powertrain")
        }
        ref, ours = out["reference"], out["powertrain"]
        bitwise = torch.equal(ref["params"], ours["params"]) and torch.equal(ref["residuals"], ours["residuals"])
        print(
            f"rank={rank_r} num_iters_per_step={iters} world_size={args.world_size} steps={args.steps}: "
            f"max |param diff| {(ref['params'] - ours['params']).abs().max():.3e}, "
            f"max |loss diff| {(ref['losses'] - ours['losses']).abs().max():.3e}, "
            f"max |residual diff| {(ref['residuals'] - ours['residuals']).abs().max():.3e}, "
            f"bitwise: {bitwise}"
        )


if __name__ == "__main__":
    main()
