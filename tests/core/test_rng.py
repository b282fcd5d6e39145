"""The zoo draws from torch's global generator only where a user asked for randomness: weights at
module creation and dropout. Loading the registry, random patterns and functional calls do not."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import zoo
from zoo.patterns import Random
from zoo.registry import BUILTIN_REGISTRY, Registry


def test_seeded_module_creation_is_the_same_the_first_time_and_later():
    # A fresh process: the first create_attention also loads the registry.
    script = textwrap.dedent(
        """
        import torch, zoo
        torch.manual_seed(0)
        first = zoo.create_attention("local", dim=32, num_heads=2)
        torch.manual_seed(0)
        second = zoo.create_attention("local", dim=32, num_heads=2)
        for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
            assert torch.equal(a, b), f"{name} differs by {(a - b).abs().max():.3g}"
        print("same")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "same"


def test_loading_the_registry_leaves_the_global_rng_alone():
    torch.manual_seed(1)
    before = torch.get_rng_state()
    Registry().load(BUILTIN_REGISTRY)  # the built-in file, as on first access
    assert torch.equal(torch.get_rng_state(), before)


def test_first_access_to_the_registry_leaves_the_global_rng_alone():
    script = textwrap.dedent(
        """
        import torch, zoo
        torch.manual_seed(0)
        before = torch.get_rng_state()
        zoo.list_variants()
        assert torch.equal(torch.get_rng_state(), before), "loading the registry drew"
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_random_patterns_and_calls_leave_the_global_rng_alone():
    zoo.list_variants()  # the registry is loaded; see the tests above for its load
    q = torch.randn(1, 2, 200, 8)
    torch.manual_seed(2)
    before = torch.get_rng_state()
    Random(block_size=16, num_blocks=2, seed=3).specialize(200, 200)
    zoo.get_spec("bigbird").build(block_size=16).specialize(200, 200)
    zoo.attention(q, q, q, variant="bigbird", block_size=16)
    zoo.attention(q, q, q, variant="random", block_size=16, backend="blocked")
    zoo.dense_mask("bigbird", 100, block_size=16)
    zoo.explain(q, q, q, variant="bigbird", block_size=16)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_functional_call_refusing_a_learned_encoding_draws_nothing():
    zoo.list_variants()
    q = torch.randn(1, 2, 16, 8)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    for pos in ("learned", "t5"):
        with pytest.raises(ValueError, match="has learned parameters"):
            zoo.attention(q, q, q, variant="full", pos=pos)
    assert torch.equal(torch.get_rng_state(), before)
