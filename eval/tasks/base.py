"""The `Task` base class, the `Batch` it samples, and helpers shared by the task modules.

Conventions every task follows:

* token id ``PAD = 0`` is padding in every vocabulary (no task emits it except as padding);
* a target of ``IGNORE = -100`` is not scored (the value PyTorch's cross-entropy ignores);
* ``vocab_size`` and ``num_classes`` depend on the task's parameters only, never on ``seq_len``,
  so a model trained at one length can be tested at longer lengths with the same vocabulary;
* for ``head == "token"`` the targets are token ids and ``num_classes == vocab_size``
  (an LM-style output layer over the vocabulary);
* ``sample(n, seed)`` is a pure function of (parameters, seq_len, n, seed).

All bad arguments raise `ValueError` (wrong types too, so one ``except`` catches every bad
config value); the message names the argument, the value and what is expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

IGNORE = -100
PAD = 0


@dataclass
class Batch:
    """One sampled batch of a task.

    ``inputs`` is (N, L) int64. ``targets`` is (N, L) int64 with IGNORE where not scored for a
    "token" head, or (N,) int64 class labels for a "sequence" head. ``padding_mask`` is (N, L)
    bool, True on padding, or None when nothing is padded. ``slices`` maps a slice name to an
    int64 tensor shaped like ``targets`` giving each scored target's slice key (meaningless
    where the target is IGNORE). ``meta`` holds anything else worth recording.
    ``attention_inputs`` are what the model's attention layers take besides the tokens, by
    keyword (a graph task's ``edge_index``: a list of one (2, E) tensor per sequence); the model
    passes each to the variants that read it.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    padding_mask: torch.Tensor | None
    slices: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    attention_inputs: dict[str, Any] = field(default_factory=dict)


class Task:
    """A synthetic sequence task: subclasses set the class variables and implement `sample`."""

    name: ClassVar[str]
    head: ClassVar[str]  # "token" (per-position prediction) or "sequence" (pooled, one label)

    vocab_size: int
    num_classes: int
    # An image task's (rows, columns), its tokens in row-major order; the harness passes it as
    # ``grid`` to the variants that take one (the 2-D patterns). None: a plain sequence.
    grid: tuple[int, int] | None = None

    def __init__(self, seq_len: int, **params: Any) -> None:
        self.seq_len = check_int("seq_len", seq_len, minimum=1)
        # Kept for describe(); subclasses pass their resolved parameters here.
        self.params: dict[str, Any] = dict(params)

    def sample(self, n: int, seed: int) -> Batch:
        """Draw `n` sequences deterministically from `seed`."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The task's name, head, sizes and parameters, for result records."""
        return {
            "task": self.name,
            "head": self.head,
            "seq_len": self.seq_len,
            "vocab_size": self.vocab_size,
            "num_classes": self.num_classes,
            **self.params,
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}(seq_len={self.seq_len}, {args})"

    def _check_sample_args(self, n: int, seed: int) -> torch.Generator:
        """Validate `sample`'s arguments and return a generator seeded from `seed`."""
        check_int("n", n, minimum=1)
        # torch's CPU generator reads 32 bits of a seed: a larger one would draw a smaller one's
        check_int("seed", seed, minimum=0, maximum=2**32 - 1)
        return torch.Generator().manual_seed(seed)


def check_int(name: str, value: object, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Return `value` if it is an int (not a bool) within [minimum, maximum], else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        what = "positive" if minimum == 1 else f"at least {minimum}"
        raise ValueError(f"{name} must be {what}, got {value}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}.")
    return value


def check_bool(name: str, value: object) -> bool:
    """Return `value` if it is a bool, else ValueError."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r} ({type(value).__name__}).")
    return value


def check_positive_float(name: str, value: object) -> float:
    """Return `value` as a float if it is a finite number > 0, else ValueError."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not 0 < float(value) < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


def too_short(seq_len: int, needed: int, why: str) -> ValueError:
    """The error for a seq_len below what the task's parameters need."""
    return ValueError(
        f"seq_len={seq_len} is too short: {why} needs seq_len >= {needed}; "
        "raise seq_len or lower that parameter."
    )


def pow2_bucket(x: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= x elementwise (the bucket's lower bound); 0 stays 0.

    Integer bit arithmetic rather than log2, so exact powers of two never round down.
    """
    x = x.to(torch.int64)
    out = torch.zeros_like(x)
    rest = x.clone()
    bit = torch.ones_like(x)
    # Shift until every value is exhausted: after the loop `out` holds the top set bit.
    while bool((rest > 0).any()):
        out = torch.where(rest > 0, bit, out)
        rest = rest >> 1
        bit = bit << 1
    return out


def pow2_bucket_int(x: int) -> int:
    """Largest power of two <= x for a plain int (0 stays 0); the checkers' version."""
    return 0 if x <= 0 else 1 << (x.bit_length() - 1)


def random_choice(gen: torch.Generator, n: int, population: int, k: int) -> torch.Tensor:
    """(n, k) int64: for each row, k distinct indices from range(population), in random order.

    Uses the top-k of i.i.d. uniforms, which is a uniformly random k-subset in random order.
    """
    scores = torch.rand(n, population, generator=gen)
    return scores.topk(k, dim=1).indices
