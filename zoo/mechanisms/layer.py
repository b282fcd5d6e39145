"""A mechanism inside ``zoo.MultiHeadAttention``: built once, as a submodule, checked at init."""

from __future__ import annotations

from ..registry import get_mechanism_spec, is_mechanism_name
from .base import Mechanism


def module_mechanism(
    variant: object,
    params: dict[str, object],
    *,
    num_heads: int,
    head_dim: int,
    causal: bool,
    options: dict[str, object],
    option_names: tuple[str, ...],
) -> Mechanism | None:
    """The module's mechanism (with its learned parameters, if any), or None for a pattern
    variant. Module options that no mechanism takes fail here, not at the first forward."""
    if isinstance(variant, Mechanism):
        if params:
            raise TypeError(
                f"parameters {sorted(params)} apply to a mechanism name, not to an instance"
            )
        mechanism = variant
    elif is_mechanism_name(variant):
        mechanism = get_mechanism_spec(variant).build(
            num_heads=num_heads,
            head_dim=head_dim,
            options=option_names,
            options_of="the module (create_attention / zoo.MultiHeadAttention)",
            **params,
        )
    else:
        return None
    what = f"mechanism {mechanism.name!r}"
    if options["backend"] != "auto":
        raise ValueError(
            f"{what} computes attention itself, with no backend; got backend="
            f"{options['backend']!r}, leave it 'auto'"
        )
    if options["dropout"]:
        raise ValueError(
            f"{what} forms no attention weights to drop, got dropout={options['dropout']}; use "
            "0.0 (dropout elsewhere in the model still works)"
        )
    if options["score"] != "dot":
        raise ValueError(f"{what} takes the dot product only, got score={options['score']!r}")
    if mechanism.num_heads != num_heads or mechanism.head_dim != head_dim:
        raise ValueError(
            f"{what} was built for {mechanism.num_heads} heads of width {mechanism.head_dim}, "
            f"but the module has {num_heads} of width {head_dim}"
        )
    mechanism.check_call(causal=causal, q_len=1, kv_len=1, padded=False, scaled=False)
    return mechanism
