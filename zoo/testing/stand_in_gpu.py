"""Inductor's CUDA code written on a machine without a GPU, for a stand-in sm90 device (an H100 or
H200), so that a fault in the code Inductor writes for a CUDA graph shows on a CPU: a name a
template lacks, a read its tiling cannot express, an assertion in its lowering. Two such faults
reached a GPU before this: a decoding step's flex mask (``tl.full([XBLOCK], 0)``, fixed in
``KVCache.next_positions``) and MoBA's transposed block lists (``get_block_shape``, fixed in
``flex_chosen._block_lists``); both were found again this way, on a CPU.

``stand_in_sm90()`` patches, for the rest of the process: torch.cuda's device queries (an sm90
device with an H200's properties), Triton's backend (that of an sm90 target, which needs no
driver), and the Inductor passes that would run tensors on the device (its pattern libraries,
constant folding's evaluation: the folded values are computed on the CPU). Nothing undoes it:
call it in a process of its own (``run_stand_in`` runs a script so), after the inputs are made
as fake CUDA tensors (``zoo.testing.fake_cuda``: the patches would make those constructors try
the device), before the first compiled call. A compiled call then lowers and writes its kernels,
and fails where Triton would load them ('libcuda.so cannot found', or no active GPU backend):
``lowered`` tells that end from a fault; the kernels' sources are in ``TORCHINDUCTOR_CACHE_DIR``
(``written_kernels``).

Needs triton (``pip install triton``), which a CPU-only torch does not bring; the tests that use
this skip without it. Inductor compiles in the process (``TORCHINDUCTOR_COMPILE_THREADS=1``:
worker processes would not be patched)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import torch

_Properties = namedtuple(
    "_Properties",
    "name major minor multi_processor_count total_memory warp_size "
    "max_threads_per_multi_processor regs_per_multiprocessor shared_memory_per_block_optin "
    "shared_memory_per_multiprocessor shared_memory_per_block max_threads_per_block "
    "L2_cache_size gcnArchName uuid clock_rate memory_clock_rate memory_bus_width",
)
H200 = _Properties("NVIDIA H200", 9, 0, 132, 140 * 2**30, 32, 2048, 65536, 232448, 233472, 49152,
                   1024, 50 * 2**20, "", "0", 1980000, 3201000, 5120)  # fmt: skip

# How a compiled call ends once its kernels are written: Triton loading them needs a driver.
_LOADING = ("libcuda", "active GPU backend")


def stand_in_sm90() -> None:
    """Patch this process so that Inductor lowers CUDA graphs for an sm90 device (above)."""
    from torch._dynamo import device_interface
    from torch._inductor import constant_folding
    from torch._inductor.fx_passes import fuse_attention, joint_graph, misc_patterns, pad_mm
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    # one function object each: dynamo registers a handler per torch.cuda function and refuses a
    # second registration of the same object
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.is_initialized = lambda: True
    cuda.get_device_properties = lambda *args, **kwargs: H200
    cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    cuda.get_device_name = lambda *args, **kwargs: H200.name
    cuda.is_bf16_supported = lambda *args, **kwargs: True
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.set_device = lambda *args, **kwargs: None
    cuda.get_rng_state = lambda *args, **kwargs: torch.zeros(16, dtype=torch.uint8)
    cuda.set_rng_state = lambda *args, **kwargs: None
    cuda._lazy_init = lambda: None
    cuda._exchange_device = lambda device: 0
    cuda._maybe_exchange_device = lambda device: 0
    interface = device_interface.CudaInterface
    interface.get_device_properties = staticmethod(lambda *args, **kwargs: H200)
    interface.Worker.get_device_properties = staticmethod(lambda *args, **kwargs: H200)
    interface.get_compute_capability = staticmethod(lambda *args, **kwargs: 90)
    C = torch._C
    C._cuda_getDeviceCount = lambda: 1
    C._cuda_getDevice = lambda: 0
    C._cuda_setDevice = lambda device: None
    C._cuda_getCurrentRawStream = lambda device: 0
    C._cuda_getArchFlags = lambda: "sm_90"
    # pattern libraries trace example tensors on the device itself: none touches flex or MoBA
    fuse_attention._sfdp_init = lambda *args, **kwargs: None
    pad_mm._pad_mm_init = lambda *args, **kwargs: None
    misc_patterns._misc_patterns_init = lambda *args, **kwargs: None
    for cls, name in ((joint_graph.UniformValueConstantFolder, "_deduce_value"),
                      (constant_folding.ConstantFolder, "run_node")):  # fmt: skip
        setattr(cls, name, _folded_on_the_cpu(getattr(cls, name)))
    import torch.utils._triton as triton_utils

    backend = make_backend(GPUTarget("cuda", 90, 32))
    triton_utils.triton_backend = lambda: backend
    triton_utils.triton_hash_with_backend = lambda: "stand-in-sm90"


def _folded_on_the_cpu(evaluate):
    """Constant folding evaluates nodes: a node's device argument mapped to the CPU meanwhile."""

    def on_the_cpu(self, node, *args, **kwargs):
        saved = node.kwargs
        device = saved.get("device") if isinstance(saved, dict) else None
        if device is not None and torch.device(device).type == "cuda":
            node.kwargs = {**saved, "device": torch.device("cpu")}
        try:
            return evaluate(self, node, *args, **kwargs)
        finally:
            node.kwargs = saved

    return on_the_cpu


def lowered(error: BaseException) -> bool:
    """Whether a compiled call's error is the stand-in's expected end (its kernels written, Triton
    could not load them), not a fault of lowering or code generation."""
    return any(mark in str(error) for mark in _LOADING)


def written_kernels(cache_dir: str | Path, templates: bool = False) -> dict[str, str]:
    """The Triton kernels Inductor wrote into ``cache_dir``, by name: each one's source up to the
    next kernel's; only the templates (FlexAttention's and the like) where ``templates``."""
    kernels = {}
    name = r"triton_(?:tem|flex)_?\w*" if templates else r"triton_\w+"
    for path in Path(cache_dir).glob("*/*.py"):
        text = path.read_text()
        for match in re.finditer(rf"^def ({name})\(", text, re.M):
            rest = text[match.end() :]
            end = re.search(r"^def triton_|^''', device_str", rest, re.M)
            kernels[match.group(1)] = rest[: end.start()] if end else rest
    return kernels


def run_stand_in(script: str, cache_dir: str | Path, timeout: float = 900) -> str:
    """``script`` run by this Python in a process of its own with an empty Inductor cache in
    ``cache_dir`` and compiling in the process; its stdout (its stderr too, where it fails)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
           "TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"stand-in script failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout
