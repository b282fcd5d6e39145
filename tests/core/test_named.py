"""One way to register: patterns, mechanisms, encodings and backends are each kept in a
``zoo.core.named.Named``, which raises on a name taken by another thing (unless replace=True),
accepts the same thing twice, and suggests the nearest names for an unknown one."""

from __future__ import annotations

import pytest
import torch

import zoo
from zoo.backends import SdpaBackend
from zoo.core.named import Named
from zoo.mechanisms import MECHANISMS, LinearAttention
from zoo.patterns.families import _FAMILIES
from zoo.positional import ENCODINGS, RotaryEncoding


def test_a_named_table():
    table = Named("widget", "list_widgets()")
    thing = object()
    assert table.add("spanner", thing) is thing
    assert table.add("spanner", thing) is thing  # the same thing again: fine
    with pytest.raises(ValueError, match=r"widget 'spanner' is already registered \(by builtins\)"):
        table.add("spanner", object())
    other = object()
    table.add("spanner", other, replace=True)
    assert table.lookup("spanner") is other
    with pytest.raises(ValueError, match=r"did you mean 'spanner'\?.*list_widgets\(\)"):
        table.lookup("spaner")
    assert isinstance(table.copy(), Named) and table.copy() == table


class Rotary2(RotaryEncoding):
    pass


class Linear2(LinearAttention):
    pass


class Sdpa2(SdpaBackend):
    pass


@pytest.mark.parametrize(
    ("register", "table", "name", "thing"),
    [
        (lambda thing, **kw: zoo.register_pattern("local", **kw)(thing), _FAMILIES, "local",
         lambda **kw: zoo.patterns.Local(3)),
        (zoo.register_encoding, ENCODINGS, "rope", Rotary2),
        (zoo.register_mechanism, MECHANISMS, "linear", Linear2),
        (zoo.register_backend, zoo.backends._BACKENDS, "sdpa", Sdpa2()),
    ],
)  # fmt: skip
def test_every_register_raises_on_a_taken_name_and_replaces_on_request(
    register, table, name, thing
):
    before = table[name]
    with pytest.raises(ValueError, match=rf"'{name}' is already registered \(by "):
        register(thing)
    assert table[name] is before
    try:
        register(thing, replace=True)
        assert table[name] is thing
    finally:
        table[name] = before


class NoCapabilities(zoo.Backend):
    name = "no_capabilities"

    def forward(self, call):
        return call.v, None


class Unnamed(zoo.Backend):
    capabilities = SdpaBackend.capabilities


def test_register_backend_refuses_a_backend_without_name_or_capabilities():
    """A backend lacking capabilities registered, and then every call refused by any backend
    raised AttributeError from the listing of backends that can; one lacking a name raised
    AttributeError; lone values in Capabilities failed in each call, or (patterns) meant any."""
    with pytest.raises(TypeError, match=r"backend 'no_capabilities' needs capabilities, a zoo"):
        zoo.register_backend(NoCapabilities())
    assert "no_capabilities" not in zoo.list_backends()
    with pytest.raises(ValueError, match=r"Unnamed needs a name, a str other than 'auto'"):
        zoo.register_backend(Unnamed())
    floats = (torch.float32,)
    with pytest.raises(TypeError, match=r"devices must be a tuple of str, got 'cpu'"):
        zoo.Capabilities(devices="cpu", backward=(), dtypes=floats, patterns="any")
    with pytest.raises(TypeError, match=r"dtypes must be a tuple of torch dtypes"):
        zoo.Capabilities(devices=("cpu",), backward=(), dtypes=torch.float32, patterns="any")
    with pytest.raises(ValueError, match=r"patterns must be 'any' .* or 'dense' .*'sparse'"):
        zoo.Capabilities(devices=("cpu",), backward=(), dtypes=floats, patterns="sparse")


class HalfOnly(zoo.Backend):
    """Runs what no built-in backend takes in this test: the built-ins refuse float16 here."""

    name = "half_only_demo"
    capabilities = zoo.Capabilities(
        devices=("cpu",), backward=("cpu",), dtypes=(torch.float16,), patterns="any"
    )

    def forward(self, call):
        ref = zoo.attention(*(t.float() for t in (call.q, call.k, call.v)), variant="local",
                            window_size=4, backend="reference")  # fmt: skip
        return ref.to(call.q.dtype), None


def test_auto_runs_a_call_that_only_a_registered_backend_can(monkeypatch):
    """auto's fallback orders end with every other registered backend: a call that none of the
    built-in orders can run runs on a user's backend that declares it, where auto refused it
    ("no backend can run this call") though a named backend's refusal listed that one as able."""
    from zoo.backends import base

    real = base.Capabilities.reason_against

    def no_half(self, call):
        if self is not HalfOnly.capabilities and call.q.dtype == torch.float16:
            return "no float16 in this test"
        return real(self, call)

    monkeypatch.setattr(base.Capabilities, "reason_against", no_half)
    q = torch.randn(1, 2, 16, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="no backend can run this call"):
        zoo.attention(q, q, q, variant="local", window_size=4)
    zoo.register_backend(HalfOnly(), replace=True)
    try:
        out = zoo.attention(q, q, q, variant="local", window_size=4)
        assert "auto -> half_only_demo" in zoo.explain(q, q, q, variant="local", window_size=4)
    finally:
        zoo.backends._BACKENDS.pop("half_only_demo", None)
        zoo.backends.clear_caches()  # no plan keeps the backend taken out
    ref = zoo.attention(q.float(), q.float(), q.float(), variant="local", window_size=4,
                        backend="reference")  # fmt: skip
    assert torch.allclose(out.float(), ref, atol=1e-3)
