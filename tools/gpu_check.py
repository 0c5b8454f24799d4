"""``make gpu-check [DEVICE=cpu]``: the GPU stages (tools/gpu_stages.py) and the CUDA test leg, in one time budget.

Run from the source tree (``PYTHONPATH=src``: a GPU machine without network needs no install). Every stage is a
subprocess with its own timeout; a failure is recorded and the next stage runs.
Files, in ``$OUT`` if set (what a device run returns), else ``runs/gpu-check``:

* ``gpu_check.json``: every stage's result or error (feed it back: ``make gpu-check GPU_CHECK_ARGS="--results
  FILE"`` rewrites BENCHMARKS.md's GPU section and the on-paper cluster model's from it, measuring nothing);
* ``gpu_check.log``: each stage's command and the tail of its output;
* ``gpu_section.md`` and ``cluster_gpu.md``: the two Markdown sections this run's figures give;
* ``BENCHMARKS.md``: the repository's, with the GPU section replaced (CUDA runs only);
* ``powersgd_profile.txt``, ``int8_profile.txt``: PowerSGD rank 32's and int8's top operations, when above the target
  share of backward.

``DEVICE=cpu`` is the dry run: the same stages on stand-in sizes, in a minute or two, and BENCHMARKS.md untouched.
Exit status 1 when any stage failed or did not start.

A rerun of some stages (``make gpu-check GPU_CHECK_ARGS="--only tests,train:fsdp --merge FILE"``): ``--only`` runs
those stages (and ``env``), in that order; ``--merge FILE`` (an earlier run's gpu_check.json, in a path that travels
with the work tree to the GPU machine, e.g. an untracked ``tools/gpu_check_prev.json``) keeps that run's other
stages when the device, torch and CUDA are the same, and every file above, BENCHMARKS.md's section included, is
written from the merged results. ``POWERTRAIN_GPU_BUDGET_S`` sets the time budget (default 420 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: The test leg: every test marked ``device``. On the CPU (the dry run) POWERTRAIN_TEST_DEVICE stays unset, so the
#: leg is the quick world-size-1 part (test_device.py's multi-process cases skip: the suite runs them on the CPU).
TEST_FILES = ["tests/test_compressors_unit.py", "tests/test_powersgd_unit.py", "tests/test_device.py"]


def _pytest_result(output: str) -> dict[str, Any]:
    """The test leg's counts (pytest's last summary line) and the failed tests' ids."""
    summary = next(
        (
            line.strip("= ")
            for line in reversed(output.splitlines())
            if re.search(
                r"\d+ (passed|failed|"
                r"error|skipped)",
                line,
            )
        ),
        "no summary",
    )
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)))
    return {"summary": summary, "failed": failed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu-check"))
    parser.add_argument("--no-tests", action="store_true", help="skip the test leg")
    parser.add_argument(
        "--only",
        metavar="STAGES",
        help="run only these stages (comma-separated, e.g. tests,train:fsdp; env always runs), in this order",
    )
    parser.add_argument(
        "--merge",
        metavar="FILE",
        help="an earlier run's gpu_check.json: keep its other stages (same device, torch, CUDA)",
    )
    parser.add_argument(
        "--write",
        default=str(ROOT / "BENCHMARKS.md"),
        metavar="FILE",
        help="the Markdown file whose GPU sections a CUDA run or --results rewrites (default: the repository's)",
    )
    parser.add_argument(
        "--results",
        metavar="FILE",
        help="a CUDA run's gpu_check.json: rewrite BENCHMARKS.md's GPU and on-paper cluster sections from it, "
        "measuring nothing",
    )
    args = parser.parse_args(argv)
    # paths as given, before the run changes directory to the repository's root
    args.write = str(Path(args.write).resolve())
    args.out = str(Path(args.out).resolve())
    if args.merge is not None:
        args.merge = str(Path(args.merge).resolve())
    if args.results is not None:
        return _publish(args.results, args.write)
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else None
    if only is not None and not only:
        parser.error(f"--only {args.only!r} names no stage: give comma-separated names, e.g. --only tests,train:fsdp")
    if args.merge is not None and not Path(args.merge).is_file():
        parser.error(f"--merge {args.merge!r}: no such file (copy the earlier run's gpu_check.json there first)")

    import torch

    from gpu_cluster import gpu_scale_section
    from gpu_stages import Stage, load_previous, run_gpu_bench, select, stages
    from powertrain.bench.report import publish

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"make gpu-check: this torch ({torch.__version__}) sees no CUDA device; run make gpu-check DEVICE=cpu "
            "for the dry run",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def tests(work: Path) -> list[Stage]:
        if args.no_tests:
            return []
        env = {"POWERTRAIN_TEST_DEVICE": "cuda"} if args.device == "cuda" else {}
        # each test's own limit (pytest-timeout) below the stage's, so that pytest reports a hang and goes on
        argv = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "device",
            "-rfE",
            "-o",
            "addopts=",
            "--timeout=180",
            *TEST_FILES,
        ]
        return [Stage("tests", argv, 240 if args.device == "cuda" else 120, parse=_pytest_result, env=env)]

    preset = "default" if args.device == "cuda" else "tiny"
    os.chdir(ROOT)  # the test leg's paths; BENCHMARKS.md
    try:  # a bad --only or --merge is said before anything runs
        if only is not None:
            select([*stages(preset, args.device, out), *tests(out)], only)
        if args.merge is not None:
            load_previous(args.merge, args.device, preset)
    except ValueError as e:
        print(f"make gpu-check: {e}", file=sys.stderr)
        return 2
    data = run_gpu_bench(
        preset=preset,
        device=args.device,
        out=str(out),
        extra=tests,
        write=args.write,
        only=only,
        merge=args.merge,
    )
    # the on-paper model with this run's figures (a CPU dry run's are no GPU's: published figures then, and the
    # Markdown file left alone, as run_gpu_bench leaves it)
    paper = gpu_scale_section(data if args.device == "cuda" else None)
    (out / "cluster_gpu.md").write_text(paper + "\n")
    if args.device == "cuda":
        publish(paper, args.write, "cluster-gpu")
        shutil.copy(args.write, out / "BENCHMARKS.md")
    bad = {name: r.get("error") or r.get("skipped") for name, r in data["stages"].items() if not r["ok"]}
    print(
        json.dumps(
            {"out": str(out), "elapsed_s": data.get("elapsed_s"), "merge": data.get("merge"), "not ok": bad}, indent=1
        )
    )
    return 1 if bad else 0


def _publish(results: str, write: str) -> int:
    """BENCHMARKS.md's two GPU sections rewritten from a CUDA run's results file."""
    from gpu_cluster import gpu_scale_section
    from gpu_stages import run_gpu_bench
    from powertrain.bench.report import publish

    try:
        data = run_gpu_bench(results=results, write=write)  # refuses a CPU run's results
    except (OSError, ValueError) as e:
        print(f"make gpu-check: {e}", file=sys.stderr)
        return 2
    publish(gpu_scale_section(data), write, "cluster-gpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
