"""Attention modules: ``MultiHeadAttention`` (``multi_head``, what ``zoo.create_attention`` builds
around any variant) and those with parameters of their own (NSA)."""
