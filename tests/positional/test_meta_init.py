"""A model built on the meta device and materialised (``to_empty`` then ``load_state_dict``, the
way large models are loaded) equals the model it was saved from, for every encoding."""

from __future__ import annotations

import pytest
import torch

import zoo


@pytest.mark.parametrize("pos", ["alibi", "rope", "t5", "sinusoidal", "learned", "none"])
def test_meta_built_model_loads_to_the_same_outputs(pos):
    """ALiBi's slopes are not in the state dict (checkpoints without them load strictly):
    ``to_empty`` left them uninitialised (outputs 0.6 off), and ``assign=True`` left them on meta
    (the forward failed)."""
    torch.manual_seed(0)
    x = torch.randn(1, 16, 32)
    saved = zoo.create_attention("full", dim=32, num_heads=4, pos=pos).eval()
    want = saved(x)
    with torch.device("meta"):
        empty = zoo.create_attention("full", dim=32, num_heads=4, pos=pos).eval()
    empty.to_empty(device="cpu")
    empty.load_state_dict(saved.state_dict())
    assert torch.equal(empty(x), want)
    with torch.device("meta"):
        assigned = zoo.create_attention("full", dim=32, num_heads=4, pos=pos).eval()
    assigned.load_state_dict(saved.state_dict(), assign=True)
    assert torch.equal(assigned(x), want)


def test_an_alibi_encoding_built_in_inference_mode_moves_and_casts():
    """Its slopes, set again on every move or cast, were written in place outside inference
    mode: "Inplace update to inference tensor outside InferenceMode"."""
    from zoo.positional.alibi import AlibiEncoding, alibi_slopes

    with torch.inference_mode():
        encoding = AlibiEncoding(dim=48, num_heads=12)
    encoding.to("cpu").float()
    assert encoding.slopes.tolist() == pytest.approx(alibi_slopes(12))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_alibi_slopes_stay_at_least_float32_when_a_model_is_cast(dtype):
    """In bfloat16 the biases of distances 256 and 257 were equal (-64.0) and 3000's was -752
    for -750: a cast to a narrower float leaves the slopes float32; float64 keeps them wide."""
    module = zoo.MultiHeadAttention(32, 4, pos="alibi", causal=True).to(dtype)
    slopes = module.pos.slopes
    assert slopes.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    distances = torch.tensor([256, 257, 3000])
    bias = module.pos.bias(torch.tensor(0), distances, torch.zeros(3, dtype=torch.long))
    assert bias.tolist() == [-64.0, -64.25, -750.0]
    with torch.inference_mode():  # a cast of a model built there is written there too
        inferred = zoo.MultiHeadAttention(32, 4, pos="alibi", causal=True)
    assert inferred.to(dtype).pos.slopes.dtype == slopes.dtype


BUILT = [
    *[("full", {"pos": pos}) for pos in ("alibi", "rope", "t5", "sinusoidal", "learned")],
    ("full", {"score": "additive"}),
    *[(name, {"max_len": 64} if name == "linformer" else {}) for name in zoo.list_mechanisms()],
    ("nsa", {"learned_compression": True, "causal": True}),
]


@pytest.mark.parametrize(("name", "options"), BUILT, ids=[f"{n}-{o}" for n, o in BUILT])
def test_meta_built_model_reset_module_by_module_equals_the_model_built_directly(name, options):
    """A fresh model made on the meta device (no checkpoint) materialises as FSDP and
    torchtitan do: ``to_empty``, then ``reset_parameters()`` on each module that has it, in
    ``modules()`` order. Every module holding its own parameters or buffers has it (Performer's
    W was uninitialised memory, found by review; NSA's learned compression began as the identity
    only when built), and with the same seed the reset draws what construction drew."""

    def build():
        return zoo.create_attention(name, dim=32, num_heads=4, **options)

    torch.manual_seed(0)
    want = build().state_dict()
    with torch.device("meta"):
        empty = build()
    empty.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in empty.modules():
        buffers = module.named_buffers(recurse=False)  # those not saved set themselves (ALiBi)
        saved = [b for n, b in buffers if n not in module._non_persistent_buffers_set]
        if [*module.parameters(recurse=False), *saved] and not hasattr(module, "reset_parameters"):
            pytest.fail(f"{type(module).__name__} holds tensors and has no reset_parameters")
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    got = empty.state_dict()
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
