"""Multi-query associative recall (MQAR), after Zoology (Arora et al. 2023).

Layout of one sequence of length L with kv key-value pairs::

    k_1 v_1 k_2 v_2 ... k_kv v_kv | query region of length L - 2*kv

* Token ids: 0 is PAD (never emitted); keys come from [1, V//2) and values from [V//2, V),
  where V = ``vocab_size``. Keys are distinct within a sequence (drawn without replacement),
  and so are values, as in the Zoology generator.
* Every key is asked again exactly once in the query region, at offset ``2*(g-1)`` from the
  region's start for a gap index g in 1..S, S = (L - 2*kv) // 2. The kv gap indices of a
  sequence are drawn without replacement with probability proportional to ``a * g**(a-1)``
  (``power_a`` = a; 0.01 by default, so short gaps dominate; a = 1 is uniform). This is the
  Zoology rule: its zero-based choice index i puts the query at offset 2*i with weight of g=i+1.
  Sampling without replacement uses the Gumbel-top-k trick (equivalent to drawing one by one).
* The target is the key's value, placed at the position of the repeated key (the model must
  emit the value on seeing the key again, i.e. next-token prediction); all else is IGNORE.
* Every other position of the query region holds a random filler token, uniform over
  [1, V) minus this sequence's keys (Zoology's ``random_non_queries=True`` fills from the whole
  vocabulary; we exclude the keys so a filler can never be mistaken for a query, and exclude
  PAD). Fillers may equal values, which are never queried.
* Defaults: V = 8192, kv = max(1, seq_len // 16) (Zoology's sweep pairs 64/128/256 with
  4/8/16), power_a = 0.01. Pass ``num_kv_pairs`` explicitly to hold it fixed across lengths.
  Validation: 4*kv <= seq_len (the query region must have at least kv gap slots) and
  kv <= V//2 - 1 (distinct keys must fit). V > seq_len is not required.
* Slices: "gap" is the distance in tokens from the key's first occurrence to its query,
  bucketed to powers of two (the bucket's lower bound: 2, 4, 8, ...); "num_kv_pairs" is kv.
* ``kv_layout="spread"`` (not Zoology's; default "front", the layout above): the pairs sit at
  random even positions of the first half (kv distinct pair slots of the L//4 there, fillers
  between them), the query region is the second half, its gaps drawn as above from its start.
  A pair then lies in any block of the first half (two may share one), so a pattern chosen by
  content (MoBA) must find the block that holds the query's key, where the front layout lets it
  learn to choose the first blocks. ``meta["pair_positions"]`` holds each pair's key position.

Speed: 1000 sequences of length 1024 (kv=64) take about 0.08 s on 2 CPU cores; at 4096
(kv=256) about 0.2 s. Key and value draws cost O(n * vocab_size) memory and time.
"""

from __future__ import annotations

import torch

from .base import (
    IGNORE,
    Batch,
    Task,
    check_int,
    check_positive_float,
    pow2_bucket,
    random_choice,
    too_short,
)

LAYOUTS = ("front", "spread")


class MQAR(Task):
    """Multi-query associative recall: recall the value bound to each key asked again."""

    name = "mqar"
    head = "token"

    def __init__(
        self,
        seq_len: int,
        vocab_size: int = 8192,
        num_kv_pairs: int | None = None,
        power_a: float = 0.01,
        kv_layout: str = "front",
    ) -> None:
        check_int("seq_len", seq_len, minimum=1)
        if num_kv_pairs is None:
            num_kv_pairs = max(1, seq_len // 16)
        kv = check_int("num_kv_pairs", num_kv_pairs, minimum=1)
        vocab_size = check_int("vocab_size", vocab_size, minimum=4)
        if kv > vocab_size // 2 - 1:
            raise ValueError(
                f"num_kv_pairs={kv} does not fit vocab_size={vocab_size}: keys are distinct ids "
                f"from [1, {vocab_size // 2}), so num_kv_pairs must be at most "
                f"{vocab_size // 2 - 1}; raise vocab_size or lower num_kv_pairs."
            )
        if 4 * kv > seq_len:
            raise too_short(seq_len, 4 * kv, f"num_kv_pairs={kv} (context plus kv query slots)")
        power_a = check_positive_float("power_a", power_a)
        if kv_layout not in LAYOUTS:
            raise ValueError(f"kv_layout must be one of {LAYOUTS}, got {kv_layout!r}")
        params = {"kv_layout": kv_layout} if kv_layout != "front" else {}  # records as before
        super().__init__(seq_len, num_kv_pairs=kv, power_a=power_a, **params)
        self.kv_layout = kv_layout
        self.vocab_size = vocab_size
        self.num_classes = vocab_size
        self.num_kv_pairs = kv
        self.power_a = power_a

    def sample(self, n: int, seed: int) -> Batch:
        """Draw `n` MQAR sequences (see the module docstring for the layout)."""
        gen = self._check_sample_args(n, seed)
        L, kv, V = self.seq_len, self.num_kv_pairs, self.vocab_size
        half = V // 2
        keys = random_choice(gen, n, half - 1, kv) + 1  # ids 1 .. half-1
        values = random_choice(gen, n, V - half, kv) + half
        if self.kv_layout == "front":
            ctx = 2 * kv  # the query region's start
            pair_pos = 2 * torch.arange(kv).expand(n, kv)
        else:  # kv of the even slots of the first half, in random order
            ctx = L // 2
            pair_pos = 2 * random_choice(gen, n, ctx // 2, kv)

        # Gumbel-top-k: top kv of log(w) + Gumbel noise is a weighted draw without replacement.
        space = (L - ctx) // 2
        g = torch.arange(1, space + 1, dtype=torch.float64)
        log_w = (self.power_a - 1.0) * torch.log(g)  # log(a) is a constant shift; dropped
        u = torch.rand(n, space, generator=gen, dtype=torch.float64).clamp_min(1e-300)
        gaps = (log_w - torch.log(-torch.log(u))).topk(kv, dim=1).indices  # zero-based g - 1
        query_pos = ctx + 2 * gaps  # (n, kv); query j asks key j

        inputs = torch.empty(n, L, dtype=torch.int64)
        if self.kv_layout == "front":
            inputs[:, ctx:] = self._fillers(gen, keys, n, L - ctx)
        else:
            inputs[:] = self._fillers(gen, keys, n, L)
        inputs.scatter_(1, pair_pos, keys)
        inputs.scatter_(1, pair_pos + 1, values)
        inputs.scatter_(1, query_pos, keys)

        targets = torch.full((n, L), IGNORE, dtype=torch.int64)
        targets.scatter_(1, query_pos, values)
        dist = query_pos - pair_pos
        gap_slice = torch.zeros(n, L, dtype=torch.int64)
        gap_slice.scatter_(1, query_pos, pow2_bucket(dist))
        return Batch(
            inputs=inputs,
            targets=targets,
            padding_mask=None,
            slices={"gap": gap_slice, "num_kv_pairs": torch.full((n, L), kv, dtype=torch.int64)},
            meta={"num_kv_pairs": kv, "query_distance": dist, "pair_positions": pair_pos},
        )

    def _fillers(self, gen: torch.Generator, keys: torch.Tensor, n: int, m: int) -> torch.Tensor:
        """(n, m) tokens uniform over [1, V) minus each row's keys, without rejection loops."""
        kv = keys.shape[1]
        # Draw a rank r among the V-1-kv allowed ids, then step over every key at or below it:
        # with sorted zero-based keys s_i, the r-th allowed id is r + #{i : s_i - i <= r}.
        ranks = torch.randint(0, self.vocab_size - 1 - kv, (n, m), generator=gen)
        s = keys.sort(dim=1).values - 1
        below = (s - torch.arange(kv)).contiguous()
        return ranks + torch.searchsorted(below, ranks, right=True) + 1


def solve(
    tokens: list[int], num_kv_pairs: int, pair_positions: list[int] | None = None
) -> list[int]:
    """Independent checker: the targets of one MQAR sequence, recomputed from its tokens.

    Reads the key -> value table from the pairs (the context's first 2 * kv tokens, or the
    pairs at ``pair_positions``, the spread layout's), then marks each later position that
    repeats a key with that key's value. The spread layout's pairs are not told apart from its
    fillers by the tokens alone, so its positions come from the generator's meta.
    """
    if pair_positions is None:
        pair_positions = list(range(0, 2 * num_kv_pairs, 2))
    table = {tokens[i]: tokens[i + 1] for i in pair_positions}
    out = [IGNORE] * len(tokens)
    for pos in range(max(pair_positions) + 2, len(tokens)):
        if tokens[pos] in table:
            out[pos] = table[tokens[pos]]
    return out
