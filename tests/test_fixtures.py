"""The test session's own fixtures (conftest.py) do what their docstrings say."""

from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config


@pytest.mark.usefixtures("scalar_cpu_code")
def test_scalar_cpu_code_turns_off_vectorized_cpu_code():
    assert inductor_config.cpp.vec_isa_ok is False


# the bare marker (not helpers.gpu, which skips without a GPU): the fixture reads the marker
@pytest.mark.gpu
@pytest.mark.usefixtures("scalar_cpu_code")
def test_a_gpu_test_keeps_vectorized_cpu_code_under_scalar_cpu_code():
    assert inductor_config.cpp.vec_isa_ok is not False
