"""``python tools/bench_simple_fsdp.py --preset tiny``: every configuration, eager and compiled, trains the same
model on the same batches (the bench itself refuses configurations whose first gradients differ: AdamW's loss cannot
see a gradient's scale), and the section lands in the Markdown file."""

from __future__ import annotations

import re

from bench_simple_fsdp import SETUPS, run_simple_fsdp_bench


def test_bench_simple_fsdp_tiny(tmp_path):
    target = tmp_path / "B.md"
    target.write_text("# Benchmarks\n\nhand-written intro stays\n")
    text = run_simple_fsdp_bench(preset="tiny", write=str(target))
    body = target.read_text()
    assert "hand-written intro stays" in body and "<!-- bench:simple_fsdp-tiny -->" in body, body
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if re.match(r"\| [FS]", line)]
    assert [r[0] for r in rows] == [s.label for s in SETUPS], rows
    for r in rows:
        assert float(r[1]) > 0 and all(float(t) > 0 for t in r[2].split("-")), r
        assert r[3].endswith("x") and float(r[3][:-1]) > 0, r
    assert rows[0][3] == "1.00x", rows[0]  # the baseline against itself
    # The same initial weights, batches and AdamW: the configurations differ only in the order of fp32 sums (compiled
    # kernels fuse and reorder them), which moves 4 steps' loss by ~1e-6, far inside the table's 4 decimals; a
    # configuration that skipped a step or a rank's gradient would not round to the same value
    assert len({r[-1] for r in rows}) == 1, [r[-1] for r in rows]
