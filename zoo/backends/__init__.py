"""How attention is computed: backends by name, and the ``auto`` choice among them."""

from __future__ import annotations

from ..core.arguments import suggest
from ..core.call import AttentionCall
from ..core.named import Named
from .base import Backend, Capabilities
from .blocked import BlockedBackend
from .flex import FlexBackend
from .reference import ReferenceBackend
from .sdpa import SdpaBackend
from .xformers import XformersBackend

_BACKENDS: Named[Backend] = Named(
    "backend",
    "zoo.list_backends()",
    {
        b.name: b
        for b in (
            ReferenceBackend(),
            SdpaBackend(),
            FlexBackend(),
            BlockedBackend(),
            XformersBackend(),
        )
    },
)


def clear_caches() -> None:
    """Forget every shape-dependent structure the zoo caches (specialised patterns, frames, block
    layouts, blocked plans, flex block masks, dense masks: every ``zoo.core.shape_cache`` builder;
    and the plans of calls, ``zoo.core.call_plans``), and the device memory they hold."""
    from ..core.shape_cache import clear_all

    clear_all()


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Make a backend selectable by its ``name`` (``backend="name"``)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend takes a zoo Backend, got {backend!r}")
    # checked here: a backend without them would fail every later call that lists the backends
    # able to run it (in its error message), not only calls that name this one
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or name in ("", "auto"):
        raise ValueError(
            f"register_backend: {type(backend).__name__} needs a name, a str other than 'auto' "
            f'(a class attribute, name = "my_backend"), got {name!r}'
        )
    capabilities = getattr(backend, "capabilities", None)
    if not isinstance(capabilities, Capabilities):
        raise TypeError(
            f"register_backend: backend {name!r} needs capabilities, a zoo.Capabilities of what "
            f"it runs (devices, backward, dtypes, patterns...), got {capabilities!r}"
        )
    return _BACKENDS.add(name, backend, replace=replace)


def list_backends(available_only: bool = False) -> list[str]:
    """Backend names (``available_only``: those whose libraries load here); 'auto' chooses."""
    return sorted(n for n, b in _BACKENDS.items() if not available_only or b.unavailable() is None)


def get_backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise ValueError(suggest("backend", name, [*_BACKENDS, "auto"], "zoo.list_backends()"))
    return _BACKENDS[name]


def able_backends(call: AttentionCall) -> list[str]:
    # sorted by name alone: dynamo cannot sort (name, backend) pairs, and a refusal inside
    # torch.compile(fullgraph=True) raised its "sort with non-constant keys" instead of ours
    return [n for n in sorted(_BACKENDS) if _BACKENDS[n].reason_against(call) is None]


def backend_named(backend: object) -> Backend | None:
    """The Backend that ``backend`` names (a registered name or an instance); None for "auto"."""
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, str):
        return None if backend == "auto" else get_backend(backend)
    raise TypeError(
        f"backend must be 'auto', a name from zoo.list_backends() or a zoo Backend instance, "
        f"got {backend!r} ({type(backend).__name__})"
    )


def _cannot_run(backend: Backend, reason: str, call: AttentionCall) -> str:
    able = ", ".join(able_backends(call)) or "none"
    return f"backend {backend.name!r} cannot run this call: {reason}; backends that can: {able}"


def explain_backend(call: AttentionCall, backend: object = "auto") -> str:
    """Which backend runs the call and what it computes: ``auto``'s choice and why, or the
    named backend's, or why it cannot."""
    from .auto import explain_choice

    chosen = backend_named(backend)
    if chosen is None:
        return explain_choice(call, _BACKENDS)
    reason = chosen.reason_against(call)
    if reason is not None:
        return _cannot_run(chosen, reason, call)
    notes = [*chosen.capabilities.adaptations(call), chosen.layout_note(call)]
    return f"{chosen.name}, as named{''.join(f'; {note}' for note in notes)}"


def resolve_backend(backend: str | Backend, call: AttentionCall) -> Backend:
    """The backend to run the call, or a ValueError that says why not and which can."""
    from .auto import choose

    chosen = backend_named(backend)
    if chosen is None:
        return choose(call, _BACKENDS)
    reason = chosen.reason_against(call)
    if reason is not None:
        raise ValueError(_cannot_run(chosen, reason, call))
    return chosen


__all__ = [
    "Backend",
    "BlockedBackend",
    "Capabilities",
    "FlexBackend",
    "ReferenceBackend",
    "SdpaBackend",
    "XformersBackend",
    "backend_named",
    "clear_caches",
    "explain_backend",
    "get_backend",
    "list_backends",
    "register_backend",
    "resolve_backend",
]
