#!/usr/bin/env bash
# The second GPU check (bench/gpu_api_check.py): the API on CUDA, every policy, transformers
# with CUDA graphs, settings (graphs off, larger budgets), a swapped page part by part; expected
# to take about 4 minutes on an H200 (its stages' times there), stopped at 560 s. Run after
# bench/gpu_check.sh on the same machine. Options pass through (--out-dir DIR, --skip-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c \
    'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  PY=.venv/bin/python
fi
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout -k 10 560 "$PY" bench/gpu_api_check.py "$@"
