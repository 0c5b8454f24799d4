"""DDP step time: torch's own comm hooks vs powertrain's compressors, side by side in one run.

Two local gloo workers (one torch thread each) train the default GPT. Every configuration has its own model
(same initial weights), optimizer and DDP instance; all are stepped in interleaved rounds, one step of each
per round on the same batch, so load from other processes hits every configuration alike. Reported: median
and interquartile range of the step time over the timed rounds, payload bytes per step, and the final
training loss (mean of the last 5 steps), so speed is compared at equal loss.

torch's ``powerSGD_hook`` only runs on gloo with a single DDP bucket (with several it deadlocks or aborts
with a collective mismatch), so every configuration uses one bucket (``bucket_cap_mb=100``).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch
import torch.distributed as dist

from powertrain.bench import sidebyside
from powertrain.bench.report import machine_info, publish, table
from powertrain.bench.sidebyside import Spec
from powertrain.compress import PowerSGDCompressor
from powertrain.compress.powersgd import Config
from powertrain.models import GPT, GPTConfig
from powertrain.train.launch import launch, leave_world

START = 10  # PowerSGD warm-up steps (exact all-reduce), for torch's hook and ours alike

CONFIGS: list[Spec] = [
    Spec("DDP fp32 (no hook)", "plain"),
    Spec("torch fp16_compress_hook", "torch_fp16"),
    Spec("torch powerSGD_hook r1", "torch_psgd", {"rank": 1}),
    Spec("torch powerSGD_hook r4", "torch_psgd", {"rank": 4}),
    Spec("powertrain none (fp32)", "none"),
    Spec("powertrain bf16", "bf16"),
    Spec("powertrain powersgd r1", "powersgd", {"rank": 1, "variant": "alternating"}),
    Spec("powertrain powersgd r4", "powersgd", {"rank": 4, "variant": "alternating"}),
    Spec("powertrain powersgd paper r4", "powersgd", {"rank": 4, "variant": "paper", "factor_dtype": "fp32"}),
    Spec("powertrain int8", "int8"),
    Spec("powertrain topk 1%", "topk", {"ratio": 0.01}),
]


@dataclasses.dataclass(frozen=True)
class Preset:
    model: GPTConfig
    batch: int
    warmup: int
    timed: int


PRESETS = {
    "default": Preset(
        GPTConfig(n_layer=4, n_head=4, d_model=256, block_size=128), batch=16, warmup=START + 2, timed=15
    ),
    "tiny": Preset(GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=32), batch=2, warmup=START + 1, timed=2),
}


def computed_bytes(spec: Spec, model: torch.nn.Module) -> dict[str, float]:
    """Payload bytes per step of the torch hooks, which do not count them (all all-reduce)."""
    numel = sum(p.numel() for p in model.parameters())
    if spec.kind in ("plain", "noop"):
        return {"all_reduce": 4.0 * numel} if spec.kind == "plain" else {}
    if spec.kind == "torch_fp16":
        return {"all_reduce": 2.0 * numel}
    # torch's hook compresses exactly the matrices the paper variant does (same rate rule) and sends P and Q.
    cfg = Config(rank=spec.options["rank"], variant="paper", start_compressing_after_num_steps=0)
    return {"all_reduce": float(PowerSGDCompressor(model.parameters(), config=cfg).bytes_per_step(0))}


def _worker(preset_name: str) -> dict[str, Any]:
    dist.init_process_group("gloo")
    p = PRESETS[preset_name]
    out = sidebyside.run(CONFIGS, model=p.model, batch=p.batch, warmup=p.warmup, timed=p.timed, start=START)
    leave_world()
    return out


def run_ddp_bench(*, preset: str = "default", write: str | None = "BENCHMARKS.md") -> str:
    p = PRESETS[preset]
    results = launch(_worker, 2, preset)
    r0 = results[0]
    model = GPT(p.model)
    rows = []
    # Step time is the slower rank's, per round.
    step_times = [
        [max(results[r]["times"][i][j] for r in results) for j in range(len(r0["times"][i]))]
        for i in range(len(CONFIGS))
    ]
    base = statistics.median(step_times[0])
    for i, spec in enumerate(CONFIGS):
        ts = sorted(step_times[i])
        med = statistics.median(ts)
        q1, q3 = ts[len(ts) // 4], ts[(3 * len(ts)) // 4]
        if spec.kind in ("plain", "torch_fp16", "torch_psgd"):
            sent, how = sum(computed_bytes(spec, model).values()), " (computed)"
        else:
            sent, how = sum(r0["sent_per_step"][i].values()), ""
        final = sum(sum(results[r]["losses"][i][-5:]) / 5 for r in results) / len(results)
        rows.append(
            [
                spec.label,
                f"{med:.3f}",
                f"{q1:.3f}-{q3:.3f}",
                f"{base / med:.2f}x",
                f"{sent / 1e6:.3f}{how}",
                f"{final:.4f}",
            ]
        )
    headers = ["configuration", "s/step (median)", "IQR", "speed vs DDP fp32", "MB sent per step", "final loss"]
    text = (
        "## DDP step time: torch hooks vs powertrain (2 gloo workers on loopback)\n\n"
        f"GPT {p.model.n_layer} layers x d_model {p.model.d_model} ({r0['params'] / 1e6:.2f}M parameters), "
        f"{p.batch}x{p.model.block_size} tokens per worker, AdamW, one torch thread per worker, one DDP bucket. "
        f"PowerSGD uses exact all-reduce for the first {START} steps in both implementations; the "
        f"{len(r0['times'][0])} timed rounds follow {p.warmup} warm-up rounds, each round one step of every "
        "configuration on the same batch. Step time is the slower rank's. Loopback is fast (~1.5 GB/s), so this "
        "table shows compute overhead, not network savings (see the emulated-network benchmark for that).\n\n"
        f"{table(headers, rows)}\n\nMachine: {machine_info()}.\n\n"
        f"Command: `powertrain bench ddp{'' if preset == 'default' else ' --preset ' + preset}`\n"
    )
    publish(text, write, "ddp" if preset == "default" else f"ddp-{preset}")
    return text
