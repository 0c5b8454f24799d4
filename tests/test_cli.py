"""``powertrain train`` end to end: real worker processes, tiny presets, seconds each."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_utils import run_cli
from powertrain.cli import main
from powertrain.train.config import parse_compressor

METRIC_KEYS = {
    "step",
    "loss",
    "lr",
    "step_time_s",
    "compute_s",
    "comm_s",
    "compress_s",
    "bytes_sent",
    "bytes_uncompressed",
}


_run = run_cli


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_default_run_writes_everything(tmp_path):
    out = tmp_path / "run"
    r = _run("train", "--preset", "tiny", "--steps", "8", "--out", str(out), "--tensorboard")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 8 and "2 worker(s)" in r.stdout
    assert "1.0x less" in steps[0] and "1.0x less" not in steps[-1]  # warm-up exact, then compressed
    assert "Summary:" in r.stdout and "held-out validation loss" in r.stdout
    rows = _metrics(out)
    assert [row["step"] for row in rows] == list(range(1, 9)) and all(set(row) >= METRIC_KEYS for row in rows)
    assert "val_loss" in rows[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bytes_sent"] < summary["bytes_uncompressed"] and summary["final_loss"] < summary["first_loss"]
    assert "compressor = " in (out / "config.toml").read_text()
    for png in ("loss_vs_step", "loss_vs_wallclock", "loss_vs_bytes"):
        assert (out / f"{png}.png").stat().st_size > 1000
    # --tensorboard: the logged scalars as TensorBoard events, the same values at the same steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for key in ("loss", "lr", "bytes_sent", "step_time_s", "comm_s", "val_loss"):
        logged = [(row["step"], row[key]) for row in rows if key in row]
        seen = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in seen] == [s for s, _ in logged], key
        assert all(abs(v - w) <= 1e-6 * max(1.0, abs(w)) for (_, v), (_, w) in zip(seen, logged, strict=True)), key


def test_tensorboard_without_the_package_is_a_clear_error(monkeypatch, capsys, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        main(["train", "--preset", "tiny", "--tensorboard", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and not (tmp_path / "x").exists()
    assert "pip install 'powertrain[tensorboard]'" in capsys.readouterr().err


def test_config_file_and_flags(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('steps = 3\ncompressor = "bf16"\nparallel = "ddp"\nlr = 0.01\n')
    out = tmp_path / "run"
    r = _run("train", "--preset", "tiny", "--config", str(cfg), "--steps", "4", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    saved = (out / "config.toml").read_text()
    assert "steps = 4" in saved and 'compressor = "bf16"' in saved and "lr = 0.01" in saved  # flags win
    assert [row["step"] for row in _metrics(out)][-1] == 4


@pytest.mark.parametrize("source", ["textdir", "bin", "mnist1d", "rtp"])
def test_data_sources_and_parallel_modes(tmp_path, source):
    out = tmp_path / "run"
    if source == "textdir":
        d = tmp_path / "texts"
        d.mkdir()
        for i in range(5):
            (d / f"f{i}.txt").write_text(f"the quick brown fox jumps over the lazy dog {i}\n" * 200)
        args = ["--data", "textdir", "--data-path", str(d), "--parallel", "ddp", "--compressor", "int4"]
    elif source == "bin":
        tokens = torch.randint(0, 1000, (40_000,), dtype=torch.int32).to(torch.uint16)
        f = tmp_path / "train.bin"
        f.write_bytes(tokens.numpy().tobytes())
        args = ["--data", "bin", "--data-path", str(f), "--parallel", "fsdp"]
        args += ["--compressor", "powersgd:rank=2,start=1"]
    elif source == "mnist1d":
        args = ["--model", "resnet", "--data", "mnist1d", "--parallel", "ddp", "--compressor", "sign", "--lr", "0.003"]
    else:  # the stdlib corpus, rotated tensor parallel (its ring's messages are counted)
        args = ["--parallel", "rtp"]
    r = _run("train", "--preset", "tiny", "--out", str(out), "--quiet", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["bytes_sent"] > 0 and summary["val_loss"] == summary["val_loss"]


_SHAMPOO = ["--optimizer", "shampoo", "--shampoo-frequency", "2", "--shampoo-max-dim", "16"]


@pytest.mark.parametrize(
    "mode",
    [
        ["ddp", "int8"],
        ["simple_fsdp", "none"],
        ["simple_fsdp", "powersgd:rank=2,start=2", "--adam-freeze", "0.3"],
        ["ddp", "none", *_SHAMPOO, "--shampoo-vectors", "shampoo"],
        ["fsdp", "none", *_SHAMPOO, "--shampoo-preconditioner", "eigenvalue_corrected"],
        ["reference", "none", *_SHAMPOO, "--shampoo-comm-dtype", "bf16"],
        ["ddp", "none", "--optimizer", "demo", "--lr", "3e-4", "--demo-chunk", "16", "--demo-topk", "4"],
        ["fsdp", "none", "--optimizer", "galore", "--galore-rank", "8", "--galore-gap", "3"],
        ["tp", "none", "--tp", "2"],
        ["tp", "powersgd:rank=2,start=2", "--tp", "2", "--nproc", "4"],
        [
            "diloco",
            "powersgd:rank=2",
            "--sync-every",
            "4",
            "--fragments",
            "2",
            "--sync-delay",
            "1",
            "--sync-mix",
            "0.5",
            "--outer-lr",
            "0.7",
            "--outer-momentum",
            "0.9",
            "--outer-lr-schedule",
            "inner",
        ],
        ["fsdp", "int8", "--optimizer", "muon", "--muon-lr", "0.05"],
        ["ddp", "none", "--optimizer", "muon"],
        ["diloco", "int4", "--optimizer", "muon", "--sync-every", "3"],
        ["ddp", "none", "--optimizer", "dion", "--dion-rank", "0.5"],
        ["fsdp", "none", "--optimizer", "dion"],
    ],
    ids=[
        "ddp-int8",
        "simple_fsdp",
        "simple_fsdp-powersgd",
        "ddp-shampoo",
        "fsdp-soap",
        "reference-shampoo-bf16",
        "ddp-demo",
        "fsdp-galore",
        "tp",
        "tp-powersgd",
        "diloco-streaming",
        "fsdp-muon-int8",
        "ddp-muon",
        "diloco-muon",
        "ddp-dion",
        "fsdp-dion",
    ],
)
# make test runs the corners (DDP with a compressor, SimpleFSDP with PowerSGD and a frozen AdamW, FSDP2 with an
# optimizer whose state differs per rank, local updates with a sync in flight, Muon's all-to-alls on FSDP2 shards
# behind a compressed reduce-scatter); make test-slow every mode
@pytest.mark.slow_unless("ddp-int8", "simple_fsdp-powersgd", "fsdp-galore", "diloco-streaming", "fsdp-muon-int8")
def test_resume_continues_bitwise(tmp_path, mode):
    """Including optimizers whose state differs per rank (Shampoo's owned blocks or local shards, DeMo's local
    momentum, GaLore's projected moments of local shards): the checkpoint keeps each rank's own. The
    simple_fsdp-powersgd run's AdamW freezes its second moment after 2 steps, before the checkpoint at 4. (RTP's bitwise
    resume through the same DCP state dicts is in test_rtp; test_data_sources_and_parallel_modes runs it here.)"""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = [
        "train",
        "--preset",
        "tiny",
        "--steps",
        "8",
        "--parallel",
        mode[0],
        "--compressor",
        mode[1],
        "--quiet",
        *mode[2:],
    ]
    r = _run(*common, "--checkpoint-every", "4", "--out", str(full))
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(*common, "--out", str(resumed), "--resume", str(full / "checkpoints" / "step_00000004"))
    assert r.returncode == 0, r.stderr[-3000:]
    a = {row["step"]: row["loss"] for row in _metrics(full)}
    b = {row["step"]: row["loss"] for row in _metrics(resumed)}
    assert sorted(b) == [5, 6, 7, 8] and all(a[s] == b[s] for s in b)
    assert a[8] < a[1], "it trains"
    rows = _metrics(full)
    if "demo" in mode:  # the optimizer's own compression and all-gather are in the step's figures
        assert all(row["compress_s"] > 0 and row["comm_s"] > 0 and row["bytes_sent"] > 0 for row in rows), rows
    if mode[0] in ("ddp", "reference") and "shampoo" in mode:  # Shampoo's all-gather of the search directions
        assert all(row["comm_s"] > 0 for row in rows), rows
    if "dion" in mode and mode[0] == "ddp":  # Dion's own factors are the run's only traffic: counted, below fp32's
        summary = json.loads((full / "summary.json").read_text())
        assert 0 < summary["bytes_sent"] < summary["bytes_uncompressed"], summary
    if "muon" in mode or "dion" in mode:  # the logged rate is --lr's (the AdamW groups'), not the matrices'
        assert all(row["lr"] <= 1e-3 for row in rows), rows
    if "muon" in mode and mode[0] != "diloco":  # the split work's collectives are counted with the gradients'
        summary = json.loads((full / "summary.json").read_text())
        assert summary["bytes_sent"] > 0 and all(row["comm_s"] > 0 for row in rows), rows
    if "shampoo" in mode:  # root computations counted over the ranks (issue 19), none failed
        roots = json.loads((full / "summary.json").read_text())["shampoo_roots"]
        assert roots["computed"] > 0 and roots["failed"] == roots["graft_steps"] == 0, roots
    if "bf16" in mode:  # the option reaches the optimizer: fewer bytes than with fp32 directions
        fp32 = _run(*common[: common.index("--shampoo-comm-dtype")], "--out", str(tmp_path / "fp32"))
        assert fp32.returncode == 0, fp32.stderr[-3000:]
        sent = [json.loads((d / "summary.json").read_text())["bytes_sent"] for d in (full, tmp_path / "fp32")]
        assert 0 < sent[0] < sent[1], sent
    if mode[:2] in (["simple_fsdp", "none"], ["tp", "none"]):  # counted by the strategy
        assert all(row["bytes_sent"] > 0 for row in rows), rows
    if "--fragments" in mode:  # the checkpoint at step 4 caught fragment 0's sync in flight (started at 4, due at 5)
        # syncs start at 2 (fragment 1), 4, 6 and at 8 (the finish); PowerSGD's second all-reduce is issued when the
        # first completes, which may fall in the next step
        assert rows[0]["bytes_sent"] == 0 and rows[1]["bytes_sent"] > 0, rows
        summary = json.loads((full / "summary.json").read_text())
        # applied at 3, 5 and 7; the finish applies the one started at 8, then syncs both fragments again (mixed
        # weights differ between the replicas): 6
        assert summary["syncs"] == 6 and summary["fragments"] == 2, summary
    if mode[0] == "tp":  # loss parallelism: the cross-entropy's all-reduces, not a gather of the logits
        from powertrain.models import GPTConfig
        from powertrain.tp import traffic
        from powertrain.train.config import resolve

        cfg = resolve("tiny", None, {})
        gpt = GPTConfig(256, cfg.block_size, *cfg.gpt_shape)
        sent = {
            lp: sum(b for b, _ in traffic(gpt, 2, 1, cfg.batch_size, cfg.block_size, loss_parallel=lp).values())
            for lp in (True, False)
        }
        assert sent[True] != sent[False], sent
        if mode[1] == "none":
            assert {row["bytes_sent"] for row in rows} == {sent[True]}, (sent, rows)
        else:  # and FSDP2's reduce-scatter through the compressor: exact for 2 steps, then PowerSGD
            assert all(row["bytes_sent"] > sent[True] for row in rows), (sent, rows)
            assert rows[0]["bytes_sent"] > rows[-1]["bytes_sent"], rows


def test_shampoo_fallbacks_are_reported_once():
    from powertrain.train.loop import _roots_text

    assert _roots_text({"computed": 9, "failed": 0, "graft_steps": 0, "abandoned": 0}) == ""
    text = _roots_text({"computed": 9, "failed": 3, "graft_steps": 7, "abandoned": 1})
    assert "3 of 12 root computations failed" in text and "7 block-steps" in text and "1 block(s) given up" in text


@pytest.mark.parametrize(("vectors", "preconditioned"), [("graft", False), ("shampoo", True)])
def test_shampoo_vectors_reach_the_optimizer(vectors, preconditioned):
    from powertrain.train.config import TrainConfig
    from powertrain.train.optimizers import build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    built = build_optimizer(TrainConfig(optimizer="shampoo", shampoo_vectors=vectors), model)
    assert built.optimizer.precondition_1d is preconditioned


@pytest.mark.slow
def test_simple_fsdp_compiled_matches_eager(tmp_path):
    """--parallel simple_fsdp --compile: the whole step (communication included) compiles with fullgraph and
    trains like eager. The first loss is computed from the same weights on the same batch: inductor may reorder
    its reductions (at most 256 terms, the vocabulary), 4 sqrt(256) eps32 |loss| on each side. Later losses
    depend on weights AdamW moved from rounding-different gradients: test_simple_fsdp's compile parity derives
    that bound from the gradients and AdamW's state; here they must be finite."""
    common = [
        "train",
        "--preset",
        "tiny",
        "--steps",
        "4",
        "--parallel",
        "simple_fsdp",
        "--compressor",
        "none",
        "--log-every",
        "1",
        "--quiet",
    ]
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        r = _run(*common, *extra, "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr[-3000:]
    a = [row["loss"] for row in _metrics(tmp_path / "eager")]
    b = [row["loss"] for row in _metrics(tmp_path / "compiled")]
    assert len(a) == len(b) == 4 and all(math.isfinite(x) for x in a + b), (a, b)
    eps32 = torch.finfo(torch.float32).eps
    assert abs(a[0] - b[0]) <= 2 * 4 * 16 * eps32 * abs(a[0]), (a, b)


def test_killed_worker_stops_the_others_and_resume_works(tmp_path):
    out = tmp_path / "run"
    args = [
        "train",
        "--preset",
        "tiny",
        "--steps",
        "400",
        "--checkpoint-every",
        "5",
        "--out",
        str(out),
        "--quiet",
        "--block-size",
        "64",
        "--batch-size",
        "8",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "powertrain", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 90
        while not (out / "checkpoints" / "latest").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        victim = int((out / "pids" / "rank1").read_text())
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        _, err = proc.communicate(timeout=60)  # the others must stop well within a minute
        stopped_after = time.monotonic() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    assert "worker rank 1" in err and "SIGKILL" in err and "--resume" in err, err[-2000:]
    assert stopped_after < 60
    done = int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])
    again = ["--steps", str(done + 3), "--quiet", "--block-size", "64", "--batch-size", "8"]
    r = _run("train", "--preset", "tiny", *again, "--out", str(tmp_path / "again"), "--resume", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in _metrics(tmp_path / "again")] == [done + 1, done + 2, done + 3]


def test_nonfinite_loss_stops_clearly_and_keeps_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    r = _run(
        "train",
        "--preset",
        "tiny",
        "--steps",
        "10",
        "--lr",
        "1e30",
        "--optimizer",
        "sgd",
        "--momentum",
        "0",
        "--checkpoint-every",
        "1",
        "--out",
        str(out),
        "--quiet",
    )
    assert r.returncode == 1
    assert "training stopped at step" in r.stderr and "non-finite" in r.stderr, r.stderr[-2000:]
    assert (out / "checkpoints" / "latest").exists()


def test_help_shows_each_default(capsys):
    from powertrain.train.config import DEFAULT_START, RECOMMENDED_POWERSGD

    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for expect in (
        "--steps STEPS default: 300",
        "--lr LR default: 0.001",
        "(default: adamw)",
        f"(default: {RECOMMENDED_POWERSGD},start={DEFAULT_START} on the default GPT: the rank is the "
        "model's width / 8 (none with simple_fsdp",
        "(ignored under torchrun, which sets the world) (default: 2)",
    ):
        assert expect in text, expect


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--compressor", "zip"], "Unknown compressor 'zip'"),
        (["--compressor", "powersgd:rank=0"], "Config.rank=0"),
        (["--compressor", "powersgd:ranks=2"], "ranks"),
        (["--compressor", "powersgd:rank"], "expected key=value"),
        (["--compressor", "powersgd:rank=2", "--steps", "5"], "starts compressing after 5 steps and the run has 5"),
        (["--steps", "0"], "steps=0"),
        (["--lr", "-1"], "lr=-1"),
        (["--parallel", "fsdp", "--compressor", "topk"], "cannot run under parallel='fsdp'"),
        (["--parallel", "simple_fsdp", "--compressor", "int8", "--compile"], "runs on eager buckets"),
        (["--parallel", "simple_fsdp", "--compressor", "sign"], "cannot run under parallel='simple_fsdp'"),
        (["--parallel", "ddp", "--compile"], "compile=True is supported with"),
        (["--parallel", "rtp", "--compressor", "int8"], "does not apply to parallel='rtp'"),
        (["--parallel", "rtp", "--optimizer", "shampoo"], "parallel='rtp' trains with optimizer='adamw' or 'sgd'"),
        (["--parallel", "rtp", "--precision", "bf16"], "parallel='rtp' runs in fp32 and eagerly"),
        (["--parallel", "tp", "--tp", "4"], "tp=4 does not divide nproc=2"),
        (["--parallel", "tp", "--tp", "4", "--nproc", "4"], "does not divide the tiny GPT's n_head=2"),
        (["--parallel", "tp", "--compressor", "topk"], "cannot run under parallel='tp'"),
        (["--parallel", "tp", "--model", "resnet", "--data", "mnist1d"], "has a plan for the GPT only"),
        (["--optimizer", "demo", "--compressor", "int8"], "drop compressor='int8'"),
        (["--optimizer", "demo", "--compressor", "none", "--parallel", "fsdp"], "powertrain.optim.FlexDeMo"),
        (["--hierarchy", "node", "--parallel", "simple_fsdp"], "hierarchy='node' compresses gradients between nodes"),
        (["--hierarchy", "rack"], "invalid choice: 'rack'"),
        (["--galore-scale", "0"], "galore_scale=0"),
        (["--demo-decay", "1"], "demo_decay=1"),
        (["--adam-freeze", "1"], "Invalid adam_freeze=1.0: must be a fraction of the steps in [0, 1)"),
        (["--adam-freeze", "0.1", "--optimizer", "sgd"], "freezes AdamW's second moment; optimizer='sgd' has none"),
        (["--shampoo-comm-dtype", "fp8"], "invalid choice: 'fp8'"),
        (["--shampoo-vectors", "diagonal"], "invalid choice: 'diagonal'"),
        (["--data", "textdir"], "needs data_path"),
        (["--data", "textdir", "--data-path", "/nonexistent/x"], "does not exist"),
        (["--data", "bin", "--data-path", "/nonexistent.bin"], "does not exist"),
        (["--model", "resnet"], "model='resnet' trains on data='mnist1d'"),
        (["--out", "/proc/powertrain-cannot-write"], "Cannot write to out="),
        (["--resume", "/nonexistent/run"], "No checkpoint at"),
    ],
)
def test_bad_flags_are_clear_errors(args, message, capsys, tmp_path):
    extra = [] if "--out" in args else ["--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exc:
        main(["train", "--preset", "tiny", *args, *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_default_compressor_compresses_even_a_short_run():
    from powertrain.train.config import DEFAULT_START, RECOMMENDED_POWERSGD, TrainConfig

    assert TrainConfig(steps=1000).compressor == f"{RECOMMENDED_POWERSGD},start={DEFAULT_START}"
    assert TrainConfig(steps=5).compressor == f"{RECOMMENDED_POWERSGD},start=2"  # half the run, not all of it
    assert TrainConfig(steps=1).compressor == f"{RECOMMENDED_POWERSGD},start=0"
    # the rank is the width / 8: the same compression ratio on every model (bench quality, BENCHMARKS.md)
    assert TrainConfig(gpt_size="medium").compressor.startswith("powersgd:rank=48,")  # d_model 384
    assert TrainConfig(model="resnet", data="mnist1d").compressor.startswith("powersgd:rank=8,")  # 64 channels
    assert parse_compressor(RECOMMENDED_POWERSGD)[1] == {
        "rank": 32,
        "variant": "paper",
        "factor_dtype": "bf16",
        "start_compressing_after_num_steps": DEFAULT_START,
    }


def test_adamw_freezes_by_default_with_powersgd_only():
    from powertrain.train.cli import _continued
    from powertrain.train.config import POWERSGD_ADAM_FREEZE, TrainConfig

    assert TrainConfig().adam_freeze == POWERSGD_ADAM_FREEZE  # make demo's run: PowerSGD and AdamW
    assert TrainConfig(compressor="powersgd:rank=4").adam_freeze == POWERSGD_ADAM_FREEZE
    assert TrainConfig(compressor="int8").adam_freeze == 0.0  # not measured with it
    assert TrainConfig(compressor="none").adam_freeze == 0.0
    assert TrainConfig(optimizer="sgd").adam_freeze == 0.0
    assert TrainConfig(adam_freeze=0.0).adam_freeze == 0.0  # the user's choice stands
    # too short for a second moment worth freezing: 80 steps freeze after 20, 79 would after 19.75: torch's AdamW
    assert TrainConfig(steps=80).adam_freeze == POWERSGD_ADAM_FREEZE and TrainConfig(steps=79).adam_freeze == 0.0
    assert TrainConfig(steps=12, adam_freeze=0.25).freeze_after == 3  # unless the user asks for it
    # a resume keeps the checkpoint's freeze (an older run's 0) unless the user sets one
    assert _continued(TrainConfig(), {"adam_freeze": 0.0}, {}).adam_freeze == 0.0
    assert _continued(TrainConfig(adam_freeze=0.5), {"adam_freeze": 0.0}, {"adam_freeze": 0.5}).adam_freeze == 0.5
    assert _continued(TrainConfig(), {}, {}).adam_freeze == POWERSGD_ADAM_FREEZE
    # the compressor: the run's own unless the user names another, which is left for the settings check to refuse
    assert _continued(TrainConfig(steps=8), {"compressor": "int8"}, {}).compressor == "int8"
    asked = _continued(TrainConfig(compressor="bf16"), {"compressor": "int8"}, {"compressor": "bf16"})
    assert asked.compressor == "bf16"  # not silently int8 (issue 49)
    auto = _continued(
        TrainConfig(compressor="powersgd:rank=auto"),
        {"compressor": "powersgd:rank=4"},
        {"compressor": "powersgd:rank=auto"},
    )
    assert auto.compressor == "powersgd:rank=4"  # rank=auto continues with what it chose
    # the run's own compressor does not fit the optimizer the user asks for: left as resolved, so that the settings
    # check names the optimizer (it named the compressor, which the user never gave)
    dion = TrainConfig(optimizer="dion")
    assert _continued(dion, {"compressor": "powersgd:rank=2,start=2"}, {"optimizer": "dion"}) == dion


def test_every_setting_is_either_applied_and_said_or_refused_on_resume():
    """Issue 49, item 1: every field of TrainConfig is in exactly one of RESUME_MAY_CHANGE and RESUME_REFUSED (a new
    flag must be placed); a resume that changes a refused one is refused naming it, one that changes an allowed one
    says it in the log (but where the run is: out, resume); no value the user gives is replaced by the checkpoint's,
    and of those the user leaves unset only the compressor, the AdamW freeze and the matrices' rate (defaults that
    depend on other settings and on the version) continue with the run's own."""
    from powertrain.train.checkpoint import RESUME_MAY_CHANGE, RESUME_REFUSED, config_changes, resume_changes
    from powertrain.train.cli import _continued
    from powertrain.train.config import TrainConfig, ignored_by

    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    assert not RESUME_MAY_CHANGE & RESUME_REFUSED, RESUME_MAY_CHANGE & RESUME_REFUSED
    assert set(fields) == RESUME_MAY_CHANGE | RESUME_REFUSED, set(fields) ^ (RESUME_MAY_CHANGE | RESUME_REFUSED)
    cfg = TrainConfig(optimizer="muon")  # a run with every kind of default, the matrices' rate among them
    saved = dataclasses.asdict(cfg)

    def another(name: str, v: object) -> object:  # a value of the field's type (the compressor's: one that parses)
        if name in ("compressor", "adam_freeze", "muon_lr"):
            return {"compressor": "int8", "adam_freeze": 0.5, "muon_lr": 0.5}[name]
        return not v if isinstance(v, bool) else v + 1 if isinstance(v, int | float) else "another"

    for name in fields:
        asked = {**saved, name: another(name, saved[name])}
        refused, said = config_changes(saved, asked), resume_changes({"config": saved}, asked)
        change = f"{name}={saved[name]!r} -> {asked[name]!r}"
        if name in ignored_by(cfg.optimizer):  # another optimizer's setting: the run never used it (and refuses it)
            assert refused == said == "", (name, refused, said)
        elif name in RESUME_REFUSED:
            assert refused == change, (name, refused)
        else:
            assert refused == "", (name, refused)
            assert said == ("" if name in ("out", "resume") else change), (name, said)
        run = TrainConfig() if name == "adam_freeze" else cfg  # the freeze is AdamW's
        other = {**dataclasses.asdict(run), name: another(name, getattr(run, name))}
        assert getattr(_continued(run, other, {name: getattr(run, name)}), name) == getattr(run, name), name
        kept = _continued(run, other, {})
        replaced = getattr(kept, name) != getattr(run, name)
        assert replaced == (name in ("compressor", "adam_freeze", "muon_lr")), (name, getattr(kept, name))


def test_a_resume_with_another_compressor_is_refused(tmp_path):
    """``--compressor int8``, then a resume with ``--compressor bf16``: refused in one line naming both (it kept
    training with int8 and exited 0)."""
    out = tmp_path / "run"
    common = ["train", "--preset", "tiny", "--parallel", "ddp", "--quiet", "--out", str(out)]
    r = _run(*common, "--compressor", "int8", "--steps", "4", "--checkpoint-every", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(*common, "--compressor", "bf16", "--steps", "6", "--resume", str(out))
    assert r.returncode != 0 and "compressor='int8' -> 'bf16'" in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_summary_says_what_the_default_costs_where_measured():
    from powertrain.train.config import RECOMMENDED_COST, TrainConfig, resolve
    from powertrain.train.loop import _cost_text

    assert _cost_text(TrainConfig()) == f"; {RECOMMENDED_COST}"  # make demo's run
    assert _cost_text(TrainConfig(compressor="powersgd:rank=8")) == ""  # not what was measured
    assert _cost_text(TrainConfig(adam_freeze=0.0)) == ""
    assert _cost_text(resolve("tiny", None, {})) == ""  # another model
    # every loss it quotes is in the section it names, as the bench wrote it
    benchmarks = (Path(__file__).resolve().parents[1] / "BENCHMARKS.md").read_text()
    name = "quality-frozen-bound"
    section = benchmarks.split(f"<!-- bench:{name} -->")[1].split(f"<!-- /bench:{name} -->")[0]
    quoted = re.findall(r"\d\.\d{4}", RECOMMENDED_COST)
    assert len(quoted) == 5 and all(q in section for q in quoted), quoted


def test_empty_data_dir_and_bad_config_files(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--data", "textdir", "--data-path", str(empty)], "has no non-empty files"),
        (["--config", str(tmp_path / "missing.toml")], "does not exist"),
    ]
    bad_key = tmp_path / "k.toml"
    bad_key.write_text("stepz = 3\n")
    bad_value = tmp_path / "v.toml"
    bad_value.write_text('optimizer = "adam"\n')
    broken = tmp_path / "b.toml"
    broken.write_text("steps = \n")
    cases += [
        (["--config", str(bad_key)], "Unknown config key(s) ['stepz']"),
        (["--config", str(bad_value)], "Invalid optimizer='adam': must be one of 'adamw', 'sgd'"),
        (["--config", str(broken)], "is not valid TOML"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit):
            main(["train", "--preset", "tiny", "--out", str(tmp_path / "o"), *args])
        assert message in capsys.readouterr().err, message


def test_compressor_spec_parsing():
    assert parse_compressor("powersgd:rank=4,iters=2,variant=alternating") == (
        "powersgd",
        {
            "rank": 4,
            "num_iters_per_step": 2,
            "variant": "alternating",
            "factor_dtype": "fp32",
            "start_compressing_after_num_steps": 5,
        },
    )
    assert parse_compressor("topk:ratio=0.01") == ("topk", {"ratio": 0.01})
    assert parse_compressor("powersgd:rank=32,variant=paper,factors=bf16,start=5") == (
        "powersgd",
        {"rank": 32, "variant": "paper", "factor_dtype": "bf16", "start_compressing_after_num_steps": 5},
    )


def test_bench_overhead_tiny(tmp_path):
    target = tmp_path / "B.md"
    target.write_text("# Benchmarks\n\nhand-written intro stays\n")
    main(["bench", "overhead", "--preset", "tiny", "--repeats", "1", "--write", str(target)])
    text = target.read_text()
    assert "hand-written intro stays" in text
    assert text.count("| alternating |") == 6 and text.count("| paper |") == 1
    main(["bench", "overhead", "--preset", "tiny", "--repeats", "1", "--write", str(target)])
    assert target.read_text().count("<!-- bench:overhead-tiny -->") == 1  # replaced, not appended
    before = torch.get_num_threads()
    try:  # --threads holds for the measurement only: this process's count is given back
        torch.set_num_threads(2)
        main(["bench", "overhead", "--preset", "tiny", "--repeats", "1", "--threads", "1", "--write", str(target)])
        assert "1 torch thread(s)" in target.read_text() and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_each_bench_suite_takes_its_own_presets_and_flags(capsys):
    """A subcommand per suite: a preset or a flag another suite reads is refused by name, with the choices."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "overhead", "--preset", "mnist1d"])
    assert exc.value.code == 2
    assert "argument --preset: invalid choice: 'mnist1d' (choose from 'default', 'tiny')" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "parallel", "--preset", "wide"])
    assert "invalid choice: 'wide'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "parallel", "--repeats", "2"])
    assert "unrecognized arguments: --repeats 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "quality", "--preset", "mnist1d", "--help"])
    assert "mnist1d (the 1-D ResNet on mnist1d)" in capsys.readouterr().out


def test_a_suite_run_from_a_checkout_takes_the_same_flags_and_errors_in_one_line(tmp_path, capsys):
    """tools/bench_*.py (suites not installed) read --preset and --write as ``powertrain bench`` does, pass their own
    flags on, and end a bad value with one line and status 2; ``powertrain bench`` no longer has them."""
    import bench_muon
    import bench_optimizers

    with pytest.raises(SystemExit) as exc:
        bench_muon.main(["--write", str(tmp_path)])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        f"tools/bench_muon.py: error: --write {str(tmp_path)!r} is not a file in an existing directory: give a "
        "Markdown file's path\n"
    )
    with pytest.raises(SystemExit) as exc:
        bench_optimizers.main(["--preset", "tiny", "--write", "", "--shampoo-reference", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tools/bench_optimizers.py: error: Invalid Shampoo reference") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        bench_muon.main(["--preset", "wide"])
    assert "invalid choice: 'wide'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "muon"])
    assert "invalid choice: 'muon'" in capsys.readouterr().err


def test_workers_start_where_tmpdir_is_too_long_for_the_fork_server(tmp_path):
    """The workers' fork server listens on a Unix socket in TMPDIR; where that path would be longer than a socket
    address takes (108 bytes), the launcher spawns its workers instead of failing."""
    long = tmp_path / ("x" * 100)
    long.mkdir()
    r = _run(
        "train",
        "--preset",
        "tiny",
        "--steps",
        "4",
        "--quiet",
        "--out",
        str(tmp_path / "run"),
        env={"TMPDIR": str(long)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(_metrics(tmp_path / "run")) == 4


def _returns(marker: str) -> int:
    import atexit

    atexit.register(lambda: Path(marker).write_text("finalized"))  # stands in for the interpreter's teardown
    return int(os.environ["RANK"]) * 10


def _rank1_fails(marker: str) -> None:
    if os.environ["RANK"] == "1":
        raise RuntimeError("boom\non two lines")
    time.sleep(60)  # rank 0 would wait for rank 1 forever: the launcher must stop it


def test_launcher_returns_results_and_stops_everyone_on_a_failure(tmp_path):
    """Workers that returned exit without interpreter finalisation (the atexit hook never runs); a failing
    worker's own one-line cause reaches the caller, and the others are stopped at once."""
    from powertrain.train.launch import WorkerFailed, launch

    marker = tmp_path / "finalized"
    assert launch(_returns, 2, str(marker)) == {0: 0, 1: 10}
    assert not marker.exists()
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as e:
        launch(_rank1_fails, 2, str(marker), trace_dir=tmp_path / "logs", grace_s=2.0)
    assert time.monotonic() - t0 < 30
    assert [(f.rank, f.cause.split(" (traceback")[0]) for f in e.value.failures] == [
        (1, "RuntimeError: boom on two lines")
    ]
    assert "Traceback" in (tmp_path / "logs" / "rank1.traceback").read_text()


@pytest.mark.parametrize("backend", ["auto", "nccl", "gloo"])
def test_the_device_follows_the_backend_also_without_a_process_group(backend, monkeypatch):
    """``--nproc 1 --parallel reference`` makes no process group; its device is still the one ``--backend`` names
    (auto: CUDA where there is one): a GPU machine trained a 124M GPT on the CPU. Here CUDA is faked, no collective
    runs; the other modes take their process group's device (:func:`powertrain.comm.collective_device`)."""
    import torch.distributed as dist

    from powertrain.train import loop
    from powertrain.train.config import TrainConfig

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = TrainConfig(parallel="reference", nproc=1, backend=backend, compressor="none")
    device = loop._init_distributed(cfg)
    assert not dist.is_initialized()
    cuda = backend != "gloo"
    assert device == (torch.device("cuda", 0) if cuda else torch.device("cpu")) and chosen == ([0] if cuda else [])
