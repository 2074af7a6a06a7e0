"""The CLI: `bench`, `sweep` and `profile` end to end on a tiny checkpoint and on the simulated
executor; the results file follows the schema and starts with the declaration."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from minicb.__main__ import main
from minicb.benchmark import bench, flags, hf, metrics, profile, report, runs, sweep
from minicb.benchmark.sim import CostModel, make_sim_engine
from minicb.benchmark.workload import Workload, WorkloadRequest, get_workload, run_workload

TINY = ["--num-requests", "4", "--prompt-lengths", "uniform:4:24",
        "--output-lengths", "uniform:2:6", "--no-progress"]
SWEEP = ["--executor", "sim", "--workload", "mixed-chat", "--num-requests", "24", "--rate", "40",
         "--max-num-batched-tokens", "64,512", "--max-num-seqs", "4,16", "--chunk-size", "64",
         "--no-progress"]
DECLARED = ("arrival_process", "burstiness", "concurrency", "prompt_lengths", "output_lengths",
            "cache_state", "policy", "token_budget", "memory_limit", "model", "runtime",
            "device", "executor", "simulated", "slo", "seed", "command")

def patch(monkeypatch, name: str, value) -> None:
    """Replace `name` in every benchmark module that looks it up (bench, sweep and profile
    import the shared steps by name)."""
    for module in (bench, flags, hf, profile, report, runs, sweep):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)


def test_bench_end_to_end_on_a_tiny_checkpoint(tiny_llama_dir, tmp_path, capsys):
    """A real bench run of several policies on a tiny checkpoint writes a valid results file
    declaring what ran, completes every request, draws the plot, prints the table, and reports
    that batching kept the greedy tokens of the first policy."""
    out, png = tmp_path / "results.json", tmp_path / "results.png"
    code = bench.main_bench(["--model", str(tiny_llama_dir), "--policy", "static,pd",
                             "--policy", "continuous", "--max-num-seqs", "3",
                             "--slo-ttft", "5", "--out", str(out), "--plot", str(png), *TINY])
    assert code == 0
    data = json.loads(out.read_text())
    assert runs.results_schema_ok(data) == []
    assert list(data["results"]) == ["static", "pd", "continuous"]
    decl = data["declaration"]
    for key in DECLARED:
        assert key in decl, key
    assert decl["simulated"] is False and decl["executor"] == "real"
    assert decl["runtime"]["torch"] and decl["device"]["cpu_count"] >= 1
    assert decl["model"]["path"] == str(tiny_llama_dir)
    assert decl["device"]["cpu_model"] and decl["attention_backend"] in ("cpu", "torch")
    assert decl["concurrency"]["max_num_seqs"] == 3 and decl["slo"] == {"ttft": 5.0}
    for summary in data["results"].values():
        assert summary["completed"] == 4 and summary["errors"] == 0
        assert 0.0 <= summary["host_time_fraction"] <= 1.0
    assert png.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "policy" in printed and "continuous" in printed and "TTFT p50" in printed
    assert "same_tokens_as" not in data["results"]["static"]  # the reference
    for policy in ("pd", "continuous"):  # greedy: batching never changes the tokens
        assert data["results"][policy]["same_tokens_as"] == {
            "policy": "static", "checked": True, "requests": 4, "differing_requests": []}
    assert "greedy tokens: pd, continuous identical to static on all 4 requests" in printed


def test_bench_runs_int8_weights(tiny_llama_dir, tmp_path):
    """Bench runs int8 weights, declares them (not prepacked), and completes every request with a
    single-stream decode speed."""
    out = tmp_path / "int8.json"
    assert bench.main_bench(["--model", str(tiny_llama_dir), "--policy", "single,pd",
                             "--quantization", "int8", "--out", str(out), *TINY]) == 0
    data = json.loads(out.read_text())
    assert data["declaration"]["model"]["quantization"] == "int8"
    assert not data["declaration"]["model"]["prepacked"]  # int8 weights are not prepacked
    assert data["results"]["single"]["single_stream"]["decode_tokens_per_s"] > 0
    assert all(s["completed"] == 4 and s["errors"] == 0 for s in data["results"].values())


def test_bench_runs_bfloat16_weights(tiny_llama_dir, tmp_path, capsys):
    """Bench runs bfloat16 weights, declares the dtype and whether they are prepacked, and prints
    it; bfloat16 with int8 is refused with status 2."""
    out = tmp_path / "bf16.json"
    assert bench.main_bench(["--model", str(tiny_llama_dir), "--policy", "pd", "--dtype",
                             "bfloat16", "--out", str(out), *TINY]) == 0
    data = json.loads(out.read_text())
    model, pd = data["declaration"]["model"], data["results"]["pd"]
    from minicb.model.prepack import prepack_wanted
    assert model["dtype"] == "torch.bfloat16"
    assert model["prepacked"] == prepack_wanted("cpu", torch.bfloat16)  # where oneDNN runs bf16
    assert pd["completed"] == 4 and pd["errors"] == 0
    label = "torch.bfloat16 prepacked weights" if model["prepacked"] else "torch.bfloat16 weights"
    assert label in capsys.readouterr().out
    assert bench.main_bench(["--model", str(tiny_llama_dir), "--policy", "pd", "--dtype",
                             "bfloat16", "--quantization", "int8", *TINY]) == 2
    assert "leave --dtype auto" in capsys.readouterr().err


def test_bench_compare_hf_and_single_stream(tiny_llama_dir, tmp_path, capsys):
    """--compare hf runs the static and generate-batch baselines on the same requests and lengths,
    measures single-stream speeds for minicb and HF, and reports HF's greedy tokens as
    informative."""
    out = tmp_path / "hf.json"
    code = bench.main_bench(["--model", str(tiny_llama_dir), "--policy", "single",
                             "--compare", "hf", "--max-num-seqs", "2", "--out", str(out),
                             *TINY])
    assert code == 0
    data = json.loads(out.read_text())
    results = data["results"]
    assert set(results) == {"single", "hf-static", "hf-generate-batch"}
    total = results["single"]["output_tokens"]
    for name in ("hf-static", "hf-generate-batch"):
        assert "error" not in results[name], results[name]
        assert results[name]["output_tokens"] == total  # same requests, same lengths
        assert results[name]["completed"] == 4
    single = results["single"]["single_stream"]
    assert single["decode_tokens_per_s"] > 0 and single["prefill_tokens_per_s"] > 0
    assert results["single"]["hf_single_stream"]["decode_tokens_per_s"] > 0
    assert data["declaration"]["compare"]["dtype"] == "float32"  # minicb's, on the CPU
    assert "untimed" in data["declaration"]["compare"]["warm_up"]
    for name in ("hf-static", "hf-generate-batch"):  # informative: counted, not required
        check = results[name]["same_tokens_as"]
        assert check["policy"] == "single" and check["checked"] and check["requests"] == 4
    printed = capsys.readouterr().out
    assert "greedy tokens of transformers: " in printed and "informative" in printed
    assert "hf generate batch-1" in printed
    if data["declaration"]["model"]["prepacked"]:  # the float32 CPU default, where oneDNN is
        assert "torch.float32 prepacked weights" in printed


def test_bench_simulated_says_so(tmp_path, capsys):
    """A simulated bench run declares itself simulated with its cost model, leaves tokens unchecked,
    and reports dec@P and mixed steps for pd but not for chunked, with the same prefill and
    decode tokens."""
    out = tmp_path / "sim.json"
    code = bench.main_bench(["--executor", "sim", "--workload", "long-prefill",
                             "--long-prompt-len", "600", "--policy", "chunked,pd",
                             "--out", str(out), "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    decl = data["declaration"]
    assert decl["simulated"] is True and decl["executor"] == "simulated"
    assert "SIMULATED" in decl["note"] and decl["cost_model"]["name"] == "h100-like"
    assert data["results"]["pd"]["dec_at_p"] > 0 == data["results"]["chunked"]["dec_at_p"]
    assert runs.results_schema_ok(data) == []
    assert data["results"]["pd"]["same_tokens_as"]["checked"] is False  # no real tokens
    assert "not checked (simulated" in data["results"]["pd"]["same_tokens_as"]["note"]
    pd, chunked = data["results"]["pd"], data["results"]["chunked"]  # what the steps processed
    assert pd["mixed_steps"] > 0 == chunked["mixed_steps"]  # prefill-first never mixes
    assert pd["prefill_tokens"] == chunked["prefill_tokens"] >= 600
    assert pd["decode_tokens"] == chunked["decode_tokens"] > 0
    assert f"mixed steps {pd['mixed_steps']} (" in capsys.readouterr().out


def test_a_warm_cache_holds_the_shared_prefix_not_the_questions(tmp_path):
    """--cache-state warm: each engine first serves the same traffic with the next seed (same
    system prompt, other questions), and only the run after it is measured."""
    results = {}
    for state in ("cold", "warm"):
        out = tmp_path / f"{state}.json"
        assert bench.main_bench(["--executor", "sim", "--workload", "shared-prefix",
                                 "--num-requests", "8", "--policy", "pd", "--cache-state",
                                 state, "--out", str(out), "--no-progress"]) == 0
        data = json.loads(out.read_text())
        assert data["declaration"]["cache_state"]["start"].startswith(state)
        results[state] = data["results"]["pd"]
    cold, warm = results["cold"], results["warm"]
    assert warm["num_requests"] == cold["num_requests"] == 8  # the warm-up is not counted
    assert warm["output_tokens"] == cold["output_tokens"]
    prefix_pages = 256 // 16  # shared-prefix: a 256-token system prompt, pages of 16
    assert warm["cached_prompt_tokens"] == 8 * prefix_pages * 16  # every request, prefix only
    assert cold["cached_prompt_tokens"] < warm["cached_prompt_tokens"]
    assert warm["ttft_s"]["p50"] < cold["ttft_s"]["p50"]


@pytest.mark.parametrize("argv, message", [
    (["--policy", "fastest"], "--policy"),
    (["--policy", ","], "--policy names no policy"),
    (["--policy", " "], "--policy names no policy"),
    (["--workload", "seed-r1-r4", "--cache-state", "warm"], "arrivals in seconds"),
    (["--workload", "seed-r1-r4", "--rate", "3"], "--rate"),
    (["--workload", "mixed-chat", "--long-prompt-len", "5"], "--long-prompt-len"),
    (["--threads", "0"], "--threads"),
    (["--compare", "hf"], "--compare hf needs --executor real"),
    (["--quantization", "int8"], "--quantization needs --executor real"),
    (["--dtype", "bfloat16"], "--dtype needs --executor real"),
    (["--slo-ttft", "-1"], "positive"),
    (["--slo-ttft", "nan"], "positive"),
    (["--num-speculative-tokens", "3"], "every guess would be kept"),
    # --compare hf only at the same load and quality: refused before any model loads
    (["--executor", "real", "--compare", "hf", "--quantization", "int8"], "same quality"),
    (["--executor", "real", "--compare", "hf", "--cancel-fraction", "0.2"], "cannot cancel"),
    (["--executor", "real", "--compare", "hf", "--reject-when-full"], "turn nobody away"),
    (["--executor", "real", "--compare", "hf", "--workload", "shared-prefix",
      "--cache-state", "warm"], "start cold"),
    # no prefix cache to warm: the run would be cold under a declaration that says warm
    (["--workload", "shared-prefix", "--cache-state", "warm", "--no-prefix-caching"],
     "--no-prefix-caching there is none"),
])
def test_bench_refuses_bad_flags(argv, message, capsys):
    """Each bad or contradictory bench flag exits with status 2 and a message naming it, before any
    model loads."""
    assert bench.main_bench(["--executor", "sim", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_compare_hf_refuses_a_trace_with_cancels_or_deadlines(tmp_path, capsys, monkeypatch):
    """transformers' baselines run every request to its full length: a trace that cancels one or
    gives it a deadline is refused before any model loads, since its speed ratio and token check
    would compare different work."""
    patch(monkeypatch, "executor_from_args", lambda *a: 1 / 0)
    for extra in ('"cancel_after_tokens": 1', '"deadline_s": 0.5'):
        trace = tmp_path / "t.jsonl"
        trace.write_text('{"arrival_s": 0, "prompt_tokens": 8, "output_tokens": 4}\n'
                         f'{{"arrival_s": 0, "prompt_tokens": 8, "output_tokens": 4, {extra}}}\n')
        assert bench.main_bench(["--executor", "real", "--compare", "hf", "--no-progress",
                                 "--workload-file", str(trace)]) == 2
        assert "cancelled or have deadlines" in capsys.readouterr().err


def test_sweep_lists_run_each_setting_once_and_slo_target_needs_rates(tmp_path, capsys):
    """A sweep value listed twice ("256, 256", "8,08") runs its setting once, the same rows as
    listed once, and --slo-target without --rates exits with status 2 saying it needs --rates."""
    rows = []
    for budgets, seqs in (("256, 256", "8,08"), ("256", "8")):
        out = tmp_path / "s.json"
        assert sweep.main_sweep(["--executor", "sim", "--num-requests", "4", "--no-progress",
                                 "--max-num-batched-tokens", budgets, "--max-num-seqs", seqs,
                                 "--out", str(out)]) == 0
        rows.append(len(json.loads(out.read_text())["rows"]))
    assert rows[0] == rows[1]  # a value listed twice runs its setting once
    assert sweep.main_sweep(["--executor", "sim", "--num-requests", "4", "--no-progress",
                             "--slo-ttft", "1", "--slo-target", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--slo-target" in err and "needs --rates" in err


def test_dynamic_batching_may_wait_longer_than_the_idle_guard(capsys):
    """A batch timeout in seconds is the clock running, not a stall: 101 s of 1 ms empty steps
    passed run_workload's 100,000-idle-step guard, which raised."""
    assert bench.main_bench(["--executor", "sim", "--no-progress", "--num-requests", "3",
                             "--rate", "1", "--policy", "dynamic", "--batch-timeout", "101"]) == 0
    assert "dynamic" in capsys.readouterr().out


def test_unwritable_outputs_are_refused_before_the_run(tmp_path, capsys, monkeypatch):
    """--out, --plot and --save-workload under a plain file (no folder can be made there) fail
    with one line naming the flag, before any engine runs; a writable --out is not left behind
    when the run then fails."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ran = []
    patch(monkeypatch, "run_policy", lambda *a, **k: ran.append(a) or 1 / 0)
    for flag in ("--out", "--plot", "--save-workload"):
        assert bench.main_bench(["--executor", "sim", "--num-requests", "2", "--no-progress",
                                 flag, str(blocker / "x")]) == 2
        assert f"{flag} {blocker / 'x'}: cannot write there" in capsys.readouterr().err
    assert sweep.main_sweep(["--executor", "sim", "--num-requests", "2", "--no-progress",
                             "--out", str(blocker / "x")]) == 2
    assert "--out" in capsys.readouterr().err
    assert ran == []
    fine = tmp_path / "deep" / "r.json"
    with pytest.raises(ZeroDivisionError):
        bench.main_bench(["--executor", "sim", "--num-requests", "2", "--no-progress",
                          "--out", str(fine)])
    assert not fine.exists()


def test_the_report_names_lost_work_evictions_deadlines_and_attainment(tmp_path, capsys):
    """Memory pressure and SLO attainment are in the printed extras, not only in the JSON."""
    out = tmp_path / "r.json"
    assert bench.main_bench(["--executor", "sim", "--workload", "mixed-chat", "--num-requests",
                             "32", "--num-pages", "60", "--policy", "pd", "--slo-ttft", "0.5",
                             "--no-progress", "--out", str(out)]) == 0
    pd = json.loads(out.read_text())["results"]["pd"]
    printed = capsys.readouterr().out
    assert pd["discarded_tokens"] >= pd["recomputed_tokens"] > 0 and pd["evicted_pages"] > 0
    assert (f"work lost to preemption={pd['discarded_tokens']} tokens "
            f"({pd['recomputed_tokens']} computed again), cached pages "
            f"evicted={pd['evicted_pages']}") in printed
    assert f"SLO met by {pd['slo_attainment']:.0%}" in printed
    assert 0 < pd["kv_pool_use_mean"] <= pd["kv_pool_use_peak"] <= 1
    assert (f"KV pool use mean {pd['kv_pool_use_mean']:.0%} peak {pd['kv_pool_use_peak']:.0%}, "
            f"token budget use mean {pd['token_budget_use_mean']:.0%}") in printed
    assert "note: no static or dynamic batching row" in printed  # pd alone
    bench.main_bench(["--executor", "sim", "--num-requests", "4", "--policy", "static,pd",
                      "--no-progress"])
    assert "no static or dynamic" not in capsys.readouterr().out
    report._print_extra("x", {"deadline_missed": 3})
    assert "x: deadline missed=3" in capsys.readouterr().out
    report._print_extra("quiet", {"deadline_missed": 0, "discarded_tokens": 0,
                                 "evicted_pages": 0, "slo": {}, "slo_attainment": None})
    assert capsys.readouterr().out == ""


def test_the_printed_header_declares_everything_the_contract_names(capsys):
    """Arrival process, burstiness and rate, lengths, concurrency, cache state, policy and its
    options, budget, memory, model, runtime and hardware: on the console, not only in the
    JSON."""
    assert bench.main_bench(["--executor", "sim", "--workload", "mixed-chat", "--num-requests",
                             "4", "--rate", "7.5", "--burstiness", "0.5", "--policy", "pd",
                             "--max-num-seqs", "6", "--no-prefix-caching", "--preemption",
                             "priority", "--max-preemptions", "2", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("workload mixed-chat"))
    header = "\n".join(lines[start:start + 5])
    for shown in ("4 requests, arrivals gamma", "at 7.5 req/s (burstiness 0.5)",
                  "prompts uniform 16-512", "outputs uniform 8-256",
                  "concurrency: open loop, max_num_seqs 6", "cache: prefix caching off, cold start",
                  "policies pd (preemption=priority, max_preemptions=2, "
                  "preemption_mode=recompute)",
                  "SIMULATED, not measured; on cpu (", f"torch {torch.__version__}",
                  "token budget {'max_num_batched_tokens': 256", "memory {'num_pages'"):
        assert shown in header, shown
    lognormal = {"kind": "lognormal", "low": 16, "high": 6000, "median": 512.0, "sigma": 1.0}
    assert report._lengths(lognormal) == "lognormal median 512 sigma 1, 16-6000"


def test_max_concurrency_closes_the_loop_and_is_declared(tmp_path, capsys):
    """bench --max-concurrency N: the run keeps N requests in flight, the declaration says
    closed loop with N, the header prints it; sweep takes it too; 0 and --compare hf are
    refused before anything runs."""
    out = tmp_path / "r.json"
    argv = ["--executor", "sim", "--num-requests", "30", "--rate", "50", "--policy", "pd",
            "--no-progress"]
    assert bench.main_bench([*argv, "--max-concurrency", "3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    concurrency = data["declaration"]["concurrency"]
    assert concurrency["max_concurrency"] == 3 and concurrency["client"].startswith("closed loop")
    assert "concurrency: closed loop of 3, max_num_seqs" in capsys.readouterr().out
    assert bench.main_bench([*argv, "--out", str(out)]) == 0  # the open loop, for comparison
    open_loop = json.loads(out.read_text())
    assert open_loop["declaration"]["concurrency"]["max_concurrency"] is None
    assert "concurrency: open loop, max_num_seqs" in capsys.readouterr().out
    closed_ttft = data["results"]["pd"]["ttft_s"]["p99"]
    assert closed_ttft < open_loop["results"]["pd"]["ttft_s"]["p99"]  # the wait is the client's
    sweep_out = tmp_path / "s.json"
    assert sweep.main_sweep(["--executor", "sim", "--num-requests", "12", "--rate", "50",
                             "--max-num-batched-tokens", "256", "--max-concurrency", "2",
                             "--no-progress", "--out", str(sweep_out)]) == 0
    assert json.loads(sweep_out.read_text())["declaration"]["concurrency"]["max_concurrency"] == 2
    capsys.readouterr()
    assert sweep.main_sweep(["--executor", "sim", "--num-requests", "12", "--rates", "5,50",
                             "--slo-ttft", "1", "--max-concurrency", "2", "--no-progress"]) == 2
    assert "--rates with --max-concurrency: a closed loop" in capsys.readouterr().err
    assert bench.main_bench([*argv, "--max-concurrency", "0"]) == 2
    assert "--max-concurrency must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--compare hf with --max-concurrency"):
        bench.refuse_unequal_hf_comparison(bench.bench_parser().parse_args(
            ["--compare", "hf", "--max-concurrency", "4"]), Workload("none", []))


def test_the_report_shows_fairness_per_tenant_and_prompt_length(tmp_path, capsys):
    """A trace with two tenants and prompts of two sizes: bench prints a per-class table for
    each grouping (done/requests, TTFT p50/p99, E2E p99, SLO met) equal to the JSON's
    by_class; priorities, all 0 here, get none."""
    trace, out = tmp_path / "t.jsonl", tmp_path / "r.json"
    trace.write_text("".join(
        json.dumps({"arrival_s": 0.05 * i, "prompt_tokens": 40 if i % 3 else 900,
                    "output_tokens": 8, "tenant": "ab"[i % 2]}) + "\n" for i in range(12)))
    assert bench.main_bench(["--executor", "sim", "--workload-file", str(trace), "--policy",
                             "pd", "--slo-ttft", "0.05", "--no-progress", "--out",
                             str(out)]) == 0
    printed = capsys.readouterr().out
    classes = json.loads(out.read_text())["results"]["pd"]["by_class"]
    assert set(classes) == {"prompt_tokens", "tenant"}
    assert list(classes["prompt_tokens"]) == ["0-127", "512-2047"]
    assert "pd by tenant: done/requests, TTFT p50 and p99, E2E p99 (s), SLO met" in printed
    for label, row in classes["tenant"].items():
        assert (f"{label}     {row['completed']}/{row['requests']}    "
                f"{row['ttft_p50_s']:>7.3f} {row['ttft_p99_s']:>7.3f}") in printed
    assert "pd by prompt tokens" in printed and "pd by priority" not in printed


def test_bench_saves_its_workload_and_replays_it(tmp_path, capsys):
    """--save-workload writes the requests as a trace; --workload-file replays them: the same
    schedule, so the same simulated results, under a declaration that says it was replayed."""
    trace, first, again = (tmp_path / n for n in ("w.jsonl", "first.json", "again.json"))
    common = ["--executor", "sim", "--policy", "static,pd", "--no-progress"]
    assert bench.main_bench([*common, "--num-requests", "6", "--rate", "4", "--save-workload",
                             str(trace), "--out", str(first)]) == 0
    assert f"wrote workload {trace}" in capsys.readouterr().out
    assert bench.main_bench([*common, "--workload-file", str(trace), "--out", str(again)]) == 0
    a, b = (json.loads(p.read_text()) for p in (first, again))
    for policy in ("static", "pd"):
        for key in ("ttft_s", "e2e_s", "num_steps", "output_tokens"):
            assert a["results"][policy][key] == b["results"][policy][key]
    assert b["declaration"]["arrival_process"] == "replayed trace"
    assert b["declaration"]["workload"]["source"] == f"replayed from {trace}"
    assert runs.results_schema_ok(b) == []


def test_a_saved_long_prefill_replays_with_its_dec_at_p(tmp_path, capsys):
    """long-prefill saved and replayed with the flags the save line names gives the same dec@P
    and short_P: the trace keeps which request is the long one."""
    trace, first, again = (tmp_path / n for n in ("lp.jsonl", "first.json", "again.json"))
    common = ["--executor", "sim", "--policy", "chunked,pd", "--no-progress"]
    assert bench.main_bench([*common, "--workload", "long-prefill", "--save-workload",
                             str(trace), "--out", str(first)]) == 0
    flags = capsys.readouterr().out.split("(replay it with ")[1].split(":")[0].split()
    assert flags == ["--max-num-seqs", "5"]
    assert bench.main_bench([*common, "--workload-file", str(trace), *flags,
                             "--out", str(again)]) == 0
    a, b = (json.loads(p.read_text())["results"] for p in (first, again))
    assert a["pd"]["dec_at_p"] > 0 and a["chunked"]["dec_at_p"] == 0
    for policy in ("chunked", "pd"):
        assert (a[policy]["dec_at_p"], a[policy]["short_p_steps"]) == \
            (b[policy]["dec_at_p"], b[policy]["short_p_steps"])


@pytest.mark.parametrize("extra, message", [
    (["--rate", "3"], "--rate do(es) not apply to --workload-file"),
    (["--workload", "mixed-chat"], "--workload do(es) not apply to --workload-file"),
    (["--cache-state", "warm"], "no other seed"),
    (["--seed", "7"], "--seed do(es) not apply to --workload-file"),  # ignored, yet declared
])
def test_a_replayed_trace_refuses_generator_flags(tmp_path, extra, message, capsys):
    """With --workload-file, the generator's flags (--rate, --workload, --seed, a warm cache) exit
    with status 2 naming the flag."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 8, "output_tokens": 2}\n')
    assert bench.main_bench(["--executor", "sim", "--workload-file", str(trace),
                             "--no-progress", *extra]) == 2
    assert message in capsys.readouterr().err


def priority_trace(tmp_path) -> str:
    """Two long requests, then a short urgent one (priority -1), all at once, for one slot."""
    path = tmp_path / "urgent.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in (
        {"arrival_s": 0.0, "prompt_tokens": 16, "output_tokens": 60},
        {"arrival_s": 0.0, "prompt_tokens": 16, "output_tokens": 60},
        {"arrival_s": 0.0, "prompt_tokens": 16, "output_tokens": 2, "priority": -1})))
    return str(path)


def test_bench_preemption_priority_serves_the_urgent_request_first(tmp_path):
    """--preemption priority: the request with the lowest priority value waits first in line
    (the trace gives it); newest serves the three in arrival order."""
    queue = {}
    for order in ("newest", "priority"):
        out = tmp_path / f"{order}.json"
        assert bench.main_bench(["--executor", "sim", "--workload-file", priority_trace(tmp_path),
                                 "--policy", "continuous", "--max-num-seqs", "1",
                                 "--preemption", order, "--out", str(out),
                                 "--no-progress"]) == 0
        data = json.loads(out.read_text())
        assert data["declaration"]["policy_options"]["preemption"] == order
        queue[order] = data["results"]["continuous"]["queue_s"]["p50"]
    assert queue["priority"] < queue["newest"] / 4  # the short one first: two short waits


def test_sweep_sweeps_the_priority_policy(tmp_path, capsys):
    """A sweep over preemption orders runs each one, declares them and the aging steps, and picks
    priority when it meets the urgent request's TTFT limit."""
    out = tmp_path / "sweep.json"
    assert sweep.main_sweep(["--executor", "sim", "--workload-file", priority_trace(tmp_path),
                             "--policy", "continuous", "--max-num-batched-tokens", "64",
                             "--max-num-seqs", "1", "--chunk-size", "64", "--preemption",
                             "newest,priority", "--priority-aging-steps", "50",
                             "--slo-ttft", "0.05", "--out", str(out), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert sorted(r["preemption"] for r in data["rows"]) == ["newest", "priority"]
    assert data["declaration"]["policy_options"]["preemption"] == ["newest", "priority"]
    assert data["declaration"]["policy_options"]["priority_aging_steps"] == 50
    assert data["best"]["preemption"] == "priority"  # the urgent one meets the TTFT limit too
    assert "preemption=priority" in capsys.readouterr().out


def by_size_sweep(tmp_path) -> list[str]:
    """Sweep flags over 100 mixed-length requests at 25 req/s (simulated), the prompts of 512
    tokens or more at priority 1: the priority order starves them."""
    import dataclasses

    from minicb.benchmark.workload import Workload, make_workload, save_workload_file
    traffic = make_workload(100, prompt_lengths="lognormal:512:1.0:16:6000",
                            output_lengths="uniform:16:256", arrival="poisson", rate=25, seed=5)
    trace = save_workload_file(Workload("by-size", [
        dataclasses.replace(r, priority=int(r.prompt_len >= 512)) for r in traffic.requests]),
        tmp_path / "by-size.jsonl")
    return ["--executor", "sim", "--workload-file", str(trace), "--max-num-batched-tokens",
            "512", "--max-num-seqs", "8,16", "--chunk-size", "512", "--preemption",
            "newest,priority", "--slo-ttft", "0.5", "--no-progress"]


def test_sweep_best_keeps_within_the_fairness_limit(tmp_path, capsys):
    """--max-queue-age: the contract picks the best goodput among the settings that stay fair.
    Long prompts at a lower priority: the priority order wins on goodput by starving them."""
    grid = by_size_sweep(tmp_path)
    unlimited = sweep.run_sweep(sweep.sweep_parser().parse_args(grid))
    top, rest = unlimited["rows"][0], unlimited["rows"][1:]
    fairer = min(r["max_queue_age_s"] for r in rest)
    assert fairer < top["max_queue_age_s"]  # the fastest setting is not the fairest
    limit = (fairer + top["max_queue_age_s"]) / 2
    out = tmp_path / "fair.json"
    assert sweep.main_sweep([*grid, "--max-queue-age", str(limit), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    within = [r for r in data["rows"] if r["max_queue_age_s"] <= limit]
    assert data["best"] == within[0] != data["rows"][0]
    assert data["declaration"]["fairness"] == {"max_queue_age_s": limit}
    assert f"fairness: oldest queue age <= {limit:g} s" in capsys.readouterr().out
    assert all(r["fails"] == (["fairness"] if r["max_queue_age_s"] > limit else [])
               for r in data["rows"])
    assert sweep.main_sweep([*grid, "--max-queue-age", "0.001"]) == 0
    assert "no setting meets them all" in capsys.readouterr().out
    assert sweep.main_sweep([*grid, "--max-queue-age", "-1"]) == 2
    assert "--max-queue-age must be" in capsys.readouterr().err


def test_sweep_best_keeps_every_class_above_the_class_fairness_limit(tmp_path, capsys):
    """--min-class-attainment: a setting in which some class (here the long prompts, bucket
    512-2047 or 2048+, or priority 1) met the SLO for less than the limit's share of its
    requests fails "class fairness" and is not the best, however high its goodput."""
    grid = by_size_sweep(tmp_path)
    unlimited = sweep.run_sweep(sweep.sweep_parser().parse_args(grid))
    rows = unlimited["rows"]
    assert all(r["fails"] == [] for r in rows)
    worst = [r["worst_class_attainment"] for r in rows]
    assert all(0 <= w <= r["slo_attainment"] for w, r in zip(worst, rows))
    assert {r["worst_class"].split("=")[0] for r in rows} <= {"prompt_tokens", "priority"}
    assert worst[0] < max(worst)  # the fastest setting is not the fairest to every class
    limit = (worst[0] + max(worst)) / 2
    out = tmp_path / "fair.json"
    assert sweep.main_sweep([*grid, "--min-class-attainment", str(limit), "--out",
                             str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert all(r["fails"] == (["class fairness"] if r["worst_class_attainment"] < limit else [])
               for r in data["rows"])
    fit = [r for r in data["rows"] if r["worst_class_attainment"] >= limit]
    assert data["best"] == fit[0] != data["rows"][0]
    assert data["declaration"]["fairness"] == {"min_class_attainment": limit}
    assert "worst class SLO %" in printed and "class fairness: every prompt-length bucket" in \
        printed and f"{data['rows'][0]['worst_class']} " in printed
    for extra, message in ((["--min-class-attainment", "0"], "must be a fraction in (0, 1]"),
                           (["--min-class-attainment", "1.5"], "must be a fraction in (0, 1]")):
        assert sweep.main_sweep([*grid, *extra]) == 2
        assert message in capsys.readouterr().err
    no_slo = [a for a in grid if a not in ("--slo-ttft", "0.5")]
    assert sweep.main_sweep([*no_slo, "--min-class-attainment", "0.5"]) == 2
    assert "give one (--slo-ttft" in capsys.readouterr().err


def test_worst_class_is_the_lowest_attainment_across_groupings():
    """`metrics.worst_class`: the lowest SLO attainment over every grouping's classes, named
    grouping=class, the first in order on a tie; None without an SLO or without classes; a
    one-class workload is "all requests" in a sweep row."""
    classes = {"prompt_tokens": {"0-127": {"slo_attainment": 0.9},
                                 "2048+": {"slo_attainment": 0.4}},
               "tenant": {"a": {"slo_attainment": 0.4}, "b": {"slo_attainment": 1.0}}}
    assert metrics.worst_class(classes) == ("prompt_tokens=2048+", 0.4)
    classes["tenant"]["a"]["slo_attainment"] = 0.3
    assert metrics.worst_class(classes) == ("tenant=a", 0.3)
    assert metrics.worst_class({"tenant": {"a": {"slo_attainment": None},
                                           "b": {"slo_attainment": None}}}) is None
    assert metrics.worst_class({}) is None
    assert sweep.worst_class_fields({"slo": {"ttft": 1}, "slo_attainment": 0.75,
                                     "by_class": {}}) == {
        "worst_class": "all requests", "worst_class_attainment": 0.75}
    assert sweep.worst_class_fields({"slo": {"ttft": 1}, "slo_attainment": None,
                                     "by_class": classes}) == {
        "worst_class": None, "worst_class_attainment": None}


@pytest.mark.parametrize("extra, message", [
    (["--slo-ttft", "-1"], "--slo-ttft must be a positive number of seconds, got -1.0"),
    (["--policy", "static,pd", "--max-num-batched-tokens", "2", "--max-num-seqs", "4"],
     "max_num_batched_tokens (2) must be >= max_num_seqs (4) under policy 'pd'"),
    (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
])
def test_bad_flags_fail_before_any_policy_runs(extra, message, capsys, monkeypatch):
    """A bad flag is named (the flag, not a dict key), and a setting one of the policies
    refuses fails before the policies before it have run (and before the banner)."""
    patch(monkeypatch, "run_policy", lambda *a, **k: pytest.fail("a policy ran"))
    assert bench.main_bench(["--executor", "sim", "--num-requests", "2", "--no-progress",
                             *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "SIMULATED" not in err


def test_sweep_without_an_slo_ranks_by_completed_requests(capsys):
    """No SLO: goodput and attainment are null, as in bench; the best is the most completed
    requests/s, and the note says so."""
    data = sweep.run_sweep(sweep.sweep_parser().parse_args(SWEEP))
    assert all(r["goodput_rps"] is None and r["slo_attainment"] is None for r in data["rows"])
    served = [r["requests_per_s"] for r in data["rows"]]
    assert served == sorted(served, reverse=True) and served[0] > served[-1]
    assert data["best"] == data["rows"][0] and "most completed requests/s" in data["note"]
    assert sweep.main_sweep(SWEEP) == 0
    assert f"completed={report.fmt(served[0])} req/s" in capsys.readouterr().out


def test_sweep_holds_each_setting_to_errors_and_cancellation():
    """Each row says whether its cancelled requests stopped at their cancel point and how many
    failed; a setting failing either is never the best, even with the highest goodput."""
    data = sweep.run_sweep(sweep.sweep_parser().parse_args(
        [*SWEEP, "--cancel-fraction", "0.5", "--slo-ttft", "0.5"]))
    assert all(r["cancelled"] == 12 and r["cancellations_honoured"] and r["errors"] == 0
               and r["fails"] == [] and r["same_tokens"] is None for r in data["rows"])
    assert set(data["declaration"]["requirements"]) == {"fairness", "class fairness", "errors",
                                                        "cancellation", "quality"}
    assert "not checked" in data["declaration"]["requirements"]["quality"]
    row = dict(data["rows"][0], errors=1)
    assert sweep.requirement_failures(row, None) == ["errors"]
    row.update(errors=0, cancellations_honoured=False, same_tokens=False, max_queue_age_s=2.0)
    assert sweep.requirement_failures(row, 1.0) == ["fairness", "cancellation", "quality"]


def test_a_rate_failing_a_requirement_is_not_sustained():
    """sustainable_rows: a rate at which the setting fails a requirement breaks its run of
    sustained rates, however good its SLO attainment."""
    rows = [{"max_num_batched_tokens": 64, "max_num_seqs": 4, "chunk_size": 64,
             "preemption": "newest", "rate_rps": rate, "slo_attainment": 1.0,
             "fails": ["fairness"] if rate == 3 else []} for rate in (1, 2, 3, 4)]
    assert sweep.sustainable_rows(rows, 0.99)[0]["sustainable_load_rps"] == 2
    rows[2]["fails"] = []
    assert sweep.sustainable_rows(rows, 0.99)[0]["sustainable_load_rps"] == 4


def test_settings_sustaining_the_same_load_rank_by_their_goodput_there():
    """Two settings sustain the same load: the one with more goodput at that load ranks first,
    whatever the grid order (it went by the order of the lists)."""
    rows = [{"max_num_batched_tokens": budget, "max_num_seqs": 4, "chunk_size": 64,
             "preemption": "newest", "rate_rps": rate, "slo_attainment": 1.0, "fails": [],
             "goodput_rps": rate * (0.9 if budget == 64 else 1.0),
             "output_tokens_per_s": 10.0} for budget in (64, 512) for rate in (1, 2)]
    assert [r["max_num_batched_tokens"] for r in sweep.sustainable_rows(rows, 0.99)] == [512, 64]


def test_sweep_varies_only_the_settings_the_policy_reads(capsys):
    """continuous ignores chunk_size and static ignores the budget and chunk_size: each is swept
    once (two values would run the same schedule twice and could rank a copy best), and the note
    says so; with speculation every policy reads the budget."""
    grid = ["--max-num-batched-tokens", "64,512", "--max-num-seqs", "4,16",
            "--chunk-size", "64,256"]
    for policy, rows, unread in (("continuous", 4, "chunk_size"),
                                 ("static", 2, "max_num_batched_tokens, chunk_size"),
                                 ("pd", 8, None)):
        data = sweep.run_sweep(sweep.sweep_parser().parse_args(
            [*SWEEP, *grid, "--policy", policy]))
        settings = {(r["max_num_batched_tokens"], r["max_num_seqs"], r["chunk_size"])
                    for r in data["rows"]}
        assert len(data["rows"]) == len(settings) == rows
        note = data["declaration"].get("not_varied")
        assert (note is None) if unread is None else note.startswith(
            f"{policy} does not read {unread}:")
    assert sweep.settings_read("single", True) == ("max_num_batched_tokens",)
    assert sweep.main_sweep([*SWEEP, *grid, "--policy", "static"]) == 0
    assert "note: static does not read max_num_batched_tokens, chunk_size" in \
        capsys.readouterr().out


def test_a_sustainable_load_at_the_highest_rate_swept_is_a_lower_bound():
    """Every swept rate passed: the setting may sustain more, so the load is flagged (it read
    as the limit); a setting that failed a higher rate is not."""
    rows = [{"max_num_batched_tokens": budget, "max_num_seqs": 4, "chunk_size": 64,
             "preemption": "newest", "rate_rps": rate, "fails": [],
             "slo_attainment": 0.5 if (budget, rate) == (64, 2) else 1.0,
             "goodput_rps": rate, "output_tokens_per_s": 1.0}
            for budget in (64, 512) for rate in (1, 2)]
    found = {r["max_num_batched_tokens"]: r for r in sweep.sustainable_rows(rows, 0.99)}
    assert found[512]["sustainable_load_rps"] == 2 and found[512]["sustainable_load_is_lower_bound"]
    assert found[64]["sustainable_load_rps"] == 1
    assert not found[64]["sustainable_load_is_lower_bound"]


def test_a_sweep_without_an_slo_names_no_worst_class_and_one_that_skips_all_fails(capsys):
    """Without an SLO there is no attainment to rank classes by (the row said 100% beside an
    SLO % of '-'); a sweep whose every setting is refused exits 2 saying so (it printed 'no
    setting meets them all' and exited 0)."""
    data = sweep.run_sweep(sweep.sweep_parser().parse_args(SWEEP))
    assert all(r["worst_class"] is None and r["worst_class_attainment"] is None
               for r in data["rows"])
    with_slo = sweep.run_sweep(sweep.sweep_parser().parse_args([*SWEEP, "--slo-ttft", "1"]))
    assert all(r["worst_class"] is not None for r in with_slo["rows"])
    assert sweep.main_sweep([*SWEEP, "--max-num-batched-tokens", "2"]) == 2
    assert "every setting was skipped" in capsys.readouterr().err


def test_cancellations_honoured_needs_the_stop_at_the_cancel_point_and_no_pages_held():
    """True after a run that cancelled at the cancel point; False when the request ran past it
    (the client's cancel came later than the trace says) or when pages are still held."""
    import dataclasses

    cancelled = Workload("c", [WorkloadRequest(prompt_len=20, max_tokens=9,
                                               cancel_after_tokens=3) for _ in range(3)])
    engine = make_sim_engine(CostModel(), policy="pd", num_pages=64, page_size=4)
    run_workload(engine, cancelled)
    assert all(r.finish_reason == "cancelled" for r in engine.requests.values())
    assert runs.cancellations_honoured(engine, cancelled)
    late = Workload("late", [dataclasses.replace(r, cancel_after_tokens=5)
                             for r in cancelled.requests])
    engine = make_sim_engine(CostModel(), policy="pd", num_pages=64, page_size=4)
    run_workload(engine, late)
    assert not runs.cancellations_honoured(engine, cancelled)  # 5 tokens where 3 were wanted
    engine = make_sim_engine(CostModel(), policy="pd", num_pages=64, page_size=4)
    run_workload(engine, cancelled, max_steps=2)  # still running: its pages are held
    assert not runs.cancellations_honoured(engine, cancelled)


def test_sweep_checks_each_settings_tokens_against_each_request_served_alone(
        tiny_llama_dir, monkeypatch, capsys):
    """On the real executor every row's greedy tokens are compared with the `single` run's;
    a setting whose tokens differ fails 'quality' and is not chosen, however fast."""
    argv = ["--model", str(tiny_llama_dir), "--max-num-batched-tokens", "16,64",
            "--max-num-seqs", "3", "--chunk-size", "16", "--cancel-fraction", "0.25", *TINY]
    data = sweep.run_sweep(sweep.sweep_parser().parse_args(argv))
    assert [r["same_tokens"] for r in data["rows"]] == [True, True]
    assert all(r["differing_requests"] == [] and r["cancelled"] == 1 for r in data["rows"])
    assert "served alone" in data["declaration"]["requirements"]["quality"]
    real = runs.output_tokens

    def one_changed(engine):  # one setting's first request gets another last token
        tokens = real(engine)
        if engine.config.max_num_batched_tokens == data["rows"][0]["max_num_batched_tokens"]:
            tokens["req-0"][-1] += 1
        return tokens
    patch(monkeypatch, "output_tokens", one_changed)
    changed = sweep.run_sweep(sweep.sweep_parser().parse_args(argv))
    failing = [r for r in changed["rows"] if r["fails"]]
    assert [(r["fails"], r["differing_requests"]) for r in failing] == [(["quality"], ["req-0"])]
    assert changed["best"] is not None and changed["best"]["fails"] == []
    assert changed["best"]["max_num_batched_tokens"] != failing[0]["max_num_batched_tokens"]


@pytest.mark.parametrize("main, extra, message", [
    (bench.main_bench, ["--preemption", "newest,priority"], "sweep takes a comma list"),
    (bench.main_bench, ["--preemption", "lifo"], "--preemption takes newest"),
    (bench.main_bench, ["--priority-aging-steps", "5"], "needs --preemption priority"),
    (sweep.main_sweep, ["--preemption", "newest,fair", "--priority-aging-steps", "5"],
     "needs priority among --preemption"),
])
def test_preemption_flags_are_checked(main, extra, message, capsys):
    """A preemption list given to bench, an unknown order, and aging steps without priority exit
    with status 2 naming the problem."""
    assert main(["--executor", "sim", "--num-requests", "2", "--no-progress", *extra]) == 2
    assert message in capsys.readouterr().err


def test_sweep_finds_the_best_goodput(tmp_path, capsys):
    """The sweep runs every valid setting of its grid, skips the ones pd refuses, puts the best
    goodput first, and declares the grid."""
    out = tmp_path / "sweep.json"
    code = sweep.main_sweep(["--executor", "sim", "--workload", "mixed-chat",
                             "--num-requests", "24", "--rate", "40",
                             "--max-num-batched-tokens", "8,64,512", "--max-num-seqs", "4,16",
                             "--chunk-size", "64", "--slo-ttft", "0.5", "--slo-tpot", "0.05",
                             "--out", str(out), "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    goodputs = [r["goodput_rps"] for r in data["rows"]]
    assert data["best"] == data["rows"][0] and data["best"]["goodput_rps"] == max(goodputs)
    # pd refuses a budget below max_num_seqs: (8, 16) is skipped, the other 5 ran
    assert len(data["rows"]) == 5 and len(data["skipped"]) == 1
    assert data["declaration"]["simulated"] is True
    assert "best:" in capsys.readouterr().out
    budget = data["declaration"]["token_budget"]  # the grid, not EngineConfig's defaults
    assert budget["max_num_batched_tokens"] == [8, 64, 512] and budget["chunk_size"] == [64]
    assert data["declaration"]["concurrency"]["max_num_seqs"] == [4, 16]


def sweep_over_rates(tmp_path, slo_target: str) -> tuple[dict, dict]:
    """Three rates x two budgets on the simulator: (the sweep's JSON, {budget: {rate:
    attainment}})."""
    out = tmp_path / "rates.json"
    argv = ["--executor", "sim", "--workload", "mixed-chat", "--num-requests", "60",
            "--rates", "5,20,10", "--max-num-batched-tokens", "64,1024", "--max-num-seqs", "32",
            "--chunk-size", "1024", "--slo-ttft", "0.3", "--slo-target", slo_target,
            "--out", str(out), "--no-progress"]
    assert sweep.main_sweep(argv) == 0
    data = json.loads(out.read_text())
    attained: dict = {}
    for row in data["rows"]:
        attained.setdefault(row["max_num_batched_tokens"], {})[row["rate_rps"]] = \
            row["slo_attainment"]
    return data, attained


def test_sweep_over_rates_reports_each_settings_sustainable_load(tmp_path, capsys):
    """--rates adds the offered load to the grid; each setting's sustainable load is the
    highest rate whose SLO attainment reaches --slo-target, with every lower rate's too. A tiny
    budget starves prefill and sustains less than a large one."""
    data, by_budget = sweep_over_rates(tmp_path, "0.99")
    assert len(data["rows"]) == 6 and data["declaration"]["rate_rps"] == [5.0, 10.0, 20.0]
    found = {r["max_num_batched_tokens"]: r["sustainable_load_rps"] for r in data["sustainable"]}
    for budget, load in found.items():
        attained = by_budget[budget]
        assert load == metrics.sustainable_load(attained, 0.99)
        assert load is None or all(attained[r] >= 0.99 for r in attained if r <= load)
    assert found == {64: 10.0, 1024: 20.0}
    assert data["sustainable"][0]["max_num_batched_tokens"] == 1024
    printed = capsys.readouterr().out
    assert "sustainable load" in printed and "best:" not in printed
    assert "max_num_batched_tokens=64 max_num_seqs=32 chunk_size=1024 preemption=newest: " \
        "10 req/s" in printed


@pytest.mark.parametrize("extra, message", [
    (["--rates", "5,10"], "give one (--slo-ttft"),
    (["--rates", "5,x", "--slo-ttft", "1"], "--rates takes comma-separated rates"),
    (["--rates", "0,5", "--slo-ttft", "1"], "positive rates"),
    (["--rates", "5,10", "--rate", "5", "--slo-ttft", "1"], "not both"),
    (["--rates", "5,10", "--slo-ttft", "1", "--slo-target", "1.5"], "--slo-target"),
    (["--rates", "5,10", "--slo-ttft", "1", "--workload", "long-prefill"],
     "--rates do(es) not apply to workload 'long-prefill'"),  # the flag given, --rates
    (["--preemption", "newest,priority", "--priority-aging-steps", "-1"],
     "--priority-aging-steps must be a positive integer"),  # refused, not rows skipped
])
def test_sweep_over_rates_refuses_bad_flags(extra, message, capsys):
    """A sweep over rates without an SLO, with bad or non-positive rates, with --rate too, with a
    target above 1, on a workload with fixed arrivals, or with negative aging steps exits with
    status 2 naming it."""
    argv = ["--executor", "sim", "--num-requests", "4", "--no-progress", *extra]
    assert sweep.main_sweep(argv) == 2
    assert message in capsys.readouterr().err


def test_dynamic_waits_on_the_clock_and_declares_its_timeout(tmp_path):
    """Arrivals in seconds: dynamic batching's timeout is in seconds (in steps, an idle engine's
    empty steps would cost nothing and dynamic would form its batches when static does). At 0.2
    requests/s on the simulated H100 every request arrives to an idle engine: static serves it at
    once, dynamic waits the timeout for company that does not come."""
    out = tmp_path / "dyn.json"
    assert bench.main_bench(["--executor", "sim", "--workload", "low-rate", "--rate", "0.2",
                             "--num-requests", "6", "--policy", "static,dynamic",
                             "--batch-timeout", "0.2", "--out", str(out),
                             "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert data["declaration"]["policy_options"]["batch_timeout"] == "0.2 s (dynamic)"
    static, dynamic = data["results"]["static"], data["results"]["dynamic"]
    assert static["queue_s"]["p50"] < 0.01
    assert dynamic["queue_s"]["p50"] == pytest.approx(0.2, abs=0.01)


def test_profile_fits_and_the_fit_drives_the_simulator(tiny_llama_dir, tmp_path):
    """profile fits a cost model with a measured swap cost that drives the simulator, and by default
    saves it where --cost-model cpu reads it."""
    out = tmp_path / "cost.json"
    code = profile.main_profile(["--model", str(tiny_llama_dir), "--num-requests", "4",
                               "--out", str(out), "--no-progress"])
    assert code == 0
    cost = CostModel.load(str(out))
    assert cost.a > 0 and cost.fit["num_steps"] > 5 and "profile" in cost.source
    assert 0 < cost.s < 1e-2 and "measure_swap_cost" in cost.fit["swap"]  # measured, saved
    engine = make_sim_engine(cost, policy="pd")
    run_workload(engine, get_workload("seed-r1-r4"))
    assert engine.clock() > 0
    # without --out the fit goes where --cost-model cpu reads it, wherever profile runs from
    from minicb.benchmark.sim import DEFAULT_CPU_COST_MODEL
    assert profile.profile_parser().parse_args([]).out == str(DEFAULT_CPU_COST_MODEL)


def test_a_killed_hf_baseline_leaves_minicbs_results_on_disk(tiny_llama_dir, tmp_path,
                                                              monkeypatch):
    """The GPU check gives the benchmark a time limit: if transformers' baseline hangs and the
    process is stopped, the results of minicb's own policies are already written."""
    def hang_up(*args, **kwargs):
        raise KeyboardInterrupt  # what a stopped run looks like from inside

    patch(monkeypatch, "hf_static", hang_up)
    out = tmp_path / "partial.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main_bench(["--model", str(tiny_llama_dir), "--policy", "pd", "--compare", "hf",
                          "--out", str(out), *TINY])
    data = json.loads(out.read_text())
    assert data["results"]["pd"]["completed"] == 4
    assert "hf-static" not in data["results"]
    assert data["declaration"]["compare"].startswith("hf: running")


def test_hf_static_returns_each_batch_whole(tiny_llama_dir):
    """transformers' generate returns a padded batch at once: E2E of every member ends at the
    batch's last token, as for minicb's static policy; TPOT still uses its own tokens."""
    from minicb.benchmark import metrics
    model = hf.hf_model(tiny_llama_dir, "cpu", torch.float32)
    workload = Workload("two", [WorkloadRequest(prompt_len=8, max_tokens=n, request_id=f"r{n}")
                                for n in (3, 9)])
    records = hf.hf_static(model, workload, batch_size=2, progress=False)
    short, long = sorted(records, key=lambda r: r.num_output_tokens)
    assert short.finish_time < long.finish_time
    assert short.released_time == long.released_time == long.finish_time
    assert metrics.e2e(short) == pytest.approx(metrics.e2e(long))
    assert metrics.tpot(short) == pytest.approx(
        (short.finish_time - short.first_token_time) / 2)


# ---------------------------------------------------------------- sweep rows and the baseline


def _spy_run_policy(monkeypatch):
    """Record each summary run_policy returns, by its (budget, seqs, chunk) setting."""
    seen, real = {}, runs.run_policy

    def spy(executor, policy, workload, options, *args, **kwargs):
        summary, engine = real(executor, policy, workload, options, *args, **kwargs)
        key = (options["max_num_batched_tokens"], options["max_num_seqs"], options["chunk_size"])
        seen[key] = summary
        return summary, engine
    patch(monkeypatch, "run_policy", spy)
    return seen


def test_sweep_rows_copy_each_settings_own_summary(tmp_path, monkeypatch):
    """Each row's p99 columns are that setting's p99 (not its p50 or p95), and its goodput,
    tokens/s, attainment and preemptions are its own."""
    seen = _spy_run_policy(monkeypatch)
    out = tmp_path / "sweep.json"
    assert sweep.main_sweep([*SWEEP, "--slo-ttft", "0.5", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(seen) == 4
    for row in rows:
        s = seen[(row["max_num_batched_tokens"], row["max_num_seqs"], row["chunk_size"])]
        assert (row["ttft_p99_s"], row["tpot_p99_s"], row["e2e_p99_s"]) == (
            s["ttft_s"]["p99"], s["tpot_s"]["p99"], s["e2e_s"]["p99"])
        assert (row["goodput_rps"], row["output_tokens_per_s"], row["slo_attainment"],
                row["preemptions"]) == (s["goodput_rps"], s["output_tokens_per_s"],
                                        s["slo_attainment"], s["preemptions"])
    # the p99s differ from the p50s here, so a p50 reported as p99 shows
    assert any(s["ttft_s"]["p99"] != s["ttft_s"]["p50"] for s in seen.values())


def test_sweep_best_is_the_fastest_when_no_setting_meets_the_slo(tmp_path, capsys):
    """Goodput ties (here at 0: an SLO nobody meets): the best row is the one with the most
    tokens/s, and the printed best is data["best"]."""
    out = tmp_path / "sweep.json"
    assert sweep.main_sweep([*SWEEP, "--slo-ttft", "1e-9", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert all(r["goodput_rps"] == 0 for r in data["rows"])
    assert data["best"]["output_tokens_per_s"] == max(r["output_tokens_per_s"]
                                                      for r in data["rows"])
    best = data["best"]
    printed = capsys.readouterr().out
    assert (f"best: max_num_batched_tokens={best['max_num_batched_tokens']} "
            f"max_num_seqs={best['max_num_seqs']} chunk_size={best['chunk_size']} "
            in printed)
    assert "no setting met the SLO for a single request" in printed
    assert sweep.main_sweep([*SWEEP, "--slo-ttft", "30"]) == 0
    assert "no setting met the SLO" not in capsys.readouterr().out


def test_sweep_sustainable_load_uses_the_slo_target(tmp_path):
    """A sweep over rates ranks settings by their sustainable load at the given SLO target, lists
    each skipped setting once, and gives no best when all are skipped."""
    data, by_budget = sweep_over_rates(tmp_path, "0.5")
    # rows at different rates do not compare: best is the setting with the highest load
    assert data["best"] == data["sustainable"][0]
    assert data["best"]["sustainable_load_rps"] == max(
        r["sustainable_load_rps"] or 0 for r in data["sustainable"])
    # every setting skipped (pd refuses a budget below max_num_seqs): no rows, no best
    skipped = sweep.run_sweep(sweep.sweep_parser().parse_args(
        ["--executor", "sim", "--num-requests", "4", "--rates", "5,10", "--max-num-batched-tokens",
         "8", "--max-num-seqs", "16", "--slo-ttft", "1", "--no-progress"]))
    assert skipped["rows"] == [] and skipped["best"] is None
    assert [item["setting"] for item in skipped["skipped"]] == [  # once each, not per rate
        {"max_num_batched_tokens": 8, "max_num_seqs": 16, "chunk_size": c, "preemption": "newest"}
        for c in (64, 256)]
    assert data["declaration"]["slo_target"] == 0.5
    differs = False
    for r in data["sustainable"]:
        attained = by_budget[r["max_num_batched_tokens"]]
        assert r["sustainable_load_rps"] == metrics.sustainable_load(attained, 0.5)
        differs |= metrics.sustainable_load(attained, 0.5) != metrics.sustainable_load(attained)
    assert differs, "the workload does not tell a 0.5 target from 0.99"


def test_the_declaration_reports_the_workload_and_system_that_ran(tmp_path):
    """The declaration reports the rate, burstiness, seed, cancel fraction, pool, prefix caching and
    preemption limit that ran, and the engine's real pool and max_num_seqs when not given."""
    out = tmp_path / "decl.json"
    assert bench.main_bench(["--executor", "sim", "--num-requests", "6", "--rate", "3",
                             "--burstiness", "0.5", "--seed", "7", "--cancel-fraction", "0.5",
                             "--num-pages", "100", "--page-size", "8", "--no-prefix-caching",
                             "--max-preemptions", "1", "--out", str(out), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    decl, pd = data["declaration"], data["results"]["pd"]
    assert decl["policy_options"]["max_preemptions"] == 1
    assert (decl["rate_rps"], decl["burstiness"], decl["seed"]) == (3.0, 0.5, 7)
    assert decl["workload"]["cancel_fraction"] == 0.5 and pd["cancelled"] > 0
    assert decl["memory_limit"] == {"num_pages": 100, "page_size": 8, "kv_tokens": 800}
    assert decl["cache_state"]["prefix_caching"] is False
    from minicb.config import EngineConfig
    assert decl["concurrency"]["max_num_seqs"] == EngineConfig().max_num_seqs  # not None
    # no --num-pages: the pool the engine really had, not a placeholder
    assert bench.main_bench(["--executor", "sim", "--num-requests", "2", "--out", str(out),
                             "--no-progress"]) == 0
    memory = json.loads(out.read_text())["declaration"]["memory_limit"]
    assert isinstance(memory["num_pages"], int)
    assert memory["kv_tokens"] == memory["num_pages"] * memory["page_size"]


def test_no_prefix_caching_caches_nothing():
    """With --no-prefix-caching no prompt token is served from the cache."""
    args = bench.bench_parser().parse_args(["--executor", "sim", "--workload", "shared-prefix",
                                            "--num-requests", "4", "--no-prefix-caching",
                                            "--no-progress"])
    assert bench.run_bench(args)["results"]["pd"]["cached_prompt_tokens"] == 0


@pytest.mark.parametrize("main", [bench.main_bench, sweep.main_sweep], ids=["bench", "sweep"])
def test_threads_flag_sets_torch_threads(main, tmp_path):
    """--threads sets torch's thread count for bench and sweep and is declared."""
    out, before = tmp_path / "t.json", torch.get_num_threads()
    wanted = 2 if before != 2 else 3
    try:
        assert main(["--executor", "sim", "--num-requests", "2", "--threads", str(wanted),
                     "--out", str(out), "--no-progress"]) == 0
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)
    assert json.loads(out.read_text())["declaration"]["device"]["torch_threads"] == wanted


def test_single_stream_speed_counts_prefill_and_decode_on_their_own_steps():
    """Batch-1 speeds on the simulated executor: prefill from the first step, decode from the
    steps after it, each over its own seconds."""
    executor = runs.Executor("sim")
    got = runs.measure_single_stream(executor, num_prompts=1, prompt_len=64, max_tokens=9)
    from minicb.request import SamplingParams
    engine = executor.engine(policy="single")
    engine.add_request(list(range(100, 164)), SamplingParams(max_tokens=9, temperature=0.0,
                                                             ignore_eos=True))
    engine.run()
    first, rest = engine.trace[0], engine.trace[1:]
    assert got["prefill_tokens_per_s"] == pytest.approx(64 / first.duration)
    assert got["decode_tokens_per_s"] == pytest.approx(
        sum(r.num_decode_tokens for r in rest) / sum(r.duration for r in rest))


def test_hf_single_stream_splits_prefill_from_decode(monkeypatch):
    """On a fake transformers model whose prefill takes 0.5 s and each further token 10 ms."""
    clock = types.SimpleNamespace(t=0.0)

    class FakeHF:
        config = types.SimpleNamespace(vocab_size=1000)

        def generate(self, input_ids, max_new_tokens, **kw):
            clock.t += 0.5 + 0.01 * (max_new_tokens - 1)

    patch(monkeypatch, "time", types.SimpleNamespace(perf_counter=lambda: clock.t))
    got = hf.hf_single_stream(FakeHF(), num_prompts=3, prompt_len=128, max_tokens=32)
    assert got["prefill_tokens_per_s"] == pytest.approx(128 / 0.5)
    assert got["decode_tokens_per_s"] == pytest.approx(100.0)


def test_hf_static_neither_stops_at_nor_bans_an_eos(tiny_llama_dir, tiny_model):
    """transformers' static rows give minicb's ignore_eos tokens even when the greedy answer
    holds an EOS (the tiny model never emits its own: make its fourth token the EOS). Banning
    EOS (min_new_tokens) would send such a request down another path, and the quality line
    would report a difference of the baseline's making."""
    from minicb import SamplingParams
    from minicb.engine import Engine
    workload = Workload("eos", [WorkloadRequest(prompt_len=8, max_tokens=8, request_id="r")])
    engine = Engine(tiny_model, policy="static")
    engine.add_request(hf._hf_prompts(workload, tiny_model[1].config.vocab_size)[0],
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    ours = engine.run()[0].token_ids
    model = hf.hf_model(tiny_llama_dir, "cpu", torch.float32)
    model.generation_config.eos_token_id = ours[3]
    tokens: dict[str, list[int]] = {}
    hf.hf_static(model, workload, batch_size=1, progress=False, tokens=tokens)
    assert tokens["r"] == ours


def test_hf_static_token_times_are_each_requests_own(tiny_llama_dir):
    """The HF static baseline records each request's own token times, not the padded batch's."""
    model = hf.hf_model(tiny_llama_dir, "cpu", torch.float32)
    workload = Workload("two", [WorkloadRequest(prompt_len=8, max_tokens=n, request_id=f"r{n}")
                                for n in (3, 9)])
    records = hf.hf_static(model, workload, batch_size=2, progress=False)
    assert sorted(len(r.token_times) for r in records) == [3, 9]  # not the padded batch's 9


def test_hf_generate_batch_sends_each_request_at_its_arrival(tiny_llama_dir):
    """The HF generate-batch baseline sends each request at its arrival time, so none gets a token
    before it arrives."""
    model = hf.hf_model(tiny_llama_dir, "cpu", torch.float32)
    workload = Workload("late", [WorkloadRequest(prompt_len=8, max_tokens=4, request_id=rid,
                                                 arrival_time=t)
                                 for rid, t in (("early", 0.0), ("late", 0.4))])
    records = {r.request_id: r for r in hf.hf_generate_batch(model, workload, 2, 64,
                                                                progress=False)}
    late = records["late"]
    assert late.arrival_time == 0.4 and late.first_token_time >= 0.4


def test_compare_hf_runs_transformers_with_minicbs_settings(tiny_llama_dir, monkeypatch):
    """Same batch size, token budget and dtype on both sides (transformers' runs are spied)."""
    seen = {}
    patch(monkeypatch, "hf_model", lambda path, device, dtype: seen.update(dtype=dtype) or "hf")
    patch(monkeypatch, "hf_static", lambda model, workload, batch_size, *a, **kw:
                        seen.update(static=batch_size) or [])
    patch(monkeypatch, "hf_generate_batch", lambda model, workload, seqs, tokens, *a, **kw:
                        seen.update(seqs=seqs, tokens=tokens) or [])
    args = bench.bench_parser().parse_args(["--model", str(tiny_llama_dir), "--policy", "pd",
                                            "--dtype", "bfloat16", "--compare", "hf",
                                            "--max-num-seqs", "3",
                                            "--max-num-batched-tokens", "48", *TINY])
    data = bench.run_bench(args)
    assert seen == {"dtype": torch.bfloat16, "static": 3, "seqs": 3, "tokens": 48}
    assert data["declaration"]["compare"]["dtype"] == "bfloat16"


def test_hf_cuda_graphs_asks_transformers_manager_for_graphs(tiny_llama_dir, monkeypatch):
    """--hf-cuda-graphs reaches ContinuousBatchingConfig; without --compare hf it is refused,
    and a field this transformers lacks is named, not passed on."""
    seen = {}
    patch(monkeypatch, "hf_model", lambda path, device, dtype: "hf")
    patch(monkeypatch, "hf_static", lambda *a, **kw: [])
    patch(monkeypatch, "hf_generate_batch",
          lambda *a, **kw: seen.update(cb_options=a[8] if len(a) > 8 else None) or [])
    flags = ["--model", str(tiny_llama_dir), "--policy", "pd", *TINY]
    bench.run_bench(bench.bench_parser().parse_args(flags + ["--compare", "hf",
                                                             "--hf-cuda-graphs"]))
    assert seen == {"cb_options": {"use_cuda_graph": True}}
    bench.run_bench(bench.bench_parser().parse_args(flags + ["--compare", "hf"]))
    assert seen == {"cb_options": None}
    with pytest.raises(ValueError, match="--hf-cuda-graphs .* needs --compare hf"):
        bench.run_bench(bench.bench_parser().parse_args(flags + ["--hf-cuda-graphs"]))
    monkeypatch.undo()  # the real transformers from here on
    model = hf.hf_model(tiny_llama_dir, "cpu", torch.float32)
    workload = Workload("one", [WorkloadRequest(prompt_len=8, max_tokens=2)])
    with pytest.raises(ValueError, match=r"no \['no_such_field'\]"):
        hf.hf_generate_batch(model, workload, 2, 64, progress=False,
                                cb_options={"no_such_field": 1})


def test_no_cuda_graphs_reaches_the_engine_and_the_declaration(tiny_llama_dir, capsys):
    """--no-cuda-graphs turns CUDA graphs off in the engine options, the declaration and the printed
    report; without it the engine's default holds."""
    args = bench.bench_parser().parse_args(["--model", str(tiny_llama_dir), "--policy", "pd",
                                            "--no-cuda-graphs", "--no-progress", *TINY])
    assert flags.engine_options(args, flags.build_workload(args))["use_cuda_graphs"] is False
    data = bench.run_bench(args)
    assert data["declaration"]["cuda_graphs"] is False
    report.print_report(data)
    assert ", CUDA graphs off" in capsys.readouterr().out
    default = bench.bench_parser().parse_args(["--model", str(tiny_llama_dir), *TINY])
    assert "use_cuda_graphs" not in flags.engine_options(default, flags.build_workload(default))


def test_the_printed_batch1_ratio_is_minicb_over_hf(tmp_path, capsys):
    """The printed batch-1 ratio is minicb's decode speed over HF's."""
    out = tmp_path / "sim.json"
    assert bench.main_bench(["--executor", "sim", "--num-requests", "2", "--policy", "single",
                             "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    data["results"]["single"]["single_stream"] = {"decode_tokens_per_s": 200.0,
                                                  "prefill_tokens_per_s": 1000.0}
    data["results"]["single"]["hf_single_stream"] = {"decode_tokens_per_s": 100.0,
                                                     "prefill_tokens_per_s": 900.0}
    report.print_report(data)
    assert "= 2.00x" in capsys.readouterr().out


def test_quality_lines_name_the_requests_that_differ():
    """The quality lines say which policies match the reference's greedy tokens and name the
    requests that differ, with HF's marked informative."""
    ref = {f"r{i}": [i, i + 1] for i in range(7)}
    other = {**ref, "r2": [0, 0], "r5": [9]}
    results = {"static": {}, "pd": {"same_tokens_as": runs.same_tokens(ref, ref, "static")},
               "chunked": {"same_tokens_as": runs.same_tokens(ref, other, "static")},
               "hf-static": {"same_tokens_as": runs.same_tokens(ref, other, "static")}}
    assert results["chunked"]["same_tokens_as"]["differing_requests"] == ["r2", "r5"]
    assert report.quality_lines(results) == [
        "greedy tokens: pd identical to static on all 7 requests; chunked differs from static "
        "on 2 of 7 (r2, r5)",
        "greedy tokens of transformers: hf-static differs from static on 2 of 7 (r2, r5) "
        "(informative: other kernels can break near-ties)"]


def test_a_rejected_request_is_listed_not_compared_and_a_lost_one_still_differs():
    """reject_when_full leaves a request without tokens in one run: that is availability
    (counted in `rejected`), not quality, so it is listed and left out; a request missing for
    any other reason still differs."""
    ref = {f"r{i}": [i, i + 1] for i in range(4)}
    rejected_here = {**ref, "r1": []}
    check = runs.same_tokens(ref, rejected_here, "pd", {"r1"})
    assert check["differing_requests"] == [] and check["requests"] == 3
    assert check["rejected_not_compared"] == ["r1"]
    lost = {k: v for k, v in ref.items() if k != "r3"}
    assert runs.same_tokens(ref, lost, "pd", {"r1"})["differing_requests"] == ["r3"]
    assert "rejected_not_compared" not in runs.same_tokens(ref, ref, "pd")
    lines = report.quality_lines({"pd": {}, "chunked": {"same_tokens_as": check}})
    assert lines == ["greedy tokens: chunked identical to pd on all 3 requests both served"]


def test_a_deadline_cut_request_is_compared_on_the_tokens_both_runs_gave_it():
    """A deadline ends a request at a point set by the run's timing, so two policies cut it
    at different lengths: the tokens both gave it are compared (a wrong one still differs).
    A policy that turns different requests away is reported on its own count."""
    ref = {"r0": [1, 2, 3, 4], "r1": [5, 6], "r2": [7, 8]}
    cut_short = {**ref, "r0": [1, 2]}
    check = runs.same_tokens(ref, cut_short, "static", cut={"r0"})
    assert check["differing_requests"] == []
    assert check["deadline_cut_compared_on_common_tokens"] == ["r0"]
    assert runs.same_tokens(ref, cut_short, "static")["differing_requests"] == ["r0"]
    assert runs.same_tokens(ref, {**ref, "r0": [1, 9]}, "static",
                             cut={"r0"})["differing_requests"] == ["r0"]
    rejected = runs.same_tokens(ref, {**ref, "r2": []}, "static", {"r2"})
    lines = report.quality_lines({"static": {}, "pd": {"same_tokens_as": check},
                                 "chunked": {"same_tokens_as": rejected}})
    assert lines == ["greedy tokens: pd identical to static on all 3 requests both served; "
                     "chunked identical to static on all 2 requests both served; requests a "
                     "deadline cut short compared on the tokens both got"]


def test_a_real_run_refuses_traffic_that_arrives_over_weeks(tiny_llama_dir, capsys):
    """--rate 1e-6 spreads four requests over weeks: a real run (bench, sweep) would wait for
    them on the wall clock, so it is refused; the simulator skips idle time and runs it."""
    slow = ["--rate", "1e-6", "--num-requests", "4", "--no-progress", "--policy", "pd"]
    assert bench.main_bench(["--model", str(tiny_llama_dir), *slow]) == 2
    assert "days) after the first, and a real run waits for it" in capsys.readouterr().err
    assert sweep.main_sweep(["--model", str(tiny_llama_dir), *slow[:-2],
                             "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                             "--chunk-size", "64"]) == 2
    assert "a real run waits for it" in capsys.readouterr().err
    assert bench.main_bench(["--executor", "sim", *slow]) == 0
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--request-rate", "1e-6",
                 "--num-prompts", "4"]) == 2  # refused before any request is sent
    assert "a real run waits for it" in capsys.readouterr().err


def test_the_span_is_refused_before_the_model_loads(monkeypatch, capsys):
    """The refusal comes before the model loads (a first run converts it for minutes)."""
    patch(monkeypatch, "executor_from_args",
          lambda *a: pytest.fail("the model loaded before the refusal"))
    slow = ["--rate", "1e-6", "--num-requests", "4", "--no-progress"]
    assert bench.main_bench(slow) == 2 and sweep.main_sweep(slow) == 2
    assert "a real run waits for it" in capsys.readouterr().err


def test_bench_compares_policies_on_the_requests_both_served(tiny_llama_dir, tmp_path):
    """Two policies under --reject-when-full on a small pool: the requests either turned away
    are not reported as differing tokens."""
    out = tmp_path / "r.json"
    assert bench.main_bench(["--model", str(tiny_llama_dir), "--policy", "continuous,pd",
                             "--num-pages", "8", "--page-size", "4", "--reject-when-full",
                             "--out", str(out),
                             *TINY]) == 0
    results = json.loads(out.read_text())["results"]
    check = results["pd"]["same_tokens_as"]
    assert results["pd"]["rejected"] + results["continuous"]["rejected"] > 0
    assert check["rejected_not_compared"] and check["differing_requests"] == []


def test_bench_prints_every_latency_percentile_and_no_goodput_without_an_slo(tmp_path, capsys):
    """A second table gives p50/p95/p99 of queue, TTFT, TPOT, ITL and E2E; without an SLO
    goodput is '-' in the table and null in the JSON, with a note (it is not completed
    requests/s under another name)."""
    out = tmp_path / "r.json"
    assert bench.main_bench(["--executor", "sim", "--num-requests", "6", "--rate", "8",
                             "--policy", "static,pd", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    table = printed.split("latency percentiles (s)\n")[1].splitlines()
    assert table[0].split()[:4] == ["policy", "queue", "p50", "queue"]
    for name in ("queue", "TTFT", "TPOT", "ITL", "E2E"):
        for p in ("p50", "p95", "p99"):
            assert f"{name} {p}" in table[0]
    pd = json.loads(out.read_text())["results"]["pd"]
    row = table[3].split()  # policy, queue p50, queue p95, ...
    assert row[0] == "pd" and float(row[2]) == pytest.approx(pd["queue_s"]["p95"], abs=1e-3)
    assert pd["goodput_rps"] is None and pd["slo_attainment"] is None
    assert "no SLO given" in pd["goodput_note"]
    main = printed.split("\n\n")[1].splitlines()  # the main table: its goodput column says "-"
    assert main[0].split()[-3:] == ["goodput", "steps", "preempt"] and main[2].split()[-3] == "-"
    assert bench.main_bench(["--executor", "sim", "--num-requests", "6", "--policy", "pd",
                             "--slo-ttft", "1", "--out", str(out), "--no-progress"]) == 0
    pd = json.loads(out.read_text())["results"]["pd"]
    assert pd["goodput_rps"] > 0 and "goodput_note" not in pd


# --- the full-cache answers beside preemption (chapter 06): swap, reject -----------------------
FULL = ["--executor", "sim", "--workload", "mixed-chat", "--num-requests", "32", "--num-pages",
        "60", "--no-progress"]


def _keep_engines(monkeypatch) -> list:
    """Make run_policy keep each engine it ran, to read its config, pool and trace."""
    engines, real = [], runs.run_policy

    def keep(*args, **kwargs):
        summary, engine = real(*args, **kwargs)
        engines.append(engine)
        return summary, engine
    patch(monkeypatch, "run_policy", keep)
    return engines


def test_swap_flags_reach_the_engine_the_declaration_and_the_report(tmp_path, capsys,
                                                                     monkeypatch):
    """--preemption-mode swap --num-swap-pages N: the engine swaps into N host pages; the JSON
    declares both and counts the pages each way (the trace's sums); the header and the extras
    print them. Without --num-swap-pages the swap space is the pool's size, declared so."""
    engines, out = _keep_engines(monkeypatch), tmp_path / "r.json"
    assert bench.main_bench([*FULL, "--preemption-mode", "swap", "--num-swap-pages", "20",
                             "--out", str(out)]) == 0
    engine, printed = engines[-1], capsys.readouterr().out
    assert (engine.config.preemption_mode, engine.pool.num_swap_pages,
            engine.config.reject_when_full) == ("swap", 20, False)
    data = json.loads(out.read_text())
    options, pd = data["declaration"]["policy_options"], data["results"]["pd"]
    assert (options["preemption_mode"], options["num_swap_pages"],
            options["reject_when_full"]) == ("swap", 20, False)
    swapped_out = sum(r.pages_swapped_out for r in engine.trace)
    swapped_in = sum(r.pages_swapped_in for r in engine.trace)
    assert pd["swapped_out_pages"] == swapped_out > 0 and pd["swapped_in_pages"] == swapped_in > 0
    assert pd["rejected"] == 0 and runs.results_schema_ok(data) == []
    assert "policies pd (preemption=newest, preemption_mode=swap, num_swap_pages=20)" in printed
    assert f"pages swapped to host memory={swapped_out}, back={swapped_in}" in printed
    assert bench.main_bench([*FULL, "--preemption-mode", "swap", "--out", str(out)]) == 0
    assert engines[-1].pool.num_swap_pages == 60
    assert json.loads(out.read_text())["declaration"]["policy_options"]["num_swap_pages"] == 60


def test_reject_when_full_reaches_the_engine_and_counts_the_rejected(tmp_path, capsys,
                                                                      monkeypatch):
    """--reject-when-full: requests the full cache turns away finish as rejected; the JSON counts
    them (and no swapped pages: recompute is the default), the header and extras say so."""
    engines, out = _keep_engines(monkeypatch), tmp_path / "r.json"
    assert bench.main_bench([*FULL, "--reject-when-full", "--out", str(out)]) == 0
    engine, printed = engines[-1], capsys.readouterr().out
    assert engine.config.reject_when_full is True and engine.pool.num_swap_pages == 0
    rejected = sum(r.finish_reason == "rejected" for r in engine.requests.values())
    data = json.loads(out.read_text())
    pd = data["results"]["pd"]
    assert pd["rejected"] == rejected > 0 and pd["swapped_out_pages"] == 0
    assert data["declaration"]["policy_options"]["reject_when_full"] is True
    assert "(preemption=newest, preemption_mode=recompute, reject_when_full=True)" in printed
    assert f"rejected when full={rejected}" in printed
    report._print_extra("quiet", {"rejected": 0, "swapped_out_pages": 0, "swapped_in_pages": 0})
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("main", [bench.main_bench, sweep.main_sweep], ids=["bench", "sweep"])
@pytest.mark.parametrize("extra, message", [
    (["--num-swap-pages", "4"],
     "--num-swap-pages sizes the swap space: it needs --preemption-mode swap"),
    (["--preemption-mode", "recompute", "--num-swap-pages", "4"], "needs --preemption-mode swap"),
    (["--preemption-mode", "swap", "--num-swap-pages", "0"],
     "--num-swap-pages must be >= 1, got 0"),
])
def test_bad_full_cache_flags_are_named_before_anything_runs(main, extra, message, capsys,
                                                              monkeypatch):
    """Swap pages without swap mode, or zero swap pages, exit bench and sweep with status 2 naming
    the flag before any policy runs; an unknown preemption mode is an argparse error."""
    patch(monkeypatch, "run_policy", lambda *a, **k: pytest.fail("a policy ran"))
    assert main(["--executor", "sim", "--num-requests", "2", "--no-progress", *extra]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--executor", "sim", "--preemption-mode", "lifo"])
    assert exit_info.value.code == 2
    assert "argument --preemption-mode: invalid choice: 'lifo'" in capsys.readouterr().err


def test_sweep_passes_the_full_cache_flags_and_its_rows_count_them(tmp_path, monkeypatch):
    """Every sweep setting runs with the flags; each row has its engine's rejected and swapped
    pages; the declaration names them."""
    engines, out = _keep_engines(monkeypatch), tmp_path / "s.json"
    assert sweep.main_sweep(["--executor", "sim", "--num-requests", "16", "--num-pages", "60",
                             "--max-num-batched-tokens", "128", "--max-num-seqs", "2,4",
                             "--chunk-size", "64", "--preemption-mode", "swap",
                             "--reject-when-full", "--no-progress", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(engines) == len(data["rows"]) == 2
    by_seqs = {e.config.max_num_seqs: e for e in engines}
    for row in data["rows"]:
        engine = by_seqs[row["max_num_seqs"]]
        assert engine.config.preemption_mode == "swap" and engine.config.reject_when_full
        assert row["swapped_out_pages"] == sum(r.pages_swapped_out for r in engine.trace)
        assert row["swapped_in_pages"] == sum(r.pages_swapped_in for r in engine.trace)
        assert row["rejected"] == sum(r.finish_reason == "rejected"
                                      for r in engine.requests.values())
    assert any(row["rejected"] for row in data["rows"])
    assert any(row["swapped_out_pages"] for row in data["rows"])
    options = data["declaration"]["policy_options"]
    assert (options["preemption_mode"], options["reject_when_full"]) == ("swap", True)


def test_the_sweeps_quality_reference_turns_no_request_away(monkeypatch):
    """Each request's tokens served alone are the quality reference: under reject_when_full a
    rejected one would have none, and every setting that served it would fail on quality."""
    seen = []
    patch(monkeypatch, "run_policy", lambda executor, policy, workload, options, **kw:
                        seen.append(options) or ({}, types.SimpleNamespace(requests={})))
    sweep.reference_tokens(None, get_workload("mixed-chat", num_requests=2),
                           {"reject_when_full": True, "preemption_mode": "swap"})
    assert seen[0]["reject_when_full"] is False and seen[0]["preemption_mode"] == "swap"


def test_the_traces_of_the_readmes_sweeps_are_made_the_same_way_every_time(tmp_path):
    """bench/make_traces.py writes the two traces bench/README.md's priority and fairness
    sweeps replay: a replay of the saved priority sweep's trace gives its best row again."""
    import subprocess
    import sys
    from pathlib import Path

    from minicb.benchmark.workload import load_workload_file
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "bench" / "make_traces.py"), str(tmp_path)],
                   check=True, capture_output=True)
    urgent = load_workload_file(tmp_path / "chat-urgent.jsonl")
    fair = load_workload_file(tmp_path / "fair.jsonl")
    assert len(urgent.requests) == 200 and len(fair.requests) == 100
    assert sum(r.priority == -1 for r in urgent.requests) == 40
    assert all(r.priority == int(r.prompt_len >= 512) for r in fair.requests)
    saved = json.loads((root / "bench" / "results" / "sweep-priority-sim.json").read_text())
    args = sweep.sweep_parser().parse_args([
        "--executor", "sim", "--workload-file", str(tmp_path / "chat-urgent.jsonl"),
        "--policy", "pd", "--max-num-batched-tokens", "512", "--max-num-seqs", "16",
        "--chunk-size", "256", "--preemption", "priority", "--slo-ttft", "0.5", "--no-progress"])
    row = sweep.run_sweep(args)["rows"][0]
    assert row["goodput_rps"] == pytest.approx(saved["best"]["goodput_rps"])


def test_the_readmes_token_mix_example_is_its_saved_result():
    """bench/README.md's token_mix lines (long-prefill, simulated) come from the results file
    it names, and a fresh run gives the same counts: the file is that command's output."""
    import json
    from pathlib import Path

    saved = json.loads((Path(__file__).resolve().parent.parent / "bench" / "results"
                        / "long-prefill-token-mix-sim.json").read_text())["results"]
    args = bench.bench_parser().parse_args(["--executor", "sim", "--workload", "long-prefill",
                                            "--policy", "chunked,pd", "--no-progress"])
    fresh = bench.run_bench(args)["results"]
    keys = ("prefill_tokens", "decode_tokens", "mixed_steps", "dec_at_p", "num_steps")
    for policy in ("chunked", "pd"):
        assert {k: fresh[policy][k] for k in keys} == {k: saved[policy][k] for k in keys}
    assert (saved["pd"]["prefill_tokens"], saved["pd"]["decode_tokens"]) == (2064, 523)
    assert (saved["chunked"]["mixed_steps"], saved["pd"]["mixed_steps"]) == (0, 8)
    assert (saved["chunked"]["dec_at_p"], saved["pd"]["dec_at_p"]) == (0, 32)


def test_a_recompute_declaration_names_no_swap_space_and_the_schema_needs_rejected(tmp_path):
    """A recompute run declares no swap space (None, not 0), and the result schema needs
    "rejected"."""
    out = tmp_path / "r.json"
    assert bench.main_bench(["--executor", "sim", "--num-requests", "4", "--no-progress",
                             "--out", str(out)]) == 0
    options = json.loads(out.read_text())["declaration"]["policy_options"]
    assert (options["preemption_mode"], options["num_swap_pages"]) == ("recompute", None)
    assert "pd.rejected" in runs.results_schema_ok({"declaration": {}, "results": {"pd": {}}})


# --------------------------------------------------------------------------- preemption flags
def test_preemption_lists_are_checked_and_deduplicated(tmp_path, capsys):
    """A --preemption list that names no order is one line and exit 2; an order named twice
    runs once in a sweep."""
    assert bench.main_bench(["--executor", "sim", "--num-requests", "2", "--no-progress",
                             "--preemption", ","]) == 2
    assert "--preemption takes newest" in capsys.readouterr().err
    args = sweep.sweep_parser().parse_args(
        ["--executor", "sim", "--num-requests", "2", "--max-num-batched-tokens", "64",
         "--max-num-seqs", "4", "--chunk-size", "64", "--preemption", "newest, newest",
         "--no-progress"])
    assert [r["preemption"] for r in sweep.run_sweep(args)["rows"]] == ["newest"]


def test_bench_gives_the_engine_its_priority_aging(tmp_path):
    """bench passes --priority-aging-steps on to the engine (the declaration reads the
    engine's config)."""
    out = tmp_path / "r.json"
    assert bench.main_bench(["--executor", "sim", "--workload-file", priority_trace(tmp_path),
                             "--policy", "continuous", "--preemption", "priority",
                             "--priority-aging-steps", "7", "--out", str(out),
                             "--no-progress"]) == 0
    options = json.loads(out.read_text())["declaration"]["policy_options"]
    assert (options["preemption"], options["priority_aging_steps"]) == ("priority", 7)


def test_sweep_ages_the_priority_rows_only(tmp_path, monkeypatch):
    """sweep gives --priority-aging-steps to the engines of its priority rows, and to no other
    row's (the declaration names the flag whatever the rows did, so the engines' options are
    checked)."""
    seen, real = {}, runs.run_policy

    def spy(executor, policy, workload, options, *args, **kwargs):
        seen[options["preemption"]] = options.get("priority_aging_steps")
        return real(executor, policy, workload, options, *args, **kwargs)
    patch(monkeypatch, "run_policy", spy)
    assert sweep.main_sweep(["--executor", "sim", "--workload-file", priority_trace(tmp_path),
                             "--policy", "continuous", "--max-num-batched-tokens", "64",
                             "--max-num-seqs", "1", "--chunk-size", "64", "--preemption",
                             "newest,priority", "--priority-aging-steps", "50",
                             "--no-progress"]) == 0
    assert seen == {"newest": None, "priority": 50}


def test_the_fairness_limit_admits_a_setting_that_waited_exactly_that_long(capsys):
    """--max-queue-age keeps the settings whose oldest wait is at most the limit (a wait equal
    to it passes), and the limit must be > 0."""
    grid = [*SWEEP, "--slo-ttft", "0.5"]
    top = sweep.run_sweep(sweep.sweep_parser().parse_args(grid))["rows"][0]
    limit = top["max_queue_age_s"]
    assert limit > 0
    fair = sweep.run_sweep(sweep.sweep_parser().parse_args([*grid, "--max-queue-age",
                                                            repr(limit)]))
    assert fair["best"] == top
    assert sweep.main_sweep([*grid, "--max-queue-age", "0"]) == 2
    assert "--max-queue-age must be" in capsys.readouterr().err


def test_a_replayed_trace_refuses_zero_requests(tmp_path, capsys):
    """--num-requests with --workload-file must be >= 1 (0 would keep no request)."""
    assert bench.main_bench(["--executor", "sim", "--workload-file", priority_trace(tmp_path),
                             "--num-requests", "0", "--no-progress"]) == 2
    assert "--num-requests must be >= 1" in capsys.readouterr().err


# --------------------------------------------------------------------------- quality check
def test_output_tokens_are_each_requests_generated_ids():
    """The tokens the quality check compares are each request's generated ids, not its
    prompt (the same for every policy)."""
    engine = types.SimpleNamespace(requests={"a": types.SimpleNamespace(
        prompt_token_ids=[1, 2], output_token_ids=[7, 8, 9])})
    assert runs.output_tokens(engine) == {"a": [7, 8, 9]}


def test_a_request_missing_from_a_run_counts_as_differing():
    """A request the compared run lacks counts as differing, and the requests checked are
    the reference's."""
    ref = {"a": [1], "b": [2]}
    assert runs.same_tokens(ref, {"a": [1]}, "static") == {
        "policy": "static", "checked": True, "requests": 2, "differing_requests": ["b"]}


def test_quality_lines_show_five_differing_ids_then_dots():
    """The quality line names the first five differing requests, then ', ...'."""
    ref = {f"r{i}": [i] for i in range(7)}
    results = {"static": {}, "pd": {"same_tokens_as": runs.same_tokens(ref, {}, "static")}}
    assert report.quality_lines(results) == [
        "greedy tokens: pd differs from static on 7 of 7 (r0, r1, r2, r3, r4, ...)"]


def test_every_policy_is_compared_with_the_first(tiny_llama_dir, monkeypatch):
    """Every policy's tokens are compared with the first policy's, not with the policy run
    before it. The policies' tokens are faked: static's differ from the others'."""
    outputs = iter([{"r": [0]}, {"r": [1]}, {"r": [1]}])
    patch(monkeypatch, "output_tokens", lambda engine: next(outputs))
    args = bench.bench_parser().parse_args(["--model", str(tiny_llama_dir), "--policy",
                                            "static,pd,continuous", *TINY])
    results = bench.run_bench(args)["results"]
    for policy in ("pd", "continuous"):
        assert results[policy]["same_tokens_as"]["differing_requests"] == ["r"], policy


def test_transformers_rows_give_no_goodput_without_an_slo(tiny_llama_dir, monkeypatch):
    """Without an SLO, bench's transformers rows (hf-static, hf-generate-batch) give no
    goodput and say why, as minicb's rows do (transformers' runs are stubbed)."""
    patch(monkeypatch, "hf_model", lambda path, device, dtype: "hf")
    patch(monkeypatch, "hf_static", lambda *a, **kw: [])
    patch(monkeypatch, "hf_generate_batch", lambda *a, **kw: [])
    args = bench.bench_parser().parse_args(["--model", str(tiny_llama_dir), "--policy", "pd",
                                            "--compare", "hf", *TINY])
    results = bench.run_bench(args)["results"]
    for name in ("hf-static", "hf-generate-batch"):
        assert results[name]["goodput_rps"] is None, name
        assert results[name]["goodput_note"] == runs.NO_SLO_NOTE


def test_hf_static_tokens_are_each_requests_own_length(tiny_llama_dir):
    """hf_static keeps each request's tokens to its own output length, not the batch's
    longest (the shorter request's tokens then match minicb's)."""
    model = hf.hf_model(tiny_llama_dir, "cpu", torch.float32)
    workload = Workload("two", [WorkloadRequest(prompt_len=8, max_tokens=n, request_id=f"r{n}")
                                for n in (3, 9)])
    tokens: dict[str, list[int]] = {}
    hf.hf_static(model, workload, batch_size=2, progress=False, tokens=tokens)
    assert {rid: len(ids) for rid, ids in tokens.items()} == {"r3": 3, "r9": 9}


def test_the_hf_baseline_is_warmed_up_by_one_short_greedy_generate(monkeypatch):
    """The transformers baseline is warmed up by one short greedy generate before it is
    timed, as minicb's engine is, so the first timed run pays no first-use costs."""
    import transformers

    calls = []

    class Fake:
        def to(self, device):
            return self

        def eval(self):
            return self

        def generate(self, ids, **kw):
            calls.append((tuple(ids.shape), kw))

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: Fake())
    model = hf.hf_model("some/path", "cpu", torch.float32)
    assert isinstance(model, Fake) and len(calls) == 1
    shape, kw = calls[0]
    assert shape[0] == 1 and kw["do_sample"] is False and kw["max_new_tokens"] <= 4


# --------------------------------------------------------------------------- cancellations
def _cancelled(**ids: str) -> Workload:
    """Three requests the client cancels after 3 of their 9 tokens."""
    return Workload("c", [WorkloadRequest(prompt_len=20, max_tokens=9, cancel_after_tokens=3,
                                          request_id=ids.get(f"r{i}")) for i in range(3)])


def _run(workload: Workload) -> object:
    engine = make_sim_engine(CostModel(), policy="pd", num_pages=64, page_size=4)
    run_workload(engine, workload)
    return engine


def test_a_request_stopped_late_with_exactly_its_cancel_point_tokens_is_not_honoured():
    """A cancellation is honoured only if the request stopped in the step that gave its
    cancel point's token: one that finished a step later, though holding exactly
    `cancel_after_tokens` tokens, computed work nobody read."""
    workload = _cancelled()
    engine = _run(workload)
    assert runs.cancellations_honoured(engine, workload)
    engine.requests["req-1"].metrics.finish_step += 1  # its cancel came a step late
    assert not runs.cancellations_honoured(engine, workload)


def test_cancellations_are_checked_under_a_traces_own_request_ids():
    """cancellations_honoured finds each request under the trace's own request_id."""
    named = _cancelled(r0="alice", r1="bob", r2="carol")
    late = Workload("late", [dataclasses.replace(r, cancel_after_tokens=5)
                             for r in named.requests])
    engine = _run(late)
    assert set(engine.requests) == {"alice", "bob", "carol"} and engine.pool.num_used == 0
    assert not runs.cancellations_honoured(engine, named)  # 5 tokens where 3 were wanted


# --------------------------------------------------------------------------- sweep's ranking
def test_the_quality_reference_is_each_request_served_alone_to_its_full_length(monkeypatch):
    """The sweep's quality reference serves each request alone (policy `single`) to its full
    length, without its cancel point."""
    policies = []
    real = runs.run_policy

    def spy(executor, policy, *args, **kwargs):
        policies.append(policy)
        return real(executor, policy, *args, **kwargs)
    patch(monkeypatch, "run_policy", spy)
    workload = Workload("w", [WorkloadRequest(prompt_len=12, max_tokens=6, cancel_after_tokens=2,
                                              arrival_time=0.01 * i, deadline=30.0)
                              for i in range(3)])
    reference = sweep.reference_tokens(runs.Executor("sim", cost=CostModel()), workload,
                                       {"num_pages": 64, "page_size": 4})
    assert policies == ["single"]
    assert sorted(reference) == ["req-0", "req-1", "req-2"]
    assert all(len(ids) == 6 for ids in reference.values())


def test_a_sweep_without_an_slo_ranks_and_picks_by_completed_requests(monkeypatch):
    """A sweep ranks its rows and picks its best by completed requests/s without an SLO
    (goodput is null then), and by goodput with one."""
    asked = []
    real = sweep.ranked

    def spy(rows, by="goodput_rps"):
        asked.append(by)
        return real(rows, by)
    patch(monkeypatch, "ranked", spy)
    sweep.run_sweep(sweep.sweep_parser().parse_args(SWEEP))
    assert asked and set(asked) == {"requests_per_s"}
    asked.clear()
    sweep.run_sweep(sweep.sweep_parser().parse_args([*SWEEP, "--slo-ttft", "0.5"]))
    assert asked and set(asked) == {"goodput_rps"}


def test_a_sweep_rows_requests_per_s_counts_every_completed_request():
    """A sweep row's requests_per_s counts every completed request: with an SLO that some
    miss, it exceeds goodput."""
    data = sweep.run_sweep(sweep.sweep_parser().parse_args([*SWEEP, "--slo-ttft", "0.05"]))
    assert all(r["requests_per_s"] >= r["goodput_rps"] for r in data["rows"])
    assert any(r["requests_per_s"] > r["goodput_rps"] for r in data["rows"])


def test_sweep_over_rates_has_no_best_when_no_setting_sustains_any_rate(tmp_path):
    """With --rates, a sweep in which no setting meets the SLO target at any rate names no
    best."""
    data = sweep.run_sweep(sweep.sweep_parser().parse_args(
        ["--executor", "sim", "--workload", "mixed-chat", "--num-requests", "8", "--rates",
         "5,10", "--max-num-batched-tokens", "64,512", "--max-num-seqs", "8", "--chunk-size",
         "64", "--slo-ttft", "1e-9", "--no-progress"]))
    assert data["rows"] and all(r["sustainable_load_rps"] is None for r in data["sustainable"])
    assert data["best"] is None


# --------------------------------------------------------------------------- flags and report
@pytest.mark.parametrize("value", [0.0, float("inf"), float("nan")])
def test_a_zero_or_infinite_slo_names_its_flag(value):
    """An SLO of 0, inf or nan is refused naming its flag (--slo-ttft), not the SLO's key."""
    args = types.SimpleNamespace(slo_ttft=value, slo_itl=None, slo_tpot=None, slo_e2e=None)
    with pytest.raises(ValueError, match="^--slo-ttft must be a positive number"):
        flags.slo_from_args(args)


def test_check_writable_leaves_an_existing_file_as_it_was(tmp_path):
    """check_writable checks that an output path can be written without touching it: an
    existing file keeps its last results until the new ones replace them, and a new path is
    not created."""
    old = tmp_path / "results.json"
    old.write_text('{"kept": true}')
    flags.check_writable(old, "--out")
    assert old.read_text() == '{"kept": true}'
    new = tmp_path / "sub" / "new.json"
    flags.check_writable(new, "--out")
    assert not new.exists()


def test_profile_checks_out_before_profiling(tmp_path, capsys, monkeypatch):
    """profile checks that --out can be written before it profiles: an unwritable path is one
    line and exit 2, with nothing run."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ran = []
    patch(monkeypatch, "run_profile", lambda *a, **k: ran.append(a) or 1 / 0)
    assert profile.main_profile(["--out", str(blocker / "cm.json"), "--no-progress"]) == 2
    assert f"--out {blocker / 'cm.json'}: cannot write there" in capsys.readouterr().err
    assert ran == []


def test_the_report_prints_the_no_slo_note_and_each_token_count(tmp_path, capsys):
    """Without an SLO the printed report says 'goodput: -' and why; its token line gives the
    prefill and the decode counts, each its own."""
    out = tmp_path / "r.json"
    assert bench.main_bench(["--executor", "sim", "--num-requests", "4", "--policy", "pd",
                             "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    pd = json.loads(out.read_text())["results"]["pd"]
    assert pd["prefill_tokens"] != pd["decode_tokens"]
    assert f"goodput: - ({runs.NO_SLO_NOTE})" in printed
    assert f"tokens: {pd['prefill_tokens']} prefill + {pd['decode_tokens']} decode, " in printed


def test_print_extra_names_evictions_without_recomputation(capsys):
    """The memory-pressure line is printed when cached pages were evicted, even with no work
    lost to preemption."""
    report._print_extra("pd", {"discarded_tokens": 0, "recomputed_tokens": 0,
                              "evicted_pages": 5})
    assert "pd: work lost to preemption=0 tokens (0 computed again), cached pages evicted=5" in \
        capsys.readouterr().out


def test_a_dynamic_batching_row_is_a_baseline(capsys):
    """A dynamic batching row is a baseline: bench --policy dynamic,pd is not told that it
    lacks a static or dynamic row."""
    assert bench.main_bench(["--executor", "sim", "--num-requests", "4", "--policy",
                             "dynamic,pd", "--no-progress"]) == 0
    assert "no static or dynamic" not in capsys.readouterr().out


def test_the_declared_lengths_and_hardware_in_their_short_form():
    """The printed declaration gives lengths in short form (a spec's kind and values, or
    low-high) and the hardware with its CPU model when it is known."""
    decl = {"workload": {"workload": "w", "num_requests": 1}, "arrival_process": "poisson",
            "executor": "sim", "simulated": True, "token_budget": 1, "memory_limit": 2,
            "model": {"name": "m"}, "prompt_lengths": {"kind": "fixed", "value": 8},
            "output_lengths": {"low": 1, "high": 2},
            "device": {"device": "cpu", "cpu_count": 2, "cpu_model": "Test CPU 9000"}}
    text = "\n".join(report.declaration_lines(decl))
    assert "prompts kind=fixed value=8, outputs 1-2\n" in text
    assert "on cpu (2 CPUs, Test CPU 9000)" in text
    decl["device"]["cpu_model"] = None
    assert "on cpu (2 CPUs)\n" in "\n".join(report.declaration_lines(decl))
