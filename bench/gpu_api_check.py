"""The second GPU check: the engine's public API on CUDA, every policy, a stronger Hugging Face
baseline, and where a swapped page's time goes (chapter 07, bench/GPU.md).

`bench/gpu_check.sh` measures the kernels and one benchmark. This script, run after it on the
same machine (`bench/gpu_api_check.sh`; expected to take about 4 minutes on an H200 from its
stages' times there, stopped at 560 s), checks what the kernel tests do not reach on a GPU and
what its first run raised:

1. the API on CUDA, each check recorded as pass/FAIL with what it saw (a check that raises is a
   FAIL; the rest still run): greedy tokens of the Triton backend with CUDA graphs equal the CPU
   reference's; graphs off equal graphs on; a seeded sampled run repeats itself; speculative
   decoding keeps greedy tokens; a repeated prompt hits the prefix cache; swap in a tight
   bfloat16 pool gives a roomy pool's tokens; reject and cancel leave no page held; a refused
   request leaves the engine usable; the default pool of engines built one after another keeps
   its size (`default_num_pages`) and the dtype is bfloat16. A tiny random checkpoint drawn
   with spread-out weights (no near-ties) serves the token checks, SmolLM2's shapes the pool;
2. `bench --policy` with all six policies on mixed-chat on the GPU (what chapter 06's table
   looks like there);
3. `bench --policy pd --compare hf --hf-cuda-graphs`: transformers' generate_batch with its
   CUDA graphs forced on (it turns them off without flash-attn);
4. static, continuous and pd under the settings a GPU changes (bench/gpu-settings-2026-12-04.md):
   the defaults, CUDA graphs off, a 2,048-token budget, and that with 32 slots;
5. the swap copy's parts for the page the h100-like cost model assumes: gather on the GPU, the
   copy to page-locked memory, the scatter into the swap store (page by page, as the engine
   does, and as one indexed assignment, as it did before), and back, each timed alone.

Writes gpu-api-<date>.md into --out-dir, rewritten after every stage. `--cpu-smoke` runs it at
toy sizes on the CPU in Triton's interpreter (tests/test_gpu_check.py)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402  (beside this file)

ROOT = gpu_check.ROOT
POLICIES = "single,static,dynamic,continuous,chunked,pd"
SETTINGS = [("defaults: 16 slots, token budget 256", []),
            ("CUDA graphs off", ["--no-cuda-graphs"]),
            ("token budget 2048", ["--max-num-batched-tokens", "2048", "--chunk-size", "2048"]),
            ("32 slots, token budget 2048", ["--max-num-seqs", "32", "--max-num-batched-tokens",
                                             "2048", "--chunk-size", "2048"])]
SWAP_PAGES = 32


def tiny_checkpoint(folder: Path) -> Path:
    """A random Llama with spread-out weights (tests' make_tiny_checkpoint): greedy decoding
    does not sit on near-ties, so two correct backends give the same tokens."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny_checkpoint
    return make_tiny_checkpoint(folder / "tiny-spread", vocab=512, hidden=128, layers=3,
                                heads=4, kv_heads=2, intermediate=256)


def prompts(num: int, seed: int = 0, repeat: bool = False) -> list[list[int]]:
    """Token-id prompts of 5-90 tokens; `repeat`: each a short phrase said again and again
    (prompt lookup finds guesses in it)."""
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        if repeat:
            phrase = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 7))]
            out.append((phrase * 20)[:rng.randrange(20, 90)])
        else:
            out.append([rng.randrange(3, 500) for _ in range(rng.randrange(5, 90))])
    return out


def token_lists(llm, prompt_ids, **params) -> list[list[int]]:
    from minicb import SamplingParams
    params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, **params}
    return [o.token_ids for o in llm.generate(prompt_ids, SamplingParams(**params))]


def same(a: list[list[int]], b: list[list[int]]) -> tuple[bool, str]:
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    ok = not differ and len(a) == len(b)
    return ok, (f"{len(a)} of {len(a)} requests identical" if ok
                else f"{len(differ)} of {len(a)} differ (#{', #'.join(map(str, differ[:3]))}"
                     f"{', ...' if len(differ) > 3 else ''})")


def api_checks(tiny: Path, shapes: str, device: str, record) -> None:
    """Stage 1; `record(name, ok, detail)` is called once per check."""
    import gc

    import torch

    from minicb import LLM, SamplingParams

    small = dict(policy="pd", max_num_seqs=8, max_num_batched_tokens=64, chunk_size=64,
                 num_pages=256, trace_snapshots=False)
    ids = prompts(12)

    def check(name, fn):
        try:
            ok, detail = fn()
        except Exception as exc:  # a FAIL row with its reason; the other checks still run
            ok, detail = False, f"raised {type(exc).__name__}: {exc}"[:300]
            traceback.print_exc()
        record(name, ok, detail)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    cpu = LLM(str(tiny), device="cpu", dtype="float32", attention_backend="torch", **small)
    reference = token_lists(cpu, ids)

    def greedy_vs_cpu():
        llm = LLM(str(tiny), device=device, dtype="float32", attention_backend="triton", **small)
        graphs = llm.engine.runner.graph_runner is not None
        ok, detail = same(token_lists(llm, ids), reference)
        return ok, f"{detail}; CUDA graphs {'captured' if graphs else 'not captured'}"
    check("greedy, Triton + CUDA graphs (float32) = CPU reference", greedy_vs_cpu)

    def graphs_off():
        llm = LLM(str(tiny), device=device, dtype="float32", attention_backend="triton",
                  use_cuda_graphs=False, **small)
        return same(token_lists(llm, ids), reference)
    check("greedy, CUDA graphs off = CPU reference", graphs_off)

    def seeded():
        llm = LLM(str(tiny), device=device, **small)
        sampled = dict(temperature=0.8, top_k=50, top_p=0.9, seed=7)
        first, again = token_lists(llm, ids, **sampled), token_lists(llm, ids, **sampled)
        ok, detail = same(first, again)
        cpu_first = token_lists(cpu, ids, **sampled)
        kv = str(llm.engine.pool.every_layer.dtype).removeprefix("torch.")
        return ok, (f"{detail} on a second run ({kv}); vs the CPU's seeded "
                    f"draws (informative, bf16 vs float32): "
                    f"{sum(a == b for a, b in zip(first, cpu_first))} of {len(ids)} equal")
    check("seeded sampling repeats itself", seeded)

    def speculative():
        rep = prompts(8, seed=1, repeat=True)
        base = LLM(str(tiny), device=device, dtype="float32", **small)
        spec = LLM(str(tiny), device=device, dtype="float32", num_speculative_tokens=3,
                   **small)
        ok, detail = same(token_lists(spec, rep), token_lists(base, rep))
        guessed = sum(g for r in spec.engine.trace for g, _ in r.speculated.values())
        kept = sum(k for r in spec.engine.trace for _, k in r.speculated.values())
        return ok, (f"{detail}; {kept} of {guessed} guesses kept" if guessed else
                    f"{detail}; no guess was made, so this says nothing about guesses")
    check("speculative decoding (3 guesses) keeps greedy tokens", speculative)

    def prefix_hit():
        llm = LLM(str(tiny), device=device, dtype="float32", **small)
        long = prompts(1, seed=2)[0] * 3
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        first, second = (llm.generate([long], params)[0] for _ in range(2))
        ok = second.num_cached_tokens > 0 and first.token_ids == second.token_ids
        tokens = "equal" if first.token_ids == second.token_ids else "DIFFER"
        return ok, (f"second run: {second.num_cached_tokens} of {len(long)} prompt tokens "
                    f"cached, tokens {tokens}")
    check("a repeated prompt hits the prefix cache", prefix_hit)

    def swap_bf16():
        roomy = LLM(str(tiny), device=device, dtype="bfloat16", **small)
        tight = LLM(str(tiny), device=device, dtype="bfloat16",
                    **{**small, "num_pages": 24, "preemption_mode": "swap"})
        want = token_lists(roomy, ids[:8], max_tokens=40)
        got = token_lists(tight, ids[:8], max_tokens=40)
        swapped = sum(r.pages_swapped_out for r in tight.engine.trace)
        ok, detail = same(got, want)
        stats = tight.engine.stats()
        return (ok and swapped > 0 and stats["pages_used"] == 0,
                f"{detail}; {swapped} pages swapped out; pages in use after: "
                f"{stats['pages_used']}")
    check("swap in a tight bf16 pool = a roomy pool's tokens", swap_bf16)

    def reject_cancel():
        from minicb import SamplingParams
        llm = LLM(str(tiny), device=device, **{**small, "num_pages": 12,
                                                "reject_when_full": True})
        engine = llm.engine
        rids = [engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
                for p in ids[:8]]
        engine.step()
        engine.step()
        engine.cancel(rids[0])
        engine.run()
        reasons = [engine.requests[r].finish_reason for r in rids]
        stats = engine.stats()
        ok = stats["pages_used"] == 0 and "rejected" in reasons and reasons[0] == "cancelled"
        return ok, (f"finish reasons {sorted(set(reasons))}, {reasons.count('rejected')} "
                    f"rejected; pages in use after: {stats['pages_used']}")
    check("reject and cancel leave no page held", reject_cancel)

    def bad_input():
        from minicb import SamplingParams
        llm = LLM(str(tiny), device=device, **small)
        try:
            llm.generate([[5] * 3000], SamplingParams(max_tokens=4))
            return False, "a 3,000-token prompt for a 2,048-token model was accepted"
        except ValueError as exc:
            message = str(exc)
        after = token_lists(llm, ids[:2])
        return (len(after) == 2 and llm.engine.stats()["pages_used"] == 0,
                f"refused ({message[:80]}...); the next generate ran")
    check("a refused prompt leaves the engine usable", bad_input)

    def pools_in_turn():
        sizes, dtypes = [], []
        before = allocated_mib(device)
        for _ in range(2):
            llm = LLM(shapes, device=device, trace_snapshots=False)
            sizes.append(llm.engine.pool.num_pages)
            dtypes.append(str(llm.engine.pool.every_layer.dtype).removeprefix("torch."))
            del llm
            gc.collect()
        ok = sizes[0] == sizes[1] and (device != "cuda" or dtypes[0] == "bfloat16")
        return ok, (f"default pools {sizes[0]} and {sizes[1]} pages, KV {dtypes[0]}; "
                    f"{before:.0f} MiB allocated before the first, {allocated_mib(device):.0f} "
                    f"after both were dropped; largest live tensors on the device: "
                    f"{largest_live_tensors(device)}")
    check("default pool and dtype, engines built in turn", pools_in_turn)


def allocated_mib(device: str) -> float:
    import torch
    return torch.cuda.memory_allocated() / 2**20 if device == "cuda" else 0.0


def largest_live_tensors(device: str, top: int = 4) -> str:
    """The largest tensors on `device` the garbage collector can see, with what holds them
    (the type of a referrer that is not a list, dict or frame): who keeps memory after an engine
    is dropped."""
    import gc
    import warnings

    import torch
    found = []
    with warnings.catch_warnings():  # isinstance on some modules' lazy attributes warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == device:
                    found.append(obj)
            except Exception:  # objects that fail isinstance or .device: not ours
                continue
    found.sort(key=lambda t: t.numel() * t.element_size(), reverse=True)
    described = []
    for tensor in found[:top]:
        holders = {type(r).__name__ for r in gc.get_referrers(tensor)
                   if not isinstance(r, (list, dict)) and type(r).__name__ != "frame"}
        described.append(f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} "
                         f"{tensor.numel() * tensor.element_size() / 2**20:.0f} MiB "
                         f"(held by {', '.join(sorted(holders)) or 'a dict or list'})")
    return "; ".join(described) or "none"


def run_cli(cmd: list[str], timeout: int) -> str:
    return gpu_check.run_logged(cmd, timeout, " ".join(["python"] + cmd[1:]), tail=5000)


def swap_parts(device: str) -> tuple[int, list[tuple[str, float]]]:
    """Stage 5: (the page's bytes, rows): seconds for each part of swapping SWAP_PAGES
    scattered pages out and back, as PagePool.swap_out/swap_in do them, each timed alone
    (median of 9), their sum, and the engine's whole path (gpu_check's swap row, doubled)."""
    import numpy as np
    import torch

    from minicb.kv_cache import PagePool
    page, dtype = gpu_check.swap_page(device)
    n = SWAP_PAGES
    pool = PagePool(2 * n, page["page_size"], page["num_layers"], page["num_kv_heads"],
                    page["head_dim"], dtype, device, num_swap_pages=2 * n)
    pool.every_layer.fill_(1.0)
    pool.swap_store.fill_(1.0)
    rng = np.random.default_rng(0)
    dev_pages = rng.permutation(2 * n)[:n].tolist()
    host_pages = rng.permutation(2 * n)[:n].tolist()
    staging = pool._staging(n) if pool.stage_swaps else torch.empty_like(
        pool.swap_store[:, :, :n])
    gathered = pool.every_layer[:, :, dev_pages]
    host_index = torch.tensor(host_pages)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def median(fn) -> float:
        times = []
        for _ in range(9):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return float(sorted(times)[4])

    parts = [
        ("out: gather the pages on the device", lambda: pool.every_layer[:, :, dev_pages]),
        ("out: device → page-locked host copy", lambda: staging.copy_(gathered)),
        ("out: scatter into the swap store (CPU), one indexed assignment (before 787e50a)",
         lambda: pool.swap_store.__setitem__((slice(None), slice(None), host_pages), staging)),
        ("out: scatter into the swap store (CPU), page by page (the engine's way)",
         lambda: [pool.swap_store[:, :, h].copy_(page)
                  for h, page in zip(host_pages, staging.unbind(2))]),
        ("in: gather from the swap store into page-locked memory (CPU)",
         lambda: torch.index_select(pool.swap_store, 2, host_index, out=staging)),
        ("in: page-locked host → device copy",
         lambda: gathered.copy_(staging, non_blocking=True)),
        ("in: scatter into the pool on the device",
         lambda: pool.every_layer.__setitem__((slice(None), slice(None), dev_pages), gathered)),
    ]
    out = [(name, median(fn) / n) for name, fn in parts]
    out.append(("sum of the parts the engine runs: a page out and back in",
                sum(s for name, s in out if "before" not in name)))
    engine = gpu_check.time_swap(device)  # seconds per page copied, out or in
    out.append(("PagePool.swap_out + swap_in: a page out and back in (gpu_check's swap row "
                "is half of this)", 2 * engine["sec"]))
    return engine["bytes"], out


def render(date: str, header: str, state: dict) -> str:
    lines = [f"# Second GPU check (API, policies, HF with graphs, swap parts), {date}", "",
             f"{header}. Made by `bench/gpu_api_check.sh`.", "", "## 1. The API on the device",
             "", "| check | result | what it saw |", "|---|---|---|"]
    for name, ok, detail in state["checks"]:
        lines.append(f"| {name} | {'pass' if ok else '**FAIL**'} | "
                     f"{gpu_check.cell(detail)} |")
    if not state["checks"]:
        lines.append("| (not reached) | | |")
    for title, key in (("2. Every policy on mixed-chat", "policies"),
                       ("3. pd vs transformers with CUDA graphs forced on", "hf_graphs"),
                       ("4. Settings: CUDA graphs and the token budget", "settings")):
        lines += ["", f"## {title}", "", "```", state.get(key) or "(not reached)", "```"]
    lines += ["", "## 5. A swapped page's time, part by part", ""]
    page_bytes = state.get("swap_page_bytes")
    if state.get("swap"):
        lines += [f"{SWAP_PAGES} scattered pages of {page_bytes / 2**10:.0f} KiB (Llama-3-8B "
                  "class, bf16), each part timed alone, median of 9, per page:", "",
                  "| part | µs a page | GB/s |", "|---|---|---|"]
        for name, sec in state["swap"]:
            moved = 2 * page_bytes if "out and back in" in name else page_bytes
            lines.append(f"| {name} | {sec * 1e6:.1f} | {moved / sec / 1e9:.1f} |")
    else:
        lines.append(state.get("swap_error") or "(not reached)")
    lines += ["", f"Whole check: {time.perf_counter() - state['t0']:.0f} s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="toy sizes on the CPU in the Triton interpreter, to test this script")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--skip-bench", action="store_true",
                        help="stages 1 and 5 only (no benchmark subprocesses)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT))
    import torch
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    device = "cpu" if args.cpu_smoke else "cuda"
    folder = Path(args.out_dir or (tempfile.mkdtemp() if args.cpu_smoke else ROOT / "bench"))
    folder.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    date = datetime.date.today().isoformat()
    where = (f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})" if device == "cuda"
             else "CPU smoke run (Triton interpreter)")
    header = f"{where}; {gpu_check.versions()}"
    report = folder / f"gpu-api-{date}.md"
    state: dict = {"checks": [], "t0": t0}

    def write() -> None:
        report.write_text(render(date, header, state))

    def record(name, ok, detail) -> None:
        print(f"{'pass' if ok else 'FAIL'}: {name}: {detail}")
        state["checks"].append((name, ok, detail))
        write()

    tiny = tiny_checkpoint(work)
    shapes, shapes_name = gpu_check.bench_model(args.cpu_smoke, work)
    print(f"model for the pool check and the benchmarks: {shapes_name}")
    api_checks(tiny, shapes, device, record)
    if not args.skip_bench:
        small = gpu_check.SMOKE_BENCH if args.cpu_smoke else []
        base = [sys.executable, "-m", "minicb", "bench", "--workload", "mixed-chat", "--model",
                shapes, "--device", device, "--no-progress"] + small
        state["policies"] = run_cli(base + ["--policy", POLICIES], 150)
        print(state["policies"])
        write()
        state["hf_graphs"] = run_cli(base + ["--policy", "pd", "--compare", "hf",
                                             "--hf-cuda-graphs"], 170)
        print(state["hf_graphs"])
        write()
        runs = []
        for label, flags in SETTINGS:
            runs.append(f"### {label}\n" + run_cli(
                base + ["--policy", "static,continuous,pd", *flags], 100))
            print(runs[-1])
            state["settings"] = "\n\n".join(runs)
            write()
    try:
        state["swap_page_bytes"], state["swap"] = swap_parts(device)
    except Exception as exc:
        state["swap_error"] = f"failed: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    write()
    print(report.read_text())
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
