"""minicb against llama.cpp on the CPU: the same client workloads against `minicb serve` and
`llama-server`, one server at a time, alternating which goes first, float32 on both sides.

    bench/llama_cpp.sh      # once: builds llama-server and the F32 GGUF under build/llama_cpp/
    .venv/bin/python bench/llama_cpp.py --repeats 3 --out bench/results/llama-cpp-DATE

Each (repeat, workload, server) is one run: the server starts, the workload runs through
minicb's client (`minicb.serving.client.bench_endpoint`: streamed /v1/completions with token-id
prompts and `ignore_eos`, so both servers receive byte-identical requests), the server stops.
Every run is appended to OUT.json as it finishes, with the machine's load (`os.getloadavg`), so
an interrupted benchmark resumes where it stopped; OUT.md is the table: output tokens/s and
TPOT p50 per run, and the ratio minicb / llama.cpp of each side-by-side pair. `--dry-run`
prints the plan and the commands and runs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "llama_cpp"
SERVERS = ("minicb", "llama.cpp")
# name -> (scenario of minicb.benchmark.workload, its overrides, server slots)
WORKLOADS: dict[str, tuple[str, dict, int]] = {
    "one request, 128 tokens": ("equal-lengths", {"num_requests": 1}, 16),
    "16 requests at once": ("mixed-chat", {"num_requests": 16}, 16),
    "32 requests at once (32 slots)": ("mixed-chat", {"num_requests": 32}, 32),
    "0.5 requests/s": ("low-rate", {"rate": 0.5}, 16),
}
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni",
                "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve", "sve2", "bf16")


def cpu_description() -> dict:
    """The CPU model, its vector flags that matter here, and the cores this process may use."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as lines:
        for line in lines:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {"model": info.get("model name") or platform.processor() or platform.machine(),
            "vector_flags": [f for f in VECTOR_FLAGS if f in flags],
            "cpus": len(os.sched_getaffinity(0))}


def minicb_command(port: int, slots: int, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "minicb", "serve", "--model", args.model, "--port", str(port),
            "--policy", "pd", "--max-num-seqs", str(slots), "--log-level", "warning"]


def llama_command(port: int, slots: int, args: argparse.Namespace) -> list[str]:
    # a context of 1,024 tokens per slot holds every workload's prompt and output
    return [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port",
            str(port), "-t", str(args.threads), "-tb", str(args.threads), "--parallel",
            str(slots), "-c", str(1024 * slots), "--log-disable"]


COMMANDS = {"minicb": minicb_command, "llama.cpp": llama_command}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(command: list[str], port: int, threads: int, log: Path,
            timeout: float = 600.0) -> Iterator[str]:
    """Start a server, wait until GET /v1/models answers, yield its URL, stop it."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    url = f"http://127.0.0.1:{port}"
    with open(log, "a") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} did not answer within {timeout:.0f} s; "
                                   f"see {log}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(url: str, workload_name: str, args: argparse.Namespace) -> dict:
    """One workload through minicb's client; the summary fields the table needs."""
    from minicb.benchmark.workload import get_workload
    from minicb.serving.client import bench_endpoint
    scenario, overrides, _ = WORKLOADS[workload_name]
    workload = get_workload(scenario, seed=args.seed, **overrides)
    summary = next(iter(bench_endpoint(url, workload, vocab_size=args.vocab_size)
                        ["results"].values()))
    return {key: summary.get(key) for key in ("output_tokens_per_s", "tpot_s", "ttft_s",
                                              "num_requests", "errors", "error_reasons")}


def plan(args: argparse.Namespace) -> list[tuple[int, str, str]]:
    """(repeat, workload, server) in the order they run: each workload's two servers back to
    back, the first of them alternating from one repeat to the next."""
    order = []
    for repeat in range(args.repeats):
        for i, name in enumerate(args.workloads):
            servers = SERVERS if (repeat + i) % 2 == 0 else SERVERS[::-1]
            order.extend((repeat, name, server) for server in servers)
    return order


def table(runs: list[dict]) -> str:
    """Markdown: per workload, each server's runs (output tok/s, TPOT p50) and the ratios."""
    lines = ["| workload | minicb out tok/s | llama.cpp out tok/s | minicb / llama.cpp | "
             "TPOT p50 minicb | TPOT p50 llama.cpp |", "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["workload"] for r in runs):
        pairs: dict[int, dict[str, dict]] = {}
        for r in runs:
            if r["workload"] == name:
                pairs.setdefault(r["repeat"], {})[r["server"]] = r["result"]
        tok = {s: [p[s]["output_tokens_per_s"] for p in pairs.values() if s in p] for s in SERVERS}
        tpot = {s: [p[s]["tpot_s"]["p50"] * 1e3 for p in pairs.values()
                    if s in p and p[s]["tpot_s"]["p50"] is not None] for s in SERVERS}
        ratios = [p["minicb"]["output_tokens_per_s"] / p["llama.cpp"]["output_tokens_per_s"]
                  for p in pairs.values() if len(p) == 2]
        fmt = lambda xs, f: " / ".join(f.format(x) for x in xs) or "-"  # noqa: E731
        span = (f"{min(ratios):.2f}-{max(ratios):.2f}x (median {statistics.median(ratios):.2f})"
                if ratios else "-")
        lines.append(f"| {name} | {fmt(tok['minicb'], '{:.1f}')} | "
                     f"{fmt(tok['llama.cpp'], '{:.1f}')} | {span} | "
                     f"{fmt(tpot['minicb'], '{:.0f} ms')} | "
                     f"{fmt(tpot['llama.cpp'], '{:.0f} ms')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "llama-cpp",
                        help="writes OUT.json and OUT.md (OUT.json is resumed from)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS),
                        choices=list(WORKLOADS), metavar="WORKLOAD")
    parser.add_argument("--threads", type=int, default=2, help="each server's threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2-135m", help="minicb's model")
    parser.add_argument("--vocab-size", type=int, default=None, help="fold prompt ids below "
                        "this (tiny test models)")
    parser.add_argument("--llama-server", type=Path, default=BUILD / "bin" / "llama-server")
    parser.add_argument("--gguf", type=Path, default=BUILD / "smollm2-135m-f32.gguf")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    args = parser.parse_args(argv)
    cpu = cpu_description()
    print(f"CPU: {cpu['model']}, {cpu['cpus']} cores usable, vector flags: "
          f"{' '.join(cpu['vector_flags']) or 'none known'}")
    order = plan(args)
    if args.dry_run:
        for repeat, name, server in order:
            command = COMMANDS[server](0, WORKLOADS[name][2], args)
            print(f"repeat {repeat}  {name:<32} {server:<10} {' '.join(command)}")
        return 0
    missing = [p for p in (args.llama_server, args.gguf) if not p.exists()]
    if missing:
        print(f"error: {', '.join(map(str, missing))} missing: run bench/llama_cpp.sh first",
              file=sys.stderr)
        return 2
    path = args.out.with_suffix(".json")
    saved = json.loads(path.read_text()) if path.exists() else {}
    # a run with a failed request is kept for the record and measured again
    failed = saved.get("failed_runs", []) + [r for r in saved.get("runs", [])
                                             if r["result"]["errors"]]
    runs = [r for r in saved.get("runs", []) if not r["result"]["errors"]]
    done = {(r["repeat"], r["workload"], r["server"]) for r in runs}
    header = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
              "cpu": cpu, "threads": args.threads, "seed": args.seed,
              "workloads": {n: WORKLOADS[n] for n in args.workloads},
              "servers": {s: COMMANDS[s](0, 0, args)[1:] for s in SERVERS}}
    log = args.out.with_suffix(".log")  # the servers' output
    path.parent.mkdir(parents=True, exist_ok=True)
    for repeat, name, server in order:
        if (repeat, name, server) in done:
            continue
        port = free_port()
        load = os.getloadavg()
        with running(COMMANDS[server](port, WORKLOADS[name][2], args), port, args.threads,
                     log) as url:
            result = measure(url, name, args)
        run = {"repeat": repeat, "workload": name, "server": server, "result": result,
               "load_before": [round(x, 2) for x in load], "finished": time.time()}
        (failed if result["errors"] else runs).append(run)
        print(f"repeat {repeat}  {name:<32} {server:<10} "
              f"{result['output_tokens_per_s']:.1f} out tok/s  (load {load[0]:.1f})"
              + (f"  FAILED: {result['error_reasons']}" if result["errors"] else ""), flush=True)
        path.write_text(json.dumps({**saved, **header, "runs": runs, "failed_runs": failed},
                                   indent=1) + "\n")
    text = table(runs)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
