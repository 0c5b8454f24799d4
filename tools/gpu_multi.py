"""``make gpu-multi [DEVICE=cpu]``: what a session lent a machine with several GPUs runs, ready before it is lent.

DDP and FSDP2, exact, with the command's PowerSGD and with int8, trained by ``powertrain train`` on NCCL at every
world size the machine holds (2, 4 and 8 GPUs, one worker each): throughput, step time, bytes a step and rank 0's
``torch.cuda.max_memory_reserved`` (compression's error buffers and factors against what it saves on the wire), in
stages with their own timeouts inside one budget (tools/gpu_stages.py: a failed stage is recorded and the
next runs). The NCCL side of the test suite is tests/test_device.py's leg, which ``make gpu-check`` runs.

Files in ``$OUT`` if set, else ``runs/gpu-multi``: ``gpu_multi.json`` (every stage's result or error),
``gpu_multi.log`` (each stage's command and output's tail), ``gpu_multi.md`` (the table, for BENCHMARKS.md's GPU
section by hand: one machine's figures), ``work/`` (each run's directory: its metrics and any rank's traceback).
``DEVICE=cpu`` is the dry run: 2 workers on gloo, the stand-in preset, half a minute. ``POWERTRAIN_GPU_BUDGET_S``
sets the budget (default 540 s on CUDA). Exit status 1 when a stage failed or did not start, 2 for bad arguments or
no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make gpu-multi", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu-multi"))
    args = parser.parse_args(argv)
    import torch

    from gpu_stages import multi_section, multi_stages, run

    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    worlds = [w for w in (2, 4, 8) if w <= gpus]
    if not worlds:
        print(
            f"make gpu-multi: {gpus} CUDA device(s) here; it needs 2 or more (DEVICE=cpu: the dry run)", file=sys.stderr
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = "default" if args.device == "cuda" else "tiny"
    work = out / "work"  # the runs' own files (tracebacks, metrics) come back with $OUT
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    budget = float(os.environ.get("POWERTRAIN_GPU_BUDGET_S", 540 if args.device == "cuda" else 400))
    data = run(
        multi_stages(preset, args.device, work, worlds),
        out / "gpu_multi.json",
        out / "gpu_multi.log",
        device=args.device,
        preset=preset,
        budget_s=budget,
    )
    (out / "gpu_multi.md").write_text(multi_section(data) + "\n")
    bad = {name: r.get("error") or r.get("skipped") for name, r in data["stages"].items() if not r["ok"]}
    print(json.dumps({"out": str(out), "elapsed_s": data.get("elapsed_s"), "not ok": bad}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
