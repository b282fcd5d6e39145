"""Argument checks whose error messages name the argument, the value and what was expected."""

from __future__ import annotations

import difflib
import importlib
import os
from collections.abc import Iterable
from pathlib import Path


def typed(value: object) -> object:
    """A value with its type, and a tuple's items with theirs: a cache key in which 1, 1.0 and
    True differ. They are equal keys, but a check accepts some and refuses others
    (``causal=1``, ``window_size=True``), and a cache hit would skip the check."""
    if isinstance(value, tuple):
        return tuple(typed(item) for item in value)
    return value, type(value)


def is_integer_dtype(dtype: object) -> bool:
    """Whether ``dtype`` holds integers (counts, positions, indices): not float, complex or bool."""
    return not (dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool")


def close_matches(name: str, known: Iterable[str], cutoff: float = 0.5) -> list[str]:
    """The known names closest to a misspelt one, best first (at most three)."""
    return difflib.get_close_matches(name, sorted(known), n=3, cutoff=cutoff)


def did_you_mean(close: Iterable[str]) -> str:
    """'; did you mean 'a' or 'b'?', or '' when nothing is close."""
    close = list(close)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def suggest(kind: str, name: str, known: Iterable[str], listing: str) -> str:
    """An 'unknown X' sentence with the closest known names, e.g. for a misspelt variant."""
    known = sorted(known)
    hint = did_you_mean(close_matches(name, known))
    return f"unknown {kind} {name!r}{hint} ({listing} lists all: {', '.join(known)})"


def check_parameters(
    what: str,
    given: Iterable[str],
    known: Iterable[str],
    *,
    options: Iterable[str] = (),
    options_of: str = "",
) -> None:
    """A TypeError for the first parameter in ``given`` that ``known`` lacks, listing the valid
    ones; ``what`` names the owner, e.g. "variant 'local'". A misspelling is matched against the
    known parameters and against ``options``, the caller's own arguments (``causal``,
    ``backend``...), which ``options_of`` names, e.g. "zoo.MultiHeadAttention"."""
    known, options = list(known), [o for o in options if o not in known]
    for key in given:
        if key in known:
            continue
        valid = ", ".join(known) or "none"
        message = f"{what} has no parameter {key!r} (its parameters: {valid})"
        close = close_matches(key, [*known, *options], cutoff=0.6)
        message += did_you_mean(close)
        misplaced = [c for c in close if c in options]
        if misplaced:
            names = " and ".join(repr(c) for c in misplaced)
            one = len(misplaced) == 1
            verb, noun = ("is an option", "a parameter") if one else ("are options", "parameters")
            message += f" {names} {verb} of {options_of or 'the call'}, not {noun} of the {what}"
        raise TypeError(message)


class NotImportable(ValueError):
    """A ``package.module:attribute`` reference that does not import. A registry file records
    such an entry instead of failing as a whole: only using it raises (see ``zoo.registry``)."""

    def __init__(self, message: str, reference: str) -> None:
        super().__init__(message)
        self.reference = reference


def import_object(reference: str, what: str) -> object:
    """The attribute named by ``package.module:attribute``; ``what`` names it in errors, e.g.
    "pattern". Raises NotImportable, naming the module that failed and how to make it import."""
    module_name, _, attribute = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # an import runs the module's code: any error may come out
        missing = error.name if isinstance(error, ModuleNotFoundError) else None
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            cause = f"no module named {missing!r}"
        elif missing:
            cause = f"it imports {missing!r}, which is not installed"
        else:
            cause = f"{type(error).__name__}: {error}"
        raise NotImportable(
            f"{what} {reference!r}: cannot import module {module_name!r} ({cause}); the part "
            "before the colon must be importable from sys.path: install its package, or add the "
            "folder that holds it to PYTHONPATH",
            reference,
        ) from error
    if not hasattr(module, attribute):
        # The module imports: a misspelt name, not a package missing here (a ValueError, which
        # a strict registry load raises, where NotImportable would defer it to its first use).
        public = [name for name in vars(module) if not name.startswith("_")]
        raise ValueError(
            f"{what} {reference!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
            f"has no attribute {attribute!r}{did_you_mean(close_matches(attribute, public))}; "
            "the part after the colon must name one"
        )
    return getattr(module, attribute)


# Sizes and positions become int64 tensors: a larger int failed inside torch ("Overflow when
# unpacking long long"), far from the parameter that held it.
INT_LIMIT = 2**62


def check_int(
    name: str, value: object, *, minimum: int = 1, maximum: int | None = INT_LIMIT
) -> int:
    """An int (not a bool) that is at least `minimum` and at most ``maximum`` (a caller with a
    bound of its own, and the reason for it, passes None)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        what = "positive" if minimum == 1 else f"at least {minimum}"
        raise ValueError(f"{name} must be {what}, got {value}")
    if maximum is not None and value > maximum:
        shown = "2**62 (an int64 size)" if maximum == INT_LIMIT else str(maximum)
        raise ValueError(f"{name} must be at most {shown}, got {value}")
    return value


def check_bool(name: str, value: object) -> bool:
    """True or False (not 1, 0 or None)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


# torch.Generator.manual_seed takes 64 bits, but its CPU generator (a Mersenne Twister) reads the
# low 32: a larger seed would draw what a smaller one draws, so it is refused.
SEED_MAX = 2**32 - 1


def check_seed(name: str, value: object) -> int:
    """A seed for ``torch.Generator().manual_seed`` on the CPU: an int in [0, 2**32 - 1]."""
    if check_int(name, value, minimum=0, maximum=None) > SEED_MAX:
        raise ValueError(
            f"{name} must be at most 2**32 - 1 = {SEED_MAX} (torch's CPU generator reads 32 bits "
            f"of a seed: a larger one would repeat a smaller one's draws), got {value}"
        )
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


def check_png_path(path: str | os.PathLike) -> Path:
    """A picture's output path, checked before any drawing so that a bad path fails fast: a PNG
    file's name in a folder that exists and can be written."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"path {str(path)!r} is a directory; pass a file name such as x.png")
    if path.suffix.lower() != ".png":  # a PNG named x.jpg would fail to open as a JPEG
        raise ValueError(
            f"path {str(path)!r} does not end in .png; pictures are PNG files: pass a name such "
            f"as {str(path.with_suffix('.png'))!r}"
        )
    if not folder.is_dir():
        problem = "is a file, not a directory" if folder.exists() else "does not exist"
        raise ValueError(
            f"cannot write {str(path)!r}: its directory {str(folder)!r} {problem}; "
            "create the directory first or pick another path"
        )
    if not os.access(folder, os.W_OK):
        raise ValueError(f"cannot write {str(path)!r}: directory {str(folder)!r} is not writable")
    return path
