"""Argument checks whose error messages name the argument, the value and what was expected."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def suggest(kind: str, name: str, known: Iterable[str], listing: str) -> str:
    """An 'unknown X' sentence with the closest known names, e.g. for a misspelt variant."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown {kind} {name!r}{hint} ({listing} lists all: {', '.join(known)})"


def check_parameters(what: str, given: Iterable[str], known: Iterable[str]) -> None:
    """A TypeError for the first parameter in ``given`` that ``known`` lacks, listing the valid
    ones; ``what`` names the owner, e.g. "variant 'local'"."""
    known = list(known)
    for key in given:
        if key not in known:
            valid = ", ".join(known) or "none"
            raise TypeError(f"{what} has no parameter {key!r} (its parameters: {valid})")


def check_int(name: str, value: object, *, minimum: int = 1) -> int:
    """An int (not a bool) that is at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        what = "positive" if minimum == 1 else f"at least {minimum}"
        raise ValueError(f"{name} must be {what}, got {value}")
    return value


def check_int_list(name: str, value: object, *, minimum: int = 0) -> tuple[int, ...]:
    """A non-empty list or tuple of ints, each at least `minimum`, returned as a sorted tuple."""
    if not isinstance(value, list | tuple) or not value:
        raise TypeError(f"{name} must be a non-empty list of ints, got {value!r}")
    items = tuple(check_int(f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(value))
    return tuple(sorted(set(items)))


def check_probability(name: str, value: object) -> float:
    """A float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)
