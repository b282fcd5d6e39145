"""The attention zoo: efficient attention variants behind one interface.

>>> import zoo
>>> attn = zoo.create_attention("bigbird", dim=512, num_heads=8)   # (B, L, 512) -> (B, L, 512)
>>> out = zoo.attention(q, k, v, variant="longformer", causal=True)  # (B, H, L, D), like SDPA
>>> out = zoo.attention(q, k, v, variant="performer", causal=True)  # a mechanism, same call
>>> zoo.list_variants("*local*"), zoo.list_mechanisms()
"""

from .backends import Backend, Capabilities, get_backend, list_backends, register_backend
from .core.scores import AdditiveScore
from .decoding.cache import KVCache
from .decoding.generation import new_cache
from .functional import attention, build_encoding, dense_mask, explain
from .layout.block_layout import allowed_pairs
from .mechanisms import Mechanism, register_mechanism
from .modules.multi_head import MultiHeadAttention, create_attention
from .patterns import Pattern, list_families, register_pattern
from .positional import PositionalEncoding, register_encoding
from .registry import (
    VariantSpec,
    get_encoding_spec,
    get_mechanism_spec,
    get_module_spec,
    get_spec,
    list_attention,
    list_encodings,
    list_mechanisms,
    list_modules,
    list_variants,
    load_registry,
)
from .testing.pattern_views import PatternCheckError, check_pattern

list_pattern_families = list_families

__all__ = [
    "AdditiveScore",
    "Backend",
    "Capabilities",
    "KVCache",
    "Mechanism",
    "MultiHeadAttention",
    "Pattern",
    "PatternCheckError",
    "PositionalEncoding",
    "VariantSpec",
    "allowed_pairs",
    "attention",
    "build_encoding",
    "check_pattern",
    "create_attention",
    "dense_mask",
    "explain",
    "get_backend",
    "get_encoding_spec",
    "get_mechanism_spec",
    "get_module_spec",
    "get_spec",
    "list_attention",
    "list_backends",
    "list_encodings",
    "list_mechanisms",
    "list_modules",
    "list_pattern_families",
    "list_variants",
    "load_registry",
    "new_cache",
    "register_backend",
    "register_encoding",
    "register_mechanism",
    "register_pattern",
]
