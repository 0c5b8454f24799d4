"""``make gpu-check``'s machinery on the CPU, so that the one GPU run cannot find it broken: a size's measurements
and their report, stages that fail or hang without stopping the others, the Makefile's choice of Python, and the
on-paper GPU cluster model's arithmetic."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gpu_cluster
from gpu_measure import COMPRESSORS, PROFILED, measure
from gpu_stages import Stage, load_previous, run, section, select, stages, write_profiles

ROOT = Path(__file__).resolve().parent.parent


def test_a_sizes_measurements_and_their_report(tmp_path):
    """The tiny stand-in measured on the CPU (what the GPU run does for 124M and 350M, fewer repetitions): every
    compressor timed against backward, GaLore's state smaller than AdamW's, each strategy's step, the section."""
    path = tmp_path / "tiny.json"
    import torch.distributed as dist

    data = measure("tiny", torch.device("cpu"), path, repeats=2, memory=("ddp", "rtp"), profile_above=0.0)
    assert not dist.is_initialized()  # its world of one is left again
    assert json.loads(path.read_text()) == data  # the file is what was measured, item by item
    assert data["passes"]["backward_s"] > 0 and data["passes"]["forward_s"] > 0
    comps = data["compressors"]
    assert comps["auto_choice"].startswith("rank=auto chose")
    for label in [*COMPRESSORS, "PowerSGD auto"]:
        c = comps[label]
        assert c["seconds"] > 0 and c["of_backward"] == c["seconds"] / data["passes"]["backward_s"], label
    assert comps["PowerSGD r4"]["bytes_per_step"] < comps["bf16"]["bytes_per_step"] < comps["bf16"]["dense_bytes"]
    # GaLore keeps rank-16 moments of the 64-wide matrices (and their projectors): less state than AdamW's two moments
    assert 0 < data["galore"]["galore"]["state_gb"] < data["galore"]["adamw"]["state_gb"]
    for kind in ("ddp", "rtp"):  # rtp: its backward under bf16 autocast (was a dtype error)
        assert data[f"memory/{kind}"]["step_s"] > 0, data[f"memory/{kind}"]
    for label in ("AdamW", "Muon", "Dion rank 1/4"):  # each optimizer's step, and its share of the training step
        o = data["optimizers"][label]
        assert o["seconds"] > 0 and 0 < o["of_step"] < 1, (label, o)
    results = {
        "device": "cpu",
        "started": "now",
        "budget_s": 60,
        "elapsed_s": 5,
        "stages": {"measure:tiny": {"ok": True, "seconds": 3.0, "result": data}},
    }
    text = section(results)
    assert "| measure:tiny | ok |" in text and "PowerSGD r32 (powersgd, rank 32)" in text
    assert "| tiny | rtp |" in text and "Target (issue 36)" in text and "| tiny | Muon |" in text
    # a profile for each profiled compressor above profile_above (here 0: every one), each in its file
    assert all(isinstance(data[key], str) for key, _ in PROFILED.values())
    written = write_profiles(results, tmp_path)
    assert sorted(p.name for p in written) == sorted(name for _, name in PROFILED.values())
    for label in PROFILED:
        text = (tmp_path / PROFILED[label][1]).read_text()
        assert text.startswith(f"measure:tiny: {label}, top operations") and "Self CPU" in text, text[:300]


def test_stages_fail_alone_and_within_the_budget(tmp_path):
    """A real train stage, one that raises, one that hangs past its timeout, and one the budget leaves no room for:
    each is recorded with its one-line cause, and the ones after a failure still run."""
    train = next(s for s in stages("tiny", "cpu", tmp_path) if s.name == "train:reference")
    raises = Stage("raises", [sys.executable, "-c", "raise ValueError('Invalid x=3: must be 2')"], 30)
    hangs = Stage("hangs", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], 2)
    late = Stage("late", [sys.executable, "-c", "pass"], 30)
    leaves = Stage(
        "leaves",
        [
            sys.executable,
            "-c",
            "import subprocess, sys; p = subprocess.Popen([sys.executable, "
            "'-c', 'import time; time.sleep(60)']); print('child', p.pid)",
        ],
        30,
    )
    results_path, log = tmp_path / "r.json", tmp_path / "r.log"
    t0 = time.monotonic()
    data = run([leaves], results_path, log, device="cpu", preset="tiny", budget_s=120)
    assert data["stages"]["leaves"]["ok"] and time.monotonic() - t0 < 30  # not held up by what it left running
    child = int(log.read_text().split("child ")[-1].split()[0])
    for _ in range(100):  # and that is gone (killed, or a zombie until its new parent reaps it)
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"stage 'leaves' left process {child} running")
    data = run([raises, hangs, train], results_path, log, device="cpu", preset="tiny", budget_s=120)
    st = data["stages"]
    assert json.loads(results_path.read_text()) == data
    assert not st["raises"]["ok"] and st["raises"]["error"] == "ValueError: Invalid x=3: must be 2"
    assert not st["hangs"]["ok"] and st["hangs"]["error"] == "timed out after 2 s" and "started" in st["hangs"]["tail"]
    assert st["train:reference"]["ok"], st["train:reference"]
    res = st["train:reference"]["result"]
    assert res["tok_per_s_steady"] > 0 and res["precision"] == "bf16" and res["summary"]["device"] == "cpu"
    assert "===== hangs" in log.read_text()
    # a budget with less than MIN_STAGE_S (20 s) left starts nothing more
    late = run([late], results_path, log, device="cpu", preset="tiny", budget_s=5)["stages"]["late"]
    assert late == {"ok": False, "skipped": "not started: 5 s of the budget left"}


def _env_stage(tmp_path: Path, **env: str) -> Stage:
    """An env stage that reports ``env`` (a stand-in for ``tools/gpu_stages.py env``)."""
    path = tmp_path / "env.json"
    return Stage(
        "env", [sys.executable, "-c", f"open({str(path)!r}, 'w').write({json.dumps(json.dumps(env))})"], 30, path
    )


def test_a_rerun_of_some_stages_merges_into_the_earlier_results(tmp_path):
    """--merge: the earlier run's stages that were not repeated stay, in their place; a repeated one takes this run's
    result; the results file is merged after every stage; another device, torch or CUDA keeps nothing, and says so.
    A worker's failure is named by its exception, behind torch's ``[rank0]:`` prefix and after NCCL's warnings."""
    gpu = {"device_name": "H100", "torch": "2.11.0", "cuda": "13.0"}
    previous = {
        "schema": 1,
        "device": "cpu",
        "preset": "tiny",
        "started": "then",
        "budget_s": 420,
        "stages": {
            "env": {"ok": True, "seconds": 5.0, "result": gpu},
            "train:ddp": {"ok": True, "seconds": 9.0, "result": {"kept": True}},
            "train:fsdp": {"ok": False, "seconds": 9.0, "error": "AttributeError: old"},
            "measure:350m": {"ok": False, "seconds": 4.0, "error": "ValueError: old"},
        },
    }
    prev_path = tmp_path / "prev.json"
    prev_path.write_text(json.dumps(previous))
    assert load_previous(prev_path, "cpu", "tiny") == previous
    fails = Stage(
        "train:fsdp",
        [
            sys.executable,
            "-c",
            "import sys; print('[rank0]: RuntimeError: No backend type'); "
            "print('[rank0]:[W1126] Warning: destroy_process_group() was not called'); "
            "sys.exit(1)",
        ],
        30,
    )
    new = Stage("train:diloco", [sys.executable, "-c", "pass"], 30)
    results_path, log = tmp_path / "r.json", tmp_path / "r.log"
    data = run(
        [_env_stage(tmp_path, **gpu), fails, new],
        results_path,
        log,
        device="cpu",
        preset="tiny",
        budget_s=120,
        previous=previous,
    )
    st = data["stages"]
    assert list(st) == ["env", "train:ddp", "train:fsdp", "measure:350m", "train:diloco"]
    assert st["train:ddp"] == previous["stages"]["train:ddp"] and st["measure:350m"]["error"] == "ValueError: old"
    assert st["train:fsdp"]["error"] == "RuntimeError: No backend type" and st["train:diloco"]["ok"]
    assert data["merge"] == {"from": "then", "kept": ["train:ddp", "measure:350m"]}
    assert json.loads(results_path.read_text()) == data and data["started"] != "then"
    text = section({**data, "device": "cuda"})
    assert "kept from an earlier run on the same device and torch (then): train:ddp, measure:350m" in text
    other = run(
        [_env_stage(tmp_path, **{**gpu, "device_name": "H200"}), new],
        results_path,
        log,
        device="cpu",
        preset="tiny",
        budget_s=120,
        previous=previous,
    )
    assert list(other["stages"]) == ["env", "train:diloco"] and other["merge"]["kept"] == []
    assert other["merge"]["refused"] == "another setup: device_name 'H100' then, 'H200' now"
    with pytest.raises(ValueError, match="measured with device='cpu', preset='tiny'; this run is device='cuda'"):
        load_previous(prev_path, "cuda", "default")


def test_only_runs_the_named_stages_after_env(tmp_path):
    named = stages("tiny", "cpu", tmp_path)
    chosen = select(named, ["train:diloco", "measure:tiny", "train:diloco"])
    assert [s.name for s in chosen] == ["env", "train:diloco", "measure:tiny"]
    with pytest.raises(ValueError, match=r"Unknown stage 'train:fsdp2' in --only: choose from env, measure:tiny, "):
        select(named, ["train:fsdp2"])
    diloco = next(s for s in named if s.name == "train:diloco")  # exact, whatever the preset's compressor
    assert diloco.argv[-4:] == ["--parallel", "diloco", "--compressor", "none"]


def test_gpu_check_reruns_a_stage_and_merges(tmp_path):
    """tools/gpu_check.py --only ... --merge FILE (the dry run's preset): the earlier run's other stages in the results
    and the section; a bad --only or --merge is refused before anything runs."""
    from gpu_stages import env_info

    env = env_info()
    previous = {
        "schema": 1,
        "device": "cpu",
        "preset": "tiny",
        "started": "then",
        "budget_s": 240,
        "stages": {
            "env": {"ok": True, "seconds": 5.0, "result": env},
            "train:ddp": {"ok": False, "seconds": 1.0, "error": "ValueError: from before"},
        },
    }
    prev_path = tmp_path / "prev.json"
    prev_path.write_text(json.dumps(previous))
    out = tmp_path / "out"
    cmd = [sys.executable, "tools/gpu_check.py", "--device", "cpu", "--no-tests", "--out", str(out)]
    env_vars = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [*cmd, "--only", "env", "--merge", str(prev_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env_vars,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr[-2000:]  # train:ddp failed then: still not ok
    data = json.loads((out / "gpu_check.json").read_text())
    assert list(data["stages"]) == ["env", "train:ddp"] and data["stages"]["env"]["ok"]
    assert data["merge"] == {"from": "then", "kept": ["train:ddp"]}
    assert "| train:ddp | ValueError: from before |" in (out / "gpu_section.md").read_text()
    r = subprocess.run(
        [*cmd, "--only", "train:nope"], cwd=ROOT, capture_output=True, text=True, env=env_vars, timeout=120
    )
    assert r.returncode == 2 and "Unknown stage 'train:nope' in --only" in r.stderr
    r = subprocess.run(
        [*cmd, "--merge", str(tmp_path / "absent.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env_vars,
        timeout=120,
    )
    assert r.returncode == 2 and "no such file" in r.stderr
    # relative --out and --merge are where the command was called, though the run changes directory to the root
    here = tmp_path / "elsewhere"
    here.mkdir()
    (here / "prev.json").write_text(json.dumps(previous))
    rel = [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", "cpu", "--no-tests", "--out", "out"]
    r = subprocess.run(
        [*rel, "--only", "env", "--merge", "prev.json"],
        cwd=here,
        capture_output=True,
        text=True,
        env=env_vars,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    data = json.loads((here / "out" / "gpu_check.json").read_text())
    assert data["merge"] == {"from": "then", "kept": ["train:ddp"]} and not (ROOT / "out").exists()


@pytest.mark.parametrize("venv", [True, False], ids=["venv", "no-venv"])
def test_make_gpu_check_never_installs(tmp_path, venv):
    """Without .venv/.installed (a GPU machine with torch preinstalled and no network) the target runs python3 on
    the source tree; with it, the venv's Python. It never depends on the install target."""
    env_dir = tmp_path / "venv"
    if venv:
        env_dir.mkdir()
        (env_dir / ".installed").touch()
    r = subprocess.run(
        ["make", "--no-print-directory", "-n", "gpu-check", f"VENV={env_dir}", "DEVICE=cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, lines  # nothing else runs: no venv, no pip
    python = f"{env_dir}/bin/python" if venv else "python3"
    assert "/src" in lines[0] and f" {python} tools/gpu_check.py --device cpu" in lines[0], lines[0]


# ---------------------------------------------------------------- the on-paper GPU cluster model


SMALL, MEDIUM = 163_109_376, 406_382_592  # the GPT-2 small and medium shapes' parameters (untied head)


def _results(backward_124: float, backward_350: float) -> dict:
    def size(name: str, n: int, layers: int, d: int, backward: float) -> dict:
        return {
            "ok": True,
            "result": {
                "size": name,
                "params": n,
                "n_layer": layers,
                "d_model": d,
                "block_size": 1024,
                "tokens": 8192,
                "batch": 8,
                "vocab": 50304,
                "passes": {"forward_s": backward / 2, "backward_s": backward},
                "compressors": {"PowerSGD r32": {"seconds": backward / 10}},
            },
        }

    return {
        "device": "cuda",
        "stages": {
            "env": {"ok": True, "result": {"device_name": "a GPU"}},
            "measure:124m": size("124m", SMALL, 12, 768, backward_124),
            "measure:350m": size("350m", MEDIUM, 24, 1024, backward_350),
        },
    }


def test_gpu_model_takes_measured_figures_and_scales_them():
    figs = gpu_cluster.figures(_results(0.02, 0.05))
    small, medium, xl = (figs[k] for k in gpu_cluster.MODELS)
    assert (small.params, medium.params) == (SMALL, MEDIUM)
    assert (small.backward_s, small.forward_s, small.compress_s["PowerSGD r32"]) == (0.02, 0.01, 0.002)  # as measured
    # 1.3B: from the 350M measurement by training FLOPs (4 x 2048 tokens, 24 layers of 2048), by parameters
    ratio = (4 * 2048 * _per_token(xl.params, 24, 2048, 2048)) / (8192 * _per_token(MEDIUM, 24, 1024, 1024))
    assert xl.backward_s == pytest.approx(0.05 * ratio, rel=1e-12) and "extrapolated" in xl.source
    assert xl.compress_s["PowerSGD r32"] == pytest.approx(0.005 * xl.params / MEDIUM, rel=1e-12)
    assert xl.compress_s["int8"] > 0  # not measured here: estimated from the datasheet
    assert medium.source.startswith("measured") and figs == gpu_cluster.figures(_results(0.02, 0.05))
    with pytest.raises(ValueError, match="measured on 'cpu'"):
        gpu_cluster.figures({"device": "cpu", "stages": {}})


def _per_token(n: int, layers: int, d: int, context: int) -> float:
    return 6 * n + 12 * layers * d * context


def test_break_even_is_where_the_steps_cross():
    figs = gpu_cluster.figures(None)  # published figures
    fig = figs["GPT-2 medium shape"]
    for method in ("PowerSGD r32", "int8"):
        for hier in (False, True):
            bps = gpu_cluster.break_even_bps(fig, method, 2, hier)
            if bps is None or math.isinf(bps):
                continue
            steps = [gpu_cluster.step_s(fig, m, 2, bps, hier) for m in (method, "bf16")]
            assert steps[0] == pytest.approx(steps[1], rel=1e-6), (method, hier)  # the bisection's end
            assert gpu_cluster.step_s(fig, method, 2, bps / 2, hier) < gpu_cluster.step_s(fig, "bf16", 2, bps / 2, hier)
    # a flat int8 all-gather over 128 GPUs sends (W - 1) bytes per value, bf16's ring 2 (W - 1) / W x 2: never pays
    assert gpu_cluster.break_even_bps(fig, "int8", 16, False) is None
    text = gpu_cluster.gpu_scale_section(None)
    assert text.count("literature: 40%") == 3 and "| GPT-3 XL shape (1.3B) | 16 x 8 | 400 |" in text


def test_results_feed_the_benchmarks_in_one_command(tmp_path, capsys):
    """``tools/gpu_check.py --results FILE`` rewrites the GPU section and the on-paper cluster model's from a CUDA
    run's file, measuring nothing; a CPU dry run's file is refused in one line, the Markdown file untouched."""
    import gpu_check
    import gpu_stages

    good, bad = tmp_path / "gpu.json", tmp_path / "cpu.json"
    good.write_text(json.dumps({**_results(0.02, 0.05), "started": "then", "budget_s": 420, "elapsed_s": 400}))
    bad.write_text(json.dumps({"device": "cpu", "stages": {}}))
    out = tmp_path / "B.md"
    assert gpu_check.main(["--results", str(good), "--write", str(out)]) == 0
    text = out.read_text()
    assert "measured (124m, a GPU)" in text and "extrapolated from the measured 350m" in text
    assert "## GPU (`make gpu-check`)" in text
    assert gpu_check.main(["--results", str(bad), "--write", str(out)]) == 2
    assert f"{bad} was measured on 'cpu'" in capsys.readouterr().err and out.read_text() == text
    # a results file larger than any run's, or not a regular file, is refused in one line before it is read
    big, pipe = tmp_path / "big.json", tmp_path / "pipe.json"
    big.write_text(" " * (gpu_stages.RESULTS_LIMIT + 1))
    os.mkfifo(pipe)
    for path, why in ((big, "more than the"), (pipe, "is not a regular file")):
        assert gpu_check.main(["--results", str(path), "--write", str(out)]) == 2
        err = capsys.readouterr().err
        assert "GPU results file" in err and why in err and len(err.splitlines()) == 1, err
    with pytest.raises(ValueError, match=r"GPU results file .* more than the"):
        gpu_stages.load_previous(big, "cuda", "default")


# ---------------------------------------------------------------- make gpu-multi


def test_gpu_multi_stages_and_table(tmp_path):
    """The multi-GPU plan's stages (every run at each world size, NCCL on CUDA, gloo for the dry run) and its table,
    with a run's memory, another's missing figure and a failed stage."""
    from gpu_stages import MULTI_RUNS, multi_section, multi_stages

    built = multi_stages("default", "cuda", tmp_path, [2, 4])
    names = [s.name for s in built]
    assert names == ["env", *(f"train:w{w} {n}" for w in (2, 4) for n in MULTI_RUNS)]
    for s in built[1:]:
        world = s.name.split()[0][len("train:w") :]
        assert s.argv[s.argv.index("--nproc") + 1] == world and s.argv[s.argv.index("--backend") + 1] == "nccl"
        assert "--parallel" in s.argv and s.argv.count("--out") == 1
    assert all("gloo" in s.argv for s in multi_stages("tiny", "cpu", tmp_path, [2])[1:])

    def ok(reserved: float | None) -> dict:
        summary = {"bytes_sent": 3e6, "steps_done": 2, "final_loss": 3.25}
        if reserved is not None:
            summary["cuda_max_reserved_gb"] = reserved
        return {
            "ok": True,
            "result": {
                "summary": summary,
                "unit": "tokens_per_s",
                "tokens_per_s_steady": 1234.0,
                "step_s_median": 0.02,
            },
        }

    data = {
        "device": "cuda",
        "stages": {
            "env": {"ok": True, "result": {"device_name": "8 x a GPU"}},
            "train:w2 ddp exact": ok(12.5),
            "train:w2 ddp int8": ok(None),
            "train:w4 fsdp powersgd": {"ok": False, "error": "timed out after 200 s"},
        },
    }
    text = multi_section(data)
    assert "on 8 x a GPU" in text
    assert "| w2 ddp exact | 1,234 | 20.0 | 1.5 | 12.50 | 3.250 |" in text
    assert "| w2 ddp int8 | 1,234 | 20.0 | 1.5 | - | 3.250 |" in text
    assert "| w4 fsdp powersgd | timed out after 200 s |" in text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_gpu_multi_dry_run(tmp_path):
    """``make gpu-multi DEVICE=cpu``: every run trains at 2 gloo workers, and the table has a row for each."""
    from gpu_stages import MULTI_RUNS

    r = subprocess.run(
        ["make", "--no-print-directory", "gpu-multi", "DEVICE=cpu", f"OUT={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_multi.json").read_text())
    assert all(s["ok"] for s in results["stages"].values()) and len(results["stages"]) == 1 + len(MULTI_RUNS)
    rows = [line for line in (tmp_path / "gpu_multi.md").read_text().splitlines() if line.startswith("| w2 ")]
    assert len(rows) == len(MULTI_RUNS), rows
