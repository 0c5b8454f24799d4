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

from powertrain.bench.cluster_gpu import ALPHA_S, H100, MFU, NVLINK_BPS
from powertrain.bench.netem import EmulatedCluster, collective_seconds, unavailable
from powertrain.bench.report import machine_info, publish, table
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


def run_cluster_bench(
    *, preset: str = "default", write: str | None = "BENCHMARKS.md", gpu_results: str | None = None
) -> dict[str, Any]:
    """The emulated cluster and the models on paper; ``preset="paper"``: the on-paper models only (no root needed),
    the GPU one with the compute figures of ``gpu_results`` (a ``make gpu-check`` results file) when given."""
    if preset == "paper" or gpu_results is not None:
        if preset != "paper":
            raise ValueError("--results feeds the on-paper model: use bench cluster --preset paper --results FILE")
        from powertrain.bench.cluster_gpu import gpu_scale_section
        from powertrain.bench.gpu import read_results

        gpu = read_results(gpu_results) if gpu_results is not None else None
        if gpu is not None and gpu.get("device") != "cuda":
            raise ValueError(
                f"{gpu_results} was measured on {gpu.get('device')!r}: the GPU model takes a CUDA run's "
                "results (make gpu-check on a GPU)"
            )
        text = gpu_scale_section(gpu)
        publish(scale_model(), write, "cluster-scale")
        publish(text, write, "cluster-gpu")
        return {"gpu_results": gpu_results}
    reason = unavailable()
    if reason:
        raise RuntimeError(f"bench cluster needs network namespaces: {reason}")
    if preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r} for bench cluster: choose {', '.join(PRESETS)}")
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
    publish(text, write, "cluster" if preset == "default" else f"cluster-{preset}")
    publish(scale_model(), write, "cluster-scale")
    return {"results": results}


# ---------------------------------------------------------------- at scale, on paper (issue 21, part 4)

#: The assumptions of :func:`scale_model`, printed with its table.
SCALE_ASSUMPTIONS = {
    "GPUs per node": "8, joined by NVLink at 450 GB/s per direction (reduce-scatter and all-gather inside a node)",
    "link between nodes": "one per node, shared by its 8 GPUs, at the rate shown; 20 us per message (alpha)",
    "flat all-reduce": "one ring over all W = 8 N GPUs, the nodes' GPUs consecutive: the link between two nodes "
    "carries 2 (W-1)/W of the payload, in 2 (W-1) messages",
    "hierarchical": "reduce-scatter inside the node, 8 rings of N nodes (one per local rank) sharing the node's link: "
    "2 (N-1)/N of the payload in 2 (N-1) messages each, all-gather inside the node",
    "compute": "6 x parameters x tokens FLOPs per step at 40% of 989 TFLOP/s (H100 bf16 dense); 16 sequences of "
    "the model's context per GPU per step",
    "overlap": "none: step = compute + communication (an upper bound; DDP overlaps part of it with backward)",
    "PowerSGD": "the recommended config (rank 32, paper variant, bf16 factors), bytes from the compressor's own "
    "bytes_per_step on the model's shapes; its matmuls are not counted (4 n m r FLOPs per matrix: < 1% of compute)",
    "steps to target": "measured on the default GPT at 300 steps (bench quality): bf16 and fp32 300, PowerSGD + "
    "frozen AdamW 275; assumed the same ratio for the 1B GPT (not measured)",
}
GPU_FLOPS = H100["bf16_flops"] * MFU
STEPS_TO_TARGET = {"fp32": 300, "bf16": 300, "PowerSGD r32": 275}


def _payloads(n_layer: int, n_head: int, d_model: int, block: int) -> dict[str, float]:
    """Bytes one rank hands to the gradient all-reduce per step, for each way to send (shapes only: meta tensors)."""
    import torch

    from powertrain.compress.powersgd import PowerSGDCompressor, recommended_config
    from powertrain.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(256 if d_model < 1024 else 50304, block, n_layer, n_head, d_model))
    n = sum(p.numel() for p in model.parameters())
    comp = PowerSGDCompressor(model.named_parameters(), config=recommended_config())
    return {
        "params": float(n),
        "fp32": 4.0 * n,
        "bf16": 2.0 * n,
        "PowerSGD r32": float(comp.bytes_per_step(compressed_step_index=0)),
    }


def _comm_s(payload: float, nodes: int, gpus: int, rate_bps: float, hierarchical: bool) -> float:
    """A ring all-reduce's time (payload bytes only, no framing), flat over all GPUs or in two stages."""
    ring = lambda world, bps, alpha: collective_seconds(
        "all_reduce", payload, world, bps / 1e6, framing=1.0, latency_s=alpha
    )
    if not hierarchical:
        return ring(nodes * gpus, rate_bps, ALPHA_S)
    # reduce-scatter + all-gather inside the node (an all-reduce's bytes), then the node rings share the link
    return ring(gpus, NVLINK_BPS, 0.0) + ring(nodes, rate_bps, ALPHA_S)


def scale_model() -> str:
    """Step time and time to target at 8 / 64 / 512 nodes x 8 GPUs, from the alpha-beta model (Markdown)."""
    models = {"default GPT": (4, 4, 256, 128), "GPT 24 x 2048, context 2048": (24, 16, 2048, 2048)}
    rows = []
    for name, (n_layer, n_head, d_model, block) in models.items():
        pay = _payloads(n_layer, n_head, d_model, block)
        label = f"{name} ({pay['params'] / 1e6:,.1f}M)"
        compute = 6 * pay["params"] * 16 * block / GPU_FLOPS
        for rate in (10e9, 100e9):
            for nodes in (8, 64, 512):
                for how in ("fp32", "bf16", "PowerSGD r32"):
                    flat = compute + _comm_s(pay[how], nodes, 8, rate, False)
                    hier = compute + _comm_s(pay[how], nodes, 8, rate, True)
                    steps = STEPS_TO_TARGET[how]
                    rows.append(
                        [
                            label,
                            f"{rate / 1e9:g} Gbit/s",
                            nodes,
                            how,
                            f"{pay[how] / 1e6:,.1f}",
                            f"{compute * 1e3:,.2f}",
                            f"{flat * 1e3:,.1f}",
                            f"{hier * 1e3:,.1f}",
                            f"{steps * flat:,.1f}",
                            f"{steps * hier:,.1f}",
                        ]
                    )
    headers = [
        "model",
        "link between nodes",
        "nodes x 8",
        "sent as",
        "MB/step/GPU",
        "compute ms",
        "flat step ms",
        "hierarchical step ms",
        "flat s to target",
        "hierarchical s to target",
    ]
    assumptions = table(["assumption", "value"], [[k, v] for k, v in SCALE_ASSUMPTIONS.items()])
    return (
        "## At scale, on paper (`powertrain bench cluster`, computed)\n\nThe alpha-beta model of the cluster "
        "benchmark at data-centre scale. Nothing here is measured except the bytes (the compressor's own count on "
        "the models' shapes) and the steps to target (default GPT).\n\n" + assumptions + "\n\n" + table(headers, rows)
    )
