"""powertrain.bench.torchft_diloco: torchft's DiLoCo on powertrain's GPT and data, and its parity with powertrain's
diloco rows (powertrain.bench.sidebyside) on a tiny GPT.

Why the parity is bitwise at 2 replicas: both runs build the same seeded model, draw the same batches, take the same
AdamW steps on the same schedule and the same SGD outer steps, and evaluate with the same sums; they differ only in
how the pseudo-gradients a and b are averaged. torchft sums, then divides by the participants: fl(fl(a + b) / 2);
powertrain divides by the world size, then sums: fl(a / 2 + b / 2). Dividing by 2 is exact in binary floating point
(barring subnormals, 2^-126 and below), and rounding commutes with scaling by a power of two, so
fl(a / 2 + b / 2) = fl(a + b) / 2: the same bits (and a + b = b + a for gloo's two-rank sum). With more replicas the
sum's order inside gloo can differ between powertrain's one flat buffer and torchft's per-parameter all-reduces, and
only a tolerance would hold; these tests stay at 2.

torchft is optional (``pip install -e '.[torchft]'``): without it the runs are skipped, and the install hint is checked.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from typing import Any

import pytest

from powertrain.bench.netem import collective_seconds
from powertrain.bench.sidebyside import Spec, SpecResult, by_spec, launch_args, worker
from powertrain.bench.torchft_diloco import TorchftResult, _combine, run_torchft
from powertrain.models import GPT, GPTConfig
from powertrain.train.launch import launch

HAVE_TORCHFT = importlib.util.find_spec("torchft") is not None
needs_torchft = pytest.mark.skipif(not HAVE_TORCHFT, reason="torchft is not installed (pip install -e '.[torchft]')")

TINY = GPTConfig(256, 32, 1, 2, 32)
RUN: dict[str, Any] = {"model": TINY, "batch": 2, "seed": 0, "data_mb": 0.5, "eval_every": 2, "timeout": 120}
#: label -> (steps, sync_every, fragments, outer_lr, outer_momentum)
ROWS = {"diloco": (6, 3, 1, 0.7, 0.9), "average": (6, 3, 1, 1.0, 0.0), "streaming": (8, 4, 2, 0.7, 0.9)}


def _torchft(label: str, **extra: Any) -> TorchftResult:
    steps, h, f, lr, momentum = ROWS[label]
    return run_torchft(**RUN, steps=steps, sync_every=h, fragments=f, outer_lr=lr, outer_momentum=momentum, **extra)


@pytest.fixture(scope="module")
def powertrain_rows() -> dict[str, SpecResult]:
    """The same rows as powertrain's diloco rows, side by side in one launch of 2 workers."""
    specs = [
        Spec(
            label,
            "none",
            steps=steps,
            optimizer="adamw",
            parallel="diloco",
            optimizer_options={"sync_every": h, "fragments": f, "outer_lr": lr, "outer_momentum": momentum},
        )
        for label, (steps, h, f, lr, momentum) in ROWS.items()
    ]
    rounds = max(s.steps for s in specs)
    args = launch_args(
        specs,
        model=TINY,
        batch=RUN["batch"],
        warmup=0,
        timed=rounds,
        start=0,
        eval_every=RUN["eval_every"],
        data_mb=RUN["data_mb"],
        seed=RUN["seed"],
    )
    return dict(zip(ROWS, by_spec(launch(worker, 2, args)), strict=True))


@pytest.fixture(scope="module")
def diloco() -> TorchftResult:
    return _torchft("diloco")


def test_importing_the_bench_does_not_import_torchft() -> None:
    code = "import sys, powertrain.bench.torchft_diloco; assert 'torchft' not in sys.modules, 'torchft was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_invalid_settings_are_named() -> None:
    with pytest.raises(ValueError, match="fragments=2 for sync_every=3"):
        run_torchft(**RUN, steps=6, sync_every=3, fragments=2)
    with pytest.raises(ValueError, match="world=1"):
        run_torchft(**RUN, steps=6, sync_every=3, world=1, rate_mbit=10.0)
    with pytest.raises(ValueError, match="sync_every=0"):
        run_torchft(**RUN, steps=6, sync_every=0)


def test_step_times_follow_the_slower_replica_between_meetings() -> None:
    """Replica A stalls at step 2, B at step 1, and they meet at step 2 (A arrives last: its hook is the sync alone):
    the steps up to there are A's, and the times add up to the run's (a per-step maximum would count both stalls)."""
    a = {
        "compute_s": [1.0, 5.0, 1.0, 1.0],
        "hook_s": [0.0, 0.5, 0.0, 0.3],
        "meets": [2, 4],
        "syncs": [[2, 8], [4, 8]],
        "evals": [[2, 10.0, 4], [4, 8.0, 4]],
    }
    b = {**a, "compute_s": [4.0, 1.0, 1.0, 1.0], "hook_s": [0.0, 1.5, 0.0, 0.2], "evals": [[2, 12.0, 4], [4, 8.0, 4]]}
    got = _combine([a, b], steps=4, period=2)
    assert got.step_times == [1.0, 5.5, 1.0, 1.2]
    assert got.val_curve == [(2, 22.0 / 8), (4, 2.0)] and got.val_loss == 2.0
    assert got.sync_steps == [2, 4] and got.bytes_per_sync == [8, 8]
    with pytest.raises(RuntimeError, match="committed 1 of 2 syncs"):
        _combine([{**a, "syncs": [[2, 8]]}, {**b, "syncs": [[2, 8]]}], steps=4, period=2)


@pytest.mark.skipif(HAVE_TORCHFT, reason="torchft is installed")
def test_without_torchft_says_how_to_install() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"pip install -e '\.\[torchft\]'"):
        _torchft("diloco")


@needs_torchft
@pytest.mark.timeout(240)
def test_tiny_run_on_loopback(diloco: TorchftResult, powertrain_rows: dict[str, SpecResult]) -> None:
    params = sum(p.numel() for p in GPT(TINY).parameters())
    assert diloco.sync_steps == [3, 6]
    assert diloco.bytes_per_sync == [4 * params] * 2, "fp32 pseudo-gradients of every parameter"
    assert [s for s, _ in diloco.val_curve] == [2, 4, 6]
    assert all(math.isfinite(v) and v < math.log(256) for _, v in diloco.val_curve), diloco.val_curve
    assert diloco.val_loss == diloco.val_curve[-1][1]
    assert len(diloco.step_times) == 6 and all(t > 0 for t in diloco.step_times)
    pt = powertrain_rows["diloco"].first  # Nesterov 0.7 / 0.9: bitwise too (see the module docstring)
    assert diloco.val_curve == pt.val_curve and diloco.val_loss == pt.val_loss


@needs_torchft
@pytest.mark.timeout(240)
def test_plain_averaging_matches_powertrain_bitwise(powertrain_rows: dict[str, SpecResult]) -> None:
    tf, pt = _torchft("average"), powertrain_rows["average"].first
    assert tf.val_curve == pt.val_curve and tf.val_loss == pt.val_loss


@needs_torchft
@pytest.mark.timeout(240)
def test_streaming_matches_powertrain_until_its_final_sync(powertrain_rows: dict[str, SpecResult]) -> None:
    """Two fragments, H=4: torchft syncs the same fragments at the same steps as powertrain (2, 4, 6, 8). At the end
    powertrain's rows synchronise every fragment once more (DiLoCo.finish); torchft has no such step."""
    tf, pt = _torchft("streaming"), powertrain_rows["streaming"].first
    params = [p.numel() for p in GPT(TINY).parameters()]
    assert tf.sync_steps == [2, 4, 6, 8]
    assert sum(tf.bytes_per_sync[:2]) == 4 * sum(params) and tf.bytes_per_sync[:2] == tf.bytes_per_sync[2:]
    assert tf.val_curve[:-1] == pt.val_curve[:-1]
    assert tf.val_curve[-1] != pt.val_curve[-1], "powertrain's final sync of the other fragment"


@needs_torchft
@pytest.mark.netem
@pytest.mark.timeout(240)
def test_emulated_link(diloco: TorchftResult) -> None:
    """On an emulated 2 Mbit/s link the run computes what it computes on loopback, and a sync step takes at least
    about the link's time for the bytes (tbf's burst lets a little through at once)."""
    rate = 2.0
    slow = _torchft("diloco", rate_mbit=rate)
    assert slow.val_curve == diloco.val_curve and slow.bytes_per_sync == diloco.bytes_per_sync
    link_s = collective_seconds("all_reduce", slow.bytes_per_sync[0], 2, rate)
    for step in slow.sync_steps:
        assert slow.step_times[step - 1] > 0.6 * link_s, (step, slow.step_times, link_s)
