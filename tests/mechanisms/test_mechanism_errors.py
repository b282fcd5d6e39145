"""What mechanisms refuse, and how they enter the registry: each error names the argument, the
value and the way out (zoo/mechanisms/, zoo/registry/__init__.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import random_qkv
from test_mechanisms import MECHANISMS

import zoo
from zoo.registry import Registry


@pytest.fixture
def qkv():
    return [t.detach() for t in random_qkv(1, 2, 16, 16)]


@pytest.mark.parametrize("name", MECHANISMS)
def test_declared_capabilities_are_what_the_call_accepts(name, qkv):
    """causal and Lq != Lk run exactly where the class declares them; elsewhere a ValueError
    names the mechanism."""
    cls = zoo.get_mechanism_spec(name).mechanism_class()
    mech = zoo.get_mechanism_spec(name).build(num_heads=2, head_dim=16)
    q, k, v = qkv
    for causal, q_len in ((True, 16), (False, 8)):
        declared = cls.causal if causal else cls.cross
        if declared:
            out = zoo.attention(q[:, :, :q_len], k, v, variant=mech, causal=causal)
            assert out.shape == (1, 2, q_len, 16)
        else:
            with pytest.raises(ValueError, match=f"mechanism '{name}'"):
                zoo.attention(q[:, :, :q_len], k, v, variant=mech, causal=causal)


@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(pos="alibi"), r"pos='alibi' adds a bias to the scores .* never forms the scores"),
        (dict(pos="t5"), r"pos='t5' adds a bias .*use pos='rope'"),
        (dict(backend="flex"), r"computes attention itself, with no backend; got backend='flex'"),
        (dict(dropout_p=0.1), r"forms no attention weights to drop, got dropout_p=0.1"),
        (dict(return_weights=True), r"never forms the \(Lq, Lk\) weights"),
    ],
)
def test_what_no_mechanism_does_is_refused(name, options, message, qkv):
    mech = zoo.get_mechanism_spec(name).build(num_heads=2, head_dim=16)
    if options.get("pos") == "t5":
        options = {**options, "pos": zoo.build_encoding("t5", dim=32, num_heads=2)}
    with pytest.raises(ValueError, match=message):
        zoo.attention(*qkv, variant=mech, **options)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            dict(variant="linformer"),
            ValueError,
            r"mechanism 'linformer' has learned parameters \(key_proj, value_proj\).*"
            r"zoo.create_attention\('linformer'",
        ),
        (
            dict(variant="nystrom", conv_kernel=33),
            ValueError,
            r"learned parameters \(conv.weight\)",
        ),
        (dict(variant="nystrom", conv_kernel=4), ValueError, r"conv_kernel must be odd.*got 4"),
        (
            dict(variant="performer", redraw_interval=100),
            ValueError,
            r"redraw_interval=100 counts a module's training calls.*functional call",
        ),
        (dict(variant="linear", scale=0.5), ValueError, r"'linear' has no score scale.*scale=None"),
        (dict(variant="nystrom", causal=True), ValueError, r"'nystrom' is non-causal only"),
        (
            dict(variant="performer", num_feature=8),
            TypeError,
            r"mechanism 'performer' has no parameter 'num_feature'.*did you mean 'num_features'",
        ),
        (
            dict(variant="perfomer"),
            ValueError,
            r"unknown variant 'perfomer'; did you mean 'performer'",
        ),
        (dict(variant="performer", num_features=0), ValueError, r"num_features must be positive"),
    ],
)
def test_functional_refusals_say_why(kwargs, error, message, qkv):
    with pytest.raises(error, match=message):
        zoo.attention(*qkv, **kwargs)


def test_linformer_refuses_keys_longer_than_max_len():
    module = zoo.create_attention("linformer", dim=32, num_heads=2, max_len=16, proj_len=8)
    module(torch.randn(1, 16, 32))
    with pytest.raises(ValueError, match=r"max_len=16 keys, got kv_len=17; build it with max_len"):
        module(torch.randn(1, 17, 32))


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("linformer", dict(causal=True), r"'linformer' is non-causal only"),
        ("performer", dict(pos="alibi"), r"pos='alibi' adds a bias"),
        ("linear", dict(backend="sdpa"), r"no backend; got backend='sdpa'"),
        ("linear", dict(dropout=0.1), r"got dropout=0.1"),
        ("linear", dict(score="additive"), r"dot product only, got score='additive'"),
        ("nystrom", dict(num_landmark=8), r"no parameter 'num_landmark'.*'num_landmarks'"),
    ],
)
def test_module_refuses_at_construction(name, options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        zoo.create_attention(name, dim=32, num_heads=2, **options)


def test_module_refuses_weights_it_never_forms():
    module = zoo.create_attention("linear", dim=32, num_heads=2)
    with pytest.raises(ValueError, match="never forms the"):
        module(torch.randn(1, 8, 32), return_weights=True)


def test_listings_keep_the_two_kinds_apart():
    assert set(MECHANISMS) == {"linear", "performer", "linformer", "nystrom"}
    assert not set(MECHANISMS) & set(zoo.list_variants())
    assert zoo.list_attention() == sorted(zoo.list_variants() + MECHANISMS)
    assert zoo.list_attention("lin*") == ["linear", "linformer"]
    with pytest.raises(ValueError, match=r"'performer' is a mechanism.*no pattern, mask"):
        zoo.dense_mask("performer", 8)


def write(tmp_path, text):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "mechanisms:\n  full: {mechanism: linear}\n",
            r"mechanism 'full' is already defined in .*registry.yaml; give it another name",
        ),
        (
            "mechanisms:\n  mine: {mechanism: lineer}\n",
            r"unknown mechanism class 'lineer'.*'linear'",
        ),
        ("mechanisms:\n  mine: {mechanism: linear, params: {chunk: 8}}\n", r"no parameter 'chunk'"),
        (
            "mechanisms:\n  mine: {params: {chunk_size: 8}}\n",
            r"mechanism 'mine': needs 'mechanism'",
        ),
        (
            "mechanisms:\n  mine: {mechanism: linear, window: 3}\n",
            r"mechanism 'mine': unknown key 'window'",
        ),
        (
            "mechanisms:\n  mine: {mechanism: 'nowhere_pkg.mod:Cls'}\n",
            None,  # recorded as unavailable; using it raises
        ),
    ],
)
def test_registry_file_errors_name_the_entry(tmp_path, text, message):
    registry = Registry()
    registry.load(zoo.registry.BUILTIN_REGISTRY)
    path = write(tmp_path, text)
    if message is None:
        registry.load(path)
        assert "mine" in registry.unavailable["mechanisms"]
        return
    with pytest.raises(ValueError, match=message):
        registry.load(path)


def test_a_users_mechanism_entry_runs_through_every_door(tmp_path, monkeypatch):
    path = write(
        tmp_path,
        "mechanisms:\n  linear_c4:\n    mechanism: linear\n    params: {chunk_size: 4}\n"
        "    description: Linear attention in chunks of 4.\n",
    )
    fresh = Registry()
    fresh.load(zoo.registry.BUILTIN_REGISTRY)
    fresh.load(path)
    monkeypatch.setattr(zoo.registry, "_registry", fresh)
    q, k, v = [t.detach() for t in random_qkv(1, 2, 10, 10)]
    out = zoo.attention(q, k, v, variant="linear_c4", causal=True)
    torch.testing.assert_close(out, zoo.attention(q, k, v, variant="linear", causal=True))
    module = zoo.create_attention("linear_c4", dim=32, num_heads=2)
    assert module.mechanism.chunk_size == 4 and module.mechanism.name == "linear_c4"
    assert "linear_c4" in zoo.list_mechanisms()


def test_explain_says_what_a_mechanism_computes_or_why_the_call_is_refused():
    """zoo.explain on a mechanism: what zoo.attention computes for the call (the mechanism, its
    parameters, a rotary encoding), or the reason that attention refuses it, the same words;
    explain raised for every mechanism ('has no pattern, mask or backend') though attention ran
    it."""
    q = torch.randn(1, 2, 32, 8)
    said = zoo.explain(q, q, q, variant="performer", causal=True, pos="rope", num_features=16)
    assert said.startswith("'performer' is a mechanism (FAVOR+") and "num_features=16" in said
    assert "with no pattern, mask or backend; causal; q and k turned by 'rope' first" in said
    zoo.attention(q, q, q, variant="performer", causal=True, pos="rope", num_features=16)
    for kwargs in ({"variant": "linformer"}, {"variant": "linear", "pos": "alibi"},
                   {"variant": "performer", "dropout_p": 0.1}):  # fmt: skip
        with pytest.raises((TypeError, ValueError)) as refused:
            zoo.attention(q, q, q, **kwargs)
        assert zoo.explain(q, q, q, **kwargs).endswith(f"this call is refused: {refused.value}")
