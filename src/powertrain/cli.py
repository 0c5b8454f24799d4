"""The ``powertrain`` command: ``powertrain train`` (:mod:`powertrain.train.cli`) and ``powertrain bench``
(:mod:`powertrain.bench.cli`). It sits above both, so that neither imports the other's command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from powertrain.bench import cli as bench_cli
from powertrain.train import cli as train_cli
from powertrain.train.launch import run_command


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``powertrain`` (``train`` and ``bench``); the docs' examples are checked against it."""
    parser = argparse.ArgumentParser(prog="powertrain", description="Communication-efficient distributed training.")
    sub = parser.add_subparsers(dest="command", required=True)
    train_cli.add_arguments(
        sub.add_parser("train", help="train a model (default: byte-level GPT on Python's own sources)")
    )
    bench_cli.add_arguments(sub.add_parser("bench", help="benchmarks; results go to a table and BENCHMARKS.md"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    body = train_cli.run if args.command == "train" else bench_cli.run
    return run_command(f"powertrain {args.command}", lambda: body(args), str(getattr(args, "out", None) or "."))


if __name__ == "__main__":
    sys.exit(main())
