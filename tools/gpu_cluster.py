"""Where compression pays on GPUs, on paper (issue 36, part 4): a section ``make gpu-check`` writes (from a results
file with ``--results FILE``).

Nodes of 8 H100s, NVLink inside, one link between nodes shared by the node's 8 GPUs. Per GPU and step, for GPTs of
the GPT-2 small and medium shapes and a 1.3B (GPT-3 XL's shape), the step time of bf16 all-reduce, PowerSGD rank 32
(the recommended config: paper variant, bf16 factors) and int8, flat (one ring over every GPU) and hierarchical
(exact inside the node, the compressor between nodes: :mod:`powertrain.compress.hierarchical`), and the inter-node
bandwidth below which each compressor beats bf16 all-reduce with the same topology.

Compute figures come from ``make gpu-check``'s results (``--results gpu_check.json``: forward, backward and each
compressor's measured compress + decompress time; 1.3B extrapolated from the 350M measurement) or, without them,
from published hardware figures, each marked in the table as what it is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from powertrain.bench.netem import collective_seconds
from powertrain.bench.report import table
from powertrain.models import GPTConfig

GPUS = 8
NODES = (2, 16)
RATES_GBIT = (25.0, 100.0, 400.0)
NVLINK_BPS = 450e9 * 8  # H100 SXM NVLink 4: 900 GB/s per GPU in both directions together
ALPHA_S = 20e-6  # per message between nodes
#: Published H100 SXM figures (NVIDIA's datasheet): dense bf16 tensor-core peak, fp32 (no tensor cores), HBM3.
H100 = {"bf16_flops": 989e12, "fp32_flops": 67e12, "hbm_bytes_per_s": 3.35e12}
MFU = 0.4  # the fraction of the bf16 peak a GPT step reaches, assumed without a measurement
#: (model, sequences per GPU per step, the gpu-check size whose measurements it takes, or extrapolates from).
MODELS: dict[str, tuple[GPTConfig, int, str]] = {
    "GPT-2 small shape": (GPTConfig(50304, 1024, 12, 12, 768), 8, "124m"),
    "GPT-2 medium shape": (GPTConfig(50304, 1024, 24, 16, 1024), 8, "350m"),
    "GPT-3 XL shape (1.3B)": (GPTConfig(50304, 2048, 24, 16, 2048), 4, "350m"),
}
METHODS = ("bf16", "PowerSGD r32", "int8")
#: Bytes one compress + decompress moves through HBM per parameter (fp32 gradients), without a measurement: the passes
#: over the gradients that tools/compressor_traffic.py counts on the 124m GPT as CUDA runs it by default (fused=auto;
#: world size 1, so int8's decoding of one message per rank is counted once) times 4 bytes.
HBM_BYTES_PER_PARAM = {"PowerSGD r32": 8.8 * 4, "int8": 19.8 * 4, "bf16": 4.0 * 4}


@dataclasses.dataclass(frozen=True)
class Figures:
    params: int
    forward_s: float
    backward_s: float
    compress_s: dict[str, float]  # per method: compress + decompress of all gradients on one GPU
    payload: dict[str, float]  # per method: bytes one GPU sends per step (all-reduce payload, or its gather part)
    source: str


def _shapes(cfg: GPTConfig) -> tuple[int, dict[str, float], float]:
    """Parameters, each method's payload bytes per GPU and step, and PowerSGD's matmul FLOPs (shapes only)."""
    import torch

    from powertrain.compress.powersgd import PowerSGDCompressor, recommended_config
    from powertrain.models import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    shapes = [p.shape for p in model.parameters()]
    n = sum(s.numel() for s in shapes)
    comp = PowerSGDCompressor(model.named_parameters(), config=recommended_config())
    int8 = sum(s.numel() + 4 * -(-s.numel() // 1024) for s in shapes)  # codes + a float32 scale per 1024 (chunk)
    # P = M Q, Q = M^T P, P Q^T, and P Q^T again where the next step subtracts it from the kept M
    flops = sum(8 * m[0] * m[1] * m[2] for m in comp._mat if m is not None)
    return n, {"bf16": 2.0 * n, "PowerSGD r32": float(comp.bytes_per_step(0)), "int8": float(int8)}, float(flops)


def _flops_per_token(n: int, n_layer: int, d_model: int, context: int) -> float:
    """Training FLOPs per token: 6 N plus attention's 12 L d T (Kaplan et al. 2020, forward x 3)."""
    return 6 * n + 12 * n_layer * d_model * context


def figures(results: dict[str, Any] | None) -> dict[str, Figures]:
    """Each model's figures: measured where ``results`` has them, else published H100 figures."""
    measured = {}
    if results is not None and results.get("device") != "cuda":
        raise ValueError(
            f"The results were measured on {results.get('device')!r}: the GPU model takes a CUDA run's "
            "(make gpu-check on a GPU)"
        )
    stages = (results or {}).get("stages") or {}
    gpu = ((stages.get("env") or {}).get("result") or {}).get("device_name", "GPU")
    for name, r in stages.items():
        res = r.get("result") or {}
        if name.startswith("measure:") and "backward_s" in (res.get("passes") or {}):
            measured[name.split(":", 1)[1]] = res
    out = {}
    for label, (cfg, seqs, size) in MODELS.items():
        n, payload, psgd_flops = _shapes(cfg)
        tokens = seqs * cfg.block_size
        m = measured.get(size)
        if m is not None:
            # measured for this shape and batch, or scaled from it by training FLOPs (compute) and by parameters
            # (compression: its passes over the gradients and its products grow with them)
            ours = _flops_per_token(n, cfg.n_layer, cfg.d_model, cfg.block_size) * tokens
            theirs = _flops_per_token(m["params"], m["n_layer"], m["d_model"], m["block_size"]) * m["tokens"]
            scale, grow = ours / theirs, n / m["params"]
            comps = m.get("compressors") or {}
            compress = {
                k: comps[k]["seconds"] * grow if "seconds" in (comps.get(k) or {}) else _estimate(k, n, psgd_flops)
                for k in METHODS
            }
            source = f"measured ({size}, {gpu})" if abs(scale - 1) < 1e-9 else f"extrapolated from the measured {size}"
            out[label] = Figures(
                n, m["passes"]["forward_s"] * scale, m["passes"]["backward_s"] * scale, compress, payload, source
            )
            continue
        step = _flops_per_token(n, cfg.n_layer, cfg.d_model, cfg.block_size) * tokens / (MFU * H100["bf16_flops"])
        compress = {k: _estimate(k, n, psgd_flops) for k in METHODS}
        where = f"literature: {MFU:.0%} of the H100's {H100['bf16_flops'] / 1e12:.0f} TFLOP/s bf16"
        out[label] = Figures(n, step / 3, 2 * step / 3, compress, payload, where)
    return out


def _estimate(method: str, n: int, psgd_flops: float) -> float:
    """Compress + decompress without a measurement: HBM passes at the datasheet bandwidth, PowerSGD's products at
    the fp32 rate (torch's default: no TF32)."""
    t = HBM_BYTES_PER_PARAM[method] * n / H100["hbm_bytes_per_s"]
    return t + (psgd_flops / H100["fp32_flops"] if method.startswith("PowerSGD") else 0.0)


def comm_s(method: str, payload: float, params: int, nodes: int, rate_bps: float, hierarchical: bool) -> float:
    """Seconds of one step's gradient communication per GPU: ring collectives, the link between nodes carrying a
    ring's whole traffic (flat: the ring over all 8 N GPUs crosses it; hierarchical: 8 rings of N nodes, one per
    local rank, each with 1/8 of the parameters, share it), NVLink inside the node."""
    op = "all_gather" if method == "int8" else "all_reduce"  # a sum of differently scaled integers is no int8 number
    collectives = 3 if method.startswith("PowerSGD") else 1  # P, Q and the exactly sent tensors

    def between(world: int) -> float:  # the ring that crosses the link between nodes, payload bytes only
        return collective_seconds(
            op, payload, world, rate_bps / 1e6, framing=1.0, latency_s=ALPHA_S, collectives=collectives
        )

    if not hierarchical:
        return between(nodes * GPUS)
    nvlink_mbit = NVLINK_BPS / 1e6
    if method == "bf16":  # reduce-scatter inside the node, the node rings, all-gather inside: an all-reduce each
        inside = collective_seconds("all_reduce", payload, GPUS, nvlink_mbit, framing=1.0)
    else:  # powertrain's: an exact fp32 mean inside the node, then gathering the parameters' owners' results
        exact = 4.0 * params
        inside = collective_seconds("all_reduce", exact, GPUS, nvlink_mbit, framing=1.0)
        inside += collective_seconds("all_gather", exact / GPUS, GPUS, nvlink_mbit, framing=1.0)
    return inside + between(nodes)


def step_s(fig: Figures, method: str, nodes: int, rate_bps: float, hierarchical: bool, overlap: bool = True) -> float:
    """forward + backward + compression + communication; ``overlap``: communication hides behind backward where it
    fits (DDP's buckets; an optimistic bound), compression does not (it runs on the GPU, between buckets)."""
    compress = 0.0 if method == "bf16" else fig.compress_s[method] / (GPUS if hierarchical else 1)
    comm = comm_s(method, fig.payload[method], fig.params, nodes, rate_bps, hierarchical)
    exposed = max(0.0, comm - fig.backward_s) if overlap else comm
    return fig.forward_s + fig.backward_s + compress + exposed


def break_even_bps(fig: Figures, method: str, nodes: int, hierarchical: bool, overlap: bool = True) -> float | None:
    """The inter-node bandwidth below which ``method`` gives a shorter step than bf16 all-reduce on the same topology
    (None: never, it sends no fewer bytes there, or costs more even on the slowest link)."""
    faster = lambda bps: (
        step_s(fig, method, nodes, bps, hierarchical, overlap) < step_s(fig, "bf16", nodes, bps, hierarchical, overlap)
    )
    lo, hi = 1e6, 1e15  # 1 Mbit/s .. 1 Pbit/s
    if not faster(lo):
        return None
    if faster(hi):
        return math.inf
    for _ in range(200):  # bisection on a log scale
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if faster(mid) else (lo, mid)
    return lo


def _gbit(bps: float | None) -> str:
    if bps is None:
        return "never"
    return "always" if math.isinf(bps) else f"{bps / 1e9:,.1f}"


def gpu_scale_section(results: dict[str, Any] | None) -> str:
    """The Markdown section: the figures used, step times, break-even bandwidths, and the comparison."""
    figs = figures(results)
    src = [
        [
            label,
            f"{f.params / 1e6:,.0f}M",
            f"{1e3 * f.forward_s:,.1f} / {1e3 * f.backward_s:,.1f}",
            " / ".join(f"{1e3 * f.compress_s[m]:,.2f}" for m in METHODS[1:]) + " (bf16 cast: "
            f"{1e3 * f.compress_s['bf16']:,.2f})",
            " / ".join(f"{f.payload[m] / 1e6:,.1f}" for m in METHODS),
            f.source,
        ]
        for label, f in figs.items()
    ]
    steps = []
    for label, f in figs.items():
        for nodes in NODES:
            for rate in RATES_GBIT:
                cells = [f"{1e3 * step_s(f, m, nodes, rate * 1e9, h):,.1f}" for m in METHODS for h in (False, True)]
                steps.append([label, f"{nodes} x 8", f"{rate:g}", *cells])
    even = []
    for label, f in figs.items():
        for nodes in NODES:
            even.append(
                [
                    label,
                    f"{nodes} x 8",
                    *(_gbit(break_even_bps(f, m, nodes, h)) for m in METHODS[1:] for h in (False, True)),
                    *(_gbit(break_even_bps(f, m, nodes, True, overlap=False)) for m in METHODS[1:]),
                ]
            )
    method_cols = [f"{m} {'hier.' if h else 'flat'} ms" for m in METHODS for h in (False, True)]
    return (
        "## Where compression pays on GPUs, on paper (`make gpu-check`)\n\n"
        f"Nodes of 8 H100s: NVLink inside ({NVLINK_BPS / 8e9:.0f} GB/s per direction), one link between nodes shared "
        f"by the node's GPUs at the rate shown, {ALPHA_S * 1e6:.0f} us per message; ring collectives. Flat: one ring "
        "over all GPUs. Hierarchical: bf16 reduce-scatters inside the node and all-reduces between nodes; the "
        "compressors as `--hierarchy node` runs them (an exact fp32 mean inside the node, each GPU compressing 1/8 "
        "of the parameters between nodes, an all-gather inside the node). int8 all-gathers (a sum of differently "
        "scaled integers is no quantised number), so its bytes grow with the ranks it crosses. Step: forward + "
        "backward + compress + the communication that does not hide behind backward (DDP's overlap, an optimistic "
        "bound; compression itself does not overlap).\n\n"
        "Figures used (ms per GPU and step; compress + decompress of all gradients; MB sent per GPU and step):\n\n"
        + table(
            [
                "model",
                "params",
                "forward / backward ms",
                "compress: PowerSGD r32 / int8 ms",
                "bf16 / PowerSGD / int8 MB",
                "source",
            ],
            src,
        )
        + "\n\nStep time (ms) by inter-node rate (Gbit/s per node):\n\n"
        + table(["model", "nodes", "Gbit/s", *method_cols], steps)
        + "\n\nBreak-even inter-node bandwidth (Gbit/s per node): below it the compressor's step is shorter than bf16 "
        "all-reduce's on the same topology (overlapped; the last two columns hierarchical without any overlap):\n\n"
        + table(
            [
                "model",
                "nodes",
                "PowerSGD flat",
                "PowerSGD hier.",
                "int8 flat",
                "int8 hier.",
                "PowerSGD hier., no overlap",
                "int8 hier., no overlap",
            ],
            even,
        )
    )
