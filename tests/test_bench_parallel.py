"""``powertrain bench parallel --preset tiny``: every configuration trains the same model on the same batches, RTP
sends the same with and without overlap, each peak lies above its state, and the section lands in the Markdown file."""

from __future__ import annotations

import math
import re

import pytest
import torch

from powertrain.bench.memory import peak_allocated
from powertrain.bench.parallel import KINDS, run_parallel_bench


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
    rtp, rtp_serial = rows[KINDS.index("rtp")], rows[KINDS.index("rtp (no overlap)")]
    assert float(rtp[7]) > 0 and rtp[7] == rtp_serial[7], (rtp, rtp_serial)  # the same messages, overlapped or not
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
def test_the_side_by_side_runner_trains_the_tensor_parallel_modes():
    """The runner the network and optimizer benchmarks share computes the loss inside the strategy's loss scope:
    tp keeps its logits vocabulary-sharded (loss parallelism), which a plain cross-entropy cannot take."""
    from powertrain.bench.sidebyside import Spec, by_spec, launch_args, worker
    from powertrain.models import GPTConfig
    from powertrain.train.launch import launch

    model = GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=32, block_size=16)
    specs = [Spec("tp", "none", parallel="tp"), Spec("rtp", "none", parallel="rtp")]
    args = launch_args(specs, model=model, batch=2, warmup=0, timed=2, start=1, data_mb=0.5)
    for result in by_spec(launch(worker, 2, args)):
        losses = result.first.losses
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses), (result, losses)
