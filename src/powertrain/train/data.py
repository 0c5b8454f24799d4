"""Text that ships with every Python install: the standard library's own ``.py`` sources, as bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from pathlib import Path

import torch


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8 tokens
    val: torch.Tensor
    description: str


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files in a fixed order (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_stdlib_corpus(max_bytes: int | None = None, val_fraction: float = 0.05) -> Corpus:
    """Byte tokens of the stdlib sources; a file goes to validation by a hash of its path (stable split)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[bytes] = []
    val: list[bytes] = []
    size = 0
    for path in stdlib_files():
        rel = path.relative_to(root).as_posix()
        try:
            data = path.read_bytes()
        except OSError:
            continue
        h = int.from_bytes(hashlib.sha1(rel.encode()).digest()[:4], "little") / 2**32
        (val if h < val_fraction else train).append(data)
        size += len(data)
        if max_bytes is not None and size >= max_bytes:
            break
    if not train or not val:
        raise ValueError(f"No Python sources found under {root}: cannot build the default corpus")
    to_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    tr, va = to_tensor(train), to_tensor(val)
    desc = (
        f"Python {sysconfig.get_python_version()} standard library sources ({(tr.numel() + va.numel()) / 1e6:.1f} MB)"
    )
    return Corpus(tr, va, desc)


def sample_batch(
    tokens: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs and next-byte targets, both ``(batch_size, block_size)`` int64."""
    starts = torch.randint(0, tokens.numel() - block_size - 1, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(block_size + 1)
    windows = tokens[idx].long()
    return windows[:, :-1], windows[:, 1:]
