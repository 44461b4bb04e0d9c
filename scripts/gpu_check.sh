#!/usr/bin/env bash
# The prepared GPU check: one command, one results file (RESULTS, markdown), on one NVIDIA GPU without internet.
#
#   scripts/gpu_check.sh                 # on the GPU machine: CUDA, bf16, the paper's small size; about 8 minutes
#   scripts/gpu_check.sh --device cpu    # the dry run: every part on CPU at tiny sizes (a few minutes on 2 cores)
#   scripts/gpu_check.sh --followup      # parts 5-8 instead: what decides Triton and compile on CUDA; as long
#
# Parts, each under its own time limit so that one that hangs cannot take the rest with it (a part that fails is
# recorded and the check goes on), and none past BUDGET seconds from the start (a device call has 600 in all):
#   1. versions (GPU, driver, Python, torch, CUDA, Triton, transformers, accelerate)
#   2. bench.py --size small --dtype bfloat16: Llama, d_v=1, CC+EC, TC+EC; DDL's default paths, then --implementation
#      triton (train tok/s, decode tok/s at batch 1 and 8, peak training memory; ratios to Llama in the same run)
#   3. a 200-step train.py run through `accelerate launch` in bf16, and the sample generated from its checkpoint
#   4. the model and kernel tests on the GPU (DDL_TEST_DEVICE=cuda; fp32, bf16 and fp16 cases)
# and with --followup, after a first run (docs/gpu.md):
#   5. the compile tests on the GPU, and the two model tests the first run could not rerun
#   6. part 3 with Triton (DDL_IMPLEMENTATION=triton): its kernels under autocast; the losses should follow part 3's
#   7. bench.py --compile: compiled static-cache decoding (CUDA graphs on CUDA), against Llama's
#   8. bench.py --compile: compiled training, d_v=1 against Llama
# Packages the machine lacks travel as wheels in .whl/ (see docs/gpu.md); they are installed into a private folder.
set -uo pipefail
OUT_DIR=$(realpath -m "${OUT:-$(dirname "$0")/../gpu_check_out}")  # (OUT: from the caller's folder, before the cd)
cd "$(dirname "$0")/.."
DEVICE=cuda
FOLLOWUP=0
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --followup) FOLLOWUP=1; shift ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --device cpu|cuda, --followup)"; exit 2 ;;
    esac
done
RESULTS=$OUT_DIR/gpu_check.md
[ $FOLLOWUP = 1 ] && RESULTS=$OUT_DIR/gpu_check_followup.md
if [ -e "$RESULTS" ]; then
    echo "gpu_check.sh: $RESULTS exists (an earlier run's): move it, or set OUT to another folder"; exit 2
fi
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d)
PART=  # the running part's `timeout`, in a process group of its own that Ctrl-C does not reach: passed on here
trap 'rm -rf "$WORK"' EXIT
trap '[ -n "$PART" ] && kill -INT "$PART" 2>/dev/null; echo "gpu_check.sh: interrupted; what ran is in $RESULTS"
      exit 130' INT TERM
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        .whl/*.whl \
        || echo "gpu_check.sh: the carried wheels did not install"
    export PYTHONPATH=$WORK/site:$PWD
else
    export PYTHONPATH=$PWD
fi
if [ "$DEVICE" = cpu ]; then
    SIZE=tiny; REPEATS=1; STEPS=5; PRECISION=no; BUDGET=${BUDGET:-1800}; export CUDA_VISIBLE_DEVICES=""
else
    SIZE=small; REPEATS=3; STEPS=200; PRECISION=bf16; BUDGET=${BUDGET:-570}
fi

section() { printf '\n## %s\n\n' "$1" >>"$RESULTS"; echo "== $1 ($(date +%T))"; }
record() {  # record LIMIT_SECONDS LOG COMMAND...: runs it, its exit status and time go to the results
    local limit=$1 log=$2 start=$SECONDS status
    shift 2
    [ $((BUDGET - SECONDS)) -lt "$limit" ] && limit=$((BUDGET - SECONDS))
    if [ "$limit" -lt 10 ]; then
        printf -- '- `%s`: **not run: the check had used its %s s**\n' "$*" "$BUDGET" >>"$RESULTS"; return 124
    fi
    timeout -k 10 "$limit" "$@" >"$log" 2>&1 &  # (waited for with `wait`, which a signal interrupts)
    PART=$!
    wait "$PART"
    status=$?
    PART=
    [ $status -eq 124 ] && echo "**stopped at its ${limit}s limit**" >>"$RESULTS"
    printf -- '- `%s`: exit %s, %ss\n' "$*" "$status" "$((SECONDS - start))" >>"$RESULTS"
    return $status
}

train_part() {  # train_part IMPLEMENTATION LOG: train.py through accelerate launch, its log lines and sample
    DDL_IMPLEMENTATION=$1 record 120 "$2" "$PY" "${LAUNCH[@]}" train.py --max_steps "$STEPS" \
        --output_dir "$WORK/run_$1" --eval_steps 100 --save_steps 100 --logging_steps 20 --sample_max_new_tokens 60 \
        --report_to none
    { echo '```'; tr '\r' '\n' <"$2" | grep -E "^\{|^data:|^saved|Error|error|failed" | grep -v Warning | tail -20
      sed -n '/^--- sample/,$p' "$2" | head -20; echo '```'; } >>"$RESULTS"
}
LAUNCH=(-m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision "$PRECISION"
        --dynamo_backend no)
[ "$DEVICE" = cpu ] && LAUNCH+=(--cpu)

KIND=$([ $FOLLOWUP = 1 ] && echo ', follow-up')
echo "# DDL GPU check$KIND, $(date -u +%Y-%m-%dT%H:%MZ), device $DEVICE" >"$RESULTS"

section "1. Versions"
{
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -3
    "$PY" - <<'PY'
import platform, torch, transformers, accelerate
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import triton; print("triton", triton.__version__)
except Exception as e: print("triton: not importable:", e)
print("transformers", transformers.__version__, "| accelerate", accelerate.__version__)
try:
    import datasets; print("datasets", datasets.__version__)
except Exception as e: print("datasets: not importable:", e)
PY
    echo '```'
} >>"$RESULTS" 2>&1

if [ $FOLLOWUP = 0 ]; then
section "2. bench.py --size $SIZE, bf16: DDL's default paths, then Triton"
for impl in auto triton; do
    # (in one process: one process per model would start 12 CUDA workers; --overwrite: this script's own folder)
    record 150 "$OUT_DIR/bench_$impl.log" "$PY" bench.py --size "$SIZE" --device "$DEVICE" --dtype bfloat16 \
        --variants llama ddl-dv1 ddl-cc ddl-tc --implementation "$impl" --repeats "$REPEATS" --train_steps 5 \
        --train_in_process --overwrite --json "$OUT_DIR/bench_$impl.json"
    { echo; echo "implementation=$impl:"; echo '```'
      grep -vE "^\s*$|USDT|repeats done" "$OUT_DIR/bench_$impl.log" | tail -25; echo '```'; } >>"$RESULTS"
done

section "3. train.py, $STEPS steps through accelerate launch (mixed precision: $PRECISION), and its sample"
train_part torch "$OUT_DIR/train.log"

section "4. The model and kernel tests on $DEVICE (DDL_TEST_DEVICE=$DEVICE)"
DDL_TEST_DEVICE=$DEVICE record 900 "$OUT_DIR/tests.log" "$PY" -m pytest -q -p no:cacheprovider -rfE \
    tests/test_device.py tests/test_kernels.py tests/test_delta_update.py tests/test_modeling_ddl.py
{ echo '```'; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT_DIR/tests.log" | tail -40; echo '```'; } >>"$RESULTS"

else  # the most telling first
section "5. The compile tests and the two model tests not yet rerun, on $DEVICE"
DDL_TEST_DEVICE=$DEVICE record 150 "$OUT_DIR/tests_followup.log" "$PY" -m pytest -q -p no:cacheprovider -rfE \
    tests/test_compile.py tests/test_modeling_ddl.py -k "compile or trainer_runs or remote_code_loading"
{ echo '```'; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT_DIR/tests_followup.log" | tail -40; echo '```'
} >>"$RESULTS"

section "6. train.py, $STEPS steps through accelerate launch (mixed precision: $PRECISION), with Triton"
train_part triton "$OUT_DIR/train_triton.log"

for part in "7 decode 200" "8 train 900"; do
    set -- $part
    section "$1. bench.py --size $SIZE --compile, bf16: $2 compiled$([ "$2" = decode ] && echo ' (static cache)')"
    skip=(prefill memory); [ "$2" = decode ] && skip+=(train) || skip+=(decode)
    variants=(llama ddl-dv1 ddl-tc); [ "$2" = train ] && variants=(llama ddl-dv1)
    record "$3" "$OUT_DIR/bench_compile_$2.log" "$PY" bench.py --size "$SIZE" --device "$DEVICE" --dtype bfloat16 \
        --compile --variants "${variants[@]}" --repeats 2 --train_steps 5 --train_in_process --skip "${skip[@]}" \
        --overwrite --json "$OUT_DIR/bench_compile_$2.json"
    { echo '```'; grep -vE "^\s*$|USDT|repeats done" "$OUT_DIR/bench_compile_$2.log" | tail -12; echo '```'
    } >>"$RESULTS"
done
fi

echo "gpu_check.sh: results in $RESULTS"
