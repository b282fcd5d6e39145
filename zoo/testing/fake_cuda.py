"""Fake CUDA tensors on a machine without a GPU: the CUDA paths run on a CPU, shapes and devices
only.

``torch._subclasses.FakeTensorMode`` gives tensors a device and a shape but no data, so a call
on fake CUDA tensors runs every line of the CUDA path and raises where a real GPU would on a
cpu/cuda mix or an unsupported shape. This is how the zoo's tests reach its CUDA paths without a
GPU, and what users meet in ``torch.export`` of a CUDA model on a CPU build machine::

    with fake_cuda():
        q = torch.randn(1, 8, 4096, 64, device="cuda")
        out = zoo.attention(q, q, q, variant="bigbird", backend="blocked")

On a CUDA build of torch without a GPU, FakeTensorMode installs a no-op CUDA device guard itself.
A CPU-only build has no CUDA guard at all, and views, indexing and autograd of a fake CUDA tensor
then fail ("PyTorch is not linked with support for cuda devices"); ``fake_cuda`` registers the
same no-op guard there, from a 10-line C++ file compiled once per torch version (needs a C++
compiler; ``FakeCudaUnavailable`` says so otherwise). The guard stays for the process: it only
answers "device -1" for CUDA, which nothing else in a CPU-only process asks.

Limits, torch's own: a fake CUDA forward may record autograd (inputs that require grad), but its
backward cannot run on a CPU-only build; compiled kernels (Inductor) are not generated.

Where a CUDA path needs values (a plan read from the data, as MoBA's runs by key block are),
``tagged_cuda`` runs it for real: CUDA tensors that hold CPU values
(``zoo.core.device_build.Tagged``), on which a cpu/cuda mix raises as on a GPU. A CUDA kernel
has to be stood in for there (the tests emulate it), and autograd's engine cannot run their
backward (it asks for a CUDA stream): a test calls a backward function itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

_GUARD_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
namespace {
struct RegisterNoOpCudaGuard {
  RegisterNoOpCudaGuard() {
    static c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA> guard;
    auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
    const c10::impl::DeviceGuardImplInterface* none = nullptr;
    slot.compare_exchange_strong(none, &guard);
  }
} registered;
}  // namespace
"""


class FakeCudaUnavailable(RuntimeError):
    """Fake CUDA tensors cannot be made in this process (the reason is the message)."""


def fake_cuda() -> contextlib.AbstractContextManager[torch._subclasses.FakeTensorMode]:
    """A ``FakeTensorMode`` in which ``device="cuda"`` tensors work on any machine."""
    ensure_cuda_guard()
    return _fake_mode()


@contextlib.contextmanager
def tagged_cuda() -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Tagged CUDA tensors (see the module docstring); yields what tags a CPU tensor as CUDA.
    For machines without a GPU: where CUDA runs, a factory asked for it makes a real CUDA tensor
    beside the tagged ones (``FakeCudaUnavailable`` says so; the CUDA path runs for real there)."""
    from ..core.device_build import Tagged, tagging

    if torch.cuda.is_available():
        raise FakeCudaUnavailable(
            "tagged CUDA tensors stand in for a GPU that is absent; this machine has one: run "
            "the CUDA path on it (the gpu tests)"
        )
    ensure_cuda_guard()
    with tagging():
        yield lambda values: Tagged(values, torch.device("cuda"))


@contextlib.contextmanager
def _fake_mode() -> Iterator[torch._subclasses.FakeTensorMode]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real tensors the zoo keeps (per-shape structures built on the CPU) enter as constants, as
    # they do in torch.export: a cpu/cuda mix still raises.
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@functools.cache
def ensure_cuda_guard() -> None:
    """Register a no-op CUDA device guard where torch has none (a CPU-only build)."""
    if torch.backends.cuda.is_built():
        return  # CUDA builds have a guard; FakeTensorMode makes it a no-op without a GPU
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise FakeCudaUnavailable(
            "fake CUDA tensors on a CPU-only build of torch need a C++ compiler to register a "
            "CUDA device guard (none found: set CXX, or install g++)"
        )
    root = Path(torch.__file__).parent
    key = hashlib.sha256(f"{torch.__version__}{root}{_GUARD_SOURCE}".encode()).hexdigest()[:16]
    library = Path(tempfile.gettempdir()) / f"zoo-cuda-guard-{key}.so"
    if not library.exists():
        _compile(compiler, root, library)
    ctypes.CDLL(str(library))


def _compile(compiler: str, root: Path, library: Path) -> None:
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "guard.cpp"
        source.write_text(_GUARD_SOURCE)
        built = Path(folder) / library.name
        command = [
            compiler, "-O1", "-shared", "-fPIC", "-std=c++17", f"-I{root / 'include'}",
            str(source), f"-L{root / 'lib'}", "-lc10", f"-Wl,-rpath,{root / 'lib'}",
            "-o", str(built),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise FakeCudaUnavailable(
                f"compiling the CUDA device guard for fake CUDA tensors failed "
                f"({' '.join(command)}):\n{done.stderr[-2000:]}"
            )
        os.replace(built, library)  # atomic: another process may be compiling the same file
