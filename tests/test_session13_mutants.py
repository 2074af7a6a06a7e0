"""Planted-bug tests from a mutation review of the sweep's requirements, replayed traces and
the SLO flags (commits 48127cd..0d3c4ba): each test fails on the bug its docstring names."""

from __future__ import annotations

import dataclasses
import http.server
import re
import threading
import types

import pytest
from test_bench import SWEEP

from minicb.benchmark import bench, flags, hf, profile, report, runs, sweep
from minicb.benchmark.sim import CostModel, make_sim_engine
from minicb.benchmark.workload import Workload, WorkloadRequest, load_workload_file, run_workload


def patch(monkeypatch, name: str, value) -> None:
    """Replace `name` in every benchmark module that looks it up (bench, sweep and profile
    import the shared steps by name)."""
    for module in (bench, flags, hf, profile, report, runs, sweep):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)



def _cancelled(**ids: str) -> Workload:
    """Three requests the client cancels after 3 of their 9 tokens."""
    return Workload("c", [WorkloadRequest(prompt_len=20, max_tokens=9, cancel_after_tokens=3,
                                          request_id=ids.get(f"r{i}")) for i in range(3)])


def _run(workload: Workload) -> object:
    engine = make_sim_engine(CostModel(), policy="pd", num_pages=64, page_size=4)
    run_workload(engine, workload)
    return engine


def test_a_request_stopped_late_with_exactly_its_cancel_point_tokens_is_not_honoured():
    """cancellations_honoured skipped requests holding exactly `cancel_after_tokens` tokens
    (`len(...) <= limit` for `< limit`): one that finished a step after its cancel point's
    token, computing nothing it returned, would pass."""
    workload = _cancelled()
    engine = _run(workload)
    assert runs.cancellations_honoured(engine, workload)
    engine.requests["req-1"].metrics.finish_step += 1  # its cancel came a step late
    assert not runs.cancellations_honoured(engine, workload)


def test_cancellations_are_checked_under_a_traces_own_request_ids():
    """cancellations_honoured looked requests up as req-{i} only (the trace's `request_id`
    dropped): a replayed trace's requests, named by the trace, were never checked."""
    named = _cancelled(r0="alice", r1="bob", r2="carol")
    late = Workload("late", [dataclasses.replace(r, cancel_after_tokens=5)
                             for r in named.requests])
    engine = _run(late)
    assert set(engine.requests) == {"alice", "bob", "carol"} and engine.pool.num_used == 0
    assert not runs.cancellations_honoured(engine, named)  # 5 tokens where 3 were wanted


def test_the_quality_reference_is_each_request_served_alone_to_its_full_length(monkeypatch):
    """reference_tokens ran another policy than `single` (batched with others, not alone), or
    kept the cancel points (a reference cut short at each request's cancel point)."""
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
    """run_sweep ranked by goodput_rps whatever the SLO (`ranked_by` fixed): goodput is null
    without one, so the rows and the best fell back to tokens/s, not completed requests/s."""
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
    """The row's requests_per_s was the summary's goodput (a wrong key): with an SLO some
    requests miss, so completed requests/s exceeds goodput."""
    data = sweep.run_sweep(sweep.sweep_parser().parse_args([*SWEEP, "--slo-ttft", "0.05"]))
    assert all(r["requests_per_s"] >= r["goodput_rps"] for r in data["rows"])
    assert any(r["requests_per_s"] > r["goodput_rps"] for r in data["rows"])


@pytest.mark.parametrize("value", [0.0, float("inf"), float("nan")])
def test_a_zero_or_infinite_slo_names_its_flag(value):
    """slo_from_args let 0 (`value < 0` for `<= 0`) or inf and nan (the finiteness check
    dropped) through its own check, so check_slo refused them naming the dict key slo['ttft']
    instead of the flag --slo-ttft."""
    args = types.SimpleNamespace(slo_ttft=value, slo_itl=None, slo_tpot=None, slo_e2e=None)
    with pytest.raises(ValueError, match="^--slo-ttft must be a positive number"):
        flags.slo_from_args(args)


def test_a_csv_trace_may_say_long_prefill_0_on_every_other_request(tmp_path):
    """FLAG_TEXT read the CSV cell "0" as true: a trace written by hand with long_prefill 0 on
    its short requests and 1 on the long one was refused as marking several."""
    trace = tmp_path / "t.csv"
    trace.write_text("request_id,arrival_s,prompt_tokens,output_tokens,long_prefill\n"
                     "a,0.0,8,2,0\nb,0.1,64,2,1\nc,0.2,8,2,FALSE\n")
    workload = load_workload_file(trace)
    assert workload.long_request_id == "b"
    assert workload.declaration["long_request_id"] == "b"


@pytest.mark.parametrize("command", ["bench", "sweep", "profile", "serve", "grade"])
def test_every_command_reaches_its_own_parser(command, capsys):
    """__main__.COMMANDS named a function its module does not have (grade's `main_grade` for
    `main`): that command failed with an AttributeError traceback, found by no test."""
    from minicb.__main__ import main
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert f"usage: python -m minicb {command}" in capsys.readouterr().out


def test_a_server_answering_404_at_the_endpoint_is_named_not_a_traceback():
    """bench_endpoint caught only a refused connection (httpx.ConnectError), not an error
    status: a wrong port or path (something else answering 404) raised httpx's traceback
    instead of the one line naming the endpoint."""
    from minicb.benchmark.workload import get_workload
    from minicb.serving.client import bench_endpoint

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the http.server name)
            self.send_error(404)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/wrong"
    try:
        told = f"(?s)cannot reach {re.escape(url)} .*is the server running"
        with pytest.raises(ValueError, match=told):
            bench_endpoint(url, get_workload("mixed-chat", num_requests=1), progress=False)
    finally:
        server.shutdown()
        server.server_close()


def test_an_empty_minicb_prepack_is_the_default(monkeypatch):
    """prepack_wanted read MINICB_PREPACK with get(name, "1"): MINICB_PREPACK= (set but
    empty, how a shell line unsets it) was refused as neither 0 nor 1 instead of the default."""
    import torch

    from minicb.model import prepack
    monkeypatch.setenv("MINICB_PREPACK", "1")
    wanted = prepack.prepack_wanted("cpu", torch.float32)
    monkeypatch.setenv("MINICB_PREPACK", "")
    assert prepack.prepack_wanted("cpu", torch.float32) == wanted


def test_an_empty_minicb_attention_is_auto(monkeypatch):
    """resolve_backend took MINICB_ATTENTION whenever it was set (`in os.environ`):
    MINICB_ATTENTION= (set but empty) was refused as a backend named '' instead of 'auto'."""
    from minicb.attention import resolve_backend
    monkeypatch.delenv("MINICB_ATTENTION", raising=False)
    unset = resolve_backend("auto", "cpu")
    monkeypatch.setenv("MINICB_ATTENTION", "")
    assert resolve_backend("auto", "cpu") == unset
