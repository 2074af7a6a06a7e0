"""The Triton kernels compiled for a GPU on this CPU machine (`bench/compile_check.py`,
chapter 07): Triton's own LLVM and ptxas build every kernel the engine launches for sm_90, so
what the interpreter cannot see (code that does not compile for a GPU, register spills, shared
memory beyond the GPU's) fails here, before any GPU time is spent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "compile_check.py"

pytestmark = pytest.mark.slow  # about 15 s of compiling


def run_check(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the interpreter replaces the kernels: compile for real
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_smollm2_kernels_compile_for_sm90_without_spills(tmp_path):
    rows_file = tmp_path / "rows.json"
    done = run_check("--models", "smollm2-135m", "--dtypes", "float32,bfloat16",
                     "--json", str(rows_file))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(rows_file.read_text())
    kernels = {(r["dtype"], r["kernel"], r["launch"].split()[0]) for r in rows}
    for dtype in ("float32", "bfloat16"):  # every kernel of a forward, both attention launches
        assert {(dtype, "store_kv_kernel"), (dtype, "rms_norm_kernel"), (dtype, "rope_kernel")} \
            <= {k[:2] for k in kernels}
        assert {(dtype, "paged_attention_kernel", "decode"),
                (dtype, "paged_attention_kernel", "prefill")} <= kernels
    assert all(r["registers"] > 0 and r["spill_bytes"] == 0 for r in rows)
    prefill32 = next(r for r in rows if r["dtype"] == "float32" and "prefill" in r["launch"])
    assert prefill32["num_warps"] == 8 and "BLOCK_N=32" in prefill32["launch"]


def test_the_old_float32_prefill_tile_spills_and_is_reported(tmp_path):
    """The check can fail: the tile float32 prefill used before (4 warps, key blocks of 64)
    spills on sm_90, and the script says so with a non-zero exit."""
    driver = tmp_path / "old_tiles.py"
    driver.write_text(
        f"import sys; sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
        "from minicb.attention import triton_ops\n"
        "triton_ops.FLOAT32_KEY_BLOCK, triton_ops.FLOAT32_PREFILL_NUM_WARPS = 4096, 4\n"
        "import compile_check\n"
        "sys.exit(compile_check.main(['--models', 'smollm2-135m', '--dtypes', 'float32']))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(driver)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "prefill" in done.stdout and "spills" in done.stdout


def test_it_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "TRITON_INTERPRET" in done.stderr
