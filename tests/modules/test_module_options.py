"""The module's options fail at construction, naming the option, the value and what it takes."""

from __future__ import annotations

import pytest

import zoo


@pytest.mark.parametrize(
    "option, error, message",
    [
        ({"backend": "nosuch"}, ValueError, "unknown backend 'nosuch'"),
        ({"backend": 3}, TypeError, "backend must be 'auto', a name from zoo.list_backends()"),
        ({"bias": "False"}, TypeError, "bias must be True or False, got 'False'"),
        ({"cp_order": "bogus"}, ValueError, "cp_order must be one of"),
    ],
)
def test_a_bad_option_fails_at_construction(option, error, message):
    """These were accepted: a misspelt backend failed at the first plain forward (never with
    return_weights=True), bias="False" built biased projections, and cp_order failed only once a
    process group was given."""
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        zoo.create_attention("local", dim=16, num_heads=2, **option)
