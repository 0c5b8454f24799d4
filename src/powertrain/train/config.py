"""Configuration of ``powertrain train``: one dataclass, named presets, and the compressor spec syntax."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch

from powertrain.compress.powersgd import Config as PowerSGDConfig
from powertrain.powersgd import AllReduce, PowerSGD

Preset = Literal["default", "tiny"]
COMPRESSORS = ("none", "powersgd")


@dataclasses.dataclass(frozen=True)
class CompressorSpec:
    """``NAME[:key=value,...]``, e.g. ``powersgd:rank=4,iters=2``."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> CompressorSpec:
        name, _, rest = text.partition(":")
        name = name.strip().lower()
        if name not in COMPRESSORS:
            raise ValueError(f"Unknown compressor {name!r} in {text!r}: choose one of {', '.join(COMPRESSORS)}")
        options = []
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or not key.strip() or not value.strip():
                raise ValueError(f"Bad compressor option {item!r} in {text!r}: expected key=value")
            options.append((key.strip(), value.strip()))
        spec = cls(name, tuple(options))
        spec.powersgd_config()  # validate now, not in the workers
        return spec

    def __str__(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.options) if self.options else "")

    def powersgd_config(self) -> PowerSGDConfig | None:
        if self.name == "none":
            if self.options:
                raise ValueError(f"Compressor 'none' takes no options, got {dict(self.options)}")
            return None
        keys: dict[str, tuple[str, type]] = {
            "rank": ("rank", int),
            "iters": ("num_iters_per_step", int),
            "min_rate": ("min_compression_rate", float),
            "start": ("start_compressing_after_num_steps", int),
            "variant": ("variant", str),
            "seed": ("seed", int),
        }
        kwargs: dict[str, Any] = {"rank": 4, "start_compressing_after_num_steps": 10}
        for key, value in self.options:
            if key not in keys:
                raise ValueError(f"Unknown powersgd option {key!r}: valid options are {', '.join(keys)}")
            field, typ = keys[key]
            try:
                kwargs[field] = typ(value)
            except ValueError:
                raise ValueError(f"powersgd option {key}={value!r} must be {typ.__name__}") from None
        return PowerSGDConfig(**kwargs)

    def build(self, params: Sequence[torch.Tensor]) -> PowerSGD | AllReduce:
        cfg = self.powersgd_config()
        return AllReduce() if cfg is None else PowerSGD(params, config=cfg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    nproc: int = 2
    """Local worker processes to launch (ignored under torchrun, which sets the world)."""
    steps: int = 300
    batch_size: int = 16
    """Sequences per worker per step."""
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    seed: int = 0
    compressor: CompressorSpec = dataclasses.field(default_factory=lambda: CompressorSpec("powersgd", (("rank", "4"),)))
    log_every: int = 25
    eval_batches: int = 16
    threads: int = 1
    """torch threads per worker."""
    data_max_mb: float | None = None
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = 120.0
    """How long a collective may wait before the workers give up (a dead peer fails the run)."""

    def __post_init__(self) -> None:
        positive = (
            "nproc",
            "steps",
            "batch_size",
            "block_size",
            "n_layer",
            "n_head",
            "d_model",
            "log_every",
            "eval_batches",
            "threads",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Invalid {name}={value!r}: must be an integer >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"Invalid warmup_steps={self.warmup_steps!r}: must be >= 0")
        if not self.lr > 0:
            raise ValueError(f"Invalid lr={self.lr!r}: must be > 0")
        if self.weight_decay < 0:
            raise ValueError(f"Invalid weight_decay={self.weight_decay!r}: must be >= 0")
        if self.data_max_mb is not None and not self.data_max_mb > 0:
            raise ValueError(f"Invalid data_max_mb={self.data_max_mb!r}: must be > 0")
        if self.d_model % self.n_head:
            raise ValueError(f"Invalid d_model={self.d_model}: must be divisible by n_head={self.n_head}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"Invalid backend={self.backend!r}: must be auto, gloo or nccl")


PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    # Seconds, for tests and smoke checks.
    "tiny": dict(
        steps=6,
        batch_size=2,
        block_size=32,
        n_layer=1,
        n_head=2,
        d_model=32,
        log_every=1,
        eval_batches=2,
        data_max_mb=0.5,
        warmup_steps=2,
        compressor=CompressorSpec("powersgd", (("rank", "2"), ("start", "2"))),
    ),
}
