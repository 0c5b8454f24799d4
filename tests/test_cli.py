"""The ``powertrain`` command end to end (tiny presets, real worker processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from powertrain.train.cli import main
from powertrain.train.config import CompressorSpec


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "powertrain", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_train_two_workers_tiny():
    out = _run("train", "--preset", "tiny", "--steps", "8")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 worker(s)" in out.stdout
    lines = [line for line in out.stdout.splitlines() if line.startswith("step")]
    assert len(lines) == 8
    # warm-up steps send the full gradient, compressed steps much less
    assert "1.0x less" in lines[0] and "1.0x less" not in lines[-1]
    assert "Summary:" in out.stdout and "held-out validation loss" in out.stdout


def test_train_without_compression_single_worker():
    out = _run("train", "--preset", "tiny", "--nproc", "1", "--compressor", "none")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 worker(s)" in out.stdout and "nothing to send with one worker" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--compressor", "zip"], "Unknown compressor 'zip'"),
        (["--compressor", "powersgd:rank=0"], "Config.rank=0"),
        (["--compressor", "powersgd:ranks=2"], "Unknown powersgd option 'ranks'"),
        (["--compressor", "powersgd:rank"], "expected key=value"),
        (["--steps", "0"], "steps=0"),
        (["--d-model", "30", "--n-head", "4"], "divisible"),
    ],
)
def test_bad_flags_are_clear_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--preset", "tiny", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_compressor_spec_roundtrip():
    spec = CompressorSpec.parse("powersgd:rank=4,iters=2,variant=paper")
    assert str(spec) == "powersgd:rank=4,iters=2,variant=paper"
    cfg = spec.powersgd_config()
    assert cfg is not None and (cfg.rank, cfg.num_iters_per_step, cfg.variant) == (4, 2, "paper")


def test_bench_overhead_tiny(tmp_path):
    target = tmp_path / "B.md"
    target.write_text("# Benchmarks\n\nhand-written intro stays\n")
    main(["bench", "overhead", "--preset", "tiny", "--repeats", "1", "--write", str(target)])
    text = target.read_text()
    assert "hand-written intro stays" in text
    assert text.count("| alternating |") == 6 and text.count("| paper |") == 1
    main(["bench", "overhead", "--preset", "tiny", "--repeats", "1", "--write", str(target)])
    assert target.read_text().count("<!-- bench:overhead-tiny -->") == 1  # replaced, not appended
