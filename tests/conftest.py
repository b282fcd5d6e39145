"""Test session settings. Shared helpers live in helpers.py."""

import os

import torch

# Two threads: the CI machine has two cores, and oversubscription makes small ops slower. Under
# pytest-xdist (`pytest -n auto`, the README's command) each worker is one process per core, so
# each takes one thread.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(torch.get_num_threads(), 2))
