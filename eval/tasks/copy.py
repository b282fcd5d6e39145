"""Copying: repeat a random token string after a separator.

* Token ids: 0 PAD (never emitted), 1 BLANK, 2 SEP, 3 ANSWER slot, 4..V-1 data symbols, where
  V = ``vocab_size`` (default 16, so 12 data symbols). Targets are token ids and
  num_classes = V.
* Layout of one sequence of length L with M = ``num_tokens`` (default (L - 1) // 2, the most
  that fits)::

      BLANK x r   x_1 ... x_M   SEP   ANSWER x M        with r = L - 2*M - 1 >= 0

  The data x_i are uniform i.i.d. symbols. The r leading BLANKs (0 or 1 with the default M)
  fill the length exactly without padding, so ``padding_mask`` is None. The target at the
  i-th ANSWER slot is x_i; all other targets are IGNORE. The answer slots never hold data, so
  nothing leaks to bidirectional models. Needs seq_len >= 2*M + 1.
* Slices: "index" = i - 1 for the i-th output (zero-based), bucketed to powers of two (lower
  bound): 0, 1, 2-3 -> 2, 4-7 -> 4, ...
* ``feed_answers=True`` (default False): the autoregressive layout, for generation. Answer slot
  i > 1 holds the previous answer x_{i-1} instead of ANSWER; the first keeps ANSWER, the start
  of the output. Targets and slices are unchanged::

      BLANK x r   x_1 ... x_M   SEP   ANSWER x_1 ... x_{M-1}

  Training reads the true previous answer (teacher forcing, as a language model is trained);
  greedy generation feeds the model's own prediction of slot i - 1 into slot i, so an error
  can carry on (``eval.harness.train``'s generation check). Only a causal model should see
  it: a bidirectional one reads each answer in the next slot.

Speed: 1000 sequences of length 1024 take about 0.01 s on 2 CPU cores (4096: about 0.02 s).
"""

from __future__ import annotations

import torch

from .base import IGNORE, Batch, Task, check_bool, check_int, pow2_bucket, too_short

BLANK, SEP, ANSWER, FIRST_DATA = 1, 2, 3, 4


class Copy(Task):
    """Copying: after SEP, emit the M data tokens that preceded it, in order."""

    name = "copy"
    head = "token"

    def __init__(
        self,
        seq_len: int,
        num_tokens: int | None = None,
        vocab_size: int = 16,
        feed_answers: bool = False,
    ) -> None:
        check_int("seq_len", seq_len, minimum=1)
        if num_tokens is None:
            num_tokens = max(1, (seq_len - 1) // 2)
        num_tokens = check_int("num_tokens", num_tokens, minimum=1)
        vocab_size = check_int("vocab_size", vocab_size, minimum=FIRST_DATA + 1)
        if seq_len < 2 * num_tokens + 1:
            raise too_short(seq_len, 2 * num_tokens + 1, f"num_tokens={num_tokens}")
        check_bool("feed_answers", feed_answers)
        params = {"feed_answers": True} if feed_answers else {}  # records as before when off
        super().__init__(seq_len, num_tokens=num_tokens, **params)
        self.num_tokens = num_tokens
        self.feed_answers = feed_answers
        self.vocab_size = vocab_size
        self.num_classes = vocab_size

    def sample(self, n: int, seed: int) -> Batch:
        """Draw `n` copy sequences (see the module docstring for the layout)."""
        gen = self._check_sample_args(n, seed)
        L, M = self.seq_len, self.num_tokens
        r = L - 2 * M - 1
        data = torch.randint(FIRST_DATA, self.vocab_size, (n, M), generator=gen)
        inputs = torch.full((n, L), BLANK, dtype=torch.int64)
        inputs[:, r : r + M] = data
        inputs[:, r + M] = SEP
        inputs[:, r + M + 1 :] = ANSWER
        if self.feed_answers:  # slot i holds answer i - 1; the first keeps ANSWER
            inputs[:, r + M + 2 :] = data[:, :-1]
        targets = torch.full((n, L), IGNORE, dtype=torch.int64)
        targets[:, r + M + 1 :] = data
        index = torch.zeros(n, L, dtype=torch.int64)
        index[:, r + M + 1 :] = pow2_bucket(torch.arange(M))
        return Batch(inputs=inputs, targets=targets, padding_mask=None, slices={"index": index})


def solve(tokens: list[int], feed_answers: bool = False) -> list[int]:
    """Independent checker: the tokens between the leading blanks and SEP, answered after SEP.
    With ``feed_answers``, each answer but the last is read from the slot after it instead (the
    fed layout puts answer i in slot i + 1), and the first slot must hold ANSWER."""
    sep = tokens.index(SEP)
    data = [t for t in tokens[:sep] if t != BLANK]
    out = [IGNORE] * len(tokens)
    for i, t in enumerate(data):
        out[sep + 1 + i] = t
    if feed_answers:
        assert tokens[sep + 1] == ANSWER, "the first answer slot holds ANSWER"
        out[sep + 1 : len(tokens) - 1] = tokens[sep + 2 :]
    return out
