"""The measuring part of ``make gpu-check`` (tools/gpu_check.py) and ``make gpu-multi``: what compression costs in
GPU compute, how much memory each way to train needs, and every ``--parallel`` mode trained on one GPU.

It runs in *stages*, each a subprocess with its own timeout, inside one time budget: a stage that fails (the first
CUDA run of any code may) is recorded, one line and its output's tail, and the next stage still runs. The results
file (JSON) is rewritten after every stage, so a run stopped from outside keeps what it measured.

* ``env``: the device, torch, CUDA, NCCL and driver versions;
* ``measure:SIZE``: tools/gpu_measure.py for a GPT of that size (backward, compressors, memory);
* ``train:RUN``: ``powertrain train`` for 50 steps on one worker (NCCL on CUDA), one run per ``--parallel`` mode
  (and DDP with the command's default PowerSGD): tokens/s from the median step after the first 10.

``make gpu-check GPU_CHECK_ARGS="--results FILE"`` rewrites the section from a results file instead (the GPU run's,
copied back), and the on-paper cluster model's (tools/gpu_cluster.py) from its compute figures.

These run from a checkout, not from the installed package: a lent GPU machine runs the source tree without an
install, and what they write is the repository's BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from powertrain import _json
from powertrain._files import read_tail
from powertrain.bench.report import publish, table
from powertrain.train.config import load_toml
from powertrain.train.metrics import read_run

TOOLS = Path(__file__).resolve().parent
SCHEMA = 1
MIN_STAGE_S = 20.0  # a stage is not started with less of the budget left


@dataclasses.dataclass(frozen=True)
class Stage:
    """A command and its timeout; ``result``: the JSON file it writes; ``parse``: its result from its output's end (the
    last OUTPUT_TAIL bytes) or from the files it wrote."""

    name: str
    argv: list[str]
    timeout_s: float
    result: Path | None = None
    parse: Callable[[str], dict[str, Any]] | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # added to the environment


@dataclasses.dataclass(frozen=True)
class Plan:
    sizes: tuple[str, ...]
    train_flags: tuple[str, ...]  # what every train run shares (size, data, steps)
    measure_timeout_s: float
    train_timeout_s: float
    budget_s: float


#: default: the GPU run (GPT-2 small and medium shapes; train on the command's "gpt2" size, 8 x 1024 tokens a step);
#: tiny: the CPU dry run (``make gpu-check DEVICE=cpu``), the same stages on stand-in sizes, in a minute or two.
_GPT2_RUN = (
    "--gpt-size",
    "gpt2",
    "--block-size",
    "1024",
    "--batch-size",
    "8",
    "--steps",
    "50",
    "--precision",
    "bf16",
    "--data-max-mb",
    "8",
    "--eval-batches",
    "2",
    "--warmup-steps",
    "5",
)
PRESETS = {
    "default": Plan(("124m", "350m"), _GPT2_RUN, 170, 100, 420),
    "tiny": Plan(("tiny",), ("--preset", "tiny", "--steps", "5", "--precision", "bf16"), 120, 60, 240),
}
#: One run per --parallel mode, exact (the modes' own cost), and DDP with the command's default PowerSGD; modes added
#: later (not named here) run with their defaults.
TRAIN_RUNS: dict[str, list[str]] = {
    "reference": ["--parallel", "reference", "--compressor", "none"],
    "ddp": ["--parallel", "ddp", "--compressor", "none"],
    "ddp + PowerSGD": ["--parallel", "ddp"],
    "fsdp": ["--parallel", "fsdp", "--compressor", "none"],
    "simple_fsdp": ["--parallel", "simple_fsdp", "--compressor", "none"],
    "rtp": ["--parallel", "rtp", "--compressor", "none", "--precision", "fp32"],  # the command runs both in fp32 only
    "tp": ["--parallel", "tp", "--tp", "1", "--compressor", "none", "--precision", "fp32"],
    # local updates with the command's defaults (a sync every 25 steps, DiLoCo's outer Nesterov step), exact: the
    # outer step's own cost. Named, so that a preset's compressor (tiny's PowerSGD, start counting syncs) stays out.
    "diloco": ["--parallel", "diloco", "--compressor", "none"],
}


def train_runs() -> dict[str, list[str]]:
    from powertrain.train.strategy import Parallel

    named = {args[1] for args in TRAIN_RUNS.values()}
    return {**TRAIN_RUNS, **{m: ["--parallel", m] for m in typing.get_args(Parallel) if m not in named}}


def _env_stage(work: Path) -> Stage:
    return Stage(
        "env", [sys.executable, str(TOOLS / "gpu_stages.py"), "env", str(work / "env.json")], 60, work / "env.json"
    )


def _train_stage(
    name: str, plan: Plan, device: str, run_dir: Path, nproc: int, args: list[str], timeout_s: float
) -> Stage:
    """``powertrain train`` on ``nproc`` workers (NCCL on CUDA, gloo on the CPU) into ``run_dir``, with ``args``."""
    argv = [sys.executable, "-m", "powertrain", "train", *plan.train_flags, "--nproc", str(nproc)]
    argv += ["--backend", "nccl" if device == "cuda" else "gloo", "--log-every", "1", "--quiet", "--out", str(run_dir)]
    return Stage(f"train:{name}", [*argv, *args], timeout_s, parse=functools.partial(_train_result, run_dir))


def stages(preset: str, device: str, work: Path) -> list[Stage]:
    """The stages of a run, most telling first: the budget may end before the last."""
    plan = PRESETS[preset]
    out = [_env_stage(work)]
    sizes = list(plan.sizes)
    first, rest = sizes[:1], sizes[1:]
    measure = lambda s: Stage(
        f"measure:{s}",
        [sys.executable, str(TOOLS / "gpu_measure.py"), s, device, str(work / f"{s}.json")],
        plan.measure_timeout_s,
        work / f"{s}.json",
    )
    out += [measure(s) for s in first]
    for name, args in train_runs().items():
        run_dir = work / "train" / re.sub(r"\W+", "_", name)
        out.append(_train_stage(name, plan, device, run_dir, 1, args, plan.train_timeout_s))
    out += [measure(s) for s in rest]
    return out


#: ``make gpu-multi`` (tools/gpu_multi.py): DDP and FSDP2, exact, with the command's PowerSGD and with int8, at each
#: world size the machine holds (2, 4, 8 GPUs; the dry run: 2 CPU workers on gloo)
MULTI_RUNS: dict[str, list[str]] = {
    f"{mode} {name}": ["--parallel", mode, *flags]
    for mode in ("ddp", "fsdp")
    for name, flags in (("exact", ["--compressor", "none"]), ("powersgd", []), ("int8", ["--compressor", "int8"]))
}


def multi_stages(preset: str, device: str, work: Path, worlds: Sequence[int]) -> list[Stage]:
    """The stages of ``make gpu-multi``: ``env``, then every run of :data:`MULTI_RUNS` at each world size in
    ``worlds`` (NCCL on CUDA, one GPU a worker), the smallest world first: the budget may end before the last."""
    plan = PRESETS[preset]
    out = [_env_stage(work)]
    for world in worlds:
        for name, args in MULTI_RUNS.items():
            run_dir = work / "train" / (f"w{world}_" + re.sub(r"\W+", "_", name))
            out.append(_train_stage(f"w{world} {name}", plan, device, run_dir, world, args, plan.train_timeout_s * 2))
    return out


def _train_rows(
    stages: dict[str, Any], cells: Callable[[dict[str, Any], dict[str, Any], str], list[str]]
) -> list[list]:
    """A row per train stage: its name (``train:`` left out) and ``cells(result, summary, unit)``, or its error or
    why it did not run, beside empty cells."""
    rows: list[list] = []
    for name, r in stages.items():
        if not name.startswith("train:"):
            continue
        res = r.get("result") or {}
        if r["ok"] and "summary" in res:
            rows.append([name[6:], *cells(res, res["summary"], res["unit"])])
        else:
            rows.append([name[6:], r.get("error") or r.get("skipped"), "", "", "", ""])
    return rows


def multi_section(data: dict[str, Any]) -> str:
    """The table of a ``make gpu-multi`` run: per world size and run, throughput, step time, bytes a step and the most
    memory rank 0 held (what compression costs or saves in memory, beside what it saves on the wire)."""

    def cells(res: dict[str, Any], s: dict[str, Any], unit: str) -> list[str]:
        reserved = s.get("cuda_max_reserved_gb")
        return [
            f"{res[unit + '_steady']:,.0f}",
            _ms(res["step_s_median"]),
            f"{s['bytes_sent'] / max(s['steps_done'], 1) / 1e6:,.1f}",
            "-" if reserved is None else f"{reserved:.2f}",
            f"{s['final_loss']:.3f}",
        ]

    rows = _train_rows(data["stages"], cells)
    env = (data["stages"].get("env", {}).get("result") or {}).get("device_name", data.get("device"))
    return (
        f"`make gpu-multi` on {env}: `powertrain train` at each world size, tokens/s from the median step after the "
        "first 10; MB a worker sent a step; rank 0's `torch.cuda.max_memory_reserved`.\n\n"
        + table(["run", "tokens/s", "step ms", "MB sent a step", "reserved GB (rank 0)", "final loss"], rows)
    )


def _train_result(run_dir: Path, output: str) -> dict[str, Any]:
    """A train stage's result: its summary, precision and steady tokens/s (``output``: unused, its files say it)."""
    rows, summary = read_run(run_dir)
    precision = load_toml(run_dir / "config.toml").get("precision")
    steady = [r["step_time_s"] for r in rows[10:]] or [r["step_time_s"] for r in rows]
    unit = next(k for k in summary if k.endswith("_per_s"))
    per_step = summary[unit] * summary["wall_s"] / max(summary["steps"], 1)  # tokens (or samples) per step
    median = statistics.median(steady)
    return {
        "summary": summary,
        "step_s_median": median,
        "unit": unit,
        f"{unit}_steady": per_step / median,
        "precision": precision,
    }


def env_info() -> dict[str, Any]:
    import platform

    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gb=props.total_memory / 1e9,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            cudnn=torch.backends.cudnn.version(),
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            info["driver"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            info["driver"] = f"unknown ({e})"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


#: The most of a stage's output read back, from its end: the log's last 300 lines, the error line and the tail of a
#: failure come from it (a stage's output is its own child's, but a chatty compile or test leg must not fill memory).
OUTPUT_TAIL = 1 << 20


def run_stage(stage: Stage, deadline: float, log: Any) -> dict[str, Any]:
    """Run one stage within the budget; its result, or its error in one line with its output's tail."""
    left = deadline - time.monotonic()
    if left < MIN_STAGE_S:
        return {"ok": False, "skipped": f"not started: {left:.0f} s of the budget left"}
    timeout = min(stage.timeout_s, left)
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **stage.env}
    with tempfile.TemporaryFile() as out:  # its output on disk: only its end is read back (OUTPUT_TAIL)
        proc = subprocess.Popen(stage.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the stage and everything it started (ranks, compile workers)
            proc.wait()
            timed_out = True
        with contextlib.suppress(ProcessLookupError):  # what the stage left running, in the session it started
            os.killpg(proc.pid, signal.SIGKILL)
        cut = out.seek(0, os.SEEK_END) > OUTPUT_TAIL
        output = read_tail(out, OUTPUT_TAIL)
    seconds = time.monotonic() - t0
    lines = output.splitlines()[1 if cut else 0 :]  # a cut output's first line is not whole
    log.write(f"\n===== {stage.name} ({seconds:.1f} s, exit {proc.returncode}): {' '.join(stage.argv)}\n")
    log.write("\n".join(lines[-300:]) + "\n")
    log.flush()
    res: dict[str, Any] = {
        "ok": proc.returncode == 0 and not timed_out,
        "seconds": round(seconds, 1),
        "returncode": proc.returncode,
    }
    try:
        if stage.result is not None and stage.result.exists():
            res["result"] = _json.load(stage.result, RESULTS_LIMIT, f"Stage {stage.name}'s result")
        elif stage.parse is not None and not timed_out:
            res["result"] = stage.parse(output)
    except Exception as e:  # a result that cannot be read is the stage's failure, not the run's
        res.update(ok=False, error=f"its result could not be read: {type(e).__name__}: {e}")
    if timed_out:
        res["error"] = f"timed out after {timeout:.0f} s"
    elif proc.returncode != 0:
        res["error"] = _last_error(lines)
    if not res["ok"]:
        res["tail"] = "\n".join(lines[-25:])
    return res


def _last_error(lines: Sequence[str]) -> str:
    """The output's last line that names an exception (a traceback's last line, also behind a worker's ``[rank0]:``
    prefix), else its last line."""
    for raw in reversed(lines):
        line = re.sub(r"^\[rank\d+\]:\s?", "", raw)
        if re.match(r"^\s*[\w.]*(Error|Exception|Failed|Interrupt)\b.*", line) or line.startswith("powertrain "):
            return line.strip()[:500]
    return (lines[-1].strip() if lines else "no output")[:500]


def run(
    run_stages: list[Stage],
    results_path: Path,
    log_path: Path,
    *,
    device: str,
    preset: str,
    budget_s: float,
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``run_stages`` in order within ``budget_s``; the results file is rewritten after each.

    ``previous``: an earlier run's results (:func:`load_previous`); its stages that this run does not repeat are kept,
    in their place, once this run's ``env`` stage shows the same device, torch and CUDA (otherwise nothing is kept,
    and ``merge`` says why)."""
    started = datetime.datetime.now().isoformat(timespec="seconds")
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "device": device,
        "preset": preset,
        "budget_s": budget_s,
        "started": started,
        "stages": {},
    }
    deadline = time.monotonic() + budget_s
    t0 = time.monotonic()
    new: dict[str, Any] = {}
    with log_path.open("w") as log:
        for stage in run_stages:
            res = run_stage(stage, deadline, log)
            new[stage.name] = res
            results["stages"] = new
            if previous is not None:
                results.update(_merged(previous, new))
            results["elapsed_s"] = round(time.monotonic() - t0, 1)
            results_path.write_text(_json.dumps(results, indent=1))
            status = "ok" if res["ok"] else res.get("error") or res.get("skipped")
            print(f"[{results['elapsed_s']:6.1f} s] {stage.name}: {status}", flush=True)
    return results


#: What must agree for an earlier run's stages to stand beside this run's.
SAME_SETUP = ("device_name", "torch", "cuda")


#: bytes a results file may hold (a whole run's takes ~12 KB): a larger one, or one that is not a regular file, is
#: refused before it is read
RESULTS_LIMIT = 16 << 20


def read_results(path: str | Path) -> Any:
    """A results file handed back (``--results``, ``--merge``), read within :data:`RESULTS_LIMIT`."""
    return _json.load(Path(path), RESULTS_LIMIT, "GPU results file")


def load_previous(path: str | Path, device: str, preset: str) -> dict[str, Any]:
    """An earlier run's results file, to merge with (``make gpu-check --merge FILE``); ValueError for one that
    cannot be (another device type or preset, another schema, no env stage)."""
    data = read_results(path)
    if data.get("schema") != SCHEMA or not isinstance(data.get("stages"), dict):
        raise ValueError(
            f"{path} is not a gpu-check results file of schema {SCHEMA}: pass the gpu_check.json a make gpu-check wrote"
        )
    if (data.get("device"), data.get("preset")) != (device, preset):
        raise ValueError(
            f"{path} was measured with device={data.get('device')!r}, preset={data.get('preset')!r}; "
            f"this run is device={device!r}, preset={preset!r}: merge runs of one kind only"
        )
    if not ((data["stages"].get("env") or {}).get("result")):
        raise ValueError(f"{path} has no env stage result: it cannot show which device it ran on, so it is not merged")
    return data


def _merged(previous: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The results' ``stages`` (the earlier run's in their order, this run's in place of those it repeated, then the
    rest) and ``merge`` (where each came from), once this run's env agrees with the earlier one's."""
    before = previous["stages"]["env"]["result"]
    now = (new.get("env") or {}).get("result")
    if now is None:
        return {
            "merge": {
                "from": previous.get("started"),
                "kept": [],
                "refused": "this run's env stage has no result yet (or failed): nothing of the earlier run is kept",
            }
        }
    differs = [f"{k} {before.get(k)!r} then, {now.get(k)!r} now" for k in SAME_SETUP if before.get(k) != now.get(k)]
    if differs:
        return {
            "merge": {"from": previous.get("started"), "kept": [], "refused": f"another setup: {'; '.join(differs)}"}
        }
    stages = {**previous["stages"], **new}  # a repeated stage stays in its place, with this run's result
    kept = [name for name in previous["stages"] if name not in new]
    return {"stages": stages, "merge": {"from": previous.get("started"), "kept": kept}}


def select(run_stages: list[Stage], only: Sequence[str]) -> list[Stage]:
    """The stages named in ``only``, in that order, after ``env`` (always run: it says where the run was)."""
    by_name = {s.name: s for s in run_stages}
    unknown = [n for n in only if n not in by_name]
    if unknown:
        raise ValueError(f"Unknown stage {unknown[0]!r} in --only: choose from {', '.join(by_name)}")
    return [by_name["env"], *(by_name[n] for n in dict.fromkeys(only) if n != "env")]


def run_gpu_bench(
    *,
    preset: str = "default",
    write: str | None = "BENCHMARKS.md",
    out: str | None = None,
    results: str | None = None,
    device: str | None = None,
    extra: Callable[[Path], list[Stage]] | None = None,
    only: Sequence[str] | None = None,
    merge: str | None = None,
) -> dict[str, Any]:
    """Measure (or, with ``results``, only report a results file); write the section and the files in ``out``.

    ``extra(work)``: stages to run right after the first size's measurements (``make gpu-check``'s test leg);
    ``only``: run just these stages (and env), in this order; ``merge``: an earlier run's results file, whose other
    stages the results keep (:func:`run`)."""
    if results is not None:
        data = read_results(results)
        if data.get("device") != "cuda":
            raise ValueError(
                f"{results} was measured on {data.get('device')!r}: the GPU section takes a CUDA run's "
                "results (make gpu-check on a GPU)"
            )
        publish(section(data), write, "gpu")
        return data
    if preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r} for the GPU check: choose {', '.join(PRESETS)}")
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    outdir = Path(out) if out else Path(tempfile.mkdtemp(prefix="powertrain-gpu-"))
    outdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="powertrain-gpu-work-"))
    plan = PRESETS[preset]
    run_stages = stages(preset, device, work)
    if extra is not None:
        run_stages[2:2] = extra(work)
    if only is not None:
        run_stages = select(run_stages, only)
    previous = load_previous(merge, device, preset) if merge is not None else None
    budget = float(os.environ.get("POWERTRAIN_GPU_BUDGET_S", plan.budget_s))
    data = run(
        run_stages,
        outdir / "gpu_check.json",
        outdir / "gpu_check.log",
        device=device,
        preset=preset,
        budget_s=budget,
        previous=previous,
    )
    if (data.get("merge") or {}).get("refused"):
        print(f"not merged with {merge}: {data['merge']['refused']}", file=sys.stderr, flush=True)
    write_profiles(data, outdir)
    text = section(data)
    (outdir / "gpu_section.md").write_text(text + "\n")
    # a CPU dry run never replaces the GPU section of the repository's BENCHMARKS.md
    publish(text, write if device == "cuda" else None, "gpu")
    print(f"results: {outdir / 'gpu_check.json'}", flush=True)
    return data


# ---------------------------------------------------------------- the Markdown section


def _ms(s: float) -> str:
    return f"{1e3 * s:,.1f}"


def section(data: dict[str, Any]) -> str:
    """BENCHMARKS.md's GPU section from a results file."""
    st = data["stages"]
    env = (st.get("env") or {}).get("result") or {}
    where = (
        f"{env.get('device_name', data['device'])}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"NCCL {env.get('nccl')}, driver {env.get('driver')}, Python {env.get('python')}, "
        f"{env.get('cpus')} CPUs"
    )
    merge = data.get("merge") or {}
    kept = (
        f"; kept from an earlier run on the same device and torch ({merge['from']}): {', '.join(merge['kept'])}"
        if merge.get("kept")
        else ""
    )
    parts = [
        f"## GPU (`make gpu-check`)\n\nDevice: {where}; run {data['started']}, {data.get('elapsed_s', 0):.0f} s "
        f"of a {data['budget_s']:.0f} s budget{kept}. Every figure at world size 1, under bf16 autocast unless "
        "a table's precision says otherwise.\n"
    ]
    parts.append(
        table(
            ["stage", "result", "s"],
            [
                [name, "ok" if r["ok"] else (r.get("error") or r.get("skipped")), r.get("seconds", "")]
                for name, r in st.items()
            ],
        )
    )
    measured = {n.split(":", 1)[1]: r["result"] for n, r in st.items() if n.startswith("measure:") and r.get("result")}
    parts += [
        _compute_table(measured),
        _target_line(measured),
        _optimizer_table(measured),
        _memory_table(measured),
        _train_table(st),
    ]
    return "\n\n".join(p for p in parts if p)


def _compute_table(measured: dict[str, Any]) -> str:
    rows = []
    for size, m in measured.items():
        passes = m.get("passes") or {}
        if "backward_s" not in passes:
            continue
        model = f"{size} ({m.get('params', 0) / 1e6:,.3g}M, {m['batch']} x {m['block_size']} tokens)"
        rows.append([model, "forward / backward", f"{_ms(passes['forward_s'])} / {_ms(passes['backward_s'])}", "", ""])
        for label, c in (m.get("compressors") or {}).items():
            if label == "auto_choice":
                continue
            if "error" in c:
                rows.append([model, label, c["error"], "", ""])
                continue
            opts = c.get("options") or {}
            name = f"{label} ({c.get('compressor')}{', rank ' + str(opts['rank']) if 'rank' in opts else ''})"
            ratio = f"{c['dense_bytes'] / max(c['bytes_per_step'], 1):.1f}x" if "bytes_per_step" in c else ""
            rows.append([model, name, _ms(c["seconds"]), f"{100 * c['seconds'] / passes['backward_s']:.1f}%", ratio])
    if not rows:
        return ""
    return (
        "Compress + decompress: the compressor's `aggregate` at world size 1 (all its math, no collectives), "
        "median of 10, after 2 warm-up calls; PowerSGD in the recommended config (paper variant, bf16 factors). "
        "`auto`: what `rank=auto` picks for this backward on 2 nodes x 8 GPUs at 100 Gbit/s. TF32: the same "
        "with `torch.backends.cuda.matmul.allow_tf32 = True` (torch's default is off). Householder QR: the same "
        "with `torch.linalg.qr` as PowerSGD's orthonormalisation (on CUDA powertrain runs a Cholesky QR). Triton "
        "kernels: the same with `POWERTRAIN_FUSED=1` (the gradient + what is owed with the first product in one "
        "pass: 5.9 passes over the gradients, 8.8 without; powertrain.ops.lowrank_kernels).\n\n"
        + table(["model", "what", "ms", "of backward", "fp32 bytes / bytes sent"], rows)
    )


def _optimizer_table(measured: dict[str, Any]) -> str:
    rows = []
    for size, m in measured.items():
        for label, o in (m.get("optimizers") or {}).items():
            got = [o["error"], ""] if "error" in o else [_ms(o["seconds"]), f"{100 * o['of_step']:.1f}%"]
            rows.append([size, label, *got])
    if not rows:
        return ""
    return (
        "Optimizer steps at world size 1 on the last backward's gradients (Muon's Newton-Schulz in bf16 on CUDA; "
        "across ranks each matrix is orthogonalized once, on its owner): median of 10 after 2 warm-ups, and the "
        "share of forward + backward + step.\n\n" + table(["model", "optimizer", "ms", "of the step"], rows)
    )


def write_profiles(data: dict[str, Any], outdir: Path) -> list[Path]:
    """The profiler tables a run's measure stages recorded (``gpu_measure.PROFILED``), each in
    its file in ``outdir`` (a later size's replaces an earlier's, as the check measures 124m first)."""
    from gpu_measure import PROFILED

    written = []
    for name, res in data["stages"].items():
        for label, (key, filename) in PROFILED.items():
            profile = (res.get("result") or {}).get(key)
            if isinstance(profile, str):
                (outdir / filename).write_text(f"{name}: {label}, top operations\n\n{profile}\n")
                written.append(outdir / filename)
    return written


def _target_line(measured: dict[str, Any]) -> str:
    first: dict[str, Any] = next(iter(measured.values()), {})
    c = (first.get("compressors") or {}).get("PowerSGD r32") or {}
    if "of_backward" not in c:
        return ""
    from gpu_measure import TARGET

    met = c["of_backward"] <= TARGET
    verdict = "met" if met else "not met: the top operations are in `powersgd_profile.txt`"
    return (
        f"Target (issue 36): PowerSGD rank 32 at most {100 * TARGET:.0f}% of backward on the {first['size']} GPT: "
        f"{100 * c['of_backward']:.1f}%, {verdict}."
    )


def _memory_table(measured: dict[str, Any]) -> str:
    rows = []
    for size, m in measured.items():
        for key, r in m.items():
            if not key.startswith("memory/"):
                continue
            kind = key.split("/", 1)[1]
            if "error" in r or "skipped" in r:
                rows.append([size, kind, r.get("error") or r.get("skipped"), "", "", ""])
            else:
                peak = f"{r['peak_gb']:.2f}" if "peak_gb" in r else f"+{r['step_peak_above_held_gb']:.4f} (CPU)"
                held = f"{r['held_gb']:.2f}" if "held_gb" in r else ""
                rows.append([size, kind, peak, held, _ms(r["step_s"]), f"{r['first_step_s']:.1f}"])
        g = m.get("galore") or {}
        if "adamw" in g and "galore" in g:
            states = f"{g['adamw']['state_gb']:.2f} / {g['galore']['state_gb']:.2f}"
            what = f"AdamW state / GaLore (rank {g['galore_rank']}) state"
            rows.append([size, what, states, "", _ms(g["galore"]["step_s"]), ""])
        elif "error" in g:
            rows.append([size, "GaLore", g["error"], "", "", ""])
    if not rows:
        return ""
    return (
        "Memory of one AdamW training step (`torch.cuda.max_memory_allocated`, GB), what stays allocated between "
        "steps, the step time and the first step's (compile, state) in s; each strategy as `powertrain train` "
        "builds it, on a world of one.\n\n"
        + table(["model", "strategy", "peak GB", "held GB", "step ms", "first step s"], rows)
    )


def _train_table(st: dict[str, Any]) -> str:
    rows = _train_rows(
        st,
        lambda res, s, unit: [
            f"{res[unit + '_steady']:,.0f}",
            _ms(res["step_s_median"]),
            f"{s['final_loss']:.3f}",
            s.get("compressor", ""),
            res.get("precision", ""),
        ],
    )
    if not rows:
        return ""
    return (
        "`powertrain train` on one worker (NCCL on CUDA): tokens/s from the median step after the first 10.\n\n"
        + table(["run", "tokens/s", "step ms", "final loss", "compressor", "precision"], rows)
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["env"]:
        Path(sys.argv[2]).write_text(_json.dumps(env_info(), indent=1))
