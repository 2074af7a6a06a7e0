"""The simulated executor: same schedule as the real engine, step times from the cost model,
a fit that recovers the model, the chapter's long-prefill claims, and scale."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from helpers import rec, step

from minicb.benchmark import metrics, sim
from minicb.benchmark.sim import (
    PRESETS,
    CostModel,
    SimClock,
    fit_cost_model,
    make_sim_engine,
    sim_model_info,
    step_features,
    swap_break_even,
)
from minicb.benchmark.workload import (
    Workload,
    WorkloadRequest,
    get_workload,
    make_workload,
    run_workload,
)
from minicb.engine import Engine

TRUE = CostModel(a=2e-3, b=3e-5, c=1e-4, d=2e-7, e=1e-9, name="true")


def schedule(trace):
    return [(r.step, [(m.request_id, m.kind, m.num_tokens, m.slot) for m in r.members],
             sorted(r.preempted), sorted(r.finished)) for r in trace]


def small_mixed(seed=0, n=8):
    return make_workload(n, prompt_lengths="uniform:3:60", output_lengths="uniform:1:12",
                         seed=seed, arrival="steps", arrival_steps=[1 + 2 * i for i in range(n)])


# --------------------------------------------------------------------------- basics
def test_sim_clock():
    """The simulated clock starts at 0, moves forward by advance and sleep, ignores a negative
    sleep, and refuses to go back."""
    clock = SimClock()
    assert clock() == 0.0
    clock.advance(0.5)
    clock.sleep(0.25)
    clock.sleep(-3)  # sleeping a negative time does nothing
    assert clock() == 0.75
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1)


def test_sim_engine_has_no_kv_tensors_and_never_emits_eos():
    """The simulated engine holds no KV tensors and no layers and emits only token 100, which is not
    EOS; a vocabulary too small for it is refused."""
    engine = make_sim_engine(TRUE, policy="pd")
    assert engine.pool.kv_caches == [] and engine.info.config.num_layers == 0
    run_workload(engine, small_mixed())
    tokens = {t for r in engine.requests.values() for t in r.output_token_ids}
    assert tokens == {100} and 100 not in engine.info.eos_token_ids
    with pytest.raises(ValueError, match="vocab"):
        sim_model_info(vocab=50)


def test_cost_model_presets_and_json(tmp_path):
    """A preset cost model states its assumption; a saved model loads back with the same
    coefficients; an unknown preset or a negative coefficient is refused."""
    h100 = CostModel.load("h100-like")
    assert h100.assumption and "assumption" in h100.source
    path = TRUE.save(tmp_path / "cm.json")
    back = CostModel.load(str(path))
    assert np.allclose(back.coefficients, TRUE.coefficients)
    with pytest.raises(ValueError, match="preset"):
        CostModel.load("tpu-like")
    with pytest.raises(ValueError, match="coefficient a"):
        CostModel.from_dict({"a": -1.0})
    assert set(PRESETS) >= {"h100-like"}


# --------------------------------------------------------------------------- same schedule
@pytest.mark.parametrize("policy, options", [
    ("pd", dict(max_num_seqs=4, max_num_batched_tokens=24, chunk_size=16)),
    ("chunked", dict(max_num_seqs=4, max_num_batched_tokens=24, chunk_size=16)),
    ("continuous", dict(max_num_seqs=3)),
    ("static", dict(max_num_seqs=3)),
    ("single", dict()),
    ("pd", dict(max_num_seqs=6, max_num_batched_tokens=32, num_pages=20, page_size=4)),
])
def test_simulated_schedule_equals_real_schedule(tiny_model, policy, options):
    """Output lengths fixed: the simulated executor admits, chunks, preempts and finishes
    exactly as the real model run does, step by step (the last case preempts)."""
    options = dict(options)
    options.setdefault("num_pages", 256)
    workload = small_mixed(seed=5)
    real = Engine(tiny_model, policy=policy, **options)
    run_workload(real, workload)
    sim = make_sim_engine(TRUE, vocab=tiny_model[1].config.vocab_size, policy=policy, **options)
    run_workload(sim, workload)
    assert schedule(sim.trace) == schedule(real.trace)
    if options.get("num_pages") == 20:
        assert any(r.preempted for r in real.trace)


@pytest.mark.parametrize("options", [
    dict(min_chunk=8),
    dict(preemption="priority"),
    dict(preemption="priority", priority_aging_steps=3),
    dict(max_preemptions=1, num_pages=16),
    dict(max_preemptions=0),
    dict(preemption="fair"),
    dict(preemption_mode="swap"),
    dict(preemption_mode="swap", num_swap_pages=4),
    dict(reject_when_full=True),
])
def test_simulated_schedule_equals_real_schedule_for_chapter_06_knobs(tiny_model, options):
    """Chapters 05 and 06 run min_chunk, the preemption orders, the bound on preemption loss,
    swap and reject on the simulated executor only, and call its schedules exact: they are,
    step by step, with a pool small enough to preempt and priorities and tenants that
    differ."""
    workload = small_mixed(seed=5, n=10)
    for i, request in enumerate(workload.requests):
        request.priority = i % 3
        request.tenant = "ab"[i % 2]
    options = dict(dict(policy="pd", max_num_seqs=6, max_num_batched_tokens=32, chunk_size=16,
                        num_pages=20, page_size=4), **options)
    real = Engine(tiny_model, **options)
    run_workload(real, workload)
    sim = make_sim_engine(TRUE, vocab=tiny_model[1].config.vocab_size, **options)
    run_workload(sim, workload)
    assert schedule(sim.trace) == schedule(real.trace)
    default = make_sim_engine(TRUE, vocab=tiny_model[1].config.vocab_size,
                              **dict(options, min_chunk=1, preemption="newest",
                                     priority_aging_steps=None, max_preemptions=None,
                                     preemption_mode="recompute", num_swap_pages=None,
                                     reject_when_full=False))
    run_workload(default, workload)
    assert schedule(sim.trace) != schedule(default.trace)  # the knob changed the schedule


def test_step_times_follow_the_model():
    """Each busy simulated step's forward time is the cost model's prediction for that step's
    features, and the step takes nothing more."""
    engine = make_sim_engine(TRUE, policy="pd", max_num_seqs=4, max_num_batched_tokens=48,
                             chunk_size=32)
    run_workload(engine, small_mixed(n=10))
    x = step_features(engine.trace, metrics.request_records(engine))
    predicted = TRUE.predict_features(x)
    busy = [i for i, r in enumerate(engine.trace) if r.members]
    forward = np.array([engine.trace[i].t_forward for i in busy])
    duration = np.array([engine.trace[i].duration for i in busy])
    assert np.allclose(forward, predicted[busy], rtol=1e-9, atol=1e-15)
    assert np.allclose(duration, forward, rtol=1e-9, atol=1e-15)  # only the model takes time
    # the metadata the model saw agrees with the trace reconstruction, step by step
    assert engine.model.num_forwards == len(busy)


def test_fit_recovers_the_model_from_a_simulated_trace():
    """Fitting the forward time of a simulated trace recovers the cost model's coefficients exactly
    (r2 = 1); an unknown target is refused."""
    engine = make_sim_engine(TRUE, policy="pd", max_num_seqs=6, max_num_batched_tokens=96,
                             chunk_size=64)
    run_workload(engine, make_workload(24, prompt_lengths="uniform:4:200",
                                       output_lengths="uniform:1:40", seed=9))
    fit = fit_cost_model(engine.trace, metrics.request_records(engine), target="forward")
    assert np.allclose(fit.coefficients, TRUE.coefficients, rtol=1e-5, atol=1e-12)
    assert fit.fit["r2"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="target"):
        fit_cost_model(engine.trace, target="wall")


def test_fit_on_a_real_tiny_run(tiny_model):
    """A fit on a real tiny-model run has non-negative coefficients, predicts a positive time for
    every step, and totals within 25% of the run's time."""
    engine = Engine(tiny_model, policy="pd", max_num_seqs=4, max_num_batched_tokens=64,
                    chunk_size=32, num_pages=256)
    run_workload(engine, make_workload(10, prompt_lengths="uniform:4:100",
                                       output_lengths="uniform:2:12", seed=1))
    fit = fit_cost_model(engine.trace, metrics.request_records(engine), skip=1)
    assert (fit.coefficients >= 0).all()
    assert fit.fit["num_steps"] > 5 and np.isfinite(fit.fit["r2"])
    # wall-clock steps are noisy and, on a tiny model, the intercept and the decode-row cost
    # are nearly collinear, so no single coefficient is asserted: the fit must predict a
    # positive time for every step and about the run's whole time
    features = step_features(engine.trace, metrics.request_records(engine))[1:]
    assert (fit.predict_features(features) > 0).all()
    assert abs(fit.fit["predicted_total_s"] / fit.fit["total_s"] - 1) < 0.25


# --------------------------------------------------------------------------- the chapter's claim
def test_long_prefill_pd_versus_chunked():
    """dec@P > 0 under pd and 0 under chunked (prefill-first); pd's short_P is smaller; total
    throughput within 10%, in tokens per step and in simulated tokens per second."""
    workload = get_workload("long-prefill", long_prompt_len=2000)
    out = {}
    for policy in ("pd", "chunked"):
        engine = make_sim_engine("h100-like", policy=policy, max_num_seqs=8,
                                 max_num_batched_tokens=256, chunk_size=256)
        run_workload(engine, workload)
        out[policy] = metrics.summarize(engine.trace, metrics.request_records(engine),
                                        long_request_id=workload.long_request_id)
    pd, chunked = out["pd"], out["chunked"]
    assert pd["dec_at_p"] > 0 and chunked["dec_at_p"] == 0
    assert pd["short_p_steps"] < chunked["short_p_steps"]
    assert pd["short_p_s"] < chunked["short_p_s"]
    for key in ("output_tokens_per_step", "output_tokens_per_s"):
        assert abs(pd[key] - chunked[key]) / chunked[key] < 0.10


def test_long_prefill_on_a_tiny_model(tiny_model):
    """On a real tiny model with one long prompt, pd decodes during the long prefill and chunked
    does not, and pd's short requests wait fewer steps."""
    workload = get_workload("long-prefill", long_prompt_len=300, short_output=48,
                            num_short=3)
    out = {}
    for policy in ("pd", "chunked"):
        engine = Engine(tiny_model, policy=policy, max_num_seqs=4, max_num_batched_tokens=64,
                        chunk_size=64, num_pages=256)
        run_workload(engine, workload)
        out[policy] = metrics.summarize(engine.trace, metrics.request_records(engine),
                                        long_request_id="long")
    assert out["pd"]["dec_at_p"] > 0 and out["chunked"]["dec_at_p"] == 0
    assert out["pd"]["short_p_steps"] < out["chunked"]["short_p_steps"]


# --------------------------------------------------------------------------- scale
def test_thousands_of_requests_without_snapshots_give_the_same_results():
    """A benchmark-sized run (1,000 requests) with `trace_snapshots=False`: the same schedule
    and metrics as with snapshots, and records that hold only the batch. (Its speed is a
    benchmark: `python -m minicb bench --executor sim --num-requests 10000`.)"""
    workload = get_workload("mixed-chat", num_requests=1000, rate=100.0)
    runs = {}
    for snapshots in (True, False):
        engine = make_sim_engine("h100-like", policy="pd", max_num_seqs=64,
                                 max_num_batched_tokens=1024, chunk_size=512, num_pages=8192,
                                 trace_snapshots=snapshots)
        run_workload(engine, workload)
        runs[snapshots] = engine
    full, light = runs[True].trace, runs[False].trace
    assert schedule(full) == schedule(light)
    assert [r.num_waiting for r in full] == [len(r.waiting) for r in full]
    assert [r.num_waiting for r in light] == [r.num_waiting for r in full]
    assert max(r.num_waiting for r in light) > 0  # the queue did build up
    assert all(not (r.waiting or r.page_tables or r.slots or r.cached_pages) for r in light)
    summaries = [metrics.summarize(e.trace, metrics.request_records(e)) for e in runs.values()]
    assert summaries[0] == summaries[1]
    assert summaries[1]["completed"] == 1000
    assert summaries[1]["duration_s"] > 10  # simulated seconds: arrivals alone span ~10 s


def test_nonnegative_fit_drops_the_most_negative_coefficient():
    """When the least-squares fit has a negative coefficient, the non-negative fit sets it to 0 and
    refits the rest."""
    from minicb.benchmark.sim import _nonnegative_lstsq
    x = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    coef = _nonnegative_lstsq(x, np.array([2.0, 1.0, 0.0]))  # unconstrained: [2, -1]
    assert coef == pytest.approx([1.0, 0.0])


def test_step_features_restart_after_preemption_and_start_at_the_cache_hit():
    """A step's features count prefill from the cache hit onward, and a preempted request's context
    starts again from zero."""
    trace = [step(1, [("A", "prefill", 8, 0), ("B", "prefill", 4, 1)], 0.0, 1.0),
             step(2, [("A", "prefill", 8, 0)], 1.0, 2.0, preempted=["A"]),
             step(3, [("A", "decode", 1, 0)], 2.0, 3.0)]
    feats = step_features(trace, [rec("A", 1), rec("B", 1, cached=4)])
    assert feats.tolist() == [[1, 12, 0, 16, 96], [1, 8, 0, 8, 64], [1, 0, 1, 9, 0]]


@pytest.mark.parametrize("data, match", [
    (b"root:x:0:0:root:/root:/bin/bash\n", r"bad\.json' is not JSON \(Expecting value, line 1\)"
                                           r": expected a JSON object with coefficients a"),
    (b"", r"bad\.json' is not JSON"),
    (b"\xff\xfe{", r"bad\.json' is not UTF-8 text"),
    (b"[1, 2]", r"bad\.json' holds no coefficients"),
    (b'{"name": "x"}', r"bad\.json' holds no coefficients"),
    (b'{"a": NaN}', r"bad\.json': coefficient a must be a finite number"),
    (b'{"a": true}', r"bad\.json': coefficient a must be a finite number"),
    # a missing or misspelt coefficient is named, never counted as 0 without a word
    (b'{"a": 0.02, "b": 0.001, "c": 0.001, "d": 1e-5, "E": 1e-6}', r"unknown key\(s\) \['E'\]"),
    (b'{"a": 1, "b": 2}', r"bad\.json' lacks coefficient\(s\) c, d, e: give each"),
], ids=["passwd", "empty", "utf-16", "list", "no-coefficients", "nan", "bool", "typo",
        "partial"])
def test_bad_cost_model_files_name_the_path(tmp_path, data, match):
    """A cost-model file that is not JSON, not UTF-8, holds no or non-numeric coefficients, an
    unknown key, or lacks some coefficients is refused with a message naming the file and the
    problem."""
    path = tmp_path / "bad.json"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match):
        CostModel.load(str(path))


def test_cost_model_missing_file_directory_and_byte_order_mark(tmp_path):
    """A missing file or a directory is refused with a message saying which; a file with a UTF-8
    byte-order mark loads."""
    with pytest.raises(ValueError, match=r"missing\.json' is neither a preset .*no such file"):
        CostModel.load(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="is a directory, not a JSON file"):
        CostModel.load(str(tmp_path))
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + TRUE.save(tmp_path / "cm.json").read_bytes())
    assert np.allclose(CostModel.load(str(path)).coefficients, TRUE.coefficients)


def test_swap_break_even_matches_the_simulator():
    """The reference's prediction is what the simulator charges: one victim preempted once,
    run with recompute and with free swaps, differs in time by the break-even times the pages
    copied, within 5% (the gap: the victim's pending token rides in its last recomputed
    chunk instead of a decode row, whose d*end read a swapped victim pays too)."""
    two = Workload("one-victim", [WorkloadRequest(prompt_len=200, max_tokens=64,
                                                  arrival_step=1 + i, request_id=rid)
                                  for i, rid in enumerate("ab")])
    for cost in (PRESETS["h100-like"], CostModel(a=0.02, b=1e-3, c=1.2e-3, d=9e-6, e=1.1e-6)):
        runs = {}
        for mode in ("recompute", "swap"):
            runs[mode] = make_sim_engine(replace(cost, s=0.0), policy="pd", num_pages=28,
                                         preemption_mode=mode)
            run_workload(runs[mode], two)
        redo, swap = (metrics.summarize(runs[mode].trace, metrics.request_records(runs[mode]))
                      for mode in ("recompute", "swap"))
        copies = swap["swapped_out_pages"] + swap["swapped_in_pages"]
        assert redo["preemptions"] == swap["preemptions"] == 1 and copies == 14 + 3  # 11 shared
        n = redo["discarded_tokens"]
        predicted = swap_break_even(cost, n, n - redo["recomputed_tokens"], 16, 256)
        measured = (runs["recompute"].clock() - runs["swap"].clock()) / copies
        assert measured == pytest.approx(predicted, rel=0.05)


def test_swap_break_even_refuses_impossible_victims():
    """swap_break_even refuses a victim with nothing computed, more cached than computed, a negative
    cache, a cache off a page boundary, or a non-positive page or chunk size; a fully cached
    victim breaks even at 0."""
    cost = PRESETS["h100-like"]
    for args, words in [((0, 0, 16, 8), "1 <= num_computed"), ((10, 11, 16, 8), "num_cached=11"),
                        ((10, -1, 16, 8), "num_cached=-1"), ((10, 0, 0, 8), "page_size"),
                        ((10, 0, 16, 0), "chunk_size")]:
        with pytest.raises(ValueError, match=words):
            swap_break_even(cost, *args)
    with pytest.raises(ValueError, match="multiple of page_size 16, got 20"):
        swap_break_even(cost, 40, 20, 16, 8)
    assert swap_break_even(cost, 32, 32, 16, 8) == 0.0  # everything cached: nothing to redo


def _sim_run():
    engine = make_sim_engine(TRUE, policy="pd", max_num_seqs=6, max_num_batched_tokens=96,
                             chunk_size=64)
    run_workload(engine, make_workload(24, prompt_lengths="uniform:4:200",
                                       output_lengths="uniform:1:40", seed=9))
    return engine


def test_a_fit_that_skips_warm_up_steps_keeps_each_step_with_its_own_features():
    """Skipping warm-up steps drops their durations and their feature rows together: each
    duration stays paired with its own step's shape."""
    engine = _sim_run()
    fit = fit_cost_model(engine.trace, metrics.request_records(engine), target="forward", skip=3)
    assert np.allclose(fit.coefficients, TRUE.coefficients, rtol=1e-5, atol=1e-12)
    assert fit.fit["r2"] == pytest.approx(1.0)


def test_the_fit_target_picks_whole_step_time_or_forward_time():
    """target='duration' fits the whole step's time, target='forward' the forward's (steps
    with host time tell them apart)."""
    shapes = [[("A", "prefill", 10, 0)], [("A", "decode", 1, 0)],
              [("A", "decode", 1, 0), ("B", "prefill", 30, 1)],
              [("A", "decode", 1, 0), ("B", "decode", 1, 1)],
              [("B", "decode", 1, 1), ("C", "prefill", 7, 0)],
              [("B", "decode", 1, 1), ("C", "decode", 1, 0)],
              [("D", "prefill", 50, 2)]]
    trace, t = [], 0.0
    for i, members in enumerate(shapes, start=1):
        forward = 1e-3 + 1e-5 * sum(m[2] for m in members)
        trace.append(step(i, members, t, t + 3 * forward, t_forward=forward))
        t += 3 * forward
    whole = fit_cost_model(trace, target="duration", use=("a", "b", "c"))
    model = fit_cost_model(trace, target="forward", use=("a", "b", "c"))
    assert whole.fit["total_s"] == pytest.approx(t)
    assert model.fit["total_s"] == pytest.approx(t / 3)
    assert np.allclose(whole.coefficients, 3 * model.coefficients, rtol=1e-6, atol=1e-12)


def test_measure_swap_cost_is_the_median_time_per_page_copied():
    """measure_swap_cost is the median over repeats of the seconds per page copied (each page
    out and back)."""
    ticks = itertools.accumulate([0.0, 1.0, 0.0, 9.0, 0.0, 2.0])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sim.time, "perf_counter", lambda: next(ticks))
        assert sim.measure_swap_cost(1, 1, 2, page_size=2, num_pages=4, repeats=3) == 0.25


def test_cost_models_carry_s_in_their_dict_and_the_h100_preset_charges_swaps():
    """A cost model's dict explains s, and the h100-like preset charges swaps."""
    data = CostModel(a=1.0, s=3e-5).to_dict()
    assert data["s"] == 3e-5 and "host memory" in data["meaning"]["s"]
    assert "s*pages_swapped" in data["formula"]
    assert CostModel.from_dict(data).s == 3e-5
    assert sim.PRESETS["h100-like"].s > 0


def test_a_missing_cpu_cost_model_says_where_cpu_reads_it(tmp_path, monkeypatch):
    """--cost-model cpu without its fitted file names the file it reads and the command that
    writes it (`minicb profile`)."""
    missing = tmp_path / "bench" / "cost_model_cpu.json"
    monkeypatch.setattr(sim, "DEFAULT_CPU_COST_MODEL", missing)
    with pytest.raises(ValueError, match=r"cost model 'cpu' reads .*cost_model_cpu\.json.*"
                                         r"no such file.*minicb profile"):
        sim.CostModel.load("cpu")


def test_an_unreadable_cost_model_names_its_path(tmp_path, monkeypatch):
    """A cost model file that exists but cannot be read (permissions) is one line naming it and
    why, not an OSError traceback."""
    import pathlib
    cost = tmp_path / "cm.json"
    cost.write_text('{"a": 0.01}')

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(pathlib.Path, "read_text", denied)
    with pytest.raises(ValueError, match=r"cm\.json': cannot read it \(Permission denied\)"):
        CostModel.load(str(cost))
