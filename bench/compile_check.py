"""Compile the engine's Triton kernels for a GPU on a machine without one (chapter 07).

Triton ships its own LLVM and NVIDIA's `ptxas`, so it can turn a kernel into GPU machine code
(a cubin) for any NVIDIA target on a plain CPU machine. This script runs one forward of a
one-layer model of each listed shape through the Triton backend, exactly as the engine calls it
(a mixed batch: decode rows, then a prefill chunk that starts mid-page), but with a stand-in
driver that reports the chosen GPU: every kernel launch is caught before it would run and
compiled instead. For each distinct compilation it reports what `ptxas -v` says: registers per
thread, bytes spilled to local memory, and the shared memory the kernel asks for; and, from the
disassembled cubin, how many spill instructions sit inside a loop.

That catches what Triton's interpreter cannot: code that does not compile for the GPU, tiles
that need more shared memory than the GPU has, and register spills (a kernel that spills reads
and writes local memory inside its loop: a failure; a spill outside every loop, stored once
and loaded once per program, is listed but passes). Nothing runs on a GPU, so it says nothing
about speed (`bench/gpu_check.sh` measures that on a real one).

    python bench/compile_check.py                 # sm_90a (H100/H200), every shape and dtype
    python bench/compile_check.py --arch 80       # A100
    python bench/compile_check.py --models smollm2-135m --dtypes bfloat16 --json rows.json
    python bench/compile_check.py --out bench/compile-sm90.md   # the committed report

Run it without TRITON_INTERPRET (the interpreter replaces the kernels with Python functions).
tests/test_compile_check.py runs it for SmolLM2's shapes and checks that nothing spills.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # minicb from this checkout, installed or not

# (num_heads, num_kv_heads, head_dim, hidden_size, qk_norm): the attention shapes that matter
MODELS = {
    "smollm2-135m": (9, 3, 64, 576, False),      # the bundled model: group 3, head_dim 64
    "qwen2.5-0.5b": (14, 2, 64, 896, False),     # group 7: not a power of two
    "llama-3-8b": (32, 8, 128, 4096, False),     # group 4, head_dim 128 (gpu_check's shape)
    "qwen3-0.6b": (16, 8, 128, 1024, True),      # per-head q/k RMSNorm through the kernel
}
DTYPES = ("float32", "bfloat16", "float16")
SHARED_MEMORY = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # per block


class CompileOnlyDriver:
    """Triton's driver, as far as a launch asks it before compiling: the target and a device."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextmanager
def compile_only(arch: int):
    """Within: a Triton launch records (kernel, signature, constants, attributes, options) in the
    yielded list and returns without compiling or running anything."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    launches: list[dict] = []

    def hook(*, fn, compile, **_) -> bool:
        launches.append(dict(fn=fn.jit_function, signature=compile["signature"],
                             constants=compile["constants"], attrs=compile["configs"][0],
                             num_warps=compile["num_warps"], num_stages=compile["num_stages"]))
        return True  # handled: Triton neither compiles nor launches

    saved_driver, saved_hook = driver._active, triton.knobs.runtime.jit_cache_hook
    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield launches
    finally:
        driver._active, triton.knobs.runtime.jit_cache_hook = saved_driver, saved_hook


def capture_launches(model: str, dtype: str, arch: int) -> list[dict]:
    """One forward of a one-layer `model`-shaped LlamaModel through the Triton backend, on CPU
    tensors, every launch caught. Three decode rows (contexts 17, 40 and 100) and one prefill
    chunk of 40 tokens at positions 20..59 (it starts mid-page), pages of 16."""
    import torch

    from minicb.attention import build_metadata, triton_ops
    from minicb.model.llama import LlamaModel, ModelConfig

    num_heads, num_kv_heads, head_dim, hidden, qk_norm = MODELS[model]
    cfg = ModelConfig("qwen3" if qk_norm else "llama", vocab_size=256, hidden_size=hidden,
                      intermediate_size=64, num_layers=1, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, qk_norm=qk_norm)
    net = LlamaModel(cfg).to(getattr(torch, dtype))
    net.attention_backend = triton_ops  # set_attention_backend would refuse CPU tensors
    kv = net.allocate_kv_cache(16, 16)
    cached, query_lens = [16, 39, 99, 20], [1, 1, 1, 40]
    tables = [[0, 1], [2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
    meta = build_metadata(tables, cached, query_lens, 16)
    positions = torch.tensor([16, 39, 99, *range(20, 60)])
    ids = torch.zeros(len(positions), dtype=torch.int64)
    checked = triton_ops._check_device
    triton_ops._check_device = lambda t: None  # CPU tensors stand in for the GPU's
    try:
        with compile_only(arch) as launches:
            net(ids, positions, meta, kv, torch.tensor([0, 1, 2, len(positions) - 1]))
    finally:
        triton_ops._check_device = checked
    return launches


SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def loop_spills(sass: str) -> int:
    """Spill instructions (STL/LDL) inside a loop of the disassembled kernel: a loop is the span
    from a backward branch's target to the branch. A spill before or after every loop runs once
    per program and costs nothing worth a tile change; one inside the key loop runs every
    iteration (Triton 3.6 spills 4 bytes around the bf16 decode loop at head_dim 128)."""
    code = [(int(a, 16), op, args) for a, op, args in SASS_LINE.findall(sass)]
    loops = []
    for address, op, args in code:
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    return sum(1 for address, op, _ in code if op.startswith(("STL", "LDL"))
               and any(start <= address <= end for start, end in loops))


def ptxas_report(kernel, arch: int) -> dict:
    """What `ptxas -v` says of a compiled kernel (registers, spill bytes, stack), and how many
    of its spill instructions sit inside a loop (`loop_spills`, from the disassembly)."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        ptx.write_text(kernel.asm["ptx"])
        done = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={sm_arch_from_capability(arch)}", str(ptx),
                               "-o", str(cubin)], capture_output=True, text=True)
        log = done.stdout + done.stderr
        if done.returncode:
            raise RuntimeError(f"ptxas failed:\n{log}")
        sass = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return dict(registers=number(r"Used (\d+) registers"),
                spill_bytes=number(r"(\d+) bytes spill stores"),
                stack_bytes=number(r"(\d+) bytes stack frame"), loop_spills=loop_spills(sass))


def compile_launch(launch: dict, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(launch["fn"], launch["signature"], launch["constants"], launch["attrs"])
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=launch["num_warps"],
                                         num_stages=launch["num_stages"]))
    return dict(shared_bytes=kernel.metadata.shared, **ptxas_report(kernel, arch))


def describe(launch: dict) -> str:
    """The launch's distinguishing constants, e.g. 'DECODE BLOCK_M=16 BLOCK_N=64'."""
    names = launch["fn"].arg_names
    shown = ("DECODE", "GROUP", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "BLOCK_T", "BLOCK_C", "BLOCK",
             "BLOCK_H", "BLOCK_D")
    parts = []
    for (index,), value in sorted(launch["constants"].items()):
        name = names[index]
        if name == "DECODE":
            parts.insert(0, "decode" if value else "prefill")
        elif name in shown:
            parts.append(f"{name}={value}")
    return " ".join(parts)


def check(models: list[str], dtypes: list[str], arch: int) -> list[dict]:
    """Every distinct kernel the engine launches for these shapes, compiled and measured."""
    rows, seen = [], set()
    for model in models:
        for dtype in dtypes:
            for launch in capture_launches(model, dtype, arch):
                key = (launch["fn"].__name__, repr(launch["signature"]),
                       repr(sorted(launch["constants"].items())), launch["num_warps"],
                       launch["num_stages"])
                if key in seen:
                    continue
                seen.add(key)
                row = dict(model=model, dtype=dtype, kernel=launch["fn"].__name__.strip("_"),
                           launch=describe(launch), num_warps=launch["num_warps"],
                           num_stages=launch["num_stages"])
                try:
                    row.update(compile_launch(launch, arch))
                except Exception as exc:  # report it with the others, then fail at the end
                    row["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                rows.append(row)
    return rows


def table(rows: list[dict], arch: int) -> str:
    limit = SHARED_MEMORY.get(arch)
    lines = ["| model | dtype | kernel | launch | warps | stages | registers | spilled bytes "
             "| spills in loops | shared KiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            tail = f"| **failed** | {r['error'].splitlines()[0]} | | |"
        else:
            over = limit is not None and r["shared_bytes"] > limit
            spill = f"**{r['spill_bytes']}**" if r["spill_bytes"] else "0"
            in_loops = f"**{r['loop_spills']}**" if r["loop_spills"] else "0"
            shared = f"{r['shared_bytes'] / 1024:.1f}" + (" **over**" if over else "")
            tail = f"| {r['registers']} | {spill} | {in_loops} | {shared} |"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['kernel']} | {r['launch']} "
                     f"| {r['num_warps']} | {r['num_stages']} {tail}")
    return "\n".join(lines)


def problems(rows: list[dict], arch: int) -> list[str]:
    """Failures, spills inside a loop and shared memory beyond the GPU's limit, one line each."""
    limit = SHARED_MEMORY.get(arch)
    out = []
    for r in rows:
        name = f"{r['model']} {r['dtype']} {r['kernel']} {r['launch']}"
        if "error" in r:
            out.append(f"{name}: {r['error']}")
        elif r["loop_spills"]:
            out.append(f"{name}: spills {r['spill_bytes']} bytes ({r['registers']} registers), "
                       f"{r['loop_spills']} spill instructions inside a loop")
        elif limit is not None and r["shared_bytes"] > limit:
            out.append(f"{name}: {r['shared_bytes']} bytes of shared memory, over {limit}")
    return out


def notes(rows: list[dict]) -> list[str]:
    """Spills outside every loop: stored once before, loaded once after, not a failure."""
    return [f"{r['model']} {r['dtype']} {r['kernel']} {r['launch']}: spills {r['spill_bytes']} "
            f"bytes ({r['registers']} registers), outside every loop (not a failure)"
            for r in rows if "error" not in r and r["spill_bytes"] and not r["loop_spills"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability: 80, 89, 90")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, among {', '.join(MODELS)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the kernels")
    models, dtypes = args.models.split(","), args.dtypes.split(",")
    for name, given, known in (("model", models, MODELS), ("dtype", dtypes, DTYPES)):
        unknown = [g for g in given if g not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown[0]!r}; choose among {', '.join(known)}")
    import triton
    rows = check(models, dtypes, args.arch)
    found, harmless = problems(rows, args.arch), notes(rows)
    report = "\n".join([
        f"# Triton kernels compiled for sm_{args.arch}, without a GPU", "",
        f"`python bench/compile_check.py --arch {args.arch}` with Triton {triton.__version__} "
        f"on {datetime.date.today()}: one forward per shape and dtype through the Triton "
        "backend, every launch compiled by Triton's own LLVM and ptxas instead of run. "
        "Registers are per thread and spilled bytes are ptxas's spill stores; spills in loops "
        "counts the spill instructions (STL/LDL) between a backward branch and its target in "
        "the disassembly, the ones that run every iteration; shared memory "
        f"is per block (the GPU allows {SHARED_MEMORY.get(args.arch, 0) // 1024} KiB). "
        "Nothing ran on a GPU: this says the kernels compile and fit, not how fast they are.",
        "", table(rows, args.arch), "",
        "\n".join(f"- {line}" for line in found + harmless) if found or harmless
        else "No failures, no spills, shared memory fits.",
        "" if found or not harmless else "\nNo failures, no spills inside a loop, shared "
        "memory fits.", ""])
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
