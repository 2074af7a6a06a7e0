"""Planted-bug tests from a mutation review of session 14's code (commits 99a207b..77e31d8:
per-class fairness, resource use, bench's output checks and --endpoint refusals, the sweep's
best over rates, the client's error reasons, the grader's notes, trace and cost-model file
errors): each test fails on the bug its docstring names."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest
from test_metrics import approx, rec

from minicb.__main__ import main
from minicb.benchmark import bench, flags, hf, metrics, profile, report, runs, sweep


def patch(monkeypatch, name: str, value) -> None:
    """Replace `name` in every benchmark module that looks it up (bench, sweep and profile
    import the shared steps by name)."""
    for module in (bench, flags, hf, profile, report, runs, sweep):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)



def test_class_slo_attainment_counts_failed_requests_as_summarize_does():
    """by_class's SLO attainment left failed requests out of its denominator (`finish_reason
    not in ("cancelled", "error")` for `!= "cancelled"`): a class whose requests failed looked
    as healthy as one whose requests all met the SLO. It is the share of not-cancelled
    requests, as `summarize`'s slo_attainment is, so one class alone gives summarize's number."""
    ok = rec("ok", 4, arrival=0.0, sched=0.0, first=0.1, finish=0.5, times=[0.1, 0.5])
    failed = replace(rec("bad", 0, "error", arrival=0.0, finish=0.2), tenant="b")
    records = [replace(ok, tenant="a"), replace(ok, request_id="ok2", tenant="b"), failed]
    rows = metrics.by_class(records, {"ttft": 1.0})["tenant"]
    assert rows["a"]["slo_attainment"] == 1.0
    assert rows["b"]["slo_attainment"] == approx(0.5)  # one met, one failed
    alone = [r for r in records if r.tenant == "b"]
    assert metrics.summarize([], alone, {"ttft": 1.0})["slo_attainment"] == approx(0.5)


def test_check_writable_leaves_an_existing_file_as_it_was(tmp_path):
    """check_writable removed (`if True: unlink`) or emptied (`open(target, "w")`) a file that
    was already there: a rerun with the same --out lost the last results before the new run
    had any, and for good if it then failed."""
    old = tmp_path / "results.json"
    old.write_text('{"kept": true}')
    flags.check_writable(old, "--out")
    assert old.read_text() == '{"kept": true}'
    new = tmp_path / "sub" / "new.json"
    flags.check_writable(new, "--out")
    assert not new.exists()


def test_print_extra_names_evictions_without_recomputation(capsys):
    """The memory-pressure line showed only when work was recomputed (`or evicted_pages`
    dropped): cached pages evicted with no preemption went unreported."""
    report._print_extra("pd", {"discarded_tokens": 0, "recomputed_tokens": 0,
                              "evicted_pages": 5})
    assert "pd: work lost to preemption=0 tokens (0 computed again), cached pages evicted=5" in \
        capsys.readouterr().out


def test_a_dynamic_batching_row_is_a_baseline(capsys):
    """The no-baseline note ignored a dynamic row ("dynamic" dropped from the set): bench
    --policy dynamic,pd was told it lacked the comparison it had."""
    assert bench.main_bench(["--executor", "sim", "--num-requests", "4", "--policy",
                             "dynamic,pd", "--no-progress"]) == 0
    assert "no static or dynamic" not in capsys.readouterr().out


def test_sweep_over_rates_has_no_best_when_no_setting_sustains_any_rate(tmp_path):
    """With --rates, best was the top of the sustainable list even when its load was None (the
    `is not None` filter dropped): a setting that met the SLO target at no rate was named
    best."""
    data = sweep.run_sweep(sweep.sweep_parser().parse_args(
        ["--executor", "sim", "--workload", "mixed-chat", "--num-requests", "8", "--rates",
         "5,10", "--max-num-batched-tokens", "64,512", "--max-num-seqs", "8", "--chunk-size",
         "64", "--slo-ttft", "1e-9", "--no-progress"]))
    assert data["rows"] and all(r["sustainable_load_rps"] is None for r in data["sustainable"])
    assert data["best"] is None


def test_profile_checks_out_before_profiling(tmp_path, capsys, monkeypatch):
    """profile's --out was not checked first (the check dropped): minutes of profiling were
    lost to a traceback at the save."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ran = []
    patch(monkeypatch, "run_profile", lambda *a, **k: ran.append(a) or 1 / 0)
    assert profile.main_profile(["--out", str(blocker / "cm.json"), "--no-progress"]) == 2
    assert f"--out {blocker / 'cm.json'}: cannot write there" in capsys.readouterr().err
    assert ran == []


def test_the_hf_baseline_is_warmed_up_by_one_short_greedy_generate(monkeypatch):
    """_hf_model returned transformers' model without its warm-up (the call dropped): the first
    timed baseline paid the first-use costs minicb's warmed-up engine does not."""
    import torch
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


def test_a_servers_error_is_its_message_or_the_start_of_its_body():
    """_server_error read `error.get("message")` whatever `error` was (a server that sends
    `{"error": "text"}` lost its words to the raw body) and kept a whole non-JSON body (an HTML
    error page of any length as one "reason")."""
    from minicb.serving.client import _server_error
    assert _server_error(400, '{"error": {"message": "too long"}}') == "HTTP 400: too long"
    assert _server_error(503, '{"error": "overloaded"}') == "HTTP 503: overloaded"
    page = "<html>" + "x" * 1000 + "</html>"
    assert _server_error(502, f"  {page}\n") == f"HTTP 502: {page[:200]}"


def test_describe_errors_plurals_and_hints_only_for_a_trace_field():
    """describe_errors said "2 request failed" (`n > 2` for `n > 1`), and suggested
    --omit-field for any failure (the check for a trace field's name dropped), a server fault
    included."""
    from minicb.serving.client import describe_errors
    text = describe_errors({"error_reasons": {"HTTP 500: boom": 2, "HTTP 400: x": 1}})
    assert text.splitlines() == ["error: 2 requests failed: HTTP 500: boom",
                                 "error: 1 request failed: HTTP 400: x"]
    assert describe_errors({"error_reasons": {"HTTP 400: bad deadline": 3}}).endswith(
        "leave it out with --omit-field)")
    assert describe_errors({"error_reasons": {}}) == describe_errors({}) == ""


def _app(chunks):
    """A completions server that streams `chunks` (SSE data lines) to every request."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        return StreamingResponse(iter([f"data: {c}\n\n" for c in chunks] + ["data: [DONE]\n\n"]),
                                 media_type="text/event-stream")
    return app


def test_failures_keep_their_reason_in_the_stream_and_on_the_wire(capsys):
    """A server's error chunk in a 200 stream (vLLM's way) and a refused connection were
    counted as errors with no reason (their `error` assignments dropped): error_reasons said
    "unknown". bench serve prints the reasons under its summary (the call was dropped)."""
    import asyncio
    import socket

    from minicb.benchmark.workload import Workload, WorkloadRequest
    from minicb.serving.client import error_reasons, run_client
    from minicb.serving.server import ServerThread

    workload = Workload("t", [WorkloadRequest(prompt_len=4, max_tokens=2)] * 2)
    with ServerThread(_app(['{"error": {"message": "boom"}}'])) as url:
        records = asyncio.run(run_client(url, workload.requests, model="m", warmup=False))
        assert main(["bench", "serve", "--base-url", url, "--model", "m", "--num-prompts", "2",
                     "--random-input-len", "4", "--random-output-len", "2",
                     "--disable-tqdm"]) == 0
    assert error_reasons(records) == {"HTTP 200: boom": 2}
    assert "error: 2 requests failed: HTTP 200: boom" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
        records = asyncio.run(run_client(closed, workload.requests, model="m", warmup=False))
    assert [r.finish_reason for r in records] == ["error", "error"]
    assert all(r.error.startswith("ConnectError: ") for r in records)


ENGINE_ONLY = ("num_steps", "preemptions", "discarded_tokens", "recomputed_tokens",
               "evicted_pages", "dead_slot_steps", "mean_batch_size", "output_tokens_per_step",
               "decode_tokens_per_s", "host_time_fraction", "cached_prompt_tokens",
               "prefill_tokens", "decode_tokens", "decode_rows", "mixed_steps", "draft_tokens",
               "accepted_draft_tokens")


def test_bench_endpoint_leaves_every_engine_only_field_null(capsys):
    """bench_endpoint reported 0 for a field only the server's engine knows when ENGINE_ONLY
    lost it (dead_slot_steps and mean_batch_size, or cached_prompt_tokens, dropped): a server
    with a prefix cache read as caching nothing. The model named by --model is sent on, not
    replaced by the server's first (it was dropped: this server has no /v1/models)."""
    from minicb.serving.server import ServerThread

    chunks = [json.dumps({"choices": [{"text": "a", "finish_reason": why}]})
              for why in (None, "length")]
    with ServerThread(_app(chunks)) as url:
        from minicb.benchmark.workload import make_workload
        from minicb.serving.client import bench_endpoint
        data = bench_endpoint(url, make_workload(2, output_lengths="fixed:2"), label="x",
                              model="mine")
    summary = data["results"]["x"]
    assert summary["completed"] == 2
    assert {key: summary[key] for key in ENGINE_ONLY} == dict.fromkeys(ENGINE_ONLY)


def test_error_reasons_count_only_failed_requests():
    """error_reasons counted every request that did not end by length (`!= "length"` for
    `== "error"`): stopped, cancelled and late requests became "unknown" failures."""
    from minicb.serving.client import error_reasons
    records = [rec(f"r{i}", 2, why) for i, why in enumerate(("stop", "cancelled", "deadline",
                                                             "length"))]
    records += [replace(rec("e1", 0, "error"), error="HTTP 400: no"), rec("e2", 0, "error")]
    assert error_reasons(records) == {"HTTP 400: no": 1, "unknown": 1}


def _trace(path, arrivals):
    path.write_text("".join(json.dumps({"arrival_s": a, "prompt_tokens": 3, "output_tokens": 2})
                            + "\n" for a in arrivals))
    return path


def test_a_trace_longer_than_a_day_that_starts_near_zero_loads(tmp_path):
    """The clock-time guard looked at the last arrival (`max(times)` for `min(times)`): a
    trace recorded over more than a day, offsets from its start, was refused as epoch
    seconds. The guard's edge is a first arrival of more than a day: a day exactly loads."""
    from minicb.benchmark.workload import load_workload_file
    long = load_workload_file(_trace(tmp_path / "long.jsonl", [0.0, 90_000.0]))
    assert [r.arrival_time for r in long.requests] == [0.0, 90_000.0]
    assert load_workload_file(_trace(tmp_path / "day.jsonl", [86_400.0, 86_401.0])).requests
    with pytest.raises(ValueError, match="more than a day"):
        load_workload_file(_trace(tmp_path / "late.jsonl", [86_400.5, 86_401.0]))


def test_loading_a_long_csv_cell_leaves_the_csv_field_limit_as_it_was(tmp_path):
    """load_workload_file raised the csv module's process-wide field size limit for a long
    prompt cell and kept it raised (the restore in `finally` dropped), for every later csv
    reader in the process."""
    from minicb.benchmark.workload import (
        Workload,
        WorkloadRequest,
        load_workload_file,
        save_workload_file,
    )
    before = csv.field_size_limit()
    w = Workload("long", [WorkloadRequest(prompt_token_ids=[12345] * 30_000, max_tokens=2)], {})
    load_workload_file(save_workload_file(w, tmp_path / "long.csv"))
    assert csv.field_size_limit() == before


def test_only_a_bad_first_line_suggests_the_trace_is_csv(tmp_path):
    """The "a CSV trace's name must end in .csv" hint is for a file whose first line is not
    JSON; it came with a bad line anywhere (`first = False` dropped), where the file is JSON
    Lines with one broken line."""
    from minicb.benchmark.workload import load_workload_file
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2}\n{"arrival_s": 1,\n')
    with pytest.raises(ValueError, match=r"line 2: not JSON") as info:
        load_workload_file(path)
    assert ".csv" not in str(info.value)


def test_a_missing_cpu_cost_model_says_where_cpu_reads_it(tmp_path, monkeypatch):
    """--cost-model cpu with no fitted file was told "'cpu' is neither a preset ... nor a JSON
    file" (its own branch dropped), which does not say which file it looked for."""
    from minicb.benchmark import sim
    missing = tmp_path / "bench" / "cost_model_cpu.json"
    monkeypatch.setattr(sim, "DEFAULT_CPU_COST_MODEL", missing)
    with pytest.raises(ValueError, match=r"cost model 'cpu' reads .*cost_model_cpu\.json.*"
                                         r"no such file.*minicb profile"):
        sim.CostModel.load("cpu")


def test_an_unreadable_cost_model_or_trace_names_its_path(tmp_path, monkeypatch):
    """A cost model file that exists but cannot be read (permissions) raised a bare
    PermissionError traceback (the `except OSError` dropped) instead of one line naming it."""
    import pathlib

    from minicb.benchmark.sim import CostModel
    from minicb.benchmark.workload import load_workload_file
    cost, trace = tmp_path / "cm.json", _trace(tmp_path / "t.jsonl", [0.0])
    cost.write_text('{"a": 0.01}')

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(pathlib.Path, "read_text", denied)
    with pytest.raises(ValueError, match=r"cm\.json': cannot read it \(Permission denied\)"):
        CostModel.load(str(cost))
    with pytest.raises(ValueError, match=r"t\.jsonl: cannot read it \(Permission denied\)"):
        load_workload_file(trace)


def test_a_bfloat16_load_holds_bfloat16_weights(tiny_llama_dir):
    """The meta model got its storage from torch.empty without the tensor's dtype (torch's
    default float32): a bfloat16 load ran in float32, twice the memory, with no error."""
    import torch

    from minicb.model.loader import load_model
    model, _ = load_model(str(tiny_llama_dir), device="cpu", dtype=torch.bfloat16,
                          prepack=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
