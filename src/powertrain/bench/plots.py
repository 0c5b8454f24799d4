"""The network benchmark's PNG plot (matplotlib, optional: without it the plot is skipped, said so)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

UNTHROTTLED_X = 1e4  # where the unthrottled run sits on the bandwidth axis (Mbit/s), labelled as such


def speedup_vs_bandwidth(report: dict[str, Any], path: Path) -> bool:
    """Step-time speedup over the best fp32 all-reduce row, per configuration, against link rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = [r["label"] for r in report["rates"][0]["rows"] if r["kind"] != "noop"]
    for label in labels:
        xs, ys, modelled = [], [], []
        for rate in report["rates"]:
            row = next(r for r in rate["rows"] if r["label"] == label)
            xs.append(rate["rate_mbit"] or UNTHROTTLED_X)
            ys.append(rate["best_fp32_s"] / row["median_s"])
            modelled.append(not row["measured"])
        order = sorted(range(len(xs)), key=xs.__getitem__)
        (line,) = ax.plot([xs[i] for i in order], [ys[i] for i in order], marker="o", label=label)
        ax.scatter(
            [xs[i] for i in order if modelled[i]],
            [ys[i] for i in order if modelled[i]],
            facecolors="white",
            edgecolors=line.get_color(),
            zorder=3,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel(f"link rate, Mbit/s ({UNTHROTTLED_X:g} = unthrottled)")
    ax.set_ylabel("speedup per step vs best fp32 all-reduce")
    ax.set_title("Step-time speedup vs bandwidth (hollow: alpha-beta model, not run)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
