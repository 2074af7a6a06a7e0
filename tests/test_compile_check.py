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

sys.path.insert(0, str(SCRIPT.parent))
import compile_check  # noqa: E402


def run_check(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the interpreter replaces the kernels: compile for real
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # about 15 s of compiling
def test_smollm2_kernels_compile_for_sm90_without_spills(tmp_path):
    """Every kernel of a SmolLM2 forward, in float32 and bfloat16 and both attention launches,
    compiles for sm_90 with no register spills; float32 prefill uses 8 warps and BLOCK_N=32."""
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
    assert all(r["registers"] > 0 and r["spill_bytes"] == 0 and r["loop_spills"] == 0
               for r in rows)
    prefill32 = next(r for r in rows if r["dtype"] == "float32" and "prefill" in r["launch"])
    assert prefill32["num_warps"] == 8 and "BLOCK_N=32" in prefill32["launch"]


@pytest.mark.slow
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
    assert "prefill" in done.stdout and "spill instructions inside a loop" in done.stdout


# cuobjdump -sass lines, shortened: a loop from 0x0100 back to 0x0100 at 0x0300
SASS = """
        /*0080*/                   STL [R1], R0 ;                 /* 0x0000000001007387 */
        /*0100*/                   FFMA R2, R3, R4, R2 ;          /* 0x0000000403027223 */
        /*0180*/                   {spill} ;                      /* 0x0000000001037983 */
        /*0200*/                   IADD3 R5, R5, 0x1, RZ ;        /* 0x0000000105057810 */
        /*0280*/                   ISETP.GE.AND P0, PT, R5, R6, PT ;
        /*0300*/              @!P0 BRA 0x100 ;                    /* 0xffffffd800f48947 */
        /*0380*/                   LDL.LU R3, [R1] ;              /* 0x0000000001037983 */
        /*0400*/               @P3 BRA 0x480 ;                    /* 0x000000000000394d */
        /*0480*/                   EXIT ;                         /* 0x000000000000794d */
        /*0500*/                   BRA 0x500;                     /* 0xfffffffc00fc7947 */
"""


def test_a_spill_counts_as_in_a_loop_only_between_a_backward_branch_and_its_target():
    """Stored once before the loop and loaded once after it (what Triton 3.6 does to the bf16
    decode tile at head_dim 128): none in a loop; a load inside the loop body: one. The
    branch to itself at the end (0x500) is Triton's trap after EXIT and holds no spill."""
    assert compile_check.loop_spills(SASS.format(spill="MOV R3, R2")) == 0
    assert compile_check.loop_spills(SASS.format(spill="LDL R3, [R1+0x4]")) == 1


def test_a_spill_outside_every_loop_is_listed_but_passes():
    """A spill outside every loop is listed as a note and passes; a spill inside a loop is a
    problem."""
    row = dict(model="m", dtype="bfloat16", kernel="k", launch="decode", registers=96,
               spill_bytes=4, loop_spills=0, shared_bytes=1024, num_warps=4, num_stages=2)
    assert compile_check.problems([row], 90) == []
    assert "outside every loop" in compile_check.notes([row])[0]
    assert compile_check.problems([{**row, "loop_spills": 2}], 90)


def test_it_refuses_the_interpreter():
    """The compile check exits with status 2 naming TRITON_INTERPRET when the Triton interpreter is
    on."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "TRITON_INTERPRET" in done.stderr
