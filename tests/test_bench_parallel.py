"""``powertrain bench parallel --preset tiny``: every configuration trains the same model on the same batches, RTP
sends the same with and without overlap, each peak lies above its state, and the section lands in the Markdown file."""

from __future__ import annotations

import math
import re

import pytest
import torch

from powertrain.bench.memory import peak_allocated
from powertrain.bench.parallel import KINDS, PRESETS, run_parallel_bench
from powertrain.models import GPT, GPTConfig
from powertrain.train.config import GPT_SIZES


def test_bench_parallel_tiny(tmp_path):
    target = tmp_path / "B.md"
    target.write_text("# Benchmarks\n\nhand-written intro stays\n")
    text = run_parallel_bench(preset="tiny", write=str(target))
    body = target.read_text()
    assert "hand-written intro stays" in body and "## Parallel modes" in body
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| 2 \| ", line)]
    assert [r[1].strip() for r in rows] == list(KINDS)
    # the same initial weights and batches: the data-parallel configurations' losses agree to the table's 4
    # decimals (fp32 sums in different orders move them by ~1e-6); a tp pair reads one batch, so tp's differ
    assert len({r[-1].strip() for r in rows if not r[1].strip().startswith("tp")}) == 1, rows
    sent = {kind: r[7].strip() for kind, r in zip(KINDS, rows, strict=True)}
    assert all(float(b) > 0 for b in sent.values()), sent
    assert sent["rtp"] == sent["rtp (no overlap)"], sent  # the same messages, overlapped or not
    assert sent["fsdp2"] == sent["simple_fsdp"], sent  # the same reduce-scatters and all-gathers
    params = GPT(GPTConfig(256, PRESETS["tiny"].block, *GPT_SIZES["tiny"])).num_params()  # the tiny preset's GPT
    assert sent["ddp"] == f"{4 * params / 1e6:.1f}", sent  # one all-reduce of the fp32 gradients
    for r in rows:  # a step allocates activations on top of the state: the peak is above it
        assert float(r[4]) > float(r[2]) > 0, r


def test_peak_allocated_sees_the_peak_inside_and_the_frees():
    """The peak inside a call, not its net growth; memory the call frees (also from its previous call) counts."""
    keep: list[torch.Tensor] = []

    def step() -> None:
        keep.clear()  # frees 1 MB that the previous call allocated
        a = torch.empty(1_000_000, dtype=torch.float32)  # 4 MB
        b = torch.empty(500_000, dtype=torch.float32)  # 2 MB: 6 MB above the start, minus the 1 MB freed
        del a, b
        keep.append(torch.empty(250_000, dtype=torch.float32))

    assert peak_allocated(step) == 5_000_000
    assert peak_allocated(keep.clear) == 0  # only frees


@pytest.mark.timeout(120)
def test_the_side_by_side_runner_trains_the_sharded_modes_and_records_their_computed_traffic():
    """The runner the network and optimizer benchmarks share trains rtp and simple_fsdp through the command's
    strategies, and records the traffic those compute rather than count (SimpleFSDP's reduce-scatters, RTP's
    replicated all-reduce); tp, whose pairs must read one batch, is refused in one line."""
    from powertrain.bench.sidebyside import Spec, by_spec, launch_args, worker
    from powertrain.models import GPT, GPTConfig
    from powertrain.train.launch import launch

    with pytest.raises(ValueError, match="a tensor-parallel group must read one together"):
        Spec("tp", "none", parallel="tp")
    model = GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=32, block_size=16)
    specs = [Spec("rtp", "none", parallel="rtp"), Spec("simple_fsdp", "none", parallel="simple_fsdp")]
    args = launch_args(specs, model=model, batch=2, warmup=0, timed=2, start=1, data_mb=0.5)
    rtp, simple = by_spec(launch(worker, 2, args))
    for result in (rtp, simple):
        losses = result.first.losses
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses), (result, losses)
    n = sum(p.numel() for p in GPT(model).parameters())
    # simple_fsdp computes one reduce-scatter of every (padded) gradient per step: at least the fp32 gradients
    assert simple.first.sent_per_step.get("reduce_scatter", 0) >= 4 * n, simple.first.sent_per_step
    # RTP replicates the LayerNorms (it rotates Linear and Embedding weights): one all-reduce of their fp32 gradients
    norms = sum(p.numel() for m in GPT(model).modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters())
    assert rtp.first.sent_per_step.get("all_reduce") == 4 * norms, rtp.first.sent_per_step
