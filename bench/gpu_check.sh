#!/usr/bin/env bash
# Every GPU check of gradcomp in one run (a few minutes on one GPU), report written to $1:
#   1. environment: GPU name, driver, versions, whether CuPy sees the device;
#   2. NVRTC compiles every kernel family (warms CuPy's cache for what follows);
#   3. the GPU tests of the kernels (pytest -m gpu, in three groups), then all other GPU tests;
#   4. the kernel benchmarks (bandwidth vs a device-to-device copy, top-k vs torch.topk).
# A part that fails or runs out of time is reported as such and the next part still runs.
# Full logs go to "$1.logs/". Usage, from anywhere, after `pip install -e .`:
#   bash bench/gpu_check.sh REPORT_PATH
set -u

REPORT="${1:?usage: bash bench/gpu_check.sh REPORT_PATH}"
mkdir -p "$(dirname "$REPORT")"
REPORT="$(cd "$(dirname "$REPORT")" && pwd)/$(basename "$REPORT")"
LOGS="$REPORT.logs"
BUDGET="${GPU_CHECK_BUDGET:-285}"  # seconds for all parts together
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
mkdir -p "$LOGS"
START=$(date +%s)
SUMMARY=()

{
  echo "# gradcomp GPU check"
  echo
  echo "- started: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), budget ${BUDGET}s, logs in $(basename "$LOGS")/"
} > "$REPORT"

# run_part NAME CAP_SECONDS COMMAND...: run with a time limit (the smaller of CAP and what is
# left of the budget), record its status and the tail of its output in the report.
run_part() {
  local name="$1" cap="$2"
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  local limit=$((cap < left ? cap : left))
  local log="$LOGS/${name//[^A-Za-z0-9]/_}.log"
  local status
  echo "== $name (limit ${limit}s)"
  if [ "$limit" -lt 5 ]; then
    status="SKIPPED (time budget used up)"
    echo "$status" > "$log"
  else
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    local took=$(($(date +%s) - t0))
    case $rc in
      0) status="ok (${took}s)"
         # a pytest part whose tests were all skipped has checked nothing
         if [ "${EXPECT_PASSED:-0}" = 1 ] && ! tail -n 3 "$log" | grep -q " passed"; then
           status="NOTHING RAN: all skipped or deselected (${took}s)"
         fi ;;
      124 | 137) status="TIMEOUT after ${limit}s" ;;
      *) status="FAILED, exit code $rc (${took}s)" ;;
    esac
  fi
  SUMMARY+=("| $name | $status |")
  echo "   -> $status"
  {
    echo
    echo "## $name: $status"
    echo
    echo '```'
    tail -n "${TAIL_LINES:-60}" "$log"
    echo '```'
  } >> "$REPORT"
}

env_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv,noheader 2>&1 || true
  python - <<'EOF'
import platform
import numpy, torch
print("python", platform.python_version(), "| torch", torch.__version__, "CUDA", torch.version.cuda,
      "| numpy", numpy.__version__)
print("torch.cuda.is_available():", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("GPU 0:", torch.cuda.get_device_name(0), f"| {p.multi_processor_count} SMs | {p.total_memory / 2**30:.0f} GiB"
          f" | sm_{p.major}{p.minor}")
try:
    import cupy
    print("cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())
except Exception as exc:
    print("cupy import failed:", type(exc).__name__, exc)
from gradcomp.kernels import _cupy
print("gradcomp kernels available:", _cupy.available())
EOF
}

compile_all() {
  python - <<'EOF'
import time
from gradcomp.kernels import _cupy
if not _cupy.available():
    raise SystemExit("CuPy cannot see a CUDA device or NVRTC: nothing to compile")
cc = _cupy.compute_capability(0)
print("NVRTC", _cupy._nvrtc().getVersion(), "| options", " ".join(_cupy.COMPILE_OPTIONS), "| cache", _cupy.cache_dir())
failed = []
for fam in _cupy.families():
    t = time.perf_counter()
    try:
        path = _cupy.binary(fam, cc)
        _cupy.module(fam, cc)
        print(f"{fam}.cu: {path.name} ({path.stat().st_size} bytes), compiled or read in {time.perf_counter() - t:.1f}s")
    except Exception as exc:
        failed.append(fam)
        print(f"{fam}.cu: FAILED\n{exc}")
raise SystemExit(1 if failed else 0)
EOF
}

export -f env_info compile_all

GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
GPU_NAME=${GPU_NAME:-$(python -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA GPU")' 2>/dev/null)}
echo "GPU: ${GPU_NAME:-unknown}"
echo "- GPU: ${GPU_NAME:-unknown}" >> "$REPORT"

run_part "environment" 30 bash -c env_info
run_part "NVRTC compile" 90 bash -c compile_all
# The kernel tests in three processes: a kernel that faults the device (a sticky CUDA error)
# then spoils only its own group.
KT=tests/kernels/test_cuda_kernels.py
GROUP_A="uniform or sign or count_set or pack_unpack"
GROUP_B="topk or threshold or scatter"
EXPECT_PASSED=1 run_part "GPU tests: rng, sign, bits" 70 python -m pytest -q -m gpu -rfEs --durations=5 "$KT" -k "$GROUP_A"
EXPECT_PASSED=1 run_part "GPU tests: select, sparse" 70 python -m pytest -q -m gpu -rfEs --durations=5 "$KT" -k "$GROUP_B"
EXPECT_PASSED=1 run_part "GPU tests: quant, plumbing, compressors" 90 \
  python -m pytest -q -m gpu -rfEs --durations=5 "$KT" -k "not ($GROUP_A or $GROUP_B)"
# every other GPU test of the project (exit code 5: none collected, which is fine)
run_part "GPU tests, others" 120 bash -c "python -m pytest -q -m gpu -rfEs --ignore=$KT tests; rc=\$?; [ \$rc -eq 5 ] && exit 0; exit \$rc"
# the memory layer on the device: save_on_cpu, offload and the codecs' cost where they are meant to run
TAIL_LINES=40 run_part "memory benchmark (transformer-like)" 150 python -m gradcomp.bench memory --model transformer-like \
  --repeats 3 --plan-repeats 2 --codecs int8,bf16 --budgets 0.25 --json "$LOGS/memory.json"
TAIL_LINES=80 run_part "kernel benchmarks" 120 python -m gradcomp.bench.kernel_bench --out "$LOGS/kernel_bench.md"

if [ -s "$LOGS/kernel_bench.md" ]; then
  { echo; cat "$LOGS/kernel_bench.md"; } >> "$REPORT"
fi
{
  echo
  echo "## Summary ($(($(date +%s) - START))s)"
  echo
  echo "| part | status |"
  echo "|---|---|"
  printf '%s\n' "${SUMMARY[@]}"
} >> "$REPORT"
printf '%s\n' "${SUMMARY[@]}"
echo "report: $REPORT"
