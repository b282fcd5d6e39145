"""``zoo.attention`` goes down, not back and forth: name -> pattern (``zoo.core.resolve``) ->
checked call (``zoo.core.prepare``) -> backend, entering the front door's module once."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

import zoo
from zoo.core.resolve import CALL_OPTIONS


def test_call_options_are_the_keyword_options_of_attention():
    signature = inspect.signature(zoo.attention).parameters.values()
    assert tuple(p.name for p in signature if p.kind == p.KEYWORD_ONLY) == CALL_OPTIONS


def modules_entered(run) -> list[str]:
    """The zoo modules whose code runs, in order, each run of consecutive calls once."""
    order: list[str] = []

    def tracer(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("zoo") and (not order or order[-1] != name):
                order.append(name)

    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(None)
    return order


@pytest.mark.parametrize("backend", ["blocked", "sdpa"])
def test_a_call_enters_the_front_door_once(backend):
    q = torch.randn(1, 2, 300, 16)

    def call():
        return zoo.attention(q, q, q, variant="longformer", backend=backend)

    call()  # the shape's structures built
    order = modules_entered(call)
    assert order[0] == "zoo.functional" and order.count("zoo.functional") == 1, order
