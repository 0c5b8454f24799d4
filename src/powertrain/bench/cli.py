"""``powertrain bench SUITE``: one subcommand per suite with the flags it reads (:func:`add_arguments`), and the
suites (:func:`run`)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from powertrain._checks import check_int
from powertrain.train.launch import run_command

QUALITY_ONLY = ("mnist1d", "wide", "local", "muon", "outer", "outer-const")  # bench quality's other workloads
BENCHMARKS = "BENCHMARKS.md"


#: each suite: what it measures (its --help), and the presets it has besides default and tiny
SUITES: dict[str, tuple[str, tuple[str, ...]]] = {
    "overhead": ("PowerSGD's compute cost against the backward pass (one process, no communication)", ()),
    "network": (
        "DDP's and FSDP2's step time with torch's hooks and powertrain's compressors, side by side on an emulated "
        "bandwidth-limited cluster (needs root; else on loopback alone)",
        (),
    ),
    "quality": (
        "validation loss, total bytes and time to a target loss over several seeds",
        QUALITY_ONLY,
    ),
    "parallel": ("DDP, FSDP2, SimpleFSDP and RTP: memory per rank, step time and bytes on 2 and 4 workers", ()),
    "cluster": ("flat and hierarchical compression on 2 emulated nodes x 2 workers under torchrun (needs root)", ()),
}
_PRESET_HELP = {
    "quality": "tiny: seconds; mnist1d (the 1-D ResNet on mnist1d), wide (a wider, shallower GPT: 2 layers x "
    "d_model 384), local (local updates against per-step rows), muon (Muon against a swept AdamW, the best AdamW's "
    "loss as the target), outer and outer-const (local updates' outer step on the command's schedule and on a "
    "constant-rate AdamW)",
}

_OUT_HELP = {
    "network": "directory for results.json and table.md",
    "quality": "kept results, reused by later calls (default runs/bench-quality)",
}


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """``powertrain bench SUITE``: one subcommand per suite, each with the flags it reads."""
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (what, presets) in SUITES.items():
        p = suites.add_parser(name, help=what, description=what)
        _common_arguments(p, presets, _PRESET_HELP.get(name, "tiny: seconds"))
        if name in _OUT_HELP:
            p.add_argument("--out", default=None, help=_OUT_HELP[name])
        if name == "overhead":
            p.add_argument("--repeats", type=int, default=None, help="timed repetitions per configuration")
            p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
        if name == "quality":
            _quality_arguments(p)


def _common_arguments(p: argparse.ArgumentParser, presets: Sequence[str], preset_help: str) -> None:
    p.add_argument("--preset", choices=["default", "tiny", *presets], default="default", help=preset_help)
    p.add_argument(
        "--write",
        default=None,
        help=f"Markdown file to update ('' to skip; default: ./{BENCHMARKS} where one exists, as in a "
        "checkout of powertrain)",
    )


def script(
    prog: str,
    description: str,
    run_bench: Callable[..., object],
    argv: Sequence[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """A suite that runs from a checkout (``python tools/bench_NAME.py``) rather than as ``powertrain bench``:
    the same ``--preset`` (default or tiny) and ``--write``, ``extra``'s flags passed to ``run_bench`` by name, and
    the command's one-line failures (:func:`~powertrain.train.launch.run_command`)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    _common_arguments(parser, (), "tiny: seconds")
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k not in ("preset", "write")}

    def body() -> int:
        run_bench(preset=args.preset, write=_write_target(args.write, prog), **options)
        return 0

    return run_command(prog, body, str(Path(args.write or ".").parent))


def _quality_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default=None, help="comma-separated row keys (default: the preset's; fp32 always)")
    p.add_argument("--horizons", default=None, help="comma-separated step counts (default: the preset's)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per row (default: the preset's)")
    p.add_argument("--workers", type=int, default=None, help="data-parallel workers, replicas of local updates")
    p.add_argument(
        "--horizon-only",
        action="store_true",
        help="no row runs on to the target loss (losses and bytes at the horizon; steps and time to target only "
        "where a row reached it within the horizon)",
    )
    p.add_argument(
        "--rates",
        default=None,
        help="link rates in Mbit/s the time to target is measured at, on an emulated link (needs root; default: "
        "the preset's; 'none': no time to target)",
    )
    p.add_argument(
        "--section",
        default=None,
        help="the section of --write to replace (default: quality-PRESET, -wN with N workers): a run of some rows "
        "under a name of its own leaves the preset's full table as it is",
    )


def run(args: argparse.Namespace) -> int:
    # the suite's own flags (each subcommand has only those its run_<suite>_bench takes), by the same names
    options = {k: v for k, v in vars(args).items() if k not in ("command", "suite", "preset", "write")}
    for name in ("repeats", "threads"):
        if options.get(name) is not None:
            check_int(name, options[name], 1)
    cores = os.cpu_count() or 1
    if options.get("threads") is not None and options["threads"] > cores:
        raise ValueError(f"Invalid threads={options['threads']}: this machine has {cores} cores; use at most {cores}")
    write = _write_target(args.write)
    if args.suite == "quality":
        options.update(_quality_lists(args))
    module = importlib.import_module(f"powertrain.bench.{args.suite}")
    getattr(module, f"run_{args.suite}_bench")(preset=args.preset, write=write, **options)
    return 0


def _quality_lists(args: argparse.Namespace) -> dict[str, list | None]:
    """bench quality's comma-separated flags as run_quality_bench takes them."""
    try:
        horizons = [int(h) for h in args.horizons.split(",")] if args.horizons else None
    except ValueError:
        raise ValueError(f"Invalid --horizons {args.horizons!r}: use step counts such as 300,1000") from None
    try:
        rates = None if args.rates in (None, "none") else [float(r) for r in args.rates.split(",")]
    except ValueError:
        raise ValueError(f"Invalid --rates {args.rates!r}: use Mbit/s such as 1,10,100, or none") from None
    rates = [] if args.rates == "none" else rates
    return {"rows": args.rows.split(",") if args.rows else None, "horizons": horizons, "rates": rates}


def _write_target(write: str | None, prog: str = "powertrain bench") -> str | None:
    """The Markdown file a suite updates, checked before it runs (a benchmark takes minutes): ``--write PATH`` (a
    file, in an existing directory), ``''`` for none, and by default ./BENCHMARKS.md where one exists (a checkout
    of powertrain); elsewhere the default prints only, rather than leave a BENCHMARKS.md in any directory."""
    if write == "":
        return None
    if write is None:
        if Path(BENCHMARKS).is_file():
            return BENCHMARKS
        print(
            f"{prog}: no {BENCHMARKS} here: the results are printed only (--write PATH writes them)",
            file=sys.stderr,
        )
        return None
    path = Path(write)
    if path.is_dir() or not path.parent.is_dir():
        raise ValueError(f"--write {write!r} is not a file in an existing directory: give a Markdown file's path")
    return write
