"""Passkey retrieval, after Mohtashami & Jaggi (2023), at the token level.

* Token ids: 0 PAD (never emitted), 1 KEY marker, 2 QUERY marker, 3 ANSWER slot,
  4..13 the digits 0..9, 14..14+F-1 filler tokens, F = ``num_filler`` (default 8), so
  vocab_size = 14 + F (22 by default). Targets are token ids and num_classes = vocab_size.
* Layout of one sequence of length L with k = ``num_digits`` (default 5) and haystack
  length H = L - k - 1::

      [ haystack: filler ... KEY d_1 ... d_k filler ... ] QUERY ANSWER x k

  Filler tokens are uniform i.i.d. over the F filler ids (random rather than a repeated
  pattern, so no position-periodic shortcut exists). The key block (KEY and k uniform digits,
  leading zeros allowed) starts at s, uniform over the H - k possible starts [0, H - k - 1].
  The target at the i-th ANSWER slot is d_i; all other targets are IGNORE. The answer slots
  are identical placeholders and never hold a digit, so the layout is causal-friendly and
  also leak-free for bidirectional models. Needs seq_len >= 2*k + 2.
* Depth: s / (H - k) in [0, 1) (0 = start of the haystack, near 1 = just before the query),
  recorded in ``meta["depth"]``. Slice "depth" = floor(10 * depth), the tenth (0..9), for
  every answer slot; slice "digit" = i, which digit of the key (0..k-1).

Speed: 1000 sequences of length 1024 take about 0.01 s on 2 CPU cores (4096: about 0.02 s).
"""

from __future__ import annotations

import torch

from .base import IGNORE, Batch, Task, check_int, too_short

KEY, QUERY, ANSWER, DIGIT0, FIRST_FILLER = 1, 2, 3, 4, 14


class Passkey(Task):
    """Passkey retrieval: find the k digits after KEY in a filler haystack and repeat them."""

    name = "passkey"
    head = "token"

    def __init__(self, seq_len: int, num_digits: int = 5, num_filler: int = 8) -> None:
        check_int("seq_len", seq_len, minimum=1)
        num_digits = check_int("num_digits", num_digits, minimum=1)
        num_filler = check_int("num_filler", num_filler, minimum=1)
        if seq_len < 2 * num_digits + 2:
            raise too_short(seq_len, 2 * num_digits + 2, f"num_digits={num_digits}")
        super().__init__(seq_len, num_digits=num_digits, num_filler=num_filler)
        self.num_digits, self.num_filler = num_digits, num_filler
        self.vocab_size = FIRST_FILLER + num_filler
        self.num_classes = self.vocab_size

    def sample(self, n: int, seed: int) -> Batch:
        """Draw `n` passkey sequences (see the module docstring for the layout)."""
        gen = self._check_sample_args(n, seed)
        L, k = self.seq_len, self.num_digits
        H = L - k - 1
        starts = H - k  # number of possible key-block starts
        inputs = torch.randint(FIRST_FILLER, self.vocab_size, (n, L), generator=gen)
        digits = torch.randint(0, 10, (n, k), generator=gen) + DIGIT0
        s = torch.randint(0, starts, (n, 1), generator=gen)

        inputs.scatter_(1, s, KEY)
        inputs.scatter_(1, s + 1 + torch.arange(k), digits)
        inputs[:, H] = QUERY
        inputs[:, H + 1 :] = ANSWER
        targets = torch.full((n, L), IGNORE, dtype=torch.int64)
        targets[:, H + 1 :] = digits

        tenth = torch.zeros(n, L, dtype=torch.int64)
        tenth[:, H + 1 :] = (10 * s) // starts
        digit = torch.zeros(n, L, dtype=torch.int64)
        digit[:, H + 1 :] = torch.arange(k)
        return Batch(
            inputs=inputs,
            targets=targets,
            padding_mask=None,
            slices={"depth": tenth, "digit": digit},
            meta={"depth": s.squeeze(1).to(torch.float64) / starts, "key_start": s.squeeze(1)},
        )


def solve(tokens: list[int], num_digits: int) -> list[int]:
    """Independent checker: read the digits after KEY, answer them after QUERY."""
    key = tokens.index(KEY)
    digits = tokens[key + 1 : key + 1 + num_digits]
    query = tokens.index(QUERY)
    out = [IGNORE] * len(tokens)
    out[query + 1 : query + 1 + num_digits] = digits
    return out
