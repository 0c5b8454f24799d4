"""Argument checks shared by the public constructors: one wording for one kind of mistake."""

from __future__ import annotations


def check_int(name: str, value: object, minimum: int, why: str = "") -> None:
    """ValueError ``Invalid name=value: must be an integer >= minimum`` (plus ``why``) unless ``value`` is an
    ``int`` (``bool`` is not) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Invalid {name}={value!r}: must be an integer >= {minimum}{why}")
