"""Test session settings. Shared helpers live in helpers.py."""

import os

# Inductor compiles each kernel in a pool of worker processes by default; on a 2-core machine
# running two pytest workers, compiling in the process itself was faster: 45.6 s against 53.0 s
# for six cold FlexAttention kernels, one thread. Set before torch reads its config; subprocesses
# of the tests inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor probes each vector ISA the CPU reports by compiling and loading a test library: once
# per cache (about 15 s of C++ builds on a cold one, which a cold CI run pays) and a loader
# subprocess per ISA in every process that compiles (workers and the tests' subprocesses). The
# probe guards against a compiler that cannot emit what the CPU has; the suite's compilers can,
# so the ISAs the CPU reports are taken as usable. A failing compile would still fail its test.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest
import torch

# Two threads: the CI machine has two cores, and oversubscription makes small ops slower. Under
# pytest-xdist (`pytest -n auto`, the README's command) each worker is one process per core, so
# each takes one thread.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(torch.get_num_threads(), 2))


@pytest.fixture
def scalar_cpu_code(request):
    """Inductor writes scalar C++ for the CPU within the test, not vectorized code. For tests
    whose graphs a GPU runs (``zoo.core.fused``'s, forced on a CPU) or whose subject is what a
    graph computes, not the CPU's code: both forms compute alike, and vectorized kernels took
    1.7x as long to compile cold (111 s against 65 s for the fused MoBA bookkeeping test). Not
    for a test that compiles FlexAttention for the CPU: inductor's CPU flex template needs
    vector code (it fails an assertion without), and a CPU user's compiled flex is what such a
    test holds to the reference. A test marked ``gpu`` keeps the default whatever its module
    asks: its CPU side may compile flex for the CPU (the GPU sync test's reference generation
    did, and failed on the GPU machine), and it runs where compiling is cheap."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    from helpers import scalar_cpu_isa

    with scalar_cpu_isa():
        yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run the whole of a matrix of which CI runs a sample; they run with
    ZOO_SLOW=1 (``ZOO_SLOW=1 pytest -m slow``)."""
    if os.environ.get("ZOO_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="the whole matrix; CI runs a sample (ZOO_SLOW=1 runs it)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


from helpers import CXX_MISSING, CXX_REASON  # noqa: E402

_NO_CXX = ("No working C++ compiler", "InvalidCxxCompiler", "need a C++ compiler")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Where no C++ compiler is found, a test that failed for that alone (Inductor's
    InvalidCxxCompiler, in the test or in the output of a subprocess it ran) is skipped, saying
    so, as a test that needs a GPU is skipped without one. With a compiler nothing changes."""
    outcome = yield
    report = outcome.get_result()
    if not (CXX_MISSING and report.failed and call.excinfo is not None) or call.when == "teardown":
        return
    text = str(call.excinfo.getrepr(style="short"))
    if any(sign in text for sign in _NO_CXX):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), (item.location[1] or 0) + 1, f"Skipped: {CXX_REASON}")
