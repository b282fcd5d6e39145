#!/usr/bin/env bash
# The project's GPU measurements in stages that each fit one 10-minute command on a lent machine
# (which has torch, triton, einops, pyyaml, pytest, matplotlib, tqdm and rich, but no network).
# Each stage writes only small files under $OUT (the results, never checkpoints or plots): the
# report, plots and auto table are rebuilt from them on any machine (see the end of this file).
#
#   bash eval/gpu_session.sh tests                      # GPU tests, tiny GPU sweep and training
#   bash eval/gpu_session.sh bench NAME [key=value...]  # one piece of eval/configs/bench.yaml
#   BENCH_CONFIG=eval/configs/bench_gqa.yaml bash eval/gpu_session.sh bench gqa  # another config
#   BENCH_CONFIG=eval/configs/bench_mechanisms.yaml bash eval/gpu_session.sh bench mech-1k-8k \
#       'lengths=[1024,2048,4096,8192]'             # linear, performer, linformer, nystrom
#   bash eval/gpu_session.sh standard NAME [key=value]  # a part of eval/configs/standard.yaml
#   RUN_CONFIG=eval/configs/compile_gpu.yaml bash eval/gpu_session.sh standard compile-graph \
#       train.compile=true                            # compiled training speed (and without)
#   bash eval/gpu_session.sh decode NAME [key=value]    # eval/configs/bench_decode.yaml (generation)
#   RUN_CONFIG=eval/configs/findings/mqar_gap_zoology_gpu.yaml bash eval/gpu_session.sh \
#       standard mqar-gap-zoology                       # a finding's GPU twin (also _uniform_gpu,
#                                                       # extrapolation_gpu; listops_gpu one
#                                                       # variant per command: variants=[full])
#
# On a machine with 2 or more GPUs (not a stage: it needs torchrun over every GPU), context
# parallelism's bytes and time beside PyTorch's ring and an all-gather, with NCCL:
#   for n in 1 2 4; do torchrun --standalone --nproc-per-node $n -m eval bench-cp \
#       eval/configs/bench_cp_gpu.yaml; done   # one report in eval/results/bench-cp-gpu
#
# xFormers, where its wheel was carried in .whl/ (see the device tool's README), is installed
# first into /tmp/site. Run from the repository root. The wheels for torch 2.11+cu130:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       xformers==0.0.35 "nvidia-cuda-runtime-cu12==12.8.*"
set -uo pipefail
stage=${1:?"stage: tests, bench, standard or decode"}
shift
OUT=${OUT:?"set OUT to the folder whose files come back"}
LIMIT=${LIMIT:-540}  # seconds; stopped with SIGINT after that, keeping what it finished
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
    # xFormers 0.0.35's _C links libcudart.so.12; a torch built for CUDA 13 has none, and
    # without its _C xFormers runs no operator at all. The nvidia-cuda-runtime-cu12 wheel has it.
    cudart=/tmp/site/nvidia/cuda_runtime/lib
    [ -d "$cudart" ] && export LD_LIBRARY_PATH=$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
python3 - <<'EOF' | tee "$OUT/environment.txt"
import torch, zoo
from zoo.backends import get_backend
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
print("xformers:", get_backend("xformers").unavailable() or "runs")
EOF

case $stage in
tests)
    timeout -s INT "$LIMIT" python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 |
        tee "$OUT/gpu-tests.txt"
    ;;
bench)
    name=${1:?"bench NAME [key=value ...]"}
    shift
    timeout -s INT "$LIMIT" python3 -m eval bench "${BENCH_CONFIG:-eval/configs/bench.yaml}" \
        "out=/tmp/bench-$name" "$@" 2>&1 |
        tee "$OUT/bench-$name.log"
    cp "/tmp/bench-$name/bench.json" "$OUT/bench-$name.json"
    ;;
standard)
    name=${1:?"standard NAME [key=value ...]"}
    shift
    timeout -s INT "$LIMIT" python3 -m eval run "${RUN_CONFIG:-eval/configs/standard.yaml}" \
        "out=/tmp/standard-$name" \
        save_checkpoints=false "$@" 2>&1 | tee "$OUT/standard-$name.log"
    cp "/tmp/standard-$name/results.jsonl" "$OUT/standard-$name.jsonl"
    ;;
decode)
    name=${1:?"decode NAME [key=value ...]"}
    shift
    timeout -s INT "$LIMIT" python3 -m eval bench-decode eval/configs/bench_decode.yaml \
        "out=/tmp/decode-$name" "$@" 2>&1 | tee "$OUT/decode-$name.log"
    cp "/tmp/decode-$name/bench-decode.json" "/tmp/decode-$name/bench-decode.md" "$OUT/"
    ;;
*)
    echo "unknown stage $stage: tests, bench, standard or decode" >&2
    exit 2
    ;;
esac

# Back on the development machine, with the files under eval/results/gpu/:
#   python -m eval bench-report eval/results/gpu/bench-*.json out=eval/results/bench-gpu
#   python -m eval auto-table eval/results/bench-gpu/bench.json
#   cat eval/results/gpu/standard-*.jsonl > eval/results/standard/results.jsonl
#   python -m eval report eval/results/standard/results.jsonl
#   mkdir -p eval/results/findings-gpu/NAME && cat eval/results/gpu/standard-NAME*.jsonl \
#       > eval/results/findings-gpu/NAME/results.jsonl   # each finding's twin, then:
#   python -m eval findings --gpu
