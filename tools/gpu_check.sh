#!/usr/bin/env bash
# Every GPU check of gradcomp in one run (7 minutes at most on one GPU, 8 on two), report written to
# REPORT_PATH (markdown; full logs in REPORT_PATH.logs/):
#   install (pip install --no-deps --no-build-isolation -e .: nothing is downloaded), the
#   environment, collection of every test marked gpu, NVRTC compiling each kernel family, the
#   gpu tests in groups (kernels; collectives, training and memory with their gloo ranks on
#   CUDA tensors; the rest), an NCCL smoke test on 2 ranks where there are 2 GPUs, the memory
#   and kernel benchmarks.
# Each part has a time cap and a minimum of passed tests; a part that ran nothing, or fewer
# than its minimum, fails. Needs only torch, CuPy, numpy and pytest. Exit status 0 only if
# every part passed. Details: tools/gpu_check.py.
#   bash tools/gpu_check.sh REPORT_PATH            # the check (from anywhere)
#   bash tools/gpu_check.sh --list REPORT_PATH     # what each part would run, in seconds, no GPU needed
# GPU_CHECK_BUDGET=SECONDS: less time for all parts together (default: the sum of their caps);
# --only WORD,WORD: only the parts whose names contain one of the words.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARGS=()
PREV=""
for a in "$@"; do  # the report path made absolute before the cd below; option values as given
  case "$PREV:$a" in
    --only:* | --budget:* | *:-* | *:) ARGS+=("$a") ;;
    *) mkdir -p "$(dirname "$a")" && ARGS+=("$(cd "$(dirname "$a")" && pwd)/$(basename "$a")") ;;
  esac
  PREV="$a"
done
cd "$ROOT" || exit 1
# the parts import gradcomp from the checkout even before the install part has run (gradcomp/ is
# the package's shape; tools/gpu_check.py puts the checkout on their PYTHONPATH)
exec "${PYTHON:-python}" "$ROOT/tools/gpu_check.py" --root "$ROOT" "${ARGS[@]}"
