"""Test session settings. Shared helpers live in helpers.py."""

import torch

# Two threads: the CI machine has two cores, and oversubscription makes small ops slower.
torch.set_num_threads(min(torch.get_num_threads(), 2))
