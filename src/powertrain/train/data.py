"""Data sources for ``powertrain train`` (nothing is downloaded) and a stateless, resumable sampler.

Sources: the Python standard library's own ``.py`` sources (bytes), a directory of text files (bytes), a
pre-tokenised nanoGPT ``.bin`` file (uint16 tokens), and ``mnist1d`` generated locally with
``make_dataset`` (its downloading ``get_dataset`` is never called).

Sampling: rank ``r`` of ``W`` draws only from its own contiguous shard of the training data; the batch of
(step, micro-step) comes from a generator seeded with ``(seed, r, step, micro)``. No sampler state exists,
so a resumed run continues from the step number alone and gets exactly the batches it would have had.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sysconfig
from pathlib import Path

import torch

from powertrain.train.config import TrainConfig

__all__ = ["ClassData", "TokenData", "bin_tokens", "check_sizes", "check_source", "load_data", "stdlib_files"]

MB = 1_000_000
MIN_TOKENS = 64  # below this no split can hold a window of even a tiny block_size
MNIST1D_MISSING = "data='mnist1d' needs the mnist1d package: pip install 'powertrain[data]'"


@dataclasses.dataclass(frozen=True)
class TokenData:
    train: torch.Tensor  # 1-D integer tokens
    val: torch.Tensor
    vocab_size: int
    description: str

    def batch(
        self, split: str, rank: int, world: int, key: tuple[int, ...], batch_size: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows from this rank's shard: inputs and next-token targets, ``(batch, block)`` int64."""
        tokens = self.train if split == "train" else self.val
        lo, hi = self._shard(split, rank, world, block_size)
        starts = lo + torch.randint(0, hi - lo - block_size - 1, (batch_size,), generator=_generator(key))
        windows = tokens[starts[:, None] + torch.arange(block_size + 1)].long()
        return windows[:, :-1], windows[:, 1:]

    def _shard(self, split: str, rank: int, world: int, block_size: int) -> tuple[int, int]:
        return _token_shard(split, (self.train if split == "train" else self.val).numel(), rank, world, block_size)

    def check(self, rank: int, world: int, block_size: int) -> None:
        """ValueError now if a batch of either split could not be drawn later (before any training)."""
        for split in ("train", "val"):
            self._shard(split, rank, world, block_size)


@dataclasses.dataclass(frozen=True)
class ClassData:
    x_train: torch.Tensor  # (N, channels, length) float32
    y_train: torch.Tensor  # (N,) int64
    x_val: torch.Tensor
    y_val: torch.Tensor
    num_classes: int
    description: str

    def batch(
        self, split: str, rank: int, world: int, key: tuple[int, ...], batch_size: int, block_size: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (self.x_train, self.y_train) if split == "train" else (self.x_val, self.y_val)
        lo, hi = _shard(x.shape[0], rank, world)
        if hi <= lo:
            raise ValueError(f"The {split} split has {x.shape[0]} samples: too few for {world} workers")
        idx = lo + torch.randint(0, hi - lo, (batch_size,), generator=_generator(key))
        return x[idx], y[idx]

    def val_shard(self, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's whole share of the validation split (the shares of all ranks partition it)."""
        lo, hi = _shard(self.x_val.shape[0], rank, world)
        return self.x_val[lo:hi], self.y_val[lo:hi]

    def check(self, rank: int, world: int, block_size: int = 0) -> None:
        """ValueError now if a batch of either split could not be drawn later."""
        for split, n in (("train", self.x_train.shape[0]), ("val", self.x_val.shape[0])):
            lo, hi = _shard(n, rank, world)
            if hi <= lo:
                raise ValueError(f"The {split} split has {n} samples: too few for {world} workers")


def _shard(n: int, rank: int, world: int) -> tuple[int, int]:
    return n * rank // world, n * (rank + 1) // world


def _token_shard(split: str, n: int, rank: int, world: int, block_size: int) -> tuple[int, int]:
    """Rank ``rank``'s shard of a split of ``n`` tokens; ValueError if it cannot hold a window of ``block_size``."""
    lo, hi = _shard(n, rank, world)
    if hi - lo < block_size + 2:
        raise ValueError(
            f"The {split} split has {n} tokens: a shard of {world} is too small for block_size={block_size}; use "
            "more data (data_max_mb) or a smaller block_size"
        )
    return lo, hi


def _generator(key: tuple[int, ...]) -> torch.Generator:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def load_data(cfg: TrainConfig) -> TokenData | ClassData:
    max_bytes = None if cfg.data_max_mb is None else int(cfg.data_max_mb * MB)
    match cfg.data:
        case "stdlib" | "textdir":
            root, plan = _byte_plan(cfg, max_bytes)
            desc = (
                f"Python {sysconfig.get_python_version()} standard library sources"
                if cfg.data == "stdlib"
                else f"text files under {root}"
            )
            return _bytes_corpus(plan, desc)
        case "bin":
            return _bin(Path(str(cfg.data_path)), max_bytes)
        case "mnist1d":
            return _mnist1d()
    raise ValueError(f"Unknown data source {cfg.data!r}")


def check_sizes(cfg: TrainConfig, world: int) -> None:
    """ValueError, before any worker starts (and before ``--out`` is made), when a split of a text source is too
    small for ``world`` workers: the files' sizes decide it, the same plan the workers read (nothing is read)."""
    max_bytes = None if cfg.data_max_mb is None else int(cfg.data_max_mb * MB)
    if cfg.data in ("stdlib", "textdir"):
        train, val = (sum(n for _, _, n in part) for part in _byte_plan(cfg, max_bytes)[1])
    elif cfg.data == "bin":
        path = Path(str(cfg.data_path))
        train_file, val_file = (path / "train.bin", path / "val.bin") if path.is_dir() else (path, None)
        train = bin_tokens(train_file, max_bytes)
        if val_file is not None and val_file.exists():
            val = bin_tokens(val_file, max_bytes)
        else:
            train, val = train * 95 // 100, train - train * 95 // 100
    else:
        return  # mnist1d: a fixed set, generated in the workers
    data_world = world // cfg.tp if cfg.parallel == "tp" else world  # a tp group reads one batch
    for split, n in (("train", train), ("val", val)):
        for rank in range(data_world):
            _token_shard(split, n, rank, data_world, cfg.block_size)
    # every worker holds the whole corpus: text as uint8 tokens (1 byte a file byte); .bin read as uint16, then
    # int32 (6 bytes a token, 3 a file byte); --data-max-mb caps the file bytes
    file_bytes, per_byte = ((train + val) * 2, 3) if cfg.data == "bin" else (train + val, 1)
    check_memory(cfg, file_bytes, per_byte, world)


def check_memory(cfg: TrainConfig, file_bytes: int, per_byte: int, world: int) -> None:
    """ValueError when this machine's workers (``LOCAL_WORLD_SIZE`` under torchrun, else all ``world``), each holding
    ``file_bytes`` of corpus at ``per_byte`` bytes of memory each, would take more than 80% of the memory available
    (``MemAvailable``; no check where it is unknown): a clear line naming the ``--data-max-mb`` that fits, instead
    of the kernel's OOM killer mid-start."""
    available = memory_available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    need = file_bytes * per_byte
    if available is None or local * need <= 0.8 * available:
        return
    fits = 0.8 * available / local / per_byte / MB
    raise ValueError(
        f"data={cfg.data!r} would take {need / MB:,.1f} MB in each of {local} worker(s), more than this machine "
        f"has available ({available / MB:,.1f} MB): pass --data-max-mb {float(f'{fits:.2g}'):g} or less"
    )


def memory_available() -> int | None:
    """Linux's ``MemAvailable`` in bytes (/proc/meminfo), None where unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files in a fixed order (site-packages excluded)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for top, dirs, names in os.walk(root):  # as Path.rglob, without its cost per path: not into linked directories
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        files += [os.path.join(top, n) for n in names if n.endswith(".py")]
    return [Path(f) for f in sorted(files, key=lambda f: Path(os.path.relpath(f, root)).as_posix())]


#: A piece of a byte corpus: a file, the offset and the number of bytes to read from it.
Segment = tuple[Path, int, int]


def _byte_plan(cfg: TrainConfig, max_bytes: int | None) -> tuple[Path, tuple[list[Segment], list[Segment]]]:
    """The root of a ``stdlib`` or ``textdir`` source and its :func:`_plan`."""
    if cfg.data == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return root, _plan(root, stdlib_files(), max_bytes)
    root = Path(str(cfg.data_path))
    if not root.is_dir():
        raise ValueError(f"data_path={cfg.data_path!r} is not a directory (data='textdir' reads its files)")
    files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
    return root, _plan(root, files, max_bytes)


def _plan(root: Path, files: list[Path], max_bytes: int | None) -> tuple[list[Segment], list[Segment]]:
    """What a byte corpus reads, from the files' sizes (each opened, so that an unreadable one is left out), as
    train and validation segments: a file goes to validation by a hash of its path (5%, stable across runs), never
    more than ``max_bytes`` in all, even from one huge file."""
    train: list[Segment] = []
    val: list[Segment] = []
    size = 0
    for path in files:
        try:
            with path.open("rb") as f:
                n = os.fstat(f.fileno()).st_size
        except OSError:
            continue
        n = n if max_bytes is None else min(n, max_bytes - size)
        if n <= 0:
            continue
        rel = path.relative_to(root).as_posix()
        h = int.from_bytes(hashlib.sha1(rel.encode()).digest()[:4], "little") / 2**32
        (val if h < 0.05 else train).append((path, 0, n))
        size += n
        if max_bytes is not None and size >= max_bytes:
            break
    if not train and not val:
        raise ValueError(f"No data found under {str(root)!r}: it has no readable, non-empty files")
    if not train:  # every file hashed to validation (a corpus of one or two files): split them as below
        train, val = val, []
    if not val:  # tiny corpora: hold out the last file's tail
        path, offset, n = train[-1]
        train[-1], val = (path, offset, n * 9 // 10), [(path, offset + n * 9 // 10, n - n * 9 // 10)]
    return train, val


def _read(segments: list[Segment]) -> torch.Tensor:
    """The segments' bytes, one after the other, as uint8 tokens (each read bounded by its planned size)."""
    buf = bytearray(sum(n for _, _, n in segments))
    at = 0
    for path, offset, n in segments:
        with path.open("rb") as f:
            f.seek(offset)
            got = f.readinto(memoryview(buf)[at : at + n])
        if got != n:
            raise ValueError(f"{str(path)!r} changed while it was read ({got} of {n} bytes): read it again")
        at += n
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


def _bytes_corpus(plan: tuple[list[Segment], list[Segment]], description: str) -> TokenData:
    """Byte tokens: the train and validation segments of :func:`_plan`."""
    tr, va = _read(plan[0]), _read(plan[1])
    # what was read, named by its content: the standard library differs between Python builds (a patch release, a
    # distribution's), so two runs' losses compare only where these agree
    digest = hashlib.sha256(tr.numpy().tobytes() + b"\0" + va.numpy().tobytes()).hexdigest()[:12]
    size = (tr.numel() + va.numel()) / MB
    return TokenData(tr, va, 256, f"{description} ({size:.1f} MB, bytes, sha256 {digest})")


def _bin(path: Path, max_bytes: int | None) -> TokenData:
    """nanoGPT format: raw uint16 tokens. A directory with train.bin and val.bin, or one file (last 5% held out)."""
    train_file, val_file = (path / "train.bin", path / "val.bin") if path.is_dir() else (path, None)

    def read(f: Path) -> torch.Tensor:
        return torch.from_file(str(f), dtype=torch.uint16, size=bin_tokens(f, max_bytes)).to(torch.int32)

    train = read(train_file)
    if val_file is not None and val_file.exists():
        val = read(val_file)
    else:  # hold out the last 5%
        cut = train.numel() * 95 // 100
        train, val = train[:cut], train[cut:]
    vocab = int(max(train.max().item(), val.max().item())) + 1
    return TokenData(train, val, vocab, f"{path} ({train.numel() + val.numel()} uint16 tokens, vocab {vocab})")


def bin_tokens(f: Path, max_bytes: int | None) -> int:
    """How many uint16 tokens to read from the nanoGPT ``.bin`` file ``f``; ValueError if it cannot be one."""
    if not f.exists():
        raise ValueError(f"{str(f)!r} is missing (data='bin' reads uint16 tokens)")
    if not f.is_file():
        raise ValueError(f"{str(f)!r} is not a regular file (data='bin' reads uint16 tokens)")
    size = f.stat().st_size
    if size % 2:
        raise ValueError(f"{str(f)!r} has {size} bytes, an odd number: not uint16 tokens (truncated?)")
    n = size // 2 if max_bytes is None else min(size, max_bytes) // 2
    if n < MIN_TOKENS:
        raise ValueError(f"{str(f)!r} holds {n} tokens (data_max_mb included): at least {MIN_TOKENS} are needed")
    return n


def check_source(cfg: TrainConfig) -> None:
    """A missing, empty or malformed data path (or mnist1d without its package) is a clear ValueError, before any
    worker starts."""
    if cfg.data == "mnist1d" and importlib.util.find_spec("mnist1d") is None:
        raise ValueError(MNIST1D_MISSING)
    if cfg.data not in ("textdir", "bin"):
        return
    path = Path(str(cfg.data_path))
    if not path.exists():
        raise ValueError(f"data_path={cfg.data_path!r} does not exist")
    if cfg.data == "textdir":
        if not path.is_dir():
            raise ValueError(f"data_path={cfg.data_path!r} is not a directory (data='textdir' reads the files in it)")
        if not any(p.is_file() and p.stat().st_size > 0 for p in path.rglob("*")):
            raise ValueError(f"data_path={cfg.data_path!r} has no non-empty files")
        return
    max_bytes = None if cfg.data_max_mb is None else int(cfg.data_max_mb * MB)
    if path.is_dir():
        bin_tokens(path / "train.bin", max_bytes)
        if (path / "val.bin").exists():
            bin_tokens(path / "val.bin", max_bytes)
    else:
        bin_tokens(path, max_bytes)


def _mnist1d() -> ClassData:
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise ValueError(MNIST1D_MISSING) from None
    args = get_dataset_args()
    args.seed = 42  # the standard mnist1d set, generated here, whatever the training seed
    d = make_dataset(args)  # generates locally; get_dataset would download
    x = torch.as_tensor(d["x"], dtype=torch.float32)[:, None, :]
    x_val = torch.as_tensor(d["x_test"], dtype=torch.float32)[:, None, :]
    return ClassData(
        x,
        torch.as_tensor(d["y"]).long(),
        x_val,
        torch.as_tensor(d["y_test"]).long(),
        10,
        f"mnist1d generated locally ({x.shape[0]} train / {x_val.shape[0]} test sequences of length {x.shape[2]})",
    )
