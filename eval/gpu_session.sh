#!/usr/bin/env bash
# The project's GPU measurements in stages that each fit one 10-minute command on a lent machine
# (which has torch, triton, einops, pyyaml, pytest, matplotlib, tqdm and rich, but no network).
# Each stage writes only small files under $OUT (the results, never checkpoints or plots): the
# report, plots and auto table are rebuilt from them on any machine (see the end of this file).
#
#   bash eval/gpu_session.sh all [LIMIT]                # the GPU campaign in one command (below)
#   bash eval/gpu_session.sh findings [LIMIT]           # the findings' GPU twins, one after another
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
#                                                       # _spread_gpu, extrapolation_gpu; listops_gpu one
#                                                       # variant per command: variants=[full])
#
# `all` runs these stages in order, each under its own limit, a share of LIMIT seconds (default 540)
# in percent (SHARES below), cut to what is left before LIMIT and enforced with `timeout` (SIGINT,
# then SIGKILL 5 s later): a stage cut short keeps what it wrote. Each writes small files in $OUT;
# $OUT/stages.tsv records each stage's limit, wall time, exit status and how it ended.
#   env          environment.txt: torch, CUDA, the device, whether xFormers runs
#   tests        gpu-tests.txt: every test marked gpu (pytest-xdist, TEST_WORKERS workers, 12 by
#                default, where it imports), one line per test as it ends: a stage stopped at
#                its limit still names what passed and failed
#   realization  bench-realization.json: eval/configs/bench_goals_realization_gpu.yaml (goal e)
#   goals        bench-goals.json: eval/configs/bench_goals_gpu.yaml, the goal cells (goal a)
#   moba         bench-moba.json: eval/configs/bench_goals_moba_gpu.yaml (goal b)
#   divisible    bench-divisible.json: eval/configs/bench_divisible_gpu.yaml at 8K and 16K,
#                forward: the symbolic-length kernel beside one compiled per length
#                (flex_static)
#   overhead     overhead.json, overhead.md: bench-overhead, the host time around the kernel
#   profile      profile.json, profile.md: bench-profile of the goal cells and their twins
#   profile_moba profile-moba/profile.{json,md}: bench-profile of MoBA on flex and blocked at 16K
#   decode       bench-decode.json: bench-decode beside sdpa_dense, each step profiled (goal c)
#   decode_compiled  bench-decode-compiled.json: the steps compiled over a static cache, CUDA
#                graphs (reduce-overhead); goal (c) judges the faster
#   compiles     compiles.json, compiles.md: bench-compiles, 20 distinct lengths (goal d)
# Then (also when a signal stops the script) `python -m eval goals $OUT` writes $OUT/summary.md,
# whose first lines say which goals hold. ARGS_<stage> adds key=value overrides to a stage's
# command (ARGS_goals='lengths=[65536,131072]' measures the longer cells in another session;
# `python -m eval goals OUT1 OUT2` reads both). ZOO_GPU_SESSION_BUNDLE=1 packs every file of $OUT
# but summary.md and stages.tsv into $OUT/campaign.tar.gz at the end (the device tool brings back
# at most 8 files). The GPU tests alone took 398 s at 12 workers on an H200 (2026-11-28, at
# a2b6674) and 269 s at 0cfc45f (15 of them failed early), so a session of 15 minutes of device
# time runs two commands, one right after the other on the warm machine (it goes back after 30 s
# idle), each carrying .whl and .gpu-cache (the compile cache, below; bring back its parts):
#   ZOO_GPU_SESSION_CACHE=.gpu-cache LIMIT=400 bash eval/gpu_session.sh tests   # timeout_s 430
#   ZOO_GPU_SESSION_CACHE=.gpu-cache ZOO_GPU_SESSION_BUNDLE=1 \
#     ZOO_GPU_SESSION_SHARES="env:4 decode_compiled:18 goals:26 moba:16 divisible:6 decode:10 compiles:10" \
#     ARGS_goals='lengths=[65536]' ARGS_compiles='backward=true' \
#     bash eval/gpu_session.sh all LEFT   # timeout_s LEFT + 30
# where LEFT is the device tool's budget_left_s after the first, less 45 s (the third run of
# 2026-11-28 had 480 s after the tests' 297, and every stage but two stopped at its limit, most
# of it compiling). These shares go to what no run has measured since the code changed: the
# compiled static steps on auto (sdpa, its masked slots now split into runs) beside sdpa_whole
# (without the split) and flex (every one failed at 0cfc45f; the cause is removed), the 64K goal
# cells (none measured on this code; 16K twice), MoBA's other 7 cells, the
# compile count (goal d: not run since the first H200 run, forward only, where 2 compiles held;
# now forward+backward, as a model trains), and auto's local attention at 16K, its second length,
# beside flex_static (a kernel compiled per length) and flex_standard: what the kernel of
# symbolic lengths costs. Stages run in their
# fixed order (below), whatever the shares' order.
# Tests of this script:
# STAGE_CMD_<stage>='...' replaces a stage's command (run by bash, with $OUT set), and
# ZOO_GPU_SESSION_FAKE=1 makes every other stage a no-op (tests/eval/test_gpu_session.py).
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
stage=${1:?"stage: all, findings, tests, bench, standard or decode"}
shift
OUT=${OUT:?"set OUT to the folder whose files come back"}
mkdir -p "$OUT"
export OUT
LIMIT=${LIMIT:-540}  # seconds; stopped with SIGINT after that, keeping what it finished
case $stage in
all | findings)
    LIMIT=${1:-$LIMIT}
    [[ $LIMIT =~ ^[0-9]+$ ]] || { echo "LIMIT must be whole seconds, got $LIMIT" >&2; exit 2; }
    ;;
esac
PY=${PYTHON:-python3}
FAKE=${ZOO_GPU_SESSION_FAKE:-0}
KILL_AFTER=${ZOO_GPU_SESSION_KILL_AFTER:-5}  # seconds from SIGINT to SIGKILL
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [[ $FAKE != 1 ]] && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
    # xFormers 0.0.35's _C links libcudart.so.12; a torch built for CUDA 13 has none, and
    # without its _C xFormers runs no operator at all. The nvidia-cuda-runtime-cu12 wheel has it.
    cudart=/tmp/site/nvidia/cuda_runtime/lib
    [ -d "$cudart" ] && export LD_LIBRARY_PATH=$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# Inductor's compile cache carried from one session to the next (ZOO_GPU_SESSION_CACHE: a
# folder of the checkout that git ignores and the device tool carries, .gpu-cache by convention;
# unset: nothing carried). Most of a stage's minutes went to compiling (the first flex call at a
# shape took 2.5-7.5 s on an H100 and an H200), and every lent machine starts bare. Before the
# stages, that folder's compile-cache.tar.gz.NN are unpacked into TORCHINDUCTOR_CACHE_DIR (once
# per machine); at the end the cache's FX graphs (with their Triton kernels, which Inductor
# bundles into them) and AOTAutograd graphs are packed into $OUT as parts of 15 MiB (the device
# tool brings back 16 MiB a file), at most CACHE_PARTS of them (the carried tree holds 64 MiB:
# the checkout and .whl took 16), within CACHE_PACK_SECONDS; where the whole cache is larger,
# only what this machine compiled (both commands of a session on it); where that is too, or
# packing fails or runs out of time, no part: parts are moved into $OUT only when complete.
# Back here, only where parts came back:
#   rm -f .gpu-cache/compile-cache.tar.gz.* && cp FILES_AT/compile-cache.tar.gz.* .gpu-cache/
CACHE_KEPT=${ZOO_GPU_SESSION_CACHE:-}
CACHE_PARTS=${ZOO_GPU_SESSION_CACHE_PARTS:-2}
CACHE_PART_BYTES=${ZOO_GPU_SESSION_CACHE_PART_BYTES:-15728640}
CACHE_PACK_SECONDS=${ZOO_GPU_SESSION_CACHE_PACK_SECONDS:-30}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/zoo-inductor}
CACHE_DIRS=(fxgraph aotautograd)
SESSION_MARK=.zoo-session-start  # in the cache folder: what the machine compiled is newer
restore_cache() {
    [[ -n $CACHE_KEPT ]] || return 0
    mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
    [[ -f $TORCHINDUCTOR_CACHE_DIR/$SESSION_MARK ]] || touch "$TORCHINDUCTOR_CACHE_DIR/$SESSION_MARK"
    local parts=()
    mapfile -t parts < <(compgen -G "$CACHE_KEPT/compile-cache.tar.gz.*" | sort -V)
    if ((${#parts[@]} == 0)) || [[ -f $TORCHINDUCTOR_CACHE_DIR/.zoo-restored ]]; then
        return 0
    fi
    # unpacked entries keep their (older) times: newer than the mark is what this machine made
    if cat "${parts[@]}" | tar -xz -C "$TORCHINDUCTOR_CACHE_DIR"; then
        touch "$TORCHINDUCTOR_CACHE_DIR/.zoo-restored"
        echo "== compile cache: restored ${#parts[@]} part(s) from $CACHE_KEPT"
    else
        echo "== compile cache: the parts in $CACHE_KEPT did not unpack; compiling afresh"
    fi
}
pack_cache() {  # FILE...: relative to the cache folder, all into $OUT's parts, or none (1)
    local budget=$((CACHE_PARTS * CACHE_PART_BYTES)) staging status size
    staging=$(mktemp -d "${TMPDIR:-/tmp}/zoo-cache-parts.XXXXXX") || return 1
    printf '%s\n' "$@" >"$staging/files"
    # one byte past the budget at most: a cache too large stops there (head closes the pipe)
    timeout -k 2 "$CACHE_PACK_SECONDS" tar -C "$TORCHINDUCTOR_CACHE_DIR" -c -T "$staging/files" |
        gzip -1 | head -c $((budget + 1)) >"$staging/archive"
    status=$?
    size=$(stat -c %s "$staging/archive" 2>/dev/null || echo $((budget + 1)))
    if ((status == 0 && size <= budget)) &&
        split -b "$CACHE_PART_BYTES" -d -a 2 "$staging/archive" "$staging/compile-cache.tar.gz."; then
        rm -f "$OUT"/compile-cache.tar.gz.*
        mv "$staging"/compile-cache.tar.gz.* "$OUT/"
        rm -rf "$staging"
        return 0
    fi
    rm -rf "$staging"
    return 1
}
save_cache() {
    [[ -n $CACHE_KEPT && -f $TORCHINDUCTOR_CACHE_DIR/$SESSION_MARK ]] || return 0
    local all=() new=()
    mapfile -t all < <(cd "$TORCHINDUCTOR_CACHE_DIR" &&
        find "${CACHE_DIRS[@]}" -type f 2>/dev/null | sort)
    ((${#all[@]})) || return 0
    if pack_cache "${all[@]}"; then
        echo "== compile cache: ${#all[@]} files in $OUT/compile-cache.tar.gz.*"
        return 0
    fi
    mapfile -t new < <(cd "$TORCHINDUCTOR_CACHE_DIR" &&
        find "${CACHE_DIRS[@]}" -type f -newer "$SESSION_MARK" 2>/dev/null | sort)
    if ((${#new[@]})) && pack_cache "${new[@]}"; then
        echo "== compile cache: the whole over $CACHE_PARTS parts; this machine's ${#new[@]} files kept"
    else
        echo "== compile cache: not kept (over $CACHE_PARTS parts even for this machine's, or failed)"
    fi
}
restore_cache

ENV_PY='
import torch, zoo
from zoo.backends import get_backend
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
print("xformers:", get_backend("xformers").unavailable() or "runs")
'

# ---- stage lists (all, findings): each stage under its own limit ----------------------------
# Shares of LIMIT in percent, in order; the rest (9%) is left for the summary and for stages
# that overrun by their SIGKILL grace. At 540 s: env 32, tests 76, realization 38, goals 81,
# moba 38, divisible 27, overhead 16, profile 38, profile_moba 22, decode 54, decode_compiled 32,
# compiles 38.
# env has 6%:
# importing torch and the zoo on a cold machine took more than 10.6 s.
# ZOO_GPU_SESSION_SHARES replaces them (the same "stage:percent" words; a stage not named gets none).
read -ra SHARES <<<"${ZOO_GPU_SESSION_SHARES:-env:6 tests:14 realization:7 goals:15 moba:7 divisible:5 overhead:3 profile:7 profile_moba:4 decode:10 decode_compiled:6 compiles:7}"
# The stages of `all`, in its order below: what a word of the shares may name (check_shares).
ALL_STAGES="env tests realization goals moba divisible overhead profile profile_moba decode decode_compiled compiles"
RESERVE_PCT=5  # kept for the summary by every stage's cut (at least 3 s)

now_ms() {
    local t=${EPOCHREALTIME:-}
    if [[ -n $t ]]; then
        t=${t//[.,]/}
        echo $((10#$t / 1000))
    else
        echo $(($(date +%s%N) / 1000000))
    fi
}
secs() { printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)); }
check_shares() {  # before any stage: a misspelt stage got no time silently ("skipped: no time
    # left"), and a share such as 12.5 stopped the list at that stage with an arithmetic error
    local item
    for item in "${SHARES[@]}"; do
        if [[ " $ALL_STAGES " != *" ${item%%:*} "* ]]; then
            echo "ZOO_GPU_SESSION_SHARES: '$item' names no stage of all; STAGE:PERCENT with STAGE" \
                "one of: $ALL_STAGES" >&2
            exit 2
        fi
        if [[ ! $item =~ ^[a-z_]+:(0|[1-9][0-9]*)$ ]]; then
            echo "ZOO_GPU_SESSION_SHARES: '$item' must be STAGE:PERCENT, PERCENT a whole number" \
                "of percent (no sign, point or leading zero)" >&2
            exit 2
        fi
    done
}
share_of() {
    local item
    for item in "${SHARES[@]}"; do [[ ${item%%:*} == "$1" ]] && echo "${item#*:}" && return; done
    echo 0
}
record() {  # NAME LIMIT_MS WALL_MS EXIT STATUS
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$(secs "$2")" "$(secs "$3")" "$4" "$5" >>"$OUT/stages.tsv"
}
CURRENT= STAGE_PID= WATCHDOG=

# run_stage NAME PERCENT LOG CMD...: CMD under `timeout` for PERCENT of LIMIT (cut to what is left
# before the deadline less the summary's reserve), its output in LOG, its end in stages.tsv.
run_stage() {
    local name=$1 pct=$2 log=$3
    shift 3
    local limit_ms=$((LIMIT * 1000 * pct / 100))
    local left_ms=$((DEADLINE_MS - $(now_ms) - RESERVE_MS))
    ((left_ms < limit_ms)) && limit_ms=$left_ms
    if ((limit_ms < 1000)); then
        echo "== $name: skipped, no time left"
        record "$name" 0 0 - "skipped: no time left"
        return 0
    fi
    local key=${name//[^A-Za-z0-9_]/_} status= cmd more
    local override="STAGE_CMD_$key" extra="ARGS_$key"
    if [[ -n ${!override:-} ]]; then
        cmd=(bash -c "${!override}")
    elif [[ $FAKE == 1 ]]; then
        cmd=(true) status=faked
    else
        cmd=("$@")
    fi
    if [[ -n ${!extra:-} && ${cmd[0]} != bash && ${cmd[0]} != true ]]; then
        read -ra more <<<"${!extra}"
        cmd+=("${more[@]}")
    fi
    echo "== $name: limit $(secs "$limit_ms") s: ${cmd[*]}"
    CURRENT=$name CURRENT_LIMIT=$limit_ms CURRENT_T0=$(now_ms)
    # In the background and waited for, so that a signal to this script is handled at once.
    timeout -s INT -k "$KILL_AFTER" "$(secs "$limit_ms")" "${cmd[@]}" >"$log" 2>&1 </dev/null &
    STAGE_PID=$!
    wait "$STAGE_PID"
    local rc=$?
    local wall_ms=$(($(now_ms) - CURRENT_T0))
    STAGE_PID= CURRENT=
    case $rc in
    0) status=${status:-ok} ;;
    124) status="stopped at its limit" ;;
    137) status="killed after its limit" ;;
    *) status="failed" ;;
    esac
    record "$name" "$limit_ms" "$wall_ms" "$rc" "$status"
    tail -n "${TAIL_LINES:-6}" "$log"
}

collect() {  # the results the stages left in $WORK, copied into $OUT (small files only)
    local name
    for name in realization goals moba divisible; do
        [[ -f $WORK/bench-$name/bench.json ]] &&
            cp "$WORK/bench-$name/bench.json" "$OUT/bench-$name.json"
    done
    for name in bench-decode.json bench-decode.md; do
        [[ -f $WORK/decode/$name ]] && cp "$WORK/decode/$name" "$OUT/$name"
        [[ -f $WORK/decode-compiled/$name ]] &&
            cp "$WORK/decode-compiled/$name" "$OUT/${name/bench-decode/bench-decode-compiled}"
    done
    for name in "${FINDINGS_RUN[@]}"; do
        [[ -f $WORK/standard-$name/results.jsonl ]] &&
            cp "$WORK/standard-$name/results.jsonl" "$OUT/standard-$name.jsonl"
    done
    return 0
}

bundle() {  # every file of $OUT but the summary and stages.tsv, in one archive
    local files=()
    mapfile -t files < <(cd "$OUT" && find . -type f ! -name summary.md ! -name stages.tsv \
        ! -name campaign.tar.gz | sort)
    ((${#files[@]})) || return 0
    tar -czf "$OUT/campaign.tar.gz" -C "$OUT" "${files[@]}" && (cd "$OUT" && rm -f "${files[@]}")
}

finish() {  # on exit, also after a signal: the stage under way recorded, the files, the summary
    local rc=$?
    trap - EXIT TERM INT HUP
    [[ -n $WATCHDOG ]] && kill "$WATCHDOG" 2>/dev/null
    if [[ -n $STAGE_PID ]]; then
        kill -INT "$STAGE_PID" 2>/dev/null  # timeout passes it on; SIGKILL follows its grace
        wait "$STAGE_PID" 2>/dev/null
        record "$CURRENT" "$CURRENT_LIMIT" $(($(now_ms) - CURRENT_T0)) - "interrupted"
    fi
    collect
    local left_ms=$((DEADLINE_MS - $(now_ms)))
    ((left_ms < 15000)) && left_ms=15000
    if ! timeout -k 2 "$(secs "$left_ms")" "$PY" -m eval goals "$OUT" "${SUMMARY_ARGS[@]}" \
        >"$OUT/goals.log" 2>&1 || [[ ! -s $OUT/summary.md ]]; then
        {
            echo "# GPU campaign: which goals hold"
            echo
            echo "- GPU tests: see gpu-tests.txt (the summary failed: see goals.log)"
            for goal in a b c d e; do echo "- goal ($goal): not measured; the summary failed"; done
        } >"$OUT/summary.md"
    fi
    echo "== summary ($OUT/summary.md)"
    head -n 12 "$OUT/summary.md"
    [[ ${ZOO_GPU_SESSION_BUNDLE:-0} == 1 ]] && bundle
    save_cache
    rm -rf "$WORK"
    exit "$rc"
}

start_list() {
    START_MS=$(now_ms)
    DEADLINE_MS=$((START_MS + LIMIT * 1000))
    RESERVE_MS=$((LIMIT * 10 * RESERVE_PCT))
    ((RESERVE_MS < 3000)) && RESERVE_MS=3000
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/zoo-gpu-session.XXXXXX")
    export WORK
    printf 'stage\tlimit_s\twall_s\texit\tstatus\n' >"$OUT/stages.tsv"
    trap finish EXIT
    trap 'echo "== stopped by a signal"; exit 143' TERM INT HUP
    # The stages' limits keep the list within LIMIT; past it (plus the last SIGKILL grace), this
    # stops the script the way a signal from outside would, and the summary is still written.
    (
        trap 'kill "$nap" 2>/dev/null; exit 0' TERM
        sleep $((LIMIT + KILL_AFTER + 1)) &
        nap=$!
        wait "$nap" && kill -TERM $$
    ) >/dev/null 2>&1 </dev/null &
    WATCHDOG=$!
}

# pytest's arguments for the GPU tests: a line per test as it ends (-v; under xdist also when the
# run is stopped), the failures' summary and the time of every test of 2 s or more at the end (the
# whole run took 398 s at 12 workers on the H200: which tests to trim), xdist workers where it
# imports.
test_args() {
    TEST_ARGS=(-v -rfE -p no:cacheprovider --durations=0 --durations-min=2)
    if [[ $FAKE != 1 ]] && "$PY" -c "import xdist" 2>/dev/null; then
        TEST_ARGS+=(-n "${TEST_WORKERS:-12}")
        export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}
    fi
}

FINDINGS_RUN=()
SUMMARY_ARGS=()
case $stage in
all)
    check_shares
    start_list
    run_stage env "$(share_of env)" "$OUT/environment.txt" "$PY" -c "$ENV_PY"
    test_args
    run_stage tests "$(share_of tests)" "$OUT/gpu-tests.txt" \
        "$PY" -m pytest -m gpu "${TEST_ARGS[@]}"
    for name in realization goals moba; do
        config=eval/configs/bench_goals_gpu.yaml
        [[ $name != goals ]] && config=eval/configs/bench_goals_${name}_gpu.yaml
        run_stage "$name" "$(share_of "$name")" "$OUT/bench-$name.log" \
            "$PY" -m eval bench "$config" "out=$WORK/bench-$name" plots=false
        collect
    done
    # What the kernel of symbolic lengths costs, which the zoo's flex runs from its second length
    # on: at 16K (the second length here) local attention took 1.4x flex_standard's time on the
    # H200. auto, flex_static (compiled per length) and flex_standard side by side, forward.
    run_stage divisible "$(share_of divisible)" "$OUT/bench-divisible.log" \
        "$PY" -m eval bench eval/configs/bench_divisible_gpu.yaml "out=$WORK/bench-divisible" \
        'lengths=[8192,16384]' 'passes=[fwd]' plots=false
    collect
    # The host time the zoo's call adds around a stubbed kernel on this machine's host, with
    # CUDA tensors (25-33 us on a 2-core EPYC before call plans, 6-7 us with them); MoBA's too,
    # whose choice and gathered rows are about 190 operations a call (eval/results/moba-gathered-cpu).
    run_stage overhead "$(share_of overhead)" "$OUT/overhead.log" \
        "$PY" -m eval bench-overhead device=cuda 'lengths=[8192]' 'backends=[flex,sdpa]' \
        'variants=[local,longformer,block_local,bigbird,causal,full,moba]' "out=$OUT"
    # The goal cells' kernels and host work beside their twins': 8K then 16K (where host time
    # decides: auto took 1.97x flex_standard's time at 8K on the H100), forward, non-causal.
    run_stage profile "$(share_of profile)" "$OUT/profile.log" \
        "$PY" -m eval bench-profile eval/configs/bench_goals_gpu.yaml "out=$OUT" \
        'lengths=[8192,16384]' 'passes=[fwd]' 'causal=[false]' warmup=2 repeats=3
    # MoBA's kernels and host work on flex (its queries gathered by chosen key block: about 190
    # operations around one kernel call, eval/results/moba-gathered-cpu) and on blocked at 16K,
    # forward (blocked took 50.8 ms on the H100, block_local at its density 0.42 ms).
    run_stage profile_moba "$(share_of profile_moba)" "$OUT/profile-moba.log" \
        "$PY" -m eval bench-profile eval/configs/bench_goals_moba_gpu.yaml "out=$OUT/profile-moba" \
        'variants=[moba]' 'backends=[flex,blocked]' 'peers=[]' 'lengths=[16384]' 'passes=[fwd]' \
        'causal=[false,true]' warmup=1 repeats=2
    # The zoo's decoding step (auto) and SDPA over the whole cache, each zoo step profiled too
    # (its kernels, the host's gaps and functions: a causal step took 60-73 ms against SDPA's
    # 0.06-0.4 ms on the H100); bench-decode rewrites its JSON after every (variant, length), so a
    # cut-short stage keeps the steps it timed.
    run_stage decode "$(share_of decode)" "$OUT/decode.log" \
        "$PY" -m eval bench-decode eval/configs/bench_decode.yaml "out=$WORK/decode" \
        'backends=[auto]' 'peers=[sdpa_dense]' 'lengths=[4096,16384,65536]' warmup=5 repeats=20 \
        profile=2
    collect
    # The same steps compiled over a static cache in reduce-overhead mode (one CUDA graph per
    # step shape, replayed: no host work per kernel; the eager steps took 0.4-1.5 ms on the H200,
    # SDPA over the whole cache 0.06-0.34 ms), each profiled: its kernels by name (a compiled
    # causal step on sdpa's masked kernel took 0.87 ms at 16K, one thread block per row and
    # key/value head over all slots). Goal (c) judges the faster of the two on auto (sdpa, its
    # masked slots split into runs: zoo/backends/split_keys.py); sdpa_whole, the same without
    # the split, and flex, which splits the slots too, beside it (flex's compiled steps failed
    # in Inductor on the H200 at 0cfc45f, XBLOCK, when auto took flex for a static cache).
    run_stage decode_compiled "$(share_of decode_compiled)" "$OUT/decode-compiled.log" \
        "$PY" -m eval bench-decode eval/configs/bench_decode.yaml "out=$WORK/decode-compiled" \
        'backends=[auto,sdpa_whole,flex]' 'peers=[sdpa_dense]' 'compile=[true]' static_cache=true \
        compile_mode=reduce-overhead 'variants=[causal,sliding_window,longformer,bigbird]' \
        'lengths=[16384,65536]' warmup=5 repeats=20 profile=2
    collect
    run_stage compiles "$(share_of compiles)" "$OUT/compiles.log" \
        "$PY" -m eval bench-compiles "out=$OUT"
    exit 0
    ;;
findings)
    # The findings' GPU twins one after another, each an equal share of 87% of LIMIT (FINDINGS
    # names which; listops_gpu runs one variant per piece; mqar-gap-spread, which trains until
    # learned, in a command of its own: FINDINGS=mqar-gap-spread). Their results, standard-NAME.jsonl,
    # go to eval/results/findings-gpu/NAME/ as the end of this file says.
    read -ra FINDINGS_RUN <<<"${FINDINGS:-mqar-gap-zoology mqar-gap-uniform extrapolation}"
    SUMMARY_ARGS=(goals=false)
    start_list
    run_stage env 3 "$OUT/environment.txt" "$PY" -c "$ENV_PY"
    pct=$((87 / ${#FINDINGS_RUN[@]}))
    for name in "${FINDINGS_RUN[@]}"; do
        case $name in
        listops-*) args=(eval/configs/findings/listops_gpu.yaml "variants=[${name#listops-}]") ;;
        *) args=("eval/configs/findings/${name//-/_}_gpu.yaml") ;;
        esac
        run_stage "$name" "$pct" "$OUT/standard-$name.log" "$PY" -m eval run "${args[@]}" \
            "out=$WORK/standard-$name" save_checkpoints=false
        collect
    done
    exit 0
    ;;
esac

"$PY" -c "$ENV_PY" | tee "$OUT/environment.txt"

# One piece (bench, standard, decode) writes under PIECES, where an earlier command on the same warm
# machine left its files: a file is shipped only where this command wrote it (newer than STARTED),
# else the piece failed (exit 1). An earlier command's bench.json was shipped as this one's, exit 0.
PIECES=${TMPDIR:-/tmp}
STARTED=$(mktemp "$PIECES/zoo-piece-start.XXXXXX")
PIECE_RC=0
ship() {  # FROM TO
    if [[ $1 -nt $STARTED ]]; then
        cp "$1" "$2"
    else
        echo "== this command wrote no $1: nothing shipped" >&2
        PIECE_RC=1
    fi
}
case $stage in
tests)
    test_args
    timeout -s INT -k "$KILL_AFTER" "$LIMIT" "$PY" -m pytest -m gpu "${TEST_ARGS[@]}" 2>&1 |
        tee "$OUT/gpu-tests.txt"
    ;;
bench)
    name=${1:?"bench NAME [key=value ...]"}
    shift
    timeout -s INT "$LIMIT" "$PY" -m eval bench "${BENCH_CONFIG:-eval/configs/bench.yaml}" \
        "out=$PIECES/bench-$name" plots=false "$@" 2>&1 |
        tee "$OUT/bench-$name.log"
    ship "$PIECES/bench-$name/bench.json" "$OUT/bench-$name.json"
    ;;
standard)
    name=${1:?"standard NAME [key=value ...]"}
    shift
    # results.jsonl is appended to (a run started again skips the cells done): newer is this run's
    timeout -s INT "$LIMIT" "$PY" -m eval run "${RUN_CONFIG:-eval/configs/standard.yaml}" \
        "out=$PIECES/standard-$name" \
        save_checkpoints=false "$@" 2>&1 | tee "$OUT/standard-$name.log"
    ship "$PIECES/standard-$name/results.jsonl" "$OUT/standard-$name.jsonl"
    ;;
decode)
    name=${1:?"decode NAME [key=value ...]"}
    shift
    timeout -s INT "$LIMIT" "$PY" -m eval bench-decode eval/configs/bench_decode.yaml \
        "out=$PIECES/decode-$name" "$@" 2>&1 | tee "$OUT/decode-$name.log"
    # The JSON is rewritten after every (variant, length); the markdown only at the end.
    ship "$PIECES/decode-$name/bench-decode.json" "$OUT/"
    [[ $PIECES/decode-$name/bench-decode.md -nt $STARTED ]] &&
        cp "$PIECES/decode-$name/bench-decode.md" "$OUT/"
    ;;
*)
    rm -f "$STARTED"
    echo "unknown stage $stage: all, findings, tests, bench, standard or decode" >&2
    exit 2
    ;;
esac
rm -f "$STARTED"
save_cache
exit "$PIECE_RC"

# Back on the development machine, with the files under eval/results/gpu/:
#   python -m eval bench-report eval/results/gpu/bench-*.json out=eval/results/bench-gpu
#   python -m eval auto-table eval/results/bench-gpu/bench.json
#   cat eval/results/gpu/standard-*.jsonl > eval/results/standard/results.jsonl
#   python -m eval report eval/results/standard/results.jsonl
#   mkdir -p eval/results/findings-gpu/NAME && cat eval/results/gpu/standard-NAME*.jsonl \
#       > eval/results/findings-gpu/NAME/results.jsonl   # each finding's twin, then:
#   python -m eval findings --gpu
