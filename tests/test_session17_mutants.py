"""Planted-bug tests from a mutation review of session 17's code (commits 982d9cc..59b92dc: the
server's lost-work, eviction and queue-age metrics, the client's reading of them, bench's printed
declaration, the page map's colours, the stream's last tokens, the bad-input checks): each test
fails on the bug its docstring names and passes on the real code."""

from __future__ import annotations

import asyncio
import socket

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import Response  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from test_engine import GREEDY, llm  # noqa: E402, F401 - a fixture
from test_serve import _chunk, _fake, metric_values  # noqa: E402
from test_viz import legend_texts, record  # noqa: E402

from minicb import SamplingParams  # noqa: E402
from minicb.benchmark import report
from minicb.benchmark.sim import make_sim_engine  # noqa: E402
from minicb.benchmark.workload import Workload, WorkloadRequest  # noqa: E402
from minicb.course import viz
from minicb.serving import client
from minicb.serving.server import ServerThread, main  # noqa: E402
from minicb.serving.worker import EngineWorker  # noqa: E402


def drive(engine, worker, added=None):
    """Step `engine` to the end as the worker's thread would (count, then retire); `added`:
    {step: [(prompt, params, id)]} to add after that step. Yields each record."""
    while engine.has_unfinished():
        rec = engine.step()
        worker._count(rec)
        worker._retire(rec)
        for prompt, params, rid in (added or {}).get(rec.step, []):
            engine.add_request(prompt, params, request_id=rid)
        yield rec


# ------------------------------------------------------------------------------ serve.py
def test_oldest_wait_is_the_oldest_unscheduled_request_and_preempted_ones_do_not_count():
    """Planted: the gauge took the newest waiter (`max` of arrival times for `min`), counted a
    preempted request's wait since its first arrival (the first_scheduled_time filter dropped:
    b, preempted at step 7, arrived before c and d), and showed milliseconds in /metrics."""
    engine = make_sim_engine(policy="continuous", num_pages=4, max_num_seqs=2)
    worker = EngineWorker(engine)  # not started: its per-step counting is driven here
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(3, 30)), long, request_id="a")
    engine.add_request(list(range(40, 67)), long, request_id="b")
    short = SamplingParams(max_tokens=2)
    checked = 0
    for rec in drive(engine, worker, {3: [([5, 6, 7], short, "c")], 4: [([8, 9, 7], short, "d")]}):
        unscheduled = [engine.requests[r].metrics.arrival_time for r in ("c", "d")
                       if r in rec.waiting]
        expected = rec.t_end - min(unscheduled) if unscheduled else 0.0
        assert worker.oldest_waiting_s == pytest.approx(expected), rec.step
        if "b" in rec.waiting and len(unscheduled) == 2:
            checked += 1
            shown = metric_values(worker.metrics_text())["minicb:oldest_waiting_seconds"]
            assert shown == pytest.approx(worker.oldest_waiting_s)
    assert checked > 5 and engine.requests["b"].num_preemptions == 1


def test_evicted_pages_count_every_page_a_step_evicts():
    """Planted: the counter grew by one per step that evicted (`bool(pages_evicted)`); here one
    prefill evicts three cached pages at once."""
    engine = make_sim_engine(policy="continuous", num_pages=6, max_num_seqs=1)
    worker = EngineWorker(engine)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request([7] * 64, params, request_id="a")  # leaves 4 cached prompt pages
    engine.add_request(list(range(100, 180)), params, request_id="b")  # 5 pages, 2 free
    evicted = [rec.pages_evicted for rec in drive(engine, worker)]
    assert max(evicted) >= 2 and worker.stats.value("kv_pages_evicted") == sum(evicted)


def test_serve_accepts_every_log_level_uvicorn_knows(capsys):
    """Planted: "trace" (uvicorn's most verbose level) left out of --log-level's choices. The
    port check after parsing stops main before any model loads."""
    from uvicorn.config import LOG_LEVELS
    for level in LOG_LEVELS:
        with pytest.raises(SystemExit):
            main(["--log-level", level, "--port", "70000"])
        assert "--port must be in [0, 65535]" in capsys.readouterr().err, level


# ------------------------------------------------------------------------------ client.py
def metrics_app(text: str) -> FastAPI:
    app = FastAPI()
    app.get("/metrics")(lambda: Response(text, media_type="text/plain"))
    return app


def dead_endpoint() -> str:
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_server_counters_read_a_label_value_with_a_brace_and_survive_a_dead_server():
    """Planted: the value was looked for after the first `}` (a label value may hold one:
    the line was skipped); a /metrics that does not answer raised (`except HTTPStatusError`),
    so a server that died as the run ended lost the whole run's results."""
    text = 'vllm:num_preemptions_total{model_name="a}b"} 4.0\n'
    with ServerThread(metrics_app(text)) as url:
        assert client.server_counters(url) == {"preemptions": 4.0}
    assert client.server_counters(dead_endpoint()) == {}


def test_bench_endpoint_reports_no_growth_for_a_counter_missing_before_the_run(monkeypatch):
    """Planted: a counter in the /metrics read after the run but not in the one before (a
    server that started exporting it mid-run) was subtracted from a missing value: KeyError."""
    reads = iter([{}, {"preemptions": 3.0}])
    monkeypatch.setattr(client, "server_counters", lambda endpoint: next(reads))
    workload = Workload("t", [WorkloadRequest(prompt_len=4, max_tokens=1)])
    with ServerThread(_fake(_chunk([1], "length"))) as url:
        data = client.bench_endpoint(url, workload, label="x", model="m")
    summary = data["results"]["x"]
    assert summary["from_server_metrics"] == [] and summary["preemptions"] is None
    assert "preemptions" in data["declaration"]["server_metrics"]


def test_report_prints_the_server_metrics_line_of_every_result():
    """Planted: the line printed only when the results held one row."""
    text = client.report({"a": {"from_server_metrics": ["preemptions"], "preemptions": 3},
                          "b": {"from_server_metrics": ["num_steps"], "num_steps": 9},
                          "c": {"from_server_metrics": []}})
    assert text.endswith("\na, from the server's /metrics over the run: preemptions=3"
                         "\nb, from the server's /metrics over the run: num_steps=9")


@pytest.mark.parametrize("vocab_size", [0, 2.5, True])
def test_run_client_refuses_a_vocab_size_that_is_not_a_positive_int(vocab_size):
    """Planted: only negative sizes refused (`vocab_size < 0`): 0 reached `% vocab_size`."""
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        asyncio.run(client.run_client(dead_endpoint(), [WorkloadRequest(prompt_len=4,
                                                                         max_tokens=4)],
                                      model="m", vocab_size=vocab_size))


# ------------------------------------------------------------------------------ bench.py
def test_the_declared_lengths_and_hardware_in_their_short_form():
    """Planted: lengths without low/high printed as a dict repr, a spec without a kind began
    with a space (`.strip()` dropped), and the CPU model left out of the hardware."""
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


# ------------------------------------------------------------------------------ viz.py
def page_faces(ax) -> list[str]:
    return [to_hex(p.get_facecolor()) for p in ax.patches if isinstance(p, Rectangle)]


def test_page_map_keeps_the_timeline_colours_when_more_requests_than_colours_show():
    """Planted: renumbering whenever two requests on the map share a colour (`< len(order)`):
    with more requests on the map than colours, some always do, so the map stopped matching
    the timeline (r1, the map's first, got colour 0)."""
    first = record(1, [(f"r{i}", "prefill", 4, i) for i in range(10)],
                   page_tables={f"r{i}": [i] for i in range(10)}, total=10)
    last = record(2, page_tables={f"r{i}": [i] for i in range(1, 10)}, total=10)
    faces = page_faces(viz.plot_page_map([first, last]).axes[0])
    assert faces[1] == viz.request_colour(1).lower() and faces[2] == viz.request_colour(2).lower()


def test_page_map_renumbers_in_the_maps_order():
    """Planted: the renumbering went by sorted id, not by the map's order (its legend's): the
    legend's first entry, r8, got the palette's second colour."""
    first = record(1, [(f"r{i}", "prefill", 4, i) for i in range(9)],
                   page_tables={f"r{i}": [i] for i in range(9)}, total=9)
    last = record(2, page_tables={"r8": [0], "r0": [1]}, total=9)
    ax = viz.plot_page_map([first, last]).axes[0]
    assert legend_texts(ax)[:2] == ["r8 (1 page)", "r0 (1 page)"]
    assert page_faces(ax)[:2] == [viz.request_colour(0).lower(), viz.request_colour(1).lower()]


# ------------------------------------------------------------------------------ llm.py
def test_a_stream_of_two_prompts_sends_both_requests_tokens_another_consumer_produced(llm):  # noqa: F811
    """Planted: only the stream's first request had its unsent tokens sent at the end: both
    finish in steps another stream runs (read after the first step's two tokens), and the
    second's tokens never came."""
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    both = llm.stream([[5, 6], [7, 8]], short)
    other = llm.stream([[9, 10]], GREEDY)
    got = [next(both), next(both)]
    assert got[0][0] != got[1][0]
    list(other)
    got += list(both)
    per_request: dict[str, list[int]] = {}
    for rid, new, _ in got:
        per_request.setdefault(rid, []).extend(new)
    ref = llm.generate([[5, 6], [7, 8]], short, use_tqdm=False)
    assert list(per_request.values()) == [o.token_ids for o in ref]


def test_bytes_are_neither_a_prompt_nor_params(llm):  # noqa: F811
    """Planted: the bytes checks dropped: b"\\x05\\x06" became two prompts of one id each, and
    b"x" one SamplingParams per prompt: refused, but as "prompt 0: ... got 120"."""
    for call, message in ((lambda: llm.generate(b"\x05\x06", GREEDY), "prompts must be"),
                          (lambda: llm.generate([[1]], b"x"), "params must be a "
                                                                  "SamplingParams .*, got b'x'")):
        with pytest.raises(ValueError, match=message):
            call()
        assert not llm.engine.requests


# ------------------------------------------------------------------------------ workload.py
def test_a_bad_trace_line_gives_the_json_error_without_its_column_of_line_1(tmp_path):
    """Planted: the JSON error given whole (`exc` for `exc.msg`): "line 2: not JSON (Expecting
    value: line 1 column 1 (char 0))" names two different lines."""
    from minicb.benchmark.workload import load_workload_file
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4}\nnope\n')
    with pytest.raises(ValueError) as info:
        load_workload_file(path)
    assert str(info.value) == f"{path}, line 2: not JSON (Expecting value)"
