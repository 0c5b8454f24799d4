"""A run of the command is a function of its settings and seed (issue 49, item 4): two runs of the same command log
the same losses bit for bit, on two gloo workers with PowerSGD past its exact steps (the demo's path: DDP, the
compressor's chained calls on a worker thread, AdamW). ``make test`` runs this file again on the other kernel paths
(NUMERIC_TESTS in the Makefile: MKL's reproducible path with ATen's scalar kernels, MKL's Intel AVX-512 path), where
a result could depend on timing, memory layout or an unordered reduction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_utils import run_cli


def _losses(out: Path) -> list[tuple[int, float | None, float | None]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows]


@pytest.mark.timeout(300)
def test_two_runs_with_one_seed_log_the_same_losses(tmp_path):
    args = ["train", "--preset", "tiny", "--parallel", "ddp", "--steps", "10", "--eval-every", "5", "--quiet"]
    runs = []
    for name in ("a", "b"):
        r = run_cli(*args, "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(_losses(tmp_path / name))
    assert [step for step, _, _ in runs[0]] == list(range(1, 11)), runs[0]
    assert sum(val is not None for _, _, val in runs[0]) == 2, runs[0]
    assert runs[0] == runs[1]
