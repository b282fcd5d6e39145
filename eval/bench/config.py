"""The benchmark's config schema (for ``eval.harness.config.load_config``) and its checks.

Defaults are the GPU sweep of eval/configs/bench.yaml; every key can be overridden on the command
line (``repeats=50 lengths=[1024,2048]``). Errors name the file, the key, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import zoo
from zoo.backends import Backend
from zoo.core.arguments import check_parameters, suggest

from ..harness.config import ConfigError
from .impls import PEERS

PASSES = ("fwd", "fwd+bwd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")
MINIMUMS = {"batch": 1, "heads": 1, "head_dim": 1, "repeats": 1, "warmup": 0, "check_max_len": 0,
            "fit_points": 2, "threads": 0, "min_time_s": 0}  # fmt: skip


@dataclass
class BenchConfig:
    """One benchmark sweep."""

    variants: list[str] = field(default_factory=lambda: ["*"])  # names or globs; "*": all
    backends: list[str] = field(default_factory=lambda: ["auto", "flex", "blocked"])
    peers: list[str] = field(default_factory=lambda: ["sdpa_dense", "flex_standard", "xformers"])
    lengths: list[int] = field(default_factory=lambda: [1024 * 2**i for i in range(7)])
    passes: list[str] = field(default_factory=lambda: ["fwd", "fwd+bwd"])
    causal: list[bool] = field(default_factory=lambda: [False, True])
    batch: int = 1
    heads: int = 16
    kv_heads: int | None = None  # key/value heads (grouped-query attention); None: heads
    head_dim: int = 64
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU
    warmup: int = 5
    repeats: int = 30
    # and more timed runs while those so far took less than this in all: a fast cell's median
    # then spans more than one noisy moment of a shared machine (0: exactly ``repeats``)
    min_time_s: float = 0.0
    check_max_len: int = 4096  # the largest n whose cells are checked against the reference
    params: dict[str, dict] = field(default_factory=dict)  # variant -> parameter overrides
    out: str = "eval/results/bench-{device}-{timestamp}"
    device: str = "auto"
    seed: int = 0
    threads: int = 0  # CPU threads for torch; 0 keeps torch's default
    fit_points: int = 3  # the largest successful lengths an exponent is fitted over
    # time-*.png and memory-*.png beside bench.md; false: none (a second each on a CPU; a run that
    # keeps only bench.json, such as a GPU session's, draws them later with ``bench-report``)
    plots: bool = True
    # name -> {backend: a registered backend, and its constructor's options}: a backend built
    # with options, listed in ``backends`` by this name (blocked computing in bfloat16, say);
    # ``compiled_call: true`` runs each of its cells' calls under torch.compile (``CompiledCall``)
    backend_instances: dict[str, dict] = field(default_factory=dict)


def _unknown(source: str, key: str, index: int, kind: str, name: str, known, listing: str) -> str:
    return f"{source}: {key}[{index}]: {suggest(kind, str(name), known, listing)}"


def expand_variants(config: BenchConfig, source: str) -> list[str]:
    """Variant and mechanism names, globs expanded (``*`` is every registered one), in config
    order."""
    out: list[str] = []
    known = zoo.list_attention()
    for i, name in enumerate(config.variants):
        matched = zoo.list_attention(name) if any(ch in name for ch in "*?[") else [name]
        if not matched:
            raise ConfigError(f"{source}: variants[{i}]: the glob {name!r} matches no variant")
        for variant in matched:
            if variant not in known:
                listing = "zoo.list_attention()"
                message = _unknown(source, "variants", i, "variant", variant, known, listing)
                raise ConfigError(message)
            if variant not in out:
                out.append(variant)
    return out


def check_config(config: BenchConfig, source: str, extra_backends: dict | None = None) -> list[str]:
    """Check names and values; returns the variants the sweep runs.

    The checks run in this order and the first failure raises, so a config with several mistakes
    always reports the same one.
    """
    variants = expand_variants(config, source)
    backend_instances(config, source)  # built once to check their options
    _check_backends(config, source, extra_backends)
    _check_listed(source, "peers", config.peers, "peer", PEERS, "the bench docs")
    _check_listed(source, "passes", config.passes, "pass", PASSES, "the bench docs")
    _check_sweep_axes(config, source)
    _check_minimums(config, source)
    _check_kv_heads(config, source)
    _check_dtype(config, source)
    _check_out_pattern(config, source)
    _check_device(config, source)
    _check_params(config, source)
    return variants


def _check_listed(source: str, key: str, names, kind: str, known, listing: str) -> None:
    """Every entry of the list ``key`` is one of ``known``; the error names the first that is not,
    its index and the nearest known names (``listing`` says where the full list is)."""
    for i, name in enumerate(names):
        if name not in known:
            raise ConfigError(_unknown(source, key, i, kind, name, known, listing))


@dataclass(frozen=True)
class CompiledCall:
    """A backend instance whose cells run the whole ``zoo.attention`` call under
    ``torch.compile``, as a compiled model runs it: a choice by
    content (MoBA), its layout and the kernel in one graph, not one launch per operation."""

    backend: Backend | str


def backend_instances(config: BenchConfig, source: str) -> dict:
    """The backends of ``backend_instances``, built (``Sweep`` builds them for every command that
    sweeps a config); an option that names a dtype (``compute_dtype: bfloat16``) as that torch
    dtype; with ``compiled_call: true`` a ``CompiledCall`` of it."""
    built: dict[str, Backend | CompiledCall] = {}
    for name, spec in config.backend_instances.items():
        options = dict(spec)
        base = options.pop("backend", None)
        if base not in zoo.list_backends():
            known = zoo.list_backends()
            hint = suggest("backend", str(base), known, "zoo.list_backends()")
            raise ConfigError(f"{source}: backend_instances.{name}.backend: {hint}")
        compiled = options.pop("compiled_call", False)
        if not isinstance(compiled, bool):
            raise ConfigError(
                f"{source}: backend_instances.{name}.compiled_call: true or false, got {compiled!r}"
            )
        for key, value in options.items():
            if key.endswith("dtype") and isinstance(value, str):
                if value not in DTYPES:  # getattr(torch, "bfloat") raised a bare AttributeError
                    raise ConfigError(
                        f"{source}: backend_instances.{name}.{key}: unknown dtype {value!r}; "
                        f"one of {', '.join(DTYPES)}"
                    )
                options[key] = DTYPES[value]
        try:
            backend = type(zoo.backends.get_backend(base))(**options)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{source}: backend_instances.{name}: {error}") from error
        built[name] = CompiledCall(backend) if compiled else backend
    return built


def _check_backends(config: BenchConfig, source: str, extra_backends: dict | None) -> None:
    """Every backend is registered in the zoo, is "auto", or is one the caller adds
    (``extra_backends``, which the zoo's registry does not list) or the config builds
    (``backend_instances``)."""
    known = [*zoo.list_backends(), "auto", *(extra_backends or {}), *config.backend_instances]
    _check_listed(source, "backends", config.backends, "backend", known, "zoo.list_backends()")


def _check_sweep_axes(config: BenchConfig, source: str) -> None:
    """The variants, passes, lengths and causal settings are non-empty, and so are the backends
    and peers together (an empty axis is an empty sweep, which would report nothing and exit 0);
    every length is positive; no axis repeats a value (its cells were measured twice, and
    ``bench-report`` refused the run's own bench.json). Variants need no check: their expansion
    drops repeats (``expand_variants``)."""
    if not config.variants:
        raise ConfigError(f"{source}: variants must name at least one variant, got []")
    if not config.passes:
        raise ConfigError(f"{source}: passes must list fwd, fwd+bwd or both, got []")
    if not config.backends and not config.peers:
        raise ConfigError(f"{source}: backends and peers are both empty: nothing to time")
    if not config.lengths or any(n < 1 for n in config.lengths):
        raise ConfigError(f"{source}: lengths must be positive ints, got {config.lengths!r}")
    if not config.causal:
        raise ConfigError(f"{source}: causal must list false, true or both, got []")
    for key in ("backends", "peers", "lengths", "passes", "causal"):
        check_distinct(source, key, getattr(config, key))


def check_distinct(source: str, key: str, values: list) -> None:
    """The list ``key`` names each value once; the error names the first repeated one."""
    repeated = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if repeated is not None:
        raise ConfigError(
            f"{source}: {key} lists {repeated!r} more than once, got {values!r}; each value once"
        )


def _check_minimums(config: BenchConfig, source: str) -> None:
    """Each numeric key is at least its entry in ``MINIMUMS`` (e.g. at least one repeat, and two
    points for an exponent fit)."""
    for key, minimum in MINIMUMS.items():
        value = getattr(config, key)
        if value < minimum:
            raise ConfigError(f"{source}: {key} must be at least {minimum}, got {value}")


def _check_kv_heads(config: BenchConfig, source: str) -> None:
    """kv_heads divides heads (grouped-query attention shares each key/value head among a whole
    group), and the repeat_kv peer, which has nothing to compare otherwise, gets fewer kv_heads
    than heads."""
    if config.kv_heads is not None and (config.kv_heads < 1 or config.heads % config.kv_heads):
        raise ConfigError(
            f"{source}: kv_heads must divide heads ({config.heads}) or be null, got "
            f"{config.kv_heads!r}"
        )
    if "repeat_kv" in config.peers and config.kv_heads in (None, config.heads):
        raise ConfigError(
            f"{source}: the repeat_kv peer compares grouped-query attention with its repeated "
            f"form; set kv_heads below heads ({config.heads}), got {config.kv_heads!r}"
        )


def _check_dtype(config: BenchConfig, source: str) -> None:
    """dtype is "auto" or a name in ``DTYPES`` (what ``resolve_dtype`` can resolve)."""
    if config.dtype != "auto" and config.dtype not in DTYPES:
        raise ConfigError(
            f"{source}: dtype must be auto or one of {', '.join(DTYPES)}, got {config.dtype!r}"
        )


def _check_out_pattern(config: BenchConfig, source: str) -> None:
    """The out pattern formats with only {device} and {timestamp}: caught here rather than after
    the sweep, when the results are written."""
    try:
        config.out.format(device="cpu", timestamp="0")
    except (KeyError, IndexError, ValueError) as error:
        raise ConfigError(
            f"{source}: out {config.out!r} may use only {{device}} and {{timestamp}} "
            f"(double other braces): {error!r}"
        ) from error


def _check_device(config: BenchConfig, source: str) -> None:
    """device is one of ``DEVICES``; whether CUDA is there is ``resolve_device``'s check."""
    if config.device not in DEVICES:
        raise ConfigError(f"{source}: device must be auto, cpu or cuda, got {config.device!r}")


def _check_params(config: BenchConfig, source: str) -> None:
    """Each params entry names a registered variant or mechanism and maps parameter names to
    values the variant accepts, in config order."""
    for name, params in config.params.items():
        if name not in zoo.list_attention():
            unknown = suggest("variant", str(name), zoo.list_attention(), "zoo.list_attention()")
            raise ConfigError(f"{source}: params: {unknown}")
        if not isinstance(params, dict):
            raise ConfigError(f"{source}: params: {name} must map parameter names to values")
        _check_param_values(source, name, params)


def _check_param_values(source: str, name: str, params: dict) -> None:
    """The overrides are valid for ``name``: a mechanism's are checked against its declared
    parameters, a variant's by building it, so a bad value fails here, before any timing."""
    try:
        if name in zoo.list_mechanisms():
            spec = zoo.get_mechanism_spec(name)
            check_parameters(f"mechanism {name!r}", params, spec.parameters())
        else:
            zoo.get_spec(name).build(**params)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{source}: params: {name}: {error}") from error


def resolve_device(name: str, source: str) -> torch.device:
    """'auto' is CUDA where there is one; asking for CUDA without one is a config error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{source}: device cuda asked for, but torch sees no CUDA device here; "
            "use device=cpu or device=auto"
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 on CUDA, float32 on CPU (CPU bf16 kernels are slow, not representative)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]
