"""Attention modules with parameters of their own (NSA)."""
