"""The ``powertrain`` command: ``powertrain train`` (:mod:`powertrain.train.cli`) and ``powertrain bench``
(:mod:`powertrain.bench.cli`). It sits above both, so that neither imports the other's command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from powertrain.bench import cli as bench_cli
from powertrain.train import cli as train_cli
from powertrain.train.launch import disk_full


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
    try:
        return train_cli.run(args) if args.command == "train" else bench_cli.run(args)
    except ValueError as e:
        parser.exit(2, f"powertrain {args.command}: error: {e}\n")
    except KeyboardInterrupt:  # before any worker started (workers' interrupts are handled in the launcher)
        print(f"powertrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:  # a full disk in this process (a single worker, the launcher, bench): one line
        full = disk_full(e, str(getattr(args, "out", None) or "."))
        if full is None:
            raise
        print(f"powertrain {args.command}: {full}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
