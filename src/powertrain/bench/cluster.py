"""``powertrain bench cluster``: flat and hierarchical compression on an emulated cluster of 2 nodes x 2 workers.

Each node is a network namespace (:mod:`powertrain.bench.netem`) running ``torchrun --nnodes 2 --nproc-per-node
2`` with c10d rendezvous, as a user runs it on each machine, and the unchanged ``powertrain train`` command. The
workers of a node talk over its loopback (the fast link inside a node, unthrottled); the nodes over a link shaped
with ``tc tbf`` to each rate. Per row: the median step time (rank 0's, after the exact warm-up), the bytes that
crossed the link between the nodes (the kernel's counters on both nodes' links: headers, rendezvous and
connection set-up included) per step, and the final training and validation loss (one seed: the rows' losses
differ by their compression, the link changes only the time).

On 2 cores the 4 workers share 2 CPUs, so compute is twice as slow as on 2 workers; the rows are compared with
each other at each rate.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from powertrain.bench.netem import EmulatedCluster, unavailable
from powertrain.bench.report import machine_info, publish, section, table
from powertrain.train.metrics import read_run

NODES, PER_NODE = 2, 2
RATES = (100.0, 10.0)
WARM = 5  # steps left out of the step time: PowerSGD's exact warm-up (start=5), gloo's first connections
PSGD = f"powersgd:rank=8,start={WARM}"  # the small GPT's 128-wide matrices: rank 8 sends 1/8 of them
ROWS: list[tuple[str, list[str]]] = [
    ("flat fp32", ["--parallel", "ddp", "--compressor", "none"]),
    ("flat bf16", ["--parallel", "ddp", "--compressor", "bf16"]),
    ("flat PowerSGD r8", ["--parallel", "ddp", "--compressor", PSGD]),
    ("hierarchical PowerSGD r8", ["--parallel", "ddp", "--compressor", PSGD, "--hierarchy", "node"]),
    ("hierarchical int8", ["--parallel", "ddp", "--compressor", "int8", "--hierarchy", "node"]),
    ("HSDP, PowerSGD r8 over the nodes", ["--parallel", "fsdp", "--compressor", PSGD, "--hierarchy", "node"]),
]
PRESETS = {
    "default": [
        "--gpt-size",
        "small",
        "--steps",
        "60",
        "--batch-size",
        "8",
        "--block-size",
        "64",
        "--eval-batches",
        "4",
        "--warmup-steps",
        "5",
        "--log-every",
        "1",
    ],
    "tiny": ["--preset", "tiny", "--steps", "8", "--log-every", "1"],
}


def _run_row(cluster: EmulatedCluster, args: list[str], out: Path, timeout: float) -> dict[str, Any]:
    before = [cluster.sent_bytes(n) for n in range(NODES)]
    argv = ["-m", "powertrain", "train", "--quiet", *args, "--out", str(out)]
    procs = [cluster.torchrun(n, PER_NODE, argv) for n in range(NODES)]
    for n, p in enumerate(procs):
        _, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"node {n} failed: {err.strip()[-1500:]}")
    sent = sum(cluster.sent_bytes(n) - b for n, b in zip(range(NODES), before, strict=True))
    rows, summary = read_run(out)
    times = [r["step_time_s"] for r in rows[WARM:]] or [r["step_time_s"] for r in rows]
    return {
        "step_s": statistics.median(times),
        "link_mb_per_step": sent / 1e6 / len(rows),
        "payload_mb_per_step": summary["bytes_sent"] / 1e6 / len(rows),
        "final_loss": summary["final_loss"],
        "val_loss": summary["val_loss"],
    }


def run_cluster_bench(*, preset: str = "default", write: str | None = "BENCHMARKS.md") -> dict[str, Any]:
    """The emulated cluster (needs network namespaces: root)."""
    if preset not in PRESETS:  # before any namespace is made
        raise ValueError(f"Unknown preset {preset!r} for bench cluster: choose {', '.join(PRESETS)}")
    reason = unavailable()
    if reason:
        raise RuntimeError(f"bench cluster needs network namespaces: {reason}")
    results: dict[float, dict[str, dict[str, Any]]] = {}
    timeout = 900 if preset == "default" else 180
    with tempfile.TemporaryDirectory(prefix="powertrain-cluster-") as tmp:
        for rate in RATES:
            results[rate] = {}
            with EmulatedCluster(NODES, rate) as cluster:
                for i, (label, args) in enumerate(ROWS):
                    out = Path(tmp) / f"{rate:g}-{i}"
                    results[rate][label] = _run_row(cluster, [*PRESETS[preset], *args], out, timeout)
                    r = results[rate][label]
                    print(
                        f"{rate:g} Mbit/s  {label:28s} {r['step_s']:.3f} s/step  {r['link_mb_per_step']:.3f} MB/step "
                        f"between nodes  val {r['val_loss']:.4f}",
                        flush=True,
                    )
    headers = [
        "link",
        "row",
        "step (s)",
        "vs flat PowerSGD",
        "MB/step between nodes",
        "vs flat PowerSGD",
        "payload MB/step/rank",
        "final train loss",
        "val loss",
    ]
    body = []
    for rate, by in results.items():
        ref = by["flat PowerSGD r8"]
        for label, r in by.items():
            link = r["link_mb_per_step"]
            body.append(
                [
                    f"{rate:g} Mbit/s",
                    label,
                    f"{r['step_s']:.3f}",
                    f"{r['step_s'] / ref['step_s']:.2f}x",
                    f"{link:.3f}",
                    f"{link / ref['link_mb_per_step']:.2f}x",
                    f"{r['payload_mb_per_step']:.3f}",
                    f"{r['final_loss']:.4f}",
                    f"{r['val_loss']:.4f}",
                ]
            )
    flags = " ".join(PRESETS[preset])
    text = (
        f"## Two nodes x two workers, torchrun per node (`powertrain bench cluster --preset {preset}`)\n\n"
        f"Machine: {machine_info()}. Each node a network namespace running `torchrun --nnodes 2 --nproc-per-node 2 "
        f"--rdzv-backend c10d`; workers of a node over its loopback, nodes over a `tc tbf` link at the rate shown. "
        f"`powertrain train {flags}` with each row's flags; one seed. Step: rank 0's median after the "
        "warm-up. MB between nodes: both nodes' link counters (TCP/IP headers, rendezvous and connection set-up "
        "included) over the run, per step. Payload: what a rank hands to its collectives (between nodes only, for "
        "the hierarchical rows; HSDP's weight all-gathers stay inside the node and are not counted).\n\n"
        + table(headers, body)
    )
    publish(text, write, section("cluster", preset))
    return {"results": results}
