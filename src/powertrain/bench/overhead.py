"""Compute overhead of PowerSGD compression relative to the backward pass (no communication).

One process, world size 1: the compressor runs all its math (batching, projections, QR, error feedback)
and skips the collectives, so what is measured is the compute a rank adds per step. Backward and
compression are timed in the same run, interleaved, and reported as medians.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from powertrain.bench.report import command, footer, publish, section, table
from powertrain.bench.rounds import interleaved, torch_threads
from powertrain.compress.powersgd import Config, PowerSGDCompressor, Variant
from powertrain.models import GPT, GPTConfig
from powertrain.train.config import TrainConfig
from powertrain.train.data import TokenData, load_data


@dataclasses.dataclass(frozen=True)
class Preset:
    model: GPTConfig
    batch: int
    repeats: int


PRESETS = {
    # >= 10M parameters; one worker's micro-batch of 8 x 256 tokens.
    "default": Preset(GPTConfig(n_layer=6, n_head=6, d_model=384, block_size=256), batch=8, repeats=15),
    "tiny": Preset(GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=32), batch=2, repeats=2),
}
CONFIGS: list[tuple[Variant, int, int]] = [("alternating", r, k) for r in (1, 2, 4) for k in (1, 2)] + [("paper", 4, 1)]


def run_overhead_bench(
    *,
    preset: str = "default",
    repeats: int | None = None,
    threads: int | None = None,
    write: str | None = "BENCHMARKS.md",
) -> str:
    with torch_threads(threads or None):  # given back after: the caller may go on in this process
        text = _measured(preset, repeats or PRESETS[preset].repeats)
    publish(text, write, section("overhead", preset))
    return text


def _measured(preset: str, n_rep: int) -> str:
    """The section's text: backward and every configuration's compression, timed in ``n_rep`` interleaved rounds."""
    p = PRESETS[preset]
    torch.manual_seed(0)
    model = GPT(p.model)
    corpus = load_data(TrainConfig(data_max_mb=2.0))
    assert isinstance(corpus, TokenData), "the stdlib corpus is text"
    x, y = corpus.batch("train", 0, 1, (0,), p.batch, p.model.block_size)

    loss: list[torch.Tensor] = []

    def forward(_round: int) -> None:
        model.zero_grad(set_to_none=False)
        loss.append(model(x, y))

    def backward(_round: int) -> None:
        loss.pop().backward()

    forward(0)
    backward(0)
    grads = [prm.grad.clone() for prm in model.parameters() if prm.grad is not None]
    comps = [
        PowerSGDCompressor(
            model.parameters(),
            config=Config(rank=rank, num_iters_per_step=iters, start_compressing_after_num_steps=0, variant=variant),
        )
        for variant, rank, iters in CONFIGS
    ]
    # a round: forward (not counted), backward, every configuration's compression of the same gradients; the
    # untimed first round allocates the compressors' error buffers
    aggregate = [lambda _round, comp=comp: comp.aggregate(grads) for comp in comps]
    _, backward_times, *times = interleaved([forward, backward, *aggregate], warmup=1, timed=n_rep)
    bwd = statistics.median(backward_times)
    n_params = sum(prm.numel() for prm in model.parameters())
    headers = ["variant", "rank", "iters/step", "compress (ms, median)", "% of backward", "compression ratio"]
    cells = []
    for (variant, rank, iters), comp, ts in zip(CONFIGS, comps, times, strict=True):
        sent = (comp.bytes_per_step(0) + comp.bytes_per_step(1)) / 2
        t = statistics.median(ts)
        ratio = comp.dense_bytes_per_step / sent
        cells.append([variant, rank, iters, f"{1e3 * t:.1f}", f"{100 * t / bwd:.1f}%", f"{ratio:.0f}x"])
    return (
        f"## PowerSGD compute overhead (CPU, no communication)\n\n"
        f"GPT {p.model.n_layer} layers x d_model {p.model.d_model} ({n_params / 1e6:.1f}M parameters), one worker's "
        f"micro-batch of {p.batch * p.model.block_size} tokens, {torch.get_num_threads()} torch thread(s). "
        f"Backward pass: {1e3 * bwd:.0f} ms (median of {len(backward_times)}). Compression: median of {n_rep} "
        "calls of `PowerSGDCompressor.aggregate` at world size 1 (all math, no collectives), measured in "
        f"{n_rep} interleaved rounds of one backward and one call per row. Compression ratio: fp32 all-reduce "
        "bytes / bytes sent, averaged over two steps."
        f"\n\n{table(headers, cells)}\n\n{footer(command('overhead', preset))}"
    )
