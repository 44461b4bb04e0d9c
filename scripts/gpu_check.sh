#!/usr/bin/env bash
# The prepared GPU check: one command, one results file (RESULTS, markdown), on one NVIDIA GPU without internet.
#
#   scripts/gpu_check.sh                 # on the GPU machine: CUDA, bf16, the paper's small size; within 9 minutes
#   scripts/gpu_check.sh --device cpu    # the dry run: every part on CPU at tiny sizes (a few minutes on 2 cores)
#
# Parts, each under its own time limit so that one that hangs cannot take the rest with it (a part that fails is
# recorded and the check goes on):
#   1. versions (GPU, driver, Python, torch, CUDA, Triton, transformers, accelerate)
#   2. bench.py --size small --dtype bfloat16: Llama, d_v=1, CC+EC, TC+EC; DDL's default paths, then --implementation
#      triton (train tok/s, decode tok/s at batch 1 and 8, peak training memory; ratios to Llama in the same run)
#   3. a 200-step train.py run through `accelerate launch` in bf16, and the sample generated from its checkpoint
#   4. the model and kernel tests on the GPU (DDL_TEST_DEVICE=cuda; fp32, bf16 and fp16 cases)
# Packages the machine lacks travel as wheels in .whl/ (see docs/gpu.md); they are installed into a private folder.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --device cpu|cuda)"; exit 2 ;;
    esac
done
OUT_DIR=${OUT:-gpu_check_out}
mkdir -p "$OUT_DIR"
RESULTS=$OUT_DIR/gpu_check.md
WORK=$(mktemp -d)
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
        || echo "gpu_check.sh: the carried wheels did not install"
    export PYTHONPATH=$WORK/site:$PWD
else
    export PYTHONPATH=$PWD
fi
if [ "$DEVICE" = cpu ]; then
    SIZE=tiny; REPEATS=1; STEPS=5; TEST_LIMIT=900; PRECISION=no; export CUDA_VISIBLE_DEVICES=""
else
    SIZE=small; REPEATS=3; STEPS=200; TEST_LIMIT=240; PRECISION=bf16  # (the tests compile every Triton kernel)
fi

section() { printf '\n## %s\n\n' "$1" >>"$RESULTS"; echo "== $1 ($(date +%T))"; }
record() {  # record LIMIT_SECONDS LOG COMMAND...: runs it, its exit status and time go to the results
    local limit=$1 log=$2 start=$SECONDS status
    shift 2
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
    status=$?
    [ $status -eq 124 ] && echo "**stopped at its ${limit}s limit**" >>"$RESULTS"
    printf -- '- `%s`: exit %s, %ss\n' "$*" "$status" "$((SECONDS - start))" >>"$RESULTS"
    return $status
}

echo "# DDL GPU check, $(date -u +%Y-%m-%dT%H:%MZ), device $DEVICE" >"$RESULTS"

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

section "2. bench.py --size $SIZE, bf16: DDL's default paths, then Triton"
for impl in auto triton; do
    record 150 "$OUT_DIR/bench_$impl.log" "$PY" bench.py --size "$SIZE" --device "$DEVICE" --dtype bfloat16 \
        --variants llama ddl-dv1 ddl-cc ddl-tc --implementation "$impl" --repeats "$REPEATS" --train_steps 5 \
        --train_in_process --json "$OUT_DIR/bench_$impl.json"  # (one process per model would start 12 CUDA workers)
    { echo; echo "implementation=$impl:"; echo '```'; grep -vE "^\s*$|USDT|repeats done" "$OUT_DIR/bench_$impl.log" | tail -25; echo '```'; } >>"$RESULTS"
done

section "3. train.py, $STEPS steps through accelerate launch (mixed precision: $PRECISION), and its sample"
LAUNCH=(-m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision "$PRECISION" --dynamo_backend no)
[ "$DEVICE" = cpu ] && LAUNCH+=(--cpu)
DDL_IMPLEMENTATION=torch record 150 "$OUT_DIR/train.log" "$PY" "${LAUNCH[@]}" train.py --max_steps "$STEPS" \
    --output_dir "$WORK/run" --eval_steps 100 --save_steps 100 --logging_steps 20 --sample_max_new_tokens 60 \
    --report_to none
{ echo '```'; tr '\r' '\n' <"$OUT_DIR/train.log" | grep -E "^\{|^data:|^saved|Error|error" | grep -v Warning | tail -20
  sed -n '/^--- sample/,$p' "$OUT_DIR/train.log" | head -20; echo '```'; } >>"$RESULTS"

section "4. The model and kernel tests on $DEVICE (DDL_TEST_DEVICE=$DEVICE)"
DDL_TEST_DEVICE=$DEVICE record "$TEST_LIMIT" "$OUT_DIR/tests.log" "$PY" -m pytest -q -p no:cacheprovider -rfE \
    tests/test_device.py tests/test_kernels.py tests/test_delta_update.py tests/test_modeling_ddl.py
{ echo '```'; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT_DIR/tests.log" | tail -40; echo '```'; } >>"$RESULTS"

echo "gpu_check.sh: results in $RESULTS"
rm -rf "$WORK"
