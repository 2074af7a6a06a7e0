#!/usr/bin/env bash
# The prepared GPU check (chapter 07): kernel tests on the GPU, decode attention against the
# measured copy bandwidth, and the mixed-chat benchmark (pd vs Hugging Face), in under 8 minutes.
# Writes bench/gpu-results-<date>.md, the benchmark's JSON and the tests' log. Without a CUDA
# device it prints "no CUDA device: nothing measured" and exits 0. Options pass through to
# bench/gpu_check.py (--skip-tests, --skip-bench, --out-dir DIR).
set -euo pipefail
# the deadline counts from here: importing torch and starting CUDA take part of the 8 minutes
export MINICB_GPU_CHECK_START="${MINICB_GPU_CHECK_START:-$(date +%s)}"
cd "$(dirname "$0")/.."
# the course's .venv on a CPU machine holds a CPU-only torch: use it only if it sees a GPU
PY=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c \
    'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  PY=.venv/bin/python
fi
# pytest for the kernel tests: the machine's own, else the copy bench/gpu_vendor.sh made (the
# run must carry build/gpu-vendor). Only then on PYTHONPATH: it would shadow the machine's own
if ! "$PY" -c 'import pytest' 2>/dev/null; then
  if [ -d build/gpu-vendor ]; then
    export PYTHONPATH="$PWD/build/gpu-vendor${PYTHONPATH:+:$PYTHONPATH}"
    echo "pytest: not installed here; using build/gpu-vendor"
  else
    echo "warning: no pytest and no build/gpu-vendor (bench/gpu_vendor.sh, then carry it):" \
         "the kernel tests cannot run"
  fi
fi
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
export PYTHONUNBUFFERED=1  # progress shows as it happens, also when the run is cut short
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # nothing is downloaded; fail fast, not slowly
# Triton compiles a small C launcher per kernel signature at its first launch; gpu_check.py's
# pre-flight tries one kernel and falls back to the torch backend if that fails
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null && ! command -v clang >/dev/null; then
  echo "warning: no C compiler (cc, gcc or clang) on PATH: Triton cannot build its launchers"
fi
# 470 s leaves the 8-minute budget a margin for start-up; the kernel tests and the benchmark
# have their own timeouts too, the in-process stages rely on this one.
# SIGTERM at 470 s lets gpu_check.py write its table; SIGKILL 10 s later if it cannot
exec timeout -k 10 470 "$PY" bench/gpu_check.py "$@"
