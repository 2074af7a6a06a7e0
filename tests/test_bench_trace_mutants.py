"""From a mutation review of replayed traces, the preemption flags, the quality check and the
no-SLO goodput (bench, sweep, workload, metrics): each test fails on the planted bug it names."""

from __future__ import annotations

import json
import types

import pytest
from test_bench import SWEEP, TINY, priority_trace

from minicb.benchmark import bench, flags, hf, metrics, profile, report, runs, sweep
from minicb.benchmark.workload import Workload, load_workload_file, save_workload_file

OK = '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4}\n'

def patch(monkeypatch, name: str, value) -> None:
    """Replace `name` in every benchmark module that looks it up (bench, sweep and profile
    import the shared steps by name)."""
    for module in (bench, flags, hf, profile, report, runs, sweep):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)



def write(tmp_path, text: str, name: str = "t.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------ trace files
@pytest.mark.parametrize("name, text, match", [
    # WorkloadRequest refuses these too, but without the file, line and field: the trace
    # reader must refuse them first
    ("t.jsonl", OK + '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4, '
     '"deadline_s": 0}\n', "line 2: deadline_s"),
    ("t.jsonl", OK + '{"arrival_step": 0, "prompt_tokens": 3, "output_tokens": 4}\n',
     "line 2: arrival_step"),
    ("t.jsonl", OK + '{"arrival_s": 0, "arrival_step": 2, "prompt_tokens": 3, '
     '"output_tokens": 4}\n', "line 2: give arrival_s or arrival_step, not both"),
    ("t.jsonl", OK + '{"arrival_s": 0, "prompt_tokens": 2, "prompt_token_ids": [5, 6], '
     '"output_tokens": 4}\n', "line 2: give prompt_tokens or prompt_token_ids, not both"),
    ("t.jsonl", OK + '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4, '
     '"priority": true}\n', "line 2: priority must be an integer"),
    ("t.csv", "arrival_s,prompt_tokens,output_tokens\n0,3,3.5\n",
     "line 2: output_tokens must be a number"),
    ("t.csv", "arrival_s,prompt_tokens,output_tokens\n0,3,4,9\n",
     "line 2: more cells than the header"),
    ("t.jsonl", "\n\n", "no requests in the file"),
    ("t.jsonl", '{"request_id": "a", "arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4}\n'
     * 2, "request_id values must be unique"),
])
def test_bad_traces_are_refused_naming_the_line(tmp_path, name, text, match):
    """Catches, in load_workload_file/_trace_value/trace_request: seconds all allowed 0
    (deadline_s 0), arrival_step read as any int, `len(found) != 1` as `not found` (both
    alternatives given), bool accepted as priority, a CSV count read through float (3.5 -> 3),
    the extra-cells check, the empty-file check (min() of nothing) and the unique-id check
    dropped."""
    with pytest.raises(ValueError, match=match):
        load_workload_file(write(tmp_path, text, name))


def test_token_id_zero_is_a_valid_prompt_token(tmp_path):
    """Catches prompt_token_ids checked as ids >= 1 (WorkloadRequest takes id 0)."""
    w = load_workload_file(write(tmp_path, '{"arrival_s": 0, "prompt_token_ids": [0, 7], '
                                           '"output_tokens": 2}\n'))
    assert w.requests[0].prompt_token_ids == [0, 7]


def test_the_declaration_summarises_what_the_trace_holds(tmp_path):
    """Catches burstiness as CV^2 or 1/CV (not 1/CV^2), p50 from another percentile, output
    lengths summarised from the prompts, requests without a tenant counted as a tenant,
    deadlines or cancel fraction miscounted, and step arrivals not declared as steps."""
    rows = [{"arrival_s": 0.0, "prompt_tokens": 10, "output_tokens": 3, "tenant": "a"},
            {"arrival_s": 1.0, "prompt_tokens": 20, "output_tokens": 5, "deadline_s": 2.0},
            {"arrival_s": 4.0, "prompt_tokens": 90, "output_tokens": 7,
             "cancel_after_tokens": 1}]
    decl = load_workload_file(write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows)))\
        .declaration
    assert decl["burstiness"] == pytest.approx(4.0)  # gaps 1, 3: CV^2 = 1 / 2^2
    assert decl["rate_rps"] == pytest.approx(2 / 4) and decl["arrival_span_s"] == 4.0
    assert decl["prompt_lengths"] == {"kind": "observed", "min": 10, "p50": 20.0, "max": 90,
                                      "mean": 40.0}
    assert (decl["output_lengths"]["min"], decl["output_lengths"]["p50"],
            decl["output_lengths"]["max"]) == (3, 5.0, 7)
    assert (decl["tenants"], decl["deadlines"]) == (1, 1)
    assert decl["cancel_fraction"] == pytest.approx(1 / 3)
    steps = load_workload_file(write(tmp_path, '{"arrival_step": 1, "prompt_tokens": 3, '
                                               '"output_tokens": 2}\n', "s.jsonl")).declaration
    assert steps["arrival_process"] == "replayed trace in steps"
    assert steps["rate_rps"] is None and steps["burstiness"] is None


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_replayed_trace_saved_again_keeps_its_prompts_and_priorities(tmp_path, suffix):
    """Catches trace_row writing every length-only prompt as request 0's ids (token_ids(0),
    not token_ids(index)) and dropping negative priorities with the default 0."""
    path = write(tmp_path, '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n'
                           '{"arrival_s": 0.5, "prompt_tokens": 5, "output_tokens": 2, '
                           '"priority": -1}\n')
    first = load_workload_file(path)
    again = load_workload_file(save_workload_file(first, tmp_path / f"again{suffix}"))
    assert [r.token_ids(i) for i, r in enumerate(again)] == \
        [r.token_ids(i) for i, r in enumerate(first)]
    assert [r.priority for r in again] == [0, -1]


# ------------------------------------------------------------------------------ bench and sweep
def test_preemption_lists_are_checked_and_deduplicated(tmp_path, capsys):
    """Catches _preemptions without its `not names` check (bench --preemption ',' crashed
    with an IndexError) and without dict.fromkeys (sweep ran a repeated order twice)."""
    assert bench.main_bench(["--executor", "sim", "--num-requests", "2", "--no-progress",
                             "--preemption", ","]) == 2
    assert "--preemption takes newest" in capsys.readouterr().err
    args = sweep.sweep_parser().parse_args(
        ["--executor", "sim", "--num-requests", "2", "--max-num-batched-tokens", "64",
         "--max-num-seqs", "4", "--chunk-size", "64", "--preemption", "newest, newest",
         "--no-progress"])
    assert [r["preemption"] for r in sweep.run_sweep(args)["rows"]] == ["newest"]


def test_bench_gives_the_engine_its_priority_aging(tmp_path):
    """Catches engine_options checking --priority-aging-steps but not passing it on (the
    declaration reads the engine's config)."""
    out = tmp_path / "r.json"
    assert bench.main_bench(["--executor", "sim", "--workload-file", priority_trace(tmp_path),
                             "--policy", "continuous", "--preemption", "priority",
                             "--priority-aging-steps", "7", "--out", str(out),
                             "--no-progress"]) == 0
    options = json.loads(out.read_text())["declaration"]["policy_options"]
    assert (options["preemption"], options["priority_aging_steps"]) == ("priority", 7)


def test_sweep_ages_the_priority_rows_only(tmp_path, monkeypatch):
    """Catches sweep dropping --priority-aging-steps from the priority rows' options (the
    declaration names it from the flag, so only the engines' options show it)."""
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
    """Catches `max_queue_age_s < limit` for `<=` ("waited no longer"), and --max-queue-age 0
    accepted (the check is `> 0`)."""
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
    """Catches --num-requests checked as >= 0 with --workload-file (0 kept no request)."""
    assert bench.main_bench(["--executor", "sim", "--workload-file", priority_trace(tmp_path),
                             "--num-requests", "0", "--no-progress"]) == 2
    assert "--num-requests must be >= 1" in capsys.readouterr().err


# ------------------------------------------------------------------------------ quality check
def test_output_tokens_are_each_requests_generated_ids():
    """Catches output_tokens returning the prompts (the same for every policy, so the quality
    check could never see a difference)."""
    engine = types.SimpleNamespace(requests={"a": types.SimpleNamespace(
        prompt_token_ids=[1, 2], output_token_ids=[7, 8, 9])})
    assert runs.output_tokens(engine) == {"a": [7, 8, 9]}


def test_a_request_missing_from_a_run_counts_as_differing():
    """Catches same_tokens skipping requests the compared run lacks (a transformers run that
    lost one) and counting `requests` from that run instead of the reference."""
    ref = {"a": [1], "b": [2]}
    assert runs.same_tokens(ref, {"a": [1]}, "static") == {
        "policy": "static", "checked": True, "requests": 2, "differing_requests": ["b"]}


def test_quality_lines_show_five_differing_ids_then_dots():
    """Catches the list of differing requests cut at another length than the five it
    promises before ', ...'."""
    ref = {f"r{i}": [i] for i in range(7)}
    results = {"static": {}, "pd": {"same_tokens_as": runs.same_tokens(ref, {}, "static")}}
    assert report.quality_lines(results) == [
        "greedy tokens: pd differs from static on 7 of 7 (r0, r1, r2, r3, r4, ...)"]


def test_every_policy_is_compared_with_the_first(tiny_llama_dir, monkeypatch):
    """Catches the reference tokens replaced by each policy's in turn (continuous compared
    with pd, not static). The policies' tokens are faked: static's differ from the others'."""
    runs = iter([{"r": [0]}, {"r": [1]}, {"r": [1]}])
    patch(monkeypatch, "output_tokens", lambda engine: next(runs))
    args = bench.bench_parser().parse_args(["--model", str(tiny_llama_dir), "--policy",
                                            "static,pd,continuous", *TINY])
    results = bench.run_bench(args)["results"]
    for policy in ("pd", "continuous"):
        assert results[policy]["same_tokens_as"]["differing_requests"] == ["r"], policy


def test_transformers_rows_give_no_goodput_without_an_slo(tiny_llama_dir, monkeypatch):
    """Catches bench's hf-static and hf-generate-batch rows reporting completed requests/s as
    goodput when no SLO was given (transformers' runs are stubbed)."""
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
    """Catches hf_static's tokens cut at the batch's longest output, not the request's own
    (the shorter request then differs from minicb's in the quality line)."""
    from minicb.benchmark.workload import WorkloadRequest
    model = hf.hf_model(tiny_llama_dir, "cpu", __import__("torch").float32)
    workload = Workload("two", [WorkloadRequest(prompt_len=8, max_tokens=n, request_id=f"r{n}")
                                for n in (3, 9)])
    tokens: dict[str, list[int]] = {}
    hf.hf_static(model, workload, batch_size=2, progress=False, tokens=tokens)
    assert {rid: len(ids) for rid, ids in tokens.items()} == {"r3": 3, "r9": 9}


# ------------------------------------------------------------------------------ printed report
def test_the_report_prints_the_no_slo_note_and_each_token_count(tmp_path, capsys):
    """Catches print_report without its 'goodput: -' line when there is no SLO, and
    _print_extra printing prefill tokens as the decode count."""
    out = tmp_path / "r.json"
    assert bench.main_bench(["--executor", "sim", "--num-requests", "4", "--policy", "pd",
                             "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    pd = json.loads(out.read_text())["results"]["pd"]
    assert pd["prefill_tokens"] != pd["decode_tokens"]
    assert f"goodput: - ({runs.NO_SLO_NOTE})" in printed
    assert f"tokens: {pd['prefill_tokens']} prefill + {pd['decode_tokens']} decode, " in printed


def test_latency_column_titles_match_their_keys():
    """Catches LATENCY_COLUMNS with two titles swapped (TPOT's numbers under 'ITL')."""
    names = {"queue_s": "queue", "ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "ITL",
             "e2e_s": "E2E"}
    for key, title, _ in metrics.LATENCY_COLUMNS:
        latency, p = key.split(".")
        assert title == f"{names[latency]} {p}", key


@pytest.mark.parametrize("count", [0, -1, 2.5])
def test_load_workload_file_checks_num_requests(tmp_path, count):
    """A bug, not a mutant: load_workload_file sliced with num_requests unchecked (-1 dropped
    the last request, 0 failed in min() of nothing, 2.5 with a TypeError); only bench's flag
    was checked."""
    with pytest.raises(ValueError, match="num_requests must be an integer >= 1"):
        load_workload_file(write(tmp_path, OK * 2), num_requests=count)
