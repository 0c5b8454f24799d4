"""``powertrain`` command line: ``powertrain train`` and ``powertrain bench``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from powertrain.train.config import PRESETS, CompressorSpec, TrainConfig


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a byte-level GPT on the Python standard library's sources")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default", help="base settings (tiny: seconds)")
    p.add_argument("--nproc", type=int, help="local workers to launch (default 2; ignored under torchrun)")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int, help="sequences per worker per step")
    p.add_argument("--block-size", type=int)
    p.add_argument("--n-layer", type=int)
    p.add_argument("--d-model", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--log-every", type=int)
    p.add_argument("--threads", type=int, help="torch threads per worker (default 1)")
    p.add_argument(
        "--compressor",
        help="NAME[:key=value,...]: none, or powersgd with rank, iters, min_rate, start, variant, seed "
        "(default powersgd:rank=4)",
    )
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"])


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks; results go to a table and BENCHMARKS.md")
    p.add_argument(
        "suite",
        choices=["overhead", "ddp"],
        help="overhead: PowerSGD compute cost vs the backward pass; ddp: step time vs torch's DDP hooks",
    )
    p.add_argument("--preset", choices=["default", "tiny"], default="default")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions per configuration")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--write", default="BENCHMARKS.md", help="Markdown file to update ('' to skip)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="powertrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _bench_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        return _bench(args)
    except ValueError as e:
        parser.exit(2, f"powertrain {args.command}: error: {e}\n")


def _train(args: argparse.Namespace) -> int:
    from powertrain.train.launch import launch
    from powertrain.train.worker import run_worker

    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if getattr(args, f.name, None) is not None
    }
    if "compressor" in overrides:
        overrides["compressor"] = CompressorSpec.parse(overrides["compressor"])
    cfg = TrainConfig(**{**PRESETS[args.preset], **overrides})
    launch(run_worker, cfg.nproc, cfg)
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.suite == "ddp":
        from powertrain.bench.ddp import run_ddp_bench

        run_ddp_bench(preset=args.preset, write=args.write or None)
        return 0
    from powertrain.bench.overhead import run_overhead

    run_overhead(preset=args.preset, repeats=args.repeats, threads=args.threads, write=args.write or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
