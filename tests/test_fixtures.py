"""The test session's own fixtures (conftest.py) do what their docstrings say."""

from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config
from helpers import scalar_cpu_isa


@pytest.mark.usefixtures("scalar_cpu_code")
def test_scalar_cpu_code_turns_off_vectorized_cpu_code():
    assert inductor_config.cpp.vec_isa_ok is False


# the bare marker (not helpers.gpu, which skips without a GPU): the fixture reads the marker
@pytest.mark.gpu
@pytest.mark.usefixtures("scalar_cpu_code")
def test_a_gpu_test_keeps_vectorized_cpu_code_under_scalar_cpu_code():
    assert inductor_config.cpp.vec_isa_ok is not False


def _forget_vector_isas():
    """Torch's per-process memory of which vector ISAs this CPU has, dropped as in a new process:
    the list and each ISA class's cached truth."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    for isa in cpu_vec_isa.supported_vec_isa_list:
        for cls in type(isa).__mro__:
            for name in ("__bool__", "_VecISA__bool__impl"):
                getattr(vars(cls).get(name), "cache_clear", lambda: None)()


def _picked() -> str:
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    return str(cpu_vec_isa.pick_vec_isa())


@pytest.mark.parametrize("first", ["before", "within"])
def test_scalar_cpu_isa_neither_keeps_nor_leaves_behind_a_vector_isa(first):
    """Within, no vector ISA; after, the ISA a new process picks, whether the process had picked
    one before or picks first within (why it may not: ``helpers.scalar_cpu_isa``). On a CPU
    with AMX the old body failed both: AMX within, AVX2 after."""
    from torch._inductor import cpu_vec_isa

    _forget_vector_isas()
    fresh = _picked()
    _forget_vector_isas()
    if first == "before":
        assert _picked() == fresh
    with scalar_cpu_isa():
        assert not cpu_vec_isa.pick_vec_isa()
    assert _picked() == fresh
