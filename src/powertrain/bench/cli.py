"""``powertrain bench``: its arguments (:func:`add_arguments`) and the suites (:func:`run`)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from powertrain._checks import check_int

QUALITY_ONLY = ("mnist1d", "wide", "local", "muon", "outer", "outer-const")  # bench quality's other workloads
BENCHMARKS = "BENCHMARKS.md"


def add_arguments(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "suite",
        choices=[
            "overhead",
            "ddp",
            "network",
            "simple_fsdp",
            "optimizers",
            "muon",
            "quality",
            "parallel",
            "cluster",
            "gpu",
        ],
        help="overhead: PowerSGD compute cost vs the backward pass; ddp: step time vs torch's DDP hooks on "
        "loopback; network: side by side on an emulated bandwidth-limited cluster (needs root); simple_fsdp: "
        "SimpleFSDP vs FSDP2 step time and memory, eager and compiled; optimizers: Shampoo, SOAP, GaLore and "
        "DeMo vs AdamW (quality, time, scaling, DeMo on a 100 Mbit/s link, GaLore memory); muon: Muon's optimizer "
        "step at 1, 2 and 4 workers, its work split against every rank computing alone; quality: validation loss, "
        "total bytes and time to a target loss of the compressors over several seeds; parallel: DDP, FSDP2, "
        "SimpleFSDP and RTP memory per rank, step time and bytes on 2 and 4 workers; cluster: flat and hierarchical "
        "compression on 2 emulated nodes x 2 workers under torchrun (needs root), and at scale on paper (--preset "
        "paper: only that, no root; with --results: a GPU's measured compute); gpu: compression's GPU compute, memory "
        "and every --parallel mode on one GPU, in isolated stages (make gpu-check adds the CUDA test leg)",
    )
    bench.add_argument(
        "--out",
        default=None,
        help="directory for results.json and table.md (network); quality: kept "
        "results, reused by later calls (default runs/bench-quality); gpu: gpu_check.json, its log and the section",
    )
    bench.add_argument(
        "--preset",
        choices=["default", "tiny", "paper", *QUALITY_ONLY],
        default="default",
        help="tiny: seconds; quality only: mnist1d (the 1-D ResNet on mnist1d), wide (a wider, "
        "shallower GPT: 2 layers x d_model 384), local (local updates against per-step rows), muon "
        "(Muon against a swept AdamW, the best AdamW's loss as the target), outer and outer-const (local updates' "
        "outer step on the command's schedule and on a constant-rate AdamW); "
        "cluster only: paper (the on-paper model alone)",
    )
    bench.add_argument(
        "--results",
        default=None,
        help="a make gpu-check results file (gpu_check.json): gpu rewrites its section from it (no "
        "measuring); cluster --preset paper takes its measured GPU compute figures",
    )
    bench.add_argument("--repeats", type=int, default=None, help="overhead: timed repetitions per configuration")
    bench.add_argument("--threads", type=int, default=None, help="overhead: torch threads (default: all cores)")
    bench.add_argument(
        "--write",
        default=None,
        help=f"Markdown file to update ('' to skip; default: ./{BENCHMARKS} where one exists, as in a "
        "checkout of powertrain)",
    )
    bench.add_argument("--rows", default=None, help="quality: comma-separated row keys (default: all; fp32 always)")
    bench.add_argument("--horizons", default=None, help="quality: comma-separated step counts (default: 300,1000)")
    bench.add_argument("--seeds", type=int, default=None, help="quality: seeds per row (default: 3)")
    bench.add_argument(
        "--workers",
        type=int,
        default=None,
        help="quality: data-parallel workers, replicas of local updates (default: 2)",
    )
    bench.add_argument(
        "--horizon-only",
        action="store_true",
        help="quality: no row runs on to the target loss (losses and bytes at the horizon; steps and "
        "time to target only where a row reached it within the horizon)",
    )
    bench.add_argument(
        "--rates",
        default=None,
        help="quality: link rates in Mbit/s the time to target is measured at, on an emulated link "
        "(needs root; default: 1,10,100; 'none': no time to target)",
    )


def run(args: argparse.Namespace) -> int:
    if args.preset in QUALITY_ONLY and args.suite != "quality":
        raise ValueError(
            f"--preset {args.preset} is a workload of bench quality only, not of {args.suite}: use default or tiny"
        )
    if args.preset == "paper" and args.suite != "cluster":
        raise ValueError(f"--preset paper is bench cluster's on-paper model, not a preset of {args.suite}")
    if args.results is not None and args.suite not in ("gpu", "cluster"):
        raise ValueError(f"--results is read by bench gpu and bench cluster --preset paper, not by {args.suite}")
    for name in ("repeats", "threads"):
        value = getattr(args, name)
        if value is not None and args.suite != "overhead":
            raise ValueError(f"--{name} is read by bench overhead only, not by {args.suite}")
        if value is not None:
            check_int(name, value, 1)
    cores = os.cpu_count() or 1
    if args.threads is not None and args.threads > cores:
        raise ValueError(f"Invalid threads={args.threads}: this machine has {cores} cores; use at most {cores}")
    write = _write_target(args.write)
    if args.suite == "network":
        from powertrain.bench.network import run_network_bench

        run_network_bench(preset=args.preset, out=args.out, write=write)
    elif args.suite == "quality":
        from powertrain.bench.quality import run_quality_bench

        rows = args.rows.split(",") if args.rows else None
        try:
            horizons = [int(h) for h in args.horizons.split(",")] if args.horizons else None
        except ValueError:
            raise ValueError(f"Invalid --horizons {args.horizons!r}: use step counts such as 300,1000") from None
        rates = None if args.rates is None else [] if args.rates == "none" else args.rates.split(",")
        try:
            rates = None if rates is None else [float(r) for r in rates]
        except ValueError:
            raise ValueError(f"Invalid --rates {args.rates!r}: use Mbit/s such as 1,10,100, or none") from None
        run_quality_bench(
            preset=args.preset,
            rows=rows,
            horizons=horizons,
            seeds=args.seeds,
            workers=args.workers,
            rates=rates,
            out=args.out,
            write=write,
            horizon_only=args.horizon_only,
        )
    elif args.suite == "gpu":
        from powertrain.bench.gpu import run_gpu_bench

        run_gpu_bench(preset=args.preset, write=write, out=args.out, results=args.results)
    elif args.suite == "cluster":
        from powertrain.bench.cluster import run_cluster_bench

        run_cluster_bench(preset=args.preset, write=write, gpu_results=args.results)
    elif args.suite == "overhead":
        from powertrain.bench.overhead import run_overhead

        run_overhead(preset=args.preset, repeats=args.repeats, threads=args.threads, write=write)
    else:  # the suites that take only a preset: function run_<suite>_bench of their module
        home = {"ddp": "ddp_step", "simple_fsdp": "simple_fsdp_step"}.get(args.suite, args.suite)
        module = importlib.import_module(f"powertrain.bench.{home}")
        getattr(module, f"run_{args.suite}_bench")(preset=args.preset, write=write)
    return 0


def _write_target(write: str | None) -> str | None:
    """The Markdown file a suite updates, checked before it runs (a benchmark takes minutes): ``--write PATH`` (a
    file, in an existing directory), ``''`` for none, and by default ./BENCHMARKS.md where one exists (a checkout
    of powertrain); elsewhere the default prints only, rather than leave a BENCHMARKS.md in any directory."""
    if write == "":
        return None
    if write is None:
        if Path(BENCHMARKS).is_file():
            return BENCHMARKS
        print(
            f"powertrain bench: no {BENCHMARKS} here: the results are printed only (--write PATH writes them)",
            file=sys.stderr,
        )
        return None
    path = Path(write)
    if path.is_dir() or not path.parent.is_dir():
        raise ValueError(f"--write {write!r} is not a file in an existing directory: give a Markdown file's path")
    return write
