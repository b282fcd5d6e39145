"""Bridges from the zoo to other libraries, each an optional extra imported only when used.

- ``zoo.integrations.transformers``: zoo variants as Hugging Face transformers attention
  implementations (``pip install -e ".[hf]"``).
"""
