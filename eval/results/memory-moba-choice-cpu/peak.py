"""Peak memory and time of MoBA's choice and layout bookkeeping at 128K tokens on a CPU: the
choice (bind), blocked's runs (``scored_pairs``, their rows and blocks without masks or
kernels) and flex's block mask (eager, not run).

    python eval/results/memory-moba-choice-cpu/peak.py [ZOO_ROOT] causal|bidirectional

(run with OMP_NUM_THREADS=2).
ZOO_ROOT (optional) puts another checkout's ``zoo`` first on the path (a worktree of an older
commit); the figures are growths of the process's peak RSS over the inputs alone."""

import resource
import sys
import time

if len(sys.argv) > 2:
    sys.path.insert(0, sys.argv.pop(1))

import torch

import zoo
from zoo.backends import BlockedBackend, FlexBackend
from zoo.functional import prepare_call
from zoo.patterns import Moba, RouteInputs


def grown(base: int) -> str:
    return f"+{(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024:.0f} MiB"


n, heads = 131072, 16
torch.manual_seed(0)
q, k, v = (torch.randn(1, heads, n, 64) for _ in range(3))
causal = sys.argv[1] == "causal"
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
Moba(512, 3).bind(RouteInputs(q, k, None, causal))
choice = f"choice {grown(base)} {time.perf_counter() - start:.1f} s"
start = time.perf_counter()
call = prepare_call(q, k, v, variant="moba", causal=causal, block_size=512, top_k=3)
scored = BlockedBackend().scored_pairs(call)
runs = f"choice + blocked's runs {grown(base)} {time.perf_counter() - start:.1f} s"
start = time.perf_counter()
FlexBackend(compile=False).block_mask(call)
mask = f"+ flex's block mask {grown(base)} {time.perf_counter() - start:.1f} s"
print(zoo.__file__, sys.argv[1], "|", choice, "|", runs, "|", mask, "| scored per head", scored)
