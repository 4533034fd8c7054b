#!/usr/bin/env bash
# The GPU checks of the open issues in one lease (a lent GPU machine runs this from the repo root;
# results come back under $OUT). Each step has its own time limit, so one that overruns costs only
# itself; the records so far are packed into $OUT/gpu.tar.gz after every step. PART picks the steps:
#   OUT=/tmp/out bash scripts/device_checks.sh           (one 10-minute call: what issue 34 still
#                                                         lacks: sparse's tiles, the fp16 forward, pytest)
#   OUT=/tmp/out PART=train bash scripts/device_checks.sh (experiment=gpu_train in bf16, 5 minutes)
#   OUT=/tmp/out PART=34 bash scripts/device_checks.sh   (issue 34's checks, then pytest -m cuda)
#   OUT=/tmp/out PART=37 bash scripts/device_checks.sh   (issue 37's xFormers runs)
#   OUT=/tmp/out PART=gpu bash scripts/device_checks.sh  (experiment=gpu's forward, gpu_train in bf16)
# Wheels of what the GPU image lacks (hydra-core, omegaconf, antlr4, xformers) are read from .whl/.
# Each call works in a fresh folder $WORK/<date>-<pid> (WORK=/tmp/gpu unless set): its records, logs
# and summary.txt, so no earlier call's records are resumed or summarized. An unknown PART is refused
# before any work (exit 2); the call exits 1 when any step failed, after printing the summary.
set -u
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header above, without starting any work
    sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
fi
# The parts: PART=NAME runs part_NAME, the steps below in that order. Their names are written here only:
# the check that follows and the dispatch at the end both go by these functions.
part_lease() {  # what issue 34 lacks after the H100 leases of 2026-11-26: sparse's auto tile at N=65536
    # and in 64-wide tiles at B=4 H=16 D=128 (its first call autotunes for over a minute), then
    # experiment=gpu's fp16 forward (CUDA-graph replay; bf16 is in results/gpu/h100/gpu_fwd_bf16) and
    # pytest -m cuda in what time is left; PART=train follows
    patterns_long 120; patterns_tile_large 200; gpu_fwd 150 dtype=float16
    pytest_cuda $((SECONDS < 500 ? 560 - SECONDS : 30))
}
part_train() { gpu_train 300; }
part_h100_2026_11_26() {  # the order that lease ran (issues 34 and 37)
    chunked_triton; patterns_small; patterns_large; pytest_cuda 130; xformers_gpu 100; decode_chunked; decode_splitk
}
part_34() { chunked_triton; chunked_triton_large; decode_chunked; patterns_tile; patterns_large; pytest_cuda $((560 - SECONDS)); }
part_37() { xformers_gpu; sdpa_gpu; decode_sdpa; decode_splitk; }
part_gpu() { gpu_fwd; gpu_train; }
PART=${PART:-lease}
if ! declare -F "part_$PART" >/dev/null; then  # refused before any work
    parts=$(declare -F | sed -n 's/^declare -f part_//p' | paste -sd, | sed 's/,/, /g; s/, \([^,]*\)$/ or \1/')
    echo "PART must be $parts, not $PART" >&2
    exit 2
fi
OUT=${OUT:-/tmp/out}
W=${WORK:-/tmp/gpu}/$(date +%Y%m%d-%H%M%S)-$$  # this call's records and logs, packed into $OUT/gpu.tar.gz
mkdir -p "$OUT" "$W" || exit 1
echo "work folder: $W"
FAILED=0  # steps whose exit status was not 0
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
pack() { tar czf "$OUT/gpu.tar.gz" -C "$W" . ; }
step() {  # step NAME SECONDS COMMAND...: its output in $W/NAME.log, its exit status in the summary
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$W/$name.log" 2>&1
    local rc=$?
    ((rc == 0)) || FAILED=$((FAILED + 1))
    echo "step $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$W/summary.txt"
    tail -n 25 "$W/$name.log"
    pack
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$W/gpu.txt"
python3 -c "import torch, triton, xformers; print('torch', torch.__version__, 'triton', triton.__version__, 'xformers', xformers.__version__)" 2>&1 | grep -v WARN | tee -a "$W/gpu.txt"
R=$W/records
# issue 34: chunked's Triton path (auto takes it on CUDA) beside dense sdpa, N=1k-16k, both dtypes and modes
chunked_triton() { step chunked_triton 110 python3 run.py -m experiment=gpu variant=chunked,sdpa min_run_time=0.1 isolate=false records_dir=$R/chunked_triton; }
chunked_triton_large() { step chunked_triton_large 40 python3 run.py -m experiment=gpu variant=chunked,sdpa batch=4 heads=16 head_dim=128 seq_len=16384 dtype=bfloat16 mode=fwd_bwd min_run_time=0.1 isolate=false records_dir=$R/chunked_triton_large; }
# one query against 16k-128k keys (GQA 32:4, D=128): chunked's split-K Triton kernel beside sdpa; GB/s
# against the copy bandwidth
decode_chunked() { step decode_chunked 50 python3 run.py -m experiment=decode device=cuda dtype=bfloat16 variant=chunked,sdpa seq_len=1 kv_len=16384,65536,131072 isolate=false records_dir=$R/decode; }
# the pattern kernels, each call's longest kernels printed (is sparse's time one tile row's tail?); on
# CUDA xFormers' window is a contender too (issue 37)
patterns_small() { step patterns_small 90 python3 scripts/pattern_vs_flex.py --device cuda --dtype bfloat16 --mode fwd_bwd --lengths 4096 16384 65536 --shape 1 8 64 --rounds 3 --min-run-time 0.05 --contenders "local_window,sparse,sparse[global in mask],sparse[global dense],xformers window" --profile 6 --json $W/patterns_small.json; }
patterns_large() { step patterns_large 50 python3 scripts/pattern_vs_flex.py --device cuda --dtype bfloat16 --mode fwd_bwd --lengths 16384 --shape 4 16 128 --rounds 3 --min-run-time 0.05 --contenders "local_window,sparse,sparse[global in mask],sparse[global dense],xformers window" --profile 6 --json $W/patterns_large.json; }
# sparse's placements: cuda_tile=auto (64-wide tiles with the global rows in the mask where the 128
# kernel's global tile row is its tail), 128 in mask / apart, 64 in mask / apart; the first call of a
# 64-wide kernel autotunes (20-35 s at B=1, over a minute at B=4 H=16 D=128)
patterns_tile() { step patterns_tile "${1:-150}" python3 scripts/pattern_vs_flex.py --device cuda --dtype bfloat16 --mode fwd_bwd --lengths 4096 16384 --shape 1 8 64 --rounds 3 --min-run-time 0.05 --contenders "local_window,sparse,sparse[global in mask],sparse[global dense],sparse[tile 64],sparse[tile 64 global dense]" --json $W/patterns_tile.json; }
patterns_tile_large() { step patterns_tile_large "${1:-200}" python3 scripts/pattern_vs_flex.py --device cuda --dtype bfloat16 --mode fwd_bwd --lengths 16384 --shape 4 16 128 --rounds 3 --min-run-time 0.05 --contenders "sparse,sparse[tile 64]" --json $W/patterns_tile_large.json; }
patterns_long() { step patterns_long "${1:-120}" python3 scripts/pattern_vs_flex.py --device cuda --dtype bfloat16 --mode fwd_bwd --lengths 65536 --shape 1 8 64 --rounds 3 --min-run-time 0.05 --contenders "local_window,sparse,sparse[global dense]" --json $W/patterns_long.json; }
pytest_cuda() {
    step pytest_cuda "$1" python3 -m pytest -m cuda -v -p no:cacheprovider -n 8 --timeout 120 -ra
    grep -E "FAILED|ERROR" "$W/pytest_cuda.log" | head -40
    tail -n 5 "$W/pytest_cuda.log"
}
# issue 37: xFormers operator by operator (auto, cutlass, flash), then its split-K decode beside sdpa's
xformers_gpu() { step xformers_gpu "${1:-110}" python3 run.py -m experiment=gpu_xformers variant=xformers variant.lift_gate=true min_run_time=0.1 isolate=false records_dir=$R/gpu_xformers; }
sdpa_gpu() { step sdpa_gpu 45 python3 run.py -m experiment=gpu variant=sdpa min_run_time=0.2 isolate=false records_dir=$R/gpu_xformers; }
decode_sdpa() { step decode_sdpa 70 python3 run.py -m experiment=decode device=cuda dtype=bfloat16 variant=sdpa seq_len=1 kv_len=16384,65536,131072 isolate=false records_dir=$R/decode; }
decode_splitk() { step decode_splitk 50 python3 run.py -m experiment=decode device=cuda dtype=bfloat16 variant=xformers variant.op=triton_splitk,auto variant.lift_gate=true seq_len=1 kv_len=16384,65536,131072 isolate=false records_dir=$R/decode; }
# what results/gpu lacks of experiment=gpu and gpu_train (the H100 run took bf16 fwd_bwd): the forward
# with its CUDA-graph replay in both dtypes, then gpu_train's bf16 rows; each step keeps what it measured
gpu_fwd() { step gpu_fwd "${1:-300}" python3 run.py -m experiment=gpu mode=fwd min_run_time=0.2 isolate=false records_dir=$R/gpu_fwd "${@:2}"; }
# gpu_train in fwd_bwd mode only: it times the forward, the backward and both (what fwd mode adds is the
# forward's CUDA-graph replay, which experiment=gpu has), so 64 jobs in bf16 instead of 128
gpu_train() { step gpu_train "${1:-240}" python3 run.py -m experiment=gpu_train dtype=bfloat16 mode=fwd_bwd min_run_time=0.2 isolate=false records_dir=$R/gpu_train; }
"part_$PART"  # the steps of PART (checked above)
cat "$W/summary.txt"
if ((FAILED > 0)); then
    echo "$FAILED step(s) failed (rc != 0); logs in $W and $OUT/gpu.tar.gz" >&2
    exit 1
fi
