"""Operations one decoding step dispatches (views included), eagerly and with the functions a GPU
compiles (``zoo.core.fused``) left out of the count: a module step of one token on sdpa, B=8,
16 query heads on 4 key/value heads, D=128 (dim 2048), a cache of 4096 slots holding 2000 tokens,
float32, on the CPU.

    OMP_NUM_THREADS=1 python eval/results/decode-step-ops-cpu/fused_step_ops.py [VARIANT ...]
"""

import sys
from contextlib import ExitStack
from unittest import mock

import torch

import zoo
from zoo.backends import base, flex_chosen, sdpa
from zoo.decoding import block_sums
from zoo.patterns import moba
from zoo.testing.shape_only_kernels import OperationCount, uncounted

FUSED = (
    (base, "_step_mask"),
    (sdpa, "_packed"),
    (block_sums, "_sums"),
    (moba, "_choose"),
    (flex_chosen, "_row_layout"),
    (flex_chosen, "_merge_pairs"),
)
VARIANTS = ["causal", "sliding_window", "longformer", "block_local", "bigbird", "strided", "moba"]


def step_ops(variant: str, fuse: bool) -> int:
    torch.manual_seed(0)
    attn = zoo.create_attention(variant, dim=2048, num_heads=16, num_kv_heads=4, causal=True,
                                backend="sdpa").eval()  # fmt: skip
    cache = attn.new_cache(8, 4096)
    x = torch.randn(8, 2000, 2048)
    with torch.no_grad():
        attn(x, cache=cache)
        attn(x[:, :1], cache=cache)
        with ExitStack() as stack:
            if fuse:
                for module, name in FUSED:
                    patched = uncounted(getattr(module, name))
                    stack.enter_context(mock.patch.object(module, name, patched))
            counted = stack.enter_context(OperationCount())
            attn(x[:, :1], cache=cache)
    return counted.count


if __name__ == "__main__":
    print("| variant | eager: ops a step | with the compiled graphs left out |")
    print("|---|---|---|")
    for variant in sys.argv[1:] or VARIANTS:
        print(f"| {variant} | {step_ops(variant, False)} | {step_ops(variant, True)} |", flush=True)
