"""Reading untrusted state without pickle's powers.

* :func:`dumps` / :func:`loads`: a state dict (dicts with str or int keys, lists, tuples, str, int, float, bool,
  None and tensors: what compressors, schedulers and the per-rank optimizers hold) as bytes, in a format parsed
  here: a JSON header describing the tree, then each tensor's raw bytes. Loading never unpickles, and never
  allocates more than the input's size: every tensor's byte range is checked against the input first.
* :func:`check_torch_pickle`: before ``torch.load(weights_only=True)`` reads a ``torch.save`` payload, the globals
  its pickle names are checked against a short list. ``weights_only`` cannot run code, but it admits
  ``builtins.bytearray``, which builds an object of any size from a few bytes of pickle (a memory bomb); and a
  compressed zip member could inflate without bound. Neither passes here.
"""

from __future__ import annotations

import io
import json
import math
import pickletools
import struct
import zipfile
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["TENSOR_GLOBALS", "UnsafeData", "check_torch_pickle", "dumps", "loads"]

_MAGIC = b"PTSTATE1"
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class UnsafeData(ValueError):
    """Bytes that are not what they claim to be (malformed, or more than plain data)."""


# ---------------------------------------------------------------- the state format


def dumps(state: Any) -> bytes:
    """``state`` as bytes (see the module docstring); TypeError for anything the format does not hold."""
    blobs: list[bytes] = []

    def enc(o: Any) -> Any:
        if o is None or isinstance(o, bool | str):
            return o
        if isinstance(o, int):
            return o
        if isinstance(o, float):
            return {"float": repr(o)}  # repr round-trips every float, nan and inf included
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            blobs.append(raw)
            return {"tensor": len(blobs) - 1, "dtype": str(t.dtype), "shape": list(t.shape), "bytes": len(raw)}
        if isinstance(o, list):
            return [enc(v) for v in o]
        if isinstance(o, tuple):
            return {"tuple": [enc(v) for v in o]}
        if isinstance(o, dict):
            for k in o:
                if not isinstance(k, str | int) or isinstance(k, bool):
                    raise TypeError(f"state keys must be str or int, got {type(k).__name__}")
            return {"dict": [[k, enc(v)] for k, v in o.items()]}
        raise TypeError(f"cannot store a {type(o).__name__} in a state blob (tensors, numbers, strings, containers)")

    header = json.dumps(enc(state), allow_nan=False).encode()
    return b"".join([_MAGIC, struct.pack("<Q", len(header)), header, *blobs])


def loads(data: bytes | bytearray | memoryview, *, max_depth: int = 64) -> Any:
    """The inverse of :func:`dumps`; :class:`UnsafeData` for anything malformed.

    Args:
        data: what :func:`dumps` wrote (any bytes: they are checked, never trusted).
        max_depth: the deepest nesting of containers accepted (deeper input is refused, not recursed into).
    """
    view = memoryview(data)
    if len(view) < 16 or bytes(view[:8]) != _MAGIC:
        raise UnsafeData("not a powertrain state blob (wrong magic bytes)")
    (size,) = struct.unpack("<Q", view[8:16])
    if size > len(view) - 16:
        raise UnsafeData(f"header of {size} bytes in a blob of {len(view)}")
    try:
        tree = json.loads(bytes(view[16 : 16 + size]))
    except (ValueError, RecursionError) as e:
        raise UnsafeData(f"unreadable header ({type(e).__name__})") from None
    offsets = [16 + size]  # where the next tensor's bytes start

    def dec(o: Any, depth: int) -> Any:
        if depth > max_depth:
            raise UnsafeData(f"nested deeper than {max_depth}")
        if o is None or isinstance(o, bool | str | int):
            return o
        if isinstance(o, list):
            return [dec(v, depth + 1) for v in o]
        if not isinstance(o, dict) or len(o) not in (1, 4):
            raise UnsafeData(f"unexpected {type(o).__name__} in the header")
        if "float" in o:
            if not isinstance(o["float"], str):
                raise UnsafeData("a float that is not a string")
            try:
                return float(o["float"])
            except ValueError:
                raise UnsafeData("a float that does not parse") from None
        if "tuple" in o and isinstance(o["tuple"], list):
            return tuple(dec(v, depth + 1) for v in o["tuple"])
        if "dict" in o and isinstance(o["dict"], list):
            out = {}
            for item in o["dict"]:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str | int)):
                    raise UnsafeData("a malformed dict entry")
                out[item[0]] = dec(item[1], depth + 1)
            return out
        if "tensor" in o:
            return _tensor(o, view, offsets)
        raise UnsafeData(f"unknown entry {sorted(o)[:3]} in the header")

    out = dec(tree, 0)
    if offsets[0] != len(view):
        raise UnsafeData(f"{len(view) - offsets[0]} bytes after the last tensor")
    return out


def _tensor(o: dict[str, Any], view: memoryview, offsets: list[int]) -> torch.Tensor:
    dtype, shape, nbytes = _DTYPES.get(o.get("dtype")), o.get("shape"), o.get("bytes")  # type: ignore[arg-type]
    if dtype is None or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise UnsafeData("a tensor with a bad dtype or shape")
    numel = math.prod(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    start = offsets[0]
    if nbytes != numel * itemsize or start + numel * itemsize > len(view):
        raise UnsafeData(f"a tensor of {numel} x {itemsize} bytes that the blob does not hold")
    offsets[0] = start + nbytes
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(view[start : start + nbytes]), dtype=torch.uint8).view(dtype).reshape(shape)


# ---------------------------------------------------------------- torch.save payloads


def _storage_globals() -> frozenset[str]:
    names = {f"torch.{n}" for n, v in vars(torch).items() if n.endswith("Storage") and isinstance(v, type)}
    return frozenset(names | {f"torch.{str(d).removeprefix('torch.')}" for d in _DTYPES.values()})


#: What ``torch.save`` of tensors names: the rebuild function, storages and dtypes, and OrderedDict (hooks).
TENSOR_GLOBALS = frozenset({"torch._utils._rebuild_tensor_v2", "collections.OrderedDict"}) | _storage_globals()


def check_torch_pickle(data: bytes, *, allowed: Iterable[str], what: str) -> None:
    """Raise :class:`UnsafeData` unless ``data`` is a ``torch.save`` archive whose members are stored
    uncompressed under names that do not collide (equal, or equal ignoring case, as torch's reader compares them)
    and whose one pickle names only ``allowed`` globals (``module.name``).

    Args:
        data: the archive's bytes.
        allowed: the globals its pickle may name, e.g. :data:`TENSOR_GLOBALS`.
        what: names the data in the error (a file's path, say).
    """
    allow = frozenset(allowed)
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError):
        raise UnsafeData(f"{what} is not in torch.save's format") from None
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        raise UnsafeData(f"{what} has compressed members (torch.save stores them uncompressed)")
    # torch's zip reader (miniz) looks member names up ignoring case: beside archive/data.pkl, it reads an
    # archive/DATA.PKL stored after it. Names that collide (equal, or equal ignoring case) could show this check one
    # member and torch another: refused, whichever torch would pick
    if len({i.filename.casefold() for i in infos}) != len(infos):
        raise UnsafeData(f"{what} has members whose names collide (equal, or equal ignoring case)")
    pickles = [i for i in infos if i.filename.rsplit("/", 1)[-1].casefold() == "data.pkl"]
    if len(pickles) != 1:
        raise UnsafeData(f"{what} has {len(pickles)} pickles, not one")
    try:
        for op, arg, _ in pickletools.genops(archive.read(pickles[0])):
            ref = None
            if op.name in ("GLOBAL", "INST"):  # the name is inline: what is read here is what is loaded
                ref = str(arg).replace(" ", ".")
            elif op.name in ("STACK_GLOBAL", "OBJ", "PERSID", "EXT1", "EXT2", "EXT4"):
                # names taken from the stack (memo entries can fake them) or from registries: torch.save (protocol
                # 2) never writes these
                ref = op.name
            if ref is not None and ref not in allow:
                raise UnsafeData(f"{what} names {ref[:80]}, which plain data does not need")
    except UnsafeData:
        raise
    except Exception as e:  # a truncated or garbled pickle
        raise UnsafeData(f"{what} holds a malformed pickle ({type(e).__name__})") from None
