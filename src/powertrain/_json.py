"""Strict JSON for every file powertrain writes: no bare ``NaN`` or ``Infinity``, which strict parsers refuse.

A non-finite number is written as ``null``, and the dict that holds it (directly, or inside lists) says why in a
field :data:`NOTE`: ``{"val_loss": null, "non_finite": {"val_loss": "nan"}}``; a number inside lists is named by
its indices, ``"curve[3][1]"``. :func:`loads` puts the numbers back, so powertrain's own readers see what was
written.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from powertrain._files import read_bounded

__all__ = ["NOTE", "dumps", "load", "loads"]

#: The field of a dict that lists its non-finite numbers (path -> "nan", "inf" or "-inf").
NOTE = "non_finite"


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps(obj, allow_nan=False, **kwargs)`` after replacing each non-finite float as the module says."""
    return json.dumps(_finite(obj, None, ""), allow_nan=False, **kwargs)


def loads(text: str | bytes) -> Any:
    """Parse what :func:`dumps` wrote, non-finite numbers restored from the notes."""
    return _restore(json.loads(text))


def load(path: Path, limit: int, what: str) -> Any:
    """:func:`loads` of the file ``path``, refused before it is read when it holds more than ``limit`` bytes
    (:class:`powertrain._files.FileTooLarge`, naming ``what``)."""
    return loads(read_bounded(path, limit, what))


def _word(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _finite(obj: Any, note: dict[str, str] | None, path: str) -> Any:
    """``obj`` with non-finite floats replaced by None; each one is recorded in ``note`` under ``path`` (the key
    in the nearest enclosing dict, then list indices)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        if note is not None:
            note[path] = _word(obj)
        return None
    if isinstance(obj, dict):
        own: dict[str, str] = {}
        out = {k: _finite(v, own, str(k)) for k, v in obj.items()}
        if own:
            assert NOTE not in obj, f"a dict with non-finite numbers already has a {NOTE!r} field"
            out[NOTE] = own
        return out
    if isinstance(obj, list | tuple):
        return [_finite(v, note, f"{path}[{i}]") for i, v in enumerate(obj)]
    return obj


_INDEX = re.compile(r"\[(\d+)\]$")


def _restore(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_restore(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out = {k: _restore(v) for k, v in obj.items()}
    note = out.pop(NOTE, None) if isinstance(out.get(NOTE), dict) else None
    for path, word in (note or {}).items():
        indices: list[int] = []
        key = path
        while key not in out and (m := _INDEX.search(key)):
            indices.insert(0, int(m.group(1)))
            key = key[: m.start()]
        value = float(word) if word in ("nan", "inf", "-inf") else None
        if key not in out or value is None:
            continue  # not a note this module wrote: leave the null
        if not indices:
            out[key] = value
            continue
        holder = out[key]
        for i in indices[:-1]:
            holder = holder[i] if isinstance(holder, list) and i < len(holder) else None
        if isinstance(holder, list) and indices[-1] < len(holder):
            holder[indices[-1]] = value
    return out
