"""A small transformer built only from zoo parts, its attention and positions chosen by name.

token ids -> embedding (+ an absolute encoding, if the encoding is of kind "embed")
          -> depth x [x + attention(norm(x)); x + mlp(norm(x))]   (pre-norm blocks)
          -> norm -> per-token logits (head "token") or mean-pooled logits (head "sequence")

Rotary and bias encodings act inside every layer's attention; one instance is shared by all
layers, as T5 shares its relative bias table. ``mlp_dim=0`` leaves the MLP out (Zoology's MQAR
models have none).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import zoo


class Block(nn.Module):
    def __init__(self, dim: int, attention: zoo.MultiHeadAttention, mlp_dim: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = attention
        self.norm2 = nn.LayerNorm(dim) if mlp_dim else None
        self.mlp = (
            nn.Sequential(
                nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim), nn.Dropout(dropout)
            )
            if mlp_dim
            else None
        )

    def forward(self, x: Tensor, key_padding_mask: Tensor | None, **attention: object) -> Tensor:
        x = x + self.attention(self.norm1(x), key_padding_mask=key_padding_mask, **attention)
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x


class SequenceModel(nn.Module):
    """Embedding, ``depth`` blocks of zoo attention, and a classification head.

    Args:
        vocab_size, num_classes: the task's sizes; ``head`` is "token" or "sequence".
        variant, variant_params: the attention pattern, by registry name.
        encoding, encoding_params: the positional encoding, by registry name.
        causal, backend, attention_dropout: passed to every zoo.MultiHeadAttention.
        kv_heads: key/value heads of grouped-query attention (None: heads).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        num_classes: int,
        head: str,
        dim: int = 64,
        depth: int = 2,
        heads: int = 2,
        kv_heads: int | None = None,
        mlp_dim: int = 128,
        dropout: float = 0.0,
        variant: str = "full",
        variant_params: dict | None = None,
        encoding: str = "none",
        encoding_params: dict | None = None,
        causal: bool = False,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if head not in ("token", "sequence"):
            raise ValueError(f"head must be 'token' or 'sequence', got {head!r}")
        self.head = head
        self.embedding = nn.Embedding(vocab_size, dim)
        self.pos = zoo.build_encoding(
            encoding, dim=dim, num_heads=heads, causal=causal, **(encoding_params or {})
        )
        in_attention = self.pos if self.pos.kind in ("rotate", "bias") else "none"

        def attention() -> nn.Module:
            if variant in zoo.list_modules():  # a mechanism with parameters of its own (nsa)
                return zoo.create_attention(
                    variant, dim=dim, num_heads=heads, num_kv_heads=kv_heads, backend=backend,
                    causal=causal,
                    **(variant_params or {}),
                )  # fmt: skip
            return zoo.MultiHeadAttention(
                dim,
                heads,
                num_kv_heads=kv_heads,
                variant=variant,
                pos=in_attention,
                backend=backend,
                dropout=dropout,
                causal=causal,
                **(variant_params or {}),
            )

        self.blocks = nn.ModuleList(Block(dim, attention(), mlp_dim, dropout) for _ in range(depth))
        # The attention inputs its variant reads: a graph's edges, or none.
        graph = variant in zoo.list_variants() and zoo.patterns.reads_graph(
            zoo.get_spec(variant).build()
        )
        self.reads = ("edge_index",) if graph else ()
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, num_classes)

    def forward(
        self, tokens: Tensor, padding_mask: Tensor | None = None, **attention_inputs: object
    ) -> Tensor:
        """tokens (B, L) -> logits (B, L, classes) for "token", (B, classes) for "sequence".
        ``attention_inputs`` (a graph's ``edge_index``) go to every attention layer whose
        variant reads them; the others never see them (a full-attention baseline on a graph task
        sees the tokens alone)."""
        x = self.embedding(tokens)  # (B, L, dim)
        if self.pos.kind == "embed":
            x = self.pos.embed(x)
        attention = {k: v for k, v in attention_inputs.items() if k in self.reads}
        for block in self.blocks:
            x = block(x, padding_mask, **attention)
        x = self.norm(x)
        if self.head == "sequence":
            keep = (
                torch.ones_like(tokens, dtype=x.dtype)
                if padding_mask is None
                else (~padding_mask).to(x.dtype)
            )
            x = (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp(min=1)  # (B, dim)
        return self.output(x)

    @torch.no_grad()
    def decode(self, tokens: Tensor, prefill: int, *, greedy: bool = False) -> Tensor:
        """Token logits (B, L, classes) as generation computes them: ``tokens[:, :prefill]`` in
        one call, then one token at a time, each layer attending its ``KVCache``.

        ``greedy=False`` reads every input from ``tokens``: equal to ``forward(tokens)`` for a
        causal model. ``greedy=True`` generates: the input at each position after ``prefill``
        is the argmax of the logits at the position before it, the model's own prediction
        (tokens at ``prefill`` and before are the prompt)::

            tokens   p0 p1 p2 | p3  .   .        prefill=3: p0..p2 in one call, then p3
            inputs   p0 p1 p2 | p3  y3  y4       y_i = argmax(logits[:, i])
        """
        if self.head != "token" or not self.blocks[0].attention.causal:
            raise ValueError("decode needs a causal model with a token head")
        batch, length = tokens.shape
        caches = [b.attention.new_cache(batch, length) for b in self.blocks]
        logits, start = [], 0
        for stop in [prefill, *range(prefill + 1, length + 1)]:
            inputs = tokens[:, start:stop]
            if greedy and start > prefill:
                inputs = logits[-1][:, -1:].argmax(-1)  # (B, 1) the previous prediction
            x = self.embedding(inputs)
            if self.pos.kind == "embed":  # every row is at the same position here
                x = self.pos.embed(x, start)
            for block, cache in zip(self.blocks, caches, strict=True):
                x = x + block.attention(block.norm1(x), cache=cache)
                if block.mlp is not None:
                    x = x + block.mlp(block.norm2(x))
            logits.append(self.output(self.norm(x)))
            start = stop
        return torch.cat(logits, 1)

    @torch.no_grad()
    def attention_weights(self, tokens: Tensor, padding_mask: Tensor | None, layer: int) -> Tensor:
        """The (B, H, L, L) attention weights of block ``layer`` on these tokens."""
        if not 0 <= layer < len(self.blocks):
            raise ValueError(f"layer must be in [0, {len(self.blocks) - 1}], got {layer}")
        x = self.embedding(tokens)
        if self.pos.kind == "embed":
            x = self.pos.embed(x)
        for block in self.blocks[:layer]:
            x = block(x, padding_mask)
        block = self.blocks[layer]
        return block.attention(block.norm1(x), key_padding_mask=padding_mask, return_weights=True)[
            1
        ]

    def check_length(self, length: int) -> None:
        """Raise ValueError if the positional encoding cannot serve sequences of ``length``."""
        self.pos.check(q_len=length, kv_len=length, head_dim=self.blocks[0].attention.head_dim)
