#!/usr/bin/env bash
# The prepared GPU check (chapter 07): kernel tests on the GPU, decode attention against the
# measured copy bandwidth, and the mixed-chat benchmark (pd vs Hugging Face), in under 8 minutes.
# Writes bench/gpu-results-<date>.md, the benchmark's JSON and the tests' log. Without a CUDA
# device it prints "no CUDA device: nothing measured" and exits 0. Options pass through to
# bench/gpu_check.py (--skip-tests, --skip-bench, --out-dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
export PYTHONUNBUFFERED=1  # progress shows as it happens, also when the run is cut short
# 470 s leaves the 8-minute budget a margin for start-up; each stage has its own timeout too
exec timeout 470 "$PY" bench/gpu_check.py "$@"
