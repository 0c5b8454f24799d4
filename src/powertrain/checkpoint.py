"""Checkpoints with torch.distributed.checkpoint (DCP) that cannot run code, drop state or load corrupted data.

DCP as torch ships it is unsafe to load from an untrusted directory: its ``.metadata`` is a plain pickle, and
every non-tensor item (a number, an optimizer's ``lr``, an ``io.BytesIO``) is read back with
``torch.load(weights_only=False)``. :func:`load` closes both paths and adds the checks DCP lacks:

1. :func:`save` records each file's size and SHA-256 in ``manifest.json``; :func:`load` verifies them first
   (regular files only: no symlinks, FIFOs or devices; nothing unlisted), so a flipped byte is a one-line
   :class:`CheckpointError` naming the file instead of a model trained on garbage.
2. ``.metadata`` is read by an unpickler that admits DCP's metadata classes only
   (:class:`powertrain._compat.SafeUnpickler`); it may name only files the manifest lists, and no stream
   transforms (decompression could inflate without bound).
3. Every item is a ``torch.save`` payload whose pickle is checked before ``torch.load(weights_only=True)`` reads
   it (:func:`powertrain.serialize.check_torch_pickle`): tensors may name tensor-rebuilding globals only, other
   items (an optimizer's ``lr``) none at all, and must decode to plain numbers, strings and containers.
4. Nothing is silently left out: every entry of the state dict to fill must be in the checkpoint, except
   those an ``optional`` predicate admits (an optimizer slot that never had a gradient); a tensor entry must
   be a tensor in the checkpoint.

State that differs per rank (compressor error buffers, per-rank optimizer state) goes through
:class:`CompressorState`: DCP treats tensors saved under one name on several ranks as replicas and keeps one.
It stores each rank's state as a byte tensor in :mod:`powertrain.serialize`'s format (parsed, never unpickled)
under its own key; the key names the world size, so loading into another world size fails with both named.

Usage::

    from powertrain import checkpoint

    state = {"model": model.state_dict(), "compressor": checkpoint.CompressorState(compressor)}
    checkpoint.save(state, path)
    ...
    checkpoint.load(state, path)  # verifies checksums, then fills model and compressor in place
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import pickle
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from powertrain import _json, serialize
from powertrain._compat import safe_dcp_reader
from powertrain._files import FileTooLarge, read_bounded, write_atomic
from powertrain.comm import Communicator

__all__ = [
    "CheckpointError",
    "CompressorState",
    "load",
    "never_stepped",
    "read_checkpoint_file",
    "read_manifest",
    "read_metadata",
    "save",
    "saved_world_size",
    "verify",
]

MANIFEST = "manifest.json"
#: The most a manifest.json holds: ~150 bytes per file listed and the run's config; 4 MiB lists 25,000 workers' files,
#: and parsing it stays within tens of MB whatever it holds.
MANIFEST_LIMIT = 4 << 20
#: The most a ``.metadata`` may hold (~300 bytes per stored chunk: 200,000 chunks); it is unpickled whole.
METADATA_LIMIT = 64 << 20
#: What torch.save adds around one item's bytes (its zip records and pickle: ~1.5 KB), with room to spare.
ITEM_OVERHEAD = 64 << 10
FORMAT = 3  # the manifest's format; a checkpoint of any other is refused (older ones held unsafe per-rank state)
_NAME = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*")  # a plain file name: no "/", no "..", no leading "."


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupted, unsafe, or made for another model or world size."""


def _short(e: BaseException, limit: int = 300) -> str:
    """An exception as one bounded line (messages may quote what a crafted checkpoint holds)."""
    text = " ".join(str(e).split())
    text = text.split(" Re-running `torch.load`")[0]  # torch's advice to load unsafely: never the right fix here
    if not text:  # MemoryError(), OverflowError(): the type is the reason
        return type(e).__name__
    return (text[:limit] + " ...") if len(text) > limit else text


# ---------------------------------------------------------------- per-rank state


def _rank_key() -> str:
    comm = Communicator()  # rank and world size of the default group, with the world-size-1 fallback
    return f"rank{comm.rank}_of_{comm.world_size}"


_RANK_KEY = re.compile(r"rank(\d+)_of_(\d+)")


def to_blob(state: Any) -> torch.Tensor:
    """``state`` (tensors, numbers, strings, containers) as a uint8 tensor (:func:`powertrain.serialize.dumps`)."""
    return torch.frombuffer(bytearray(serialize.dumps(state)), dtype=torch.uint8)


def from_blob(blob: torch.Tensor) -> Any:
    """The inverse of :func:`to_blob`: parsed, never unpickled; :class:`CheckpointError` if malformed."""
    try:
        return serialize.loads(blob.numpy().tobytes())
    except serialize.UnsafeData as e:
        raise CheckpointError(f"The checkpoint's per-rank state is not valid: {e}") from None


class CompressorState:
    """A DCP ``Stateful`` wrapper storing the state of ``obj`` (anything with ``state_dict`` /
    ``load_state_dict``: a compressor, a per-rank optimizer) under this rank's own key, as a byte tensor.

    :func:`load` offers an empty uint8 tensor in its place, which its planner sizes from the checkpoint.
    """

    def __init__(self, obj: Any) -> None:
        self.compressor = obj

    def state_dict(self) -> dict[str, Any]:
        """``{"rank{r}_of_{world}": blob}``: the wrapped object's ``state_dict()`` as one uint8 tensor
        (:func:`powertrain.serialize.dumps`), under this rank's key in the default group."""
        return {_rank_key(): to_blob(self.compressor.state_dict())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Parse this rank's blob and hand it to the wrapped object's ``load_state_dict``; :class:`CheckpointError`
        if the state has no entry for this rank (saved with another world size) or the blob is malformed."""
        key = _rank_key()
        if key not in state:
            raise CheckpointError(
                f"The checkpoint has no per-rank state for {key}: resume with the world size it was saved with"
            )
        self.compressor.load_state_dict(from_blob(state[key]))


# ---------------------------------------------------------------- loading


Optional = Callable[[str, Metadata], bool]


def _plain(o: Any, depth: int = 0) -> bool:
    """Numbers, strings, None and (shallow) containers of them: what an optimizer's hyperparameters are."""
    if depth > 8:
        return False
    if o is None or isinstance(o, bool | int | float | str):
        return True
    if isinstance(o, list | tuple):
        return all(_plain(v, depth + 1) for v in o)
    if isinstance(o, dict):
        return all(isinstance(k, str | int) and _plain(v, depth + 1) for k, v in o.items())
    return False


def _item_limit(value: Any) -> int | None:
    """The most bytes a stored item loading into ``value`` may take: a tensor's elements at up to 16 bytes each (a
    stored dtype may be wider than the destination's); any other value (an optimizer's hyperparameter, its list
    of parameter names) twice its own pickle; each with torch.save's framing. None for what is not loaded and for a
    per-rank blob (an empty uint8 tensor, sized from what is stored)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return None if value.dtype == torch.uint8 and value.numel() == 0 else 16 * value.numel() + ITEM_OVERHEAD
    try:
        return 2 * len(pickle.dumps(value, protocol=2)) + ITEM_OVERHEAD
    except Exception:  # not picklable here: then not what powertrain saved either; DCP's own checks decide
        return 1 << 20


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner with the checks of this module's docstring (3 and 4).

    Args:
        optional: ``optional(fqn, metadata)`` is True for a state-dict entry the checkpoint may lack (it keeps
            its current value). Anything else missing raises :class:`CheckpointError` listing the keys.
    """

    def __init__(self, *, optional: Optional | None = None) -> None:
        super().__init__(allow_partial_load=True)  # the strict check is ours (DCP's has no exceptions)
        self.optional = optional or (lambda fqn, md: False)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        assert metadata is not None, "DCP passes the checkpoint's metadata"
        saved = metadata.state_dict_metadata
        super().set_up_planner(state_dict, metadata, is_coordinator)
        stored: dict[str, int] = {}  # bytes stored per item: a blob cannot be longer
        for index, info in (metadata.storage_data or {}).items():
            length = int(getattr(info, "length", 0))
            stored[index.fqn] = stored.get(index.fqn, 0) + length
            limit = _item_limit(self.state_dict.get(index.fqn))
            if limit is not None and length > limit:  # checked before any item is read
                raise CheckpointError(
                    f"Checkpoint item {index.fqn!r} is stored in {length:,} bytes, more than its destination takes "
                    f"({limit:,}): the checkpoint is damaged or crafted"
                )
        missing = []
        for fqn, value in self.state_dict.items():
            md = saved.get(fqn)
            if md is None:
                if not self.optional(fqn, metadata):
                    missing.append(fqn)
                continue
            if not isinstance(value, torch.Tensor):
                continue
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"Checkpoint item {fqn!r} should be a tensor but is stored as an object")
            if value.dtype == torch.uint8 and value.numel() == 0:  # a CompressorState blob: sized from the checkpoint
                if len(md.size) != 1 or not 0 <= math.prod(md.size) <= stored.get(fqn, 0):
                    raise CheckpointError(f"Checkpoint item {fqn!r} claims a size its data file does not hold")
                value.resize_(md.size)
            _check_stored(fqn, md, value, metadata)
        if missing:
            ranks = sorted({m.group(0) for k in saved if (m := _RANK_KEY.search(k))})[:8]
            hint = f" (it has per-rank state for {', '.join(ranks)})" if ranks else ""
            raise CheckpointError(
                f"The checkpoint lacks {len(missing)} entries this run needs{hint}: {', '.join(missing[:5])}"
                + (" ..." if len(missing) > 5 else "")
            )

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        raw = value.getvalue()
        try:
            serialize.check_torch_pickle(raw, allowed=(), what=f"checkpoint item {fqn!r}")
            obj = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as e:
            raise CheckpointError(_short(e)) from None
        if not _plain(obj):
            raise CheckpointError(f"Checkpoint item {fqn!r} holds a {type(obj).__name__}, not plain data")
        if self.flatten_state_dict:  # put it where it was in the nested state dict (DCP's set_element is private)
            *parents, last = self.mappings[fqn]
            node: Any = self.original_state_dict
            for key in parents:
                node = node[key]
            node[last] = obj
        else:
            self.state_dict[fqn] = obj


def _check_stored(fqn: str, md: TensorStorageMetadata, value: torch.Tensor, metadata: Metadata) -> None:
    """CheckpointError unless ``fqn`` is stored with its destination's (``value``) dtype and shape, in chunks that
    tile it exactly, each with data: DCP casts what it reads (a complex momentum lost its imaginary part with a
    warning) and fills whichever chunks overlap a destination, leaving the rest as it was (a shard dropped from the
    metadata left that rank's freshly initialised rows in place, silently)."""
    shape = tuple(value.shape)
    if tuple(md.size) != shape or md.properties.dtype != value.dtype:
        raise CheckpointError(
            f"Checkpoint item {fqn!r} is stored as {md.properties.dtype} {tuple(md.size)}, this run's is "
            f"{value.dtype} {shape}"
        )
    covered = torch.zeros(shape, dtype=torch.bool)  # the destination's own size: bounded by what this run holds
    for chunk in md.chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
            raise CheckpointError(f"Checkpoint item {fqn!r} has a chunk outside its shape {shape}")
        ends = [o + n for o, n in zip(chunk.offsets, chunk.sizes, strict=True)]
        if any(o < 0 or e > d for o, e, d in zip(chunk.offsets, ends, shape, strict=True)):
            raise CheckpointError(f"Checkpoint item {fqn!r} has a chunk outside its shape {shape}")
        if MetadataIndex(fqn, chunk.offsets) not in (metadata.storage_data or {}):
            raise CheckpointError(f"Checkpoint item {fqn!r} has a chunk at {tuple(chunk.offsets)} without data")
        region = covered[tuple(slice(o, e) for o, e in zip(chunk.offsets, ends, strict=True))]
        if bool(region.any()):
            raise CheckpointError(f"Checkpoint item {fqn!r} has overlapping chunks")
        region.fill_(True)
    if not bool(covered.all()):
        raise CheckpointError(
            f"Checkpoint item {fqn!r} is stored in chunks that leave part of it out: the checkpoint is damaged or "
            "crafted; resume from another"
        )


def never_stepped(key: str = "optim") -> Optional:
    """An ``optional`` predicate for :func:`load`: the optimizer state (``get_state_dict``'s, stored under ``key``)
    of a parameter that never had a gradient may be absent, since ``get_state_dict`` creates every slot when it
    loads. Only a parameter with no saved state at all qualifies; anything else missing is still an error."""

    def optional(fqn: str, metadata: Metadata) -> bool:
        parts = fqn.split(".")
        if parts[:2] != [key, "state"] or len(parts) < 4:
            return False
        prefix = ".".join(parts[:-1]) + "."  # key.state.<parameter fqn>.
        return not any(k.startswith(prefix) for k in metadata.state_dict_metadata)

    return optional


def _reader(path: str | Path, manifest: Mapping[str, Any]) -> Any:
    return safe_dcp_reader(str(path), files=frozenset(manifest["files"]), metadata_limit=METADATA_LIMIT)


def read_metadata(path: str | Path, manifest: Mapping[str, Any] | None = None) -> Metadata:
    """DCP's metadata of the checkpoint at ``path``, read safely (verifying the checkpoint unless its
    ``manifest`` from :func:`verify` is given)."""
    manifest = verify(path) if manifest is None else manifest
    try:
        return _reader(path, manifest).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{str(Path(path) / '.metadata')!r} cannot be read safely: {_short(e)}") from None


def load(
    state_dict: dict[str, Any],
    path: str | Path,
    *,
    optional: Optional | None = None,
    group: dist.ProcessGroup | None = None,
    manifest: Mapping[str, Any] | None = None,
) -> None:
    """Fill ``state_dict`` (and its ``Stateful`` entries) in place from the checkpoint at ``path``.

    Verifies the checkpoint first (:func:`verify`; skipped when its ``manifest`` is passed), then loads through
    ``SafeLoadPlanner`` with ``optional``: ``optional(fqn, metadata)`` is True for an entry the checkpoint may
    lack (it keeps its current value; default None: none may be missing). Every rank of ``group`` must call it. Any
    failure is a :class:`CheckpointError` with a one-line reason.
    """
    manifest = verify(path) if manifest is None else manifest
    # A CompressorState offers an empty blob to load into (its own state_dict() would serialise the current state).
    wrapped = {k: v for k, v in state_dict.items() if isinstance(v, CompressorState)}
    for k in wrapped:
        state_dict[k] = {_rank_key(): torch.empty(0, dtype=torch.uint8)}
    try:
        dcp.load(
            state_dict,
            storage_reader=_reader(path, manifest),
            planner=SafeLoadPlanner(optional=optional),
            process_group=group,
        )
        for k, v in wrapped.items():
            v.load_state_dict(state_dict[k])
    except CheckpointException as e:  # DCP gathers every rank's traceback into one message: keep the cause
        causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        first = next((c for c in causes if isinstance(c, CheckpointError)), causes[0] if causes else e)
        raise CheckpointError(f"Cannot load checkpoint {str(path)!r}: {_short(first)}") from None
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, RuntimeError, MemoryError) as e:  # a state that does not fit
        raise CheckpointError(f"Cannot load checkpoint {str(path)!r}: {type(e).__name__}: {_short(e)}") from None
    finally:
        state_dict.update(wrapped)


# ---------------------------------------------------------------- saving and the manifest


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def save(
    state_dict: dict[str, Any],
    path: str | Path,
    *,
    extra: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """``dcp.save`` of ``state_dict`` (and its ``Stateful`` entries) to ``path``, then rank 0 writes ``manifest.json``:
    the format, the world size, each file's size and SHA-256, and ``extra`` (JSON values). Every rank of ``group``
    must call it; it returns once the manifest exists."""
    dcp.save(state_dict, checkpoint_id=str(path), process_group=group)
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        dist.barrier(group=group)
    comm = Communicator(group)
    if comm.rank == 0:
        root = Path(path)
        files = {
            p.name: {"bytes": p.stat().st_size, "sha256": _digest(p)}
            for p in sorted(root.iterdir())
            if p.is_file() and p.name != MANIFEST
        }
        manifest = {"format": FORMAT, "world_size": comm.world_size, **(extra or {}), "files": files}
        write_atomic(root / MANIFEST, _json.dumps(manifest, indent=1) + "\n")
    if initialized:
        dist.barrier(group=group)


def read_checkpoint_file(path: Path, limit: int, what: str, too_large: str) -> bytes:
    """``path``'s bytes, read within ``limit`` (its size checked first); :class:`CheckpointError` in one line when it
    is larger (naming the file as ``what``, e.g. "Checkpoint manifest", and saying ``too_large``: what that means) or
    cannot be read."""
    try:
        return read_bounded(path, limit, what)
    except FileTooLarge as e:
        raise CheckpointError(f"{e}: {too_large}") from None
    except OSError as e:
        raise CheckpointError(f"Cannot read {str(path)!r}: {e.strerror or e}") from None


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The ``manifest.json`` of the checkpoint directory ``path`` (plain JSON, checked field by field), or a
    :class:`CheckpointError`."""
    f = Path(path) / MANIFEST
    if not f.is_file() or f.is_symlink():
        raise CheckpointError(
            f"Checkpoint {str(path)!r} has no {MANIFEST}: it is incomplete, or was written by a powertrain older "
            f"than checkpoint format {FORMAT}, whose per-rank state cannot be loaded safely"
        )
    damaged = "the checkpoint is damaged or not powertrain's"
    raw = read_checkpoint_file(f, MANIFEST_LIMIT, "Checkpoint manifest", damaged)
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{str(f)!r} is not valid JSON: the checkpoint is corrupted") from None
    bad = f"{str(f)!r} is not a format-{FORMAT} powertrain manifest"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(bad)
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(_entry_ok(name, e) for name, e in files.items()):
        raise CheckpointError(f"{bad}: its file list is malformed")
    for key in ("world_size", "step"):
        value = manifest.get(key)
        if key in manifest and not (type(value) is int and value >= (1 if key == "world_size" else 0)):
            raise CheckpointError(f"{bad}: {key} is not a valid count")
    return manifest


def _entry_ok(name: Any, entry: Any) -> bool:
    return (
        isinstance(name, str)
        and (name == ".metadata" or bool(_NAME.fullmatch(name)))
        and isinstance(entry, dict)
        and type(entry.get("bytes")) is int
        and isinstance(entry.get("sha256"), str)
    )


def verify(path: str | Path) -> dict[str, Any]:
    """Check every file of the checkpoint at ``path`` against its manifest (each a regular file, not a link, of the
    listed size and SHA-256; nothing unlisted); return the manifest. Raises :class:`CheckpointError` naming the
    first bad file."""
    root = Path(path)
    manifest = read_manifest(root)
    listed = manifest["files"]
    for name, entry in listed.items():
        f = root / name
        try:
            st = f.lstat()
        except OSError:
            raise CheckpointError(f"Checkpoint file {str(f)!r} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"Checkpoint file {str(f)!r} is not a regular file (a link, pipe or device)")
        if name == ".metadata" and st.st_size > METADATA_LIMIT:
            raise CheckpointError(
                f"Checkpoint file {str(f)!r} is {st.st_size:,} bytes, more than DCP metadata can be "
                f"({METADATA_LIMIT:,}): the checkpoint is damaged or crafted"
            )
        if st.st_size != entry["bytes"] or _digest(f) != entry["sha256"]:
            raise CheckpointError(f"Checkpoint file {str(f)!r} is corrupted: its checksum differs from the manifest")
    extra = sorted(p.name for p in root.iterdir() if p.name not in listed and p.name != MANIFEST)
    if extra:
        raise CheckpointError(f"Checkpoint {str(root)!r} has files its manifest does not list: {extra[:5]}")
    return manifest


def saved_world_size(path: str | Path) -> int:
    """The world size the checkpoint at ``path`` was written with (from its manifest)."""
    size = read_manifest(path).get("world_size")
    if type(size) is not int:
        raise CheckpointError(f"{str(Path(path) / MANIFEST)!r} has no world_size")
    return size
