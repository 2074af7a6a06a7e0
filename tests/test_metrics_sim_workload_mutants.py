"""Planted-bug tests from a mutation review of metrics.py, sim.py and workload.py (percentiles,
per-request latencies, SLOs, the long-prefill pair, the cost-model fit, arrival processes,
length distributions, trace files and the feeder): each test fails on the bug its docstring
names and passes on the real code."""

from __future__ import annotations

import numpy as np
import pytest
from test_metrics import rec, step

from minicb.benchmark import metrics
from minicb.benchmark.sim import CostModel, fit_cost_model, make_sim_engine
from minicb.benchmark.workload import (
    Lengths,
    Workload,
    WorkloadRequest,
    arrival_times,
    gamma_gaps,
    load_workload_file,
    make_workload,
    poisson_gaps,
    run_workload,
)

TRUE = CostModel(a=2e-3, b=3e-5, c=1e-4, d=2e-7, e=1e-9, name="true")


# ------------------------------------------------------------------------------ metrics
def test_tokens_delivered_together_make_one_gap():
    """Bug: itls keeps the zero gaps between tokens stamped with the same time (guesses kept in
    one step), so a speculative run's ITL p50 drops towards 0."""
    r = rec("A", 5, first=1.0, finish=3.0, times=[1.0, 2.0, 2.0, 2.0, 3.0])
    assert metrics.itls(r) == [1.0, 1.0]
    assert metrics.summarize([], [r])["itl_s"]["p50"] == 1.0


def test_a_request_that_did_not_complete_never_meets_the_slo():
    """Bug: meets_slo forgets that only a completed request can meet an SLO, so a cancelled or
    failed request with fast tokens counts as met (check.py counts meets_slo over every
    record)."""
    fast = dict(arrival=0.0, sched=0.0, first=0.1, finish=0.2, times=[0.1, 0.2])
    slo = {"ttft": 1.0, "e2e": 1.0}
    assert metrics.meets_slo(rec("ok", 2, **fast), slo)
    for reason in ("cancelled", "error", "deadline", None):
        assert not metrics.meets_slo(rec("x", 2, reason=reason, **fast), slo)
        assert not metrics.meets_slo(rec("x", 2, reason=reason, **fast), None)


# ------------------------------------------------------------------------------ sim
def _sim_run():
    engine = make_sim_engine(TRUE, policy="pd", max_num_seqs=6, max_num_batched_tokens=96,
                             chunk_size=64)
    run_workload(engine, make_workload(24, prompt_lengths="uniform:4:200",
                                       output_lengths="uniform:1:40", seed=9))
    return engine


def test_a_fit_that_skips_warm_up_steps_keeps_each_step_with_its_own_features():
    """Bug: fit_cost_model drops the first `skip` step durations but not their feature rows,
    so every duration is paired with an earlier step's shape and the fit is off."""
    engine = _sim_run()
    fit = fit_cost_model(engine.trace, engine.request_records(), target="forward", skip=3)
    assert np.allclose(fit.coefficients, TRUE.coefficients, rtol=1e-5, atol=1e-12)
    assert fit.fit["r2"] == pytest.approx(1.0)


def test_the_fit_target_picks_whole_step_time_or_forward_time():
    """Bug: target='duration' fits t_forward and target='forward' fits the whole step (they are
    equal on the simulated executor, so only steps with host time tell them apart)."""
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


# ------------------------------------------------------------------------------ workload
def test_poisson_gaps_have_mean_one_over_the_rate():
    """Bug: poisson_gaps passes 1/rate as the rate, so gaps average `rate` seconds."""
    gaps = poisson_gaps(20_000, 8.0, np.random.default_rng(3))
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.05)
    assert np.array_equal(gaps, gamma_gaps(20_000, 8.0, 1.0, np.random.default_rng(3)))


def test_poisson_arrivals_ignore_burstiness():
    """Bug: arrival_times gives a Poisson process the caller's burstiness (gamma gaps), though
    the declaration says Poisson and burstiness 1.0."""
    plain = arrival_times(200, "poisson", rate=4.0, rng=np.random.default_rng(1))
    bursty = arrival_times(200, "poisson", rate=4.0, burstiness=0.25,
                           rng=np.random.default_rng(1))
    assert plain == bursty
    w = make_workload(50, prompt_lengths=4, output_lengths=2, arrival="poisson", rate=4.0,
                      burstiness=0.25, seed=2)
    assert [r.arrival_time for r in w.requests] == arrival_times(
        50, "poisson", rate=4.0, rng=np.random.default_rng([2, 2]))  # arrivals: own stream
    assert w.declaration["burstiness"] == 1.0


def test_lognormal_lengths_round_to_the_nearest_token():
    """Bug: Lengths.sample truncates a lognormal draw instead of rounding it (a median of 10.7
    draws 10, not 11; every length biased half a token down)."""
    assert Lengths.lognormal(10.7, 0.0).sample(3, np.random.default_rng(0)) == [11, 11, 11]
    assert Lengths.lognormal(10.2, 0.0).sample(2, np.random.default_rng(0)) == [10, 10]
    assert Lengths.parse("lognormal:0.2:0:3:9").sample(2, np.random.default_rng(0)) == [3, 3]
    assert Lengths.parse("lognormal:50:0:3:9").sample(2, np.random.default_rng(0)) == [9, 9]


def test_the_cancelled_requests_follow_the_seed():
    """Bug: the cancel draw ignores the workload's seed, so every seed cancels the same
    requests (the same seed must still cancel the same ones)."""
    def cancelled(seed):
        w = make_workload(40, prompt_lengths=4, output_lengths=2, seed=seed,
                          cancel_fraction=0.5, cancel_after_tokens=1)
        return {i for i, r in enumerate(w.requests) if r.cancel_after_tokens is not None}
    assert len(cancelled(0)) == 20 and cancelled(3) == cancelled(3)
    assert len({frozenset(cancelled(seed)) for seed in range(4)}) == 4


def test_num_requests_keeps_the_earliest_arrivals_of_an_unsorted_trace(tmp_path):
    """Bug: load_workload_file keeps the first `num_requests` lines of the file, not the first
    `num_requests` arrivals, when the file is not sorted by arrival."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(f'{{"arrival_s": {t}, "prompt_tokens": 4, "output_tokens": 2}}\n'
                            for t in (3.0, 1.0, 2.0, 0.5)))
    w = load_workload_file(path, num_requests=2)
    assert [r.arrival_time for r in w.requests] == [0.5, 1.0]
    assert [r.request_id for r in w.requests] == ["req-3", "req-1"]  # named by file line


def test_a_request_arriving_exactly_at_the_clock_joins_the_next_step():
    """Bug: the feeder holds a request whose arrival time equals the engine clock (`<` for
    `<=`), so it queues one step longer than it arrived: B, arriving at 2.0 s, must run in the
    step that starts at 2.0 s."""
    engine = make_sim_engine(CostModel(a=1.0), policy="continuous", max_num_seqs=4)
    run_workload(engine, Workload("t", [
        WorkloadRequest(prompt_len=4, max_tokens=6, arrival_time=0.0, request_id="A"),
        WorkloadRequest(prompt_len=4, max_tokens=2, arrival_time=2.0, request_id="B")]))
    b = {r.request_id: r for r in engine.request_records()}["B"]
    assert (b.first_scheduled_step, b.first_scheduled_time, b.first_token_time) == (3, 2.0, 3.0)
    assert metrics.queue_time(b) == 0.0
