"""ListOps, after the Long Range Arena (Tay et al. 2020): evaluate a nested prefix expression.

* Token ids (vocab_size 16): 0 PAD, 1 ``[MIN``, 2 ``[MAX``, 3 ``[MED``, 4 ``[SM``, 5 ``]``,
  6..15 the digits 0..9. LRA's ``(`` ``)`` grouping tokens are not emitted.
* Trees follow LRA's ``generate_tree``: the root is at depth 1; below ``max_depth`` a node is a
  digit with probability 0.75, otherwise an operator with randint(2, max_args) children
  (children generated first, then the operator drawn uniformly); at ``max_depth`` a node is
  always a digit. An operator node's length is 2 plus its children's.
* A tree is kept when ``min_length < length < max_length`` (strict, as in LRA) and it is not a
  duplicate of a tree already drawn in the same ``sample`` call. Generation stops a tree as
  soon as it reaches ``max_length`` tokens, since it would be rejected anyway.
* Labels: MIN and MAX as usual, MED = int(statistics.median(args)) (a .5 median truncates),
  SM = sum(args) % 10; ten classes, head "sequence".
* Layout: the expression from position 0, then PAD up to ``seq_len``; ``padding_mask`` is True
  on the PAD positions. ``seq_len`` must be at least ``max_length - 1`` (no cropping).
* Defaults: min_length 500, max_length 2000, max_depth 10, max_args 10 (LRA), which need
  seq_len >= 1999; pass a smaller max_length for shorter sequences.
* Slices, shape (N,): "depth" = operator nesting depth of the tree (the root operator is 1);
  "length" = expression length bucketed to powers of two (lower bound). ``meta`` records the
  exact "lengths" and "depths".

Speed: tree generation is Python recursion plus rejection sampling (one CPU core). With the
LRA range (500, 2000) about 8% of trees are kept and 1000 samples take about 0.8 s; with
(20, 100) about 2.5% are kept and 1000 samples take about 0.3 s. Both scale linearly in n.
"""

from __future__ import annotations

import random
import statistics

import torch

from .base import PAD, Batch, Task, check_int, pow2_bucket, too_short

MIN, MAX, MED, SM, END, DIGIT0 = 1, 2, 3, 4, 5, 6
WORDS = {"[MIN": MIN, "[MAX": MAX, "[MED": MED, "[SM": SM, "]": END}
WORDS.update({str(d): DIGIT0 + d for d in range(10)})
VALUE_P = 0.25  # LRA: a node below max_depth is an operator when random() <= 0.25


class _TooLong(Exception):
    """Raised inside the recursion once a tree reaches max_length (it would be rejected)."""


def _apply(op: int, args: list[int]) -> int:
    if op == MIN:
        return min(args)
    if op == MAX:
        return max(args)
    if op == MED:
        return int(statistics.median(args))
    return sum(args) % 10


def _tree(rng: random.Random, depth: int, task: ListOps, out: list[int]) -> tuple[int, int]:
    """Append one subtree's tokens to `out`; return its value and operator height."""
    r = rng.random() if depth < task.max_depth else 1.0
    if r > VALUE_P:
        value = rng.randrange(10)
        out.append(DIGIT0 + value)
        if len(out) >= task.max_length:
            raise _TooLong
        return value, 0
    num_args = rng.randint(2, task.max_args)
    slot = len(out)
    out.append(PAD)  # the operator is drawn after its children (as in LRA) but comes first
    values, height = [], 0
    for _ in range(num_args):
        value, h = _tree(rng, depth + 1, task, out)
        values.append(value)
        height = max(height, h)
    op = MIN + rng.randrange(4)
    out[slot] = op
    out.append(END)
    if len(out) >= task.max_length:
        raise _TooLong
    return _apply(op, values), height + 1


def _max_possible_length(depth: int, max_depth: int, max_args: int, cap: int) -> int:
    """Longest tree the generator can produce from `depth`, capped to avoid huge ints."""
    if depth >= max_depth:
        return 1
    return min(
        cap, max(1, 2 + max_args * _max_possible_length(depth + 1, max_depth, max_args, cap))
    )


class ListOps(Task):
    """LRA ListOps: classify the value (0-9) of a nested MIN/MAX/MED/SM expression."""

    name = "listops"
    head = "sequence"
    vocab_size = 16
    num_classes = 10

    def __init__(
        self,
        seq_len: int,
        min_length: int = 500,
        max_length: int = 2000,
        max_depth: int = 10,
        max_args: int = 10,
    ) -> None:
        check_int("seq_len", seq_len, minimum=1)
        min_length = check_int("min_length", min_length, minimum=0)
        max_length = check_int("max_length", max_length, minimum=2)
        max_depth = check_int("max_depth", max_depth, minimum=1)
        max_args = check_int("max_args", max_args, minimum=2)
        if max_length < min_length + 2:
            raise ValueError(
                f"max_length={max_length} leaves no length strictly between min_length="
                f"{min_length} and max_length; max_length must be at least {min_length + 2}."
            )
        longest = _max_possible_length(1, max_depth, max_args, cap=max_length)
        if longest <= min_length:
            raise ValueError(
                f"min_length={min_length} is unreachable: with max_depth={max_depth} and "
                f"max_args={max_args} no tree is longer than {longest} tokens; lower min_length "
                "or raise max_depth or max_args."
            )
        if seq_len < max_length - 1:
            raise too_short(seq_len, max_length - 1, f"max_length={max_length}")
        super().__init__(
            seq_len,
            min_length=min_length,
            max_length=max_length,
            max_depth=max_depth,
            max_args=max_args,
        )
        self.min_length, self.max_length = min_length, max_length
        self.max_depth, self.max_args = max_depth, max_args

    def generate(self, rng: random.Random) -> tuple[list[int], int, int] | None:
        """One tree as (tokens, value, depth), or None when it falls outside the length range."""
        out: list[int] = []
        try:
            value, depth = _tree(rng, 1, self, out)
        except _TooLong:
            return None
        if len(out) <= self.min_length:
            return None
        return out, value, depth

    def sample(self, n: int, seed: int) -> Batch:
        """Draw `n` distinct expressions by rejection sampling (see the module docstring)."""
        self._check_sample_args(n, seed)
        rng = random.Random(seed)
        seen: set[tuple[int, ...]] = set()
        rows: list[tuple[list[int], int, int]] = []
        # Rare ranges could loop for ever; this cap is far above what any sane range needs.
        budget = 10_000 * n + 1_000_000
        while len(rows) < n:
            budget -= 1
            if budget < 0:
                raise RuntimeError(
                    f"listops drew too many trees outside ({self.min_length}, "
                    f"{self.max_length}) for n={n}; widen the length range."
                )
            tree = self.generate(rng)
            if tree is None or tuple(tree[0]) in seen:
                continue
            seen.add(tuple(tree[0]))
            rows.append(tree)

        inputs = torch.full((n, self.seq_len), PAD, dtype=torch.int64)
        for i, (tokens, _, _) in enumerate(rows):
            inputs[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        lengths = torch.tensor([len(t) for t, _, _ in rows], dtype=torch.int64)
        depths = torch.tensor([d for _, _, d in rows], dtype=torch.int64)
        targets = torch.tensor([v for _, v, _ in rows], dtype=torch.int64)
        padding_mask = torch.arange(self.seq_len).unsqueeze(0) >= lengths.unsqueeze(1)
        return Batch(
            inputs=inputs,
            targets=targets,
            padding_mask=padding_mask,
            slices={"depth": depths, "length": pow2_bucket(lengths)},
            meta={"lengths": lengths, "depths": depths},
        )


def encode(text: str) -> list[int]:
    """Token ids of a space-separated expression such as ``"[MED 1 2 3 4 ]"``."""
    try:
        return [WORDS[word] for word in text.split()]
    except KeyError as err:
        raise ValueError(
            f"unknown ListOps word {err.args[0]!r} in {text!r}; known: {list(WORDS)}."
        ) from None


def solve(tokens: list[int]) -> int:
    """Independent checker: evaluate a ListOps token sequence (PAD ignored) with a stack."""
    stack: list[list[int]] = [[]]  # each frame: [operator, arg, arg, ...]; bottom frame: result
    for tok in tokens:
        if tok == PAD:
            continue
        if tok in (MIN, MAX, MED, SM):
            stack.append([tok])
        elif tok == END:
            op, *args = stack.pop()
            if op == MIN:
                value = sorted(args)[0]
            elif op == MAX:
                value = sorted(args)[-1]
            elif op == MED:
                s, mid = sorted(args), len(args) // 2
                value = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) // 2
            else:
                value = 0
                for a in args:
                    value = (value + a) % 10
            stack[-1].append(value)
        else:
            stack[-1].append(tok - DIGIT0)
    if len(stack) != 1 or len(stack[0]) != 1:
        raise ValueError(f"tokens do not form one complete expression: {tokens!r}")
    return stack[0][0]


def depth_of(tokens: list[int]) -> int:
    """Independent checker for the "depth" slice: the deepest bracket nesting in `tokens`."""
    depth = best = 0
    for tok in tokens:
        if tok in (MIN, MAX, MED, SM):
            depth += 1
            best = max(best, depth)
        elif tok == END:
            depth -= 1
    return best
