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


def test_scalar_cpu_isa_picks_no_vector_isa_and_asks_no_isa_its_truth(monkeypatch):
    """Within, no vector ISA, and no ISA's truth asked (torch caches it for the process whatever
    ``cpp.vec_isa_ok`` says: ``helpers.scalar_cpu_isa``); after, the process's list of usable
    ISAs as it was. The old body, which recomputed the list within, asked every ISA."""
    from torch._inductor import cpu_vec_isa

    asked, listed = [], cpu_vec_isa.valid_vec_isa_list
    for isa in cpu_vec_isa.supported_vec_isa_list:
        monkeypatch.setattr(type(isa), "__bool__", lambda self: asked.append(str(self)) or True)
    with scalar_cpu_isa():
        assert not cpu_vec_isa.pick_vec_isa()
    assert asked == []
    assert cpu_vec_isa.valid_vec_isa_list is listed
