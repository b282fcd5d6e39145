"""Induction heads, after Mamba (Gu & Dao 2023, Table 11): recall what followed the special token.

* Token ids: 0 PAD (never emitted), 1 SPECIAL, 2..V-1 ordinary tokens, where
  V = ``vocab_size`` (default 17: PAD and Mamba's vocabulary of 16, the special token and 15
  ordinary ones). Targets are token ids and num_classes = V.
* Layout of one sequence of length L: uniform i.i.d. ordinary tokens, except SPECIAL at a
  position p drawn uniformly from [0, L - 3] and again at the last position L - 1. The token
  at p + 1 (an ordinary token) is the answer: the only target, at position L - 1; all other
  targets are IGNORE. SPECIAL occurs exactly twice. Needs seq_len >= 3.
* Slices: "distance" = (L - 1) - p, the distance from the first SPECIAL to the query,
  bucketed to powers of two (lower bound). ``meta["distance"]`` holds the exact distances.

Speed: 1000 sequences of length 1024 take about 0.01 s on 2 CPU cores (4096: about 0.02 s).
"""

from __future__ import annotations

import torch

from .base import IGNORE, Batch, Task, check_int, pow2_bucket, too_short

SPECIAL, FIRST_ORDINARY = 1, 2
# PAD, then Mamba's 16 tokens: the special token and 15 ordinary ones
VOCAB_SIZE = 17


class Induction(Task):
    """Induction heads: at the final SPECIAL, output the token after the first SPECIAL."""

    name = "induction"
    head = "token"

    def __init__(self, seq_len: int, vocab_size: int = VOCAB_SIZE) -> None:
        check_int("seq_len", seq_len, minimum=1)
        vocab_size = check_int("vocab_size", vocab_size, minimum=FIRST_ORDINARY + 1)
        if seq_len < 3:
            raise too_short(seq_len, 3, "the special token, its successor and the query")
        super().__init__(seq_len)
        self.vocab_size = vocab_size
        self.num_classes = vocab_size

    def sample(self, n: int, seed: int) -> Batch:
        """Draw `n` induction sequences (see the module docstring for the layout)."""
        gen = self._check_sample_args(n, seed)
        L = self.seq_len
        inputs = torch.randint(FIRST_ORDINARY, self.vocab_size, (n, L), generator=gen)
        first = torch.randint(0, L - 2, (n, 1), generator=gen)
        answer = inputs.gather(1, first + 1)
        inputs.scatter_(1, first, SPECIAL)
        inputs[:, L - 1] = SPECIAL

        targets = torch.full((n, L), IGNORE, dtype=torch.int64)
        targets[:, L - 1 :] = answer
        distance = (L - 1) - first.squeeze(1)
        slice_ = torch.zeros(n, L, dtype=torch.int64)
        slice_[:, L - 1] = pow2_bucket(distance)
        return Batch(
            inputs=inputs,
            targets=targets,
            padding_mask=None,
            slices={"distance": slice_},
            meta={"distance": distance},
        )


def solve(tokens: list[int]) -> list[int]:
    """Independent checker: find the first SPECIAL and read the token after it."""
    out = [IGNORE] * len(tokens)
    out[-1] = tokens[tokens.index(SPECIAL) + 1]
    return out
