"""workload.py: reproducibility, arrival statistics, length distributions, scenarios, argument
checks, driving an engine (exact lengths, cancellation, online arrivals), and trace files
(saved, replayed, and refused naming the line)."""

from __future__ import annotations

import csv
import json
import time

import numpy as np
import pytest

from minicb.benchmark import metrics
from minicb.benchmark.sim import CostModel, SimClock, SimModel, make_sim_engine, sim_model_info
from minicb.benchmark.workload import (
    Lengths,
    Workload,
    WorkloadRequest,
    arrival_times,
    gamma_gaps,
    get_workload,
    load_workload_file,
    make_workload,
    poisson_gaps,
    replay_flags,
    run_workload,
    save_workload_file,
    submit,
)
from minicb.engine import Engine


# --------------------------------------------------------------------------- reproducibility
@pytest.mark.parametrize("name", ["mixed-chat", "equal-lengths", "low-rate", "shared-prefix",
                                  "seed-r1-r4", "long-prefill"])
def test_same_seed_same_workload(name):
    """Every named workload is the same for the same seed, and the random ones change with the
    seed."""
    a, b = get_workload(name, seed=3), get_workload(name, seed=3)
    assert a.to_dict() == b.to_dict()
    if name in ("mixed-chat", "low-rate", "shared-prefix"):
        assert get_workload(name, seed=4).to_dict() != a.to_dict()


def test_the_same_seed_draws_the_same_requests_whatever_their_arrivals():
    """Comparing arrival processes (chapter 06's burstiness table, `bench --burstiness`) must
    compare the same requests: only their arrival times may differ. Gamma draws a different
    amount of randomness for each shape, all-at-once none, so arrivals have their own stream."""
    def requests(**arrival):
        w = get_workload("mixed-chat", num_requests=50, seed=3, **arrival)
        return [(r.prompt_token_ids, r.max_tokens) for r in w.requests], \
            [r.arrival_time for r in w.requests]

    same, at_once = requests()
    for arrival in (dict(rate=1.0), dict(rate=4.0), dict(rate=4.0, burstiness=0.25),
                    dict(rate=4.0, burstiness=4.0)):
        drawn, times = requests(**arrival)
        assert drawn == same, arrival
        assert times != at_once
    assert requests(rate=4.0, burstiness=0.25)[1] != requests(rate=4.0, burstiness=4.0)[1]


# --------------------------------------------------------------------------- arrivals
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_mean_and_burstiness(burstiness):
    """Gamma inter-arrival gaps average 1/rate and have a squared coefficient of variation of
    1/burstiness."""
    rate = 5.0
    gaps = gamma_gaps(40_000, rate, burstiness, np.random.default_rng(7))
    mean = gaps.mean()
    cv2 = gaps.var() / mean**2
    assert mean == pytest.approx(1 / rate, rel=0.03)
    assert cv2 == pytest.approx(1 / burstiness, rel=0.08)  # CV^2 = 1/shape


def test_poisson_arrivals_through_make_workload():
    """Poisson arrivals start at 0, never go back, average 1/rate apart, and are declared with their
    rate."""
    w = make_workload(4000, prompt_lengths=4, output_lengths=2, arrival="poisson", rate=10.0,
                      seed=1)
    t = np.array([r.arrival_time for r in w.requests])
    assert t[0] == 0.0 and (np.diff(t) >= 0).all()
    assert np.diff(t).mean() == pytest.approx(0.1, rel=0.05)
    assert w.declaration["arrival_process"] == "poisson" and w.declaration["rate_rps"] == 10.0


def test_bursty_workload_declares_gamma():
    """A workload given a burstiness declares gamma arrivals and that burstiness."""
    w = get_workload("mixed-chat", num_requests=8, rate=2.0, burstiness=0.5)
    assert w.declaration["arrival_process"].startswith("gamma")
    assert w.declaration["burstiness"] == 0.5


def test_explicit_arrivals():
    """Given arrival times are kept as they are, no process means all at 0, and step arrivals set
    arrival steps and no arrival times."""
    assert arrival_times(3, "times", times=[0.0, 0.5, 0.5]) == [0.0, 0.5, 0.5]
    assert arrival_times(2) == [0.0, 0.0]
    w = make_workload(3, prompt_lengths=4, output_lengths=2, arrival="steps",
                      arrival_steps=[1, 4, 9])
    assert [r.arrival_step for r in w.requests] == [1, 4, 9]
    assert all(r.arrival_time is None for r in w.requests)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=3, process="poisson"), "rate"),
    (dict(n=3, process="gamma", rate=-1.0), "rate"),
    (dict(n=3, process="gamma", rate=1.0, burstiness=0.0), "burstiness"),
    (dict(n=3, process="fifo"), "arrival process"),
    (dict(n=2, process="times", times=[0.0]), "times"),
    (dict(n=2, process="times", times=[1.0, 0.5]), "non-decreasing"),
    (dict(n=-1), "num_requests"),
])
def test_arrival_arguments_are_checked(kwargs, match):
    """A missing or negative rate, a non-positive burstiness, an unknown process, too few or
    decreasing times and a negative count are refused, naming the argument."""
    n = kwargs.pop("n")
    with pytest.raises(ValueError, match=match):
        arrival_times(n, **kwargs)


# --------------------------------------------------------------------------- lengths
def test_length_distributions():
    """Fixed, uniform, bounded lognormal and list lengths sample within their bounds (the lognormal
    around its median), and describe themselves."""
    rng = np.random.default_rng(0)
    assert Lengths.parse("128").sample(3, rng) == [128, 128, 128]
    u = Lengths.parse("uniform:16:512").sample(2000, rng)
    assert min(u) >= 16 and max(u) <= 512 and min(u) < 40 and max(u) > 480
    ln = Lengths.parse("lognormal:100:1.0:8:300").sample(4000, rng)
    assert min(ln) >= 8 and max(ln) <= 300
    assert np.median(ln) == pytest.approx(100, rel=0.1)
    assert set(Lengths.parse("list:8,32,200").sample(500, rng)) == {8, 32, 200}
    assert Lengths.fixed(5).describe() == {"kind": "fixed", "value": 5}


@pytest.mark.parametrize("text, match", [
    ("uniform:9:3", "lengths.high"), ("fixed:0", "lengths.value"), ("list:", "lengths.values"),
    ("gauss:3:4", "cannot read"), ("lognormal:-1:1", "lengths.median"), ("abc", "cannot read"),
])
def test_bad_lengths_are_refused(text, match):
    """A length spec with bounds reversed, a zero value, an empty list, an unknown kind, a negative
    median or no sense at all is refused, naming the problem."""
    with pytest.raises(ValueError, match=match):
        Lengths.parse(text)


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "prompt_token_ids or prompt_len"),
    (dict(prompt_len=0), "prompt_len"),
    (dict(prompt_len=4, max_tokens=0), "max_tokens"),
    (dict(prompt_len=4, arrival_time=-1.0), "arrival_time"),
    (dict(prompt_len=4, arrival_step=0), "arrival_step"),
    (dict(prompt_len=4, arrival_step=2, arrival_time=1.0), "not both"),
    (dict(prompt_token_ids=[]), "non-empty"),
    (dict(prompt_token_ids=[1, 2], prompt_len=3), "disagrees"),
    (dict(prompt_len=4, cancel_after_tokens=0), "cancel_after_tokens"),
])
def test_workload_request_checks(kwargs, match):
    """A workload request without a prompt, with a non-positive length, max_tokens or cancel point,
    a negative time, step 0, both a time and a step, an empty prompt or a length that disagrees
    with its ids is refused."""
    with pytest.raises(ValueError, match=match):
        WorkloadRequest(**kwargs)


@pytest.mark.parametrize("call, match", [
    (lambda: get_workload("nope"), "workload must be one of"),
    (lambda: make_workload(0), "num_requests"),
    (lambda: make_workload(2, arrival="later"), "arrival must be one of"),
    (lambda: make_workload(2, seed=-1), "seed"),
    (lambda: make_workload(2, cancel_fraction=2.0), "cancel_fraction"),
    (lambda: get_workload("mixed-chat", burstiness=0.5), "burstiness needs a rate"),
    (lambda: get_workload("long-prefill", long_prompt_len=0), "long_prompt_len"),
])
def test_generator_arguments_are_checked(call, match):
    """An unknown workload, no requests, an unknown arrival kind, a negative seed, a cancel fraction
    above 1, burstiness without a rate and a zero long prompt are refused, naming the argument."""
    with pytest.raises(ValueError, match=match):
        call()


def test_length_only_request_is_reproducible():
    """A request given only a length draws the same token ids for the same seed, other ids for
    another, all in 100..9999."""
    r = WorkloadRequest(prompt_len=12, max_tokens=3)
    assert r.token_ids(5) == r.token_ids(5) != r.token_ids(6)
    assert all(100 <= t < 10000 for t in r.token_ids(5))


# --------------------------------------------------------------------------- scenarios
def test_scenarios_shapes():
    """Each named workload has its declared shape: seed-r1-r4's lengths and late R4, long-prefill's
    one late long prompt, mixed-chat's and equal-lengths' lengths, low-rate's Poisson arrivals,
    shared-prefix's common head; all with token ids in 100..9999 and exact output lengths."""
    r = get_workload("seed-r1-r4")
    assert [q.max_tokens for q in r.requests][:3] == [30, 200, 80]
    assert r.requests[3].request_id == "R4" and r.requests[3].arrival_step == 31
    assert r.recommended == {"max_num_seqs": 3}
    lp = get_workload("long-prefill", long_prompt_len=300)
    assert lp.long_request_id == "long" and lp.requests[-1].prompt_len == 300
    assert lp.requests[-1].arrival_step > 1 and all(q.arrival_step == 1 for q in lp.requests[:-1])
    assert get_workload("long-prefill").requests[-1].prompt_len == 2000
    mc = get_workload("mixed-chat")
    assert len(mc) == 32 and all(q.arrival_time == 0.0 for q in mc.requests)
    assert all(16 <= q.prompt_len <= 512 and 8 <= q.max_tokens <= 256 for q in mc.requests)
    eq = get_workload("equal-lengths")
    assert {(q.prompt_len, q.max_tokens) for q in eq.requests} == {(128, 128)}
    lr = get_workload("low-rate")
    assert lr.declaration["arrival_process"] == "poisson" and lr.declaration["rate_rps"] > 0
    sp = get_workload("shared-prefix", prefix_len=64)
    heads = {tuple(q.prompt_token_ids[:64]) for q in sp.requests}
    assert len(heads) == 1 and len({tuple(q.prompt_token_ids) for q in sp.requests}) == len(sp)
    for w in (r, lp, mc, eq, lr, sp):
        assert all(100 <= t < 10000 for q in w.requests for t in q.token_ids())
        assert w.declaration["output_lengths_exact"] is True


# --------------------------------------------------------------------------- driving an engine
def test_submit_gives_exact_lengths_and_step_arrivals():
    """submit adds the workload's requests under their ids, each makes exactly its output length,
    and R4 arrives and is scheduled at step 31."""
    w = get_workload("seed-r1-r4")
    engine = make_sim_engine("h100-like", policy="continuous", max_num_seqs=3)
    ids = submit(engine, w)
    assert ids == ["R1", "R2", "R3", "R4"]
    engine.run()
    recs = {r.request_id: r for r in metrics.request_records(engine)}
    assert [recs[i].num_output_tokens for i in ids] == [30, 200, 80, 60]  # R4: the course's
    assert recs["R4"].arrival_step == 31 and recs["R4"].first_scheduled_step == 31
    assert recs["R1"].finish_step == 30


def test_seed_example_static_has_dead_slots_and_blocks_r4():
    """Under static batching the seed example's R4 waits until step 201 for the whole batch, and
    R1's and R3's idle slots add up to 290 dead slot steps."""
    w = get_workload("seed-r1-r4")
    engine = make_sim_engine("h100-like", policy="static", max_num_seqs=3)
    run_workload(engine, w)
    recs = {r.request_id: r for r in metrics.request_records(engine)}
    assert recs["R4"].first_scheduled_step == 201  # waits for the whole batch (200 steps)
    # R1 idles steps 31..200 (170), R3 idles 81..200 (120)
    assert metrics.dead_slot_steps(engine.trace) == 170 + 120


def test_cancel_after_tokens_is_counted():
    """Requests marked to cancel after 2 tokens finish cancelled with 2 tokens, the rest complete,
    and no page is left in use."""
    w = make_workload(6, prompt_lengths=8, output_lengths=10, cancel_fraction=0.5,
                      cancel_after_tokens=2, seed=2)
    engine = make_sim_engine("h100-like", policy="pd")
    run_workload(engine, w)
    s = metrics.summarize(engine.trace, metrics.request_records(engine))
    assert s["cancelled"] == 3 and s["completed"] == 3
    cancelled = [r for r in metrics.request_records(engine) if r.finish_reason == "cancelled"]
    assert all(r.num_output_tokens == 2 for r in cancelled)
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("upfront", [False, True])
def test_online_arrivals_follow_the_wall_clock(upfront):
    """Requests with arrival times enter when real time comes: the engine runs on the real
    clock (the stand-in model computes nothing and costs nothing)."""
    gaps = [0.0, 0.04, 0.08, 0.12]
    w = make_workload(4, prompt_lengths=6, output_lengths=3, arrival="times",
                      arrival_times_s=gaps)
    info = sim_model_info()
    engine = Engine((SimModel(CostModel(), SimClock(), info.config.vocab_size), info),
                    policy="pd", attention_backend="torch")
    t0 = time.perf_counter()
    run_workload(engine, w, upfront=upfront)
    assert time.perf_counter() - t0 >= 0.12
    recs = sorted(metrics.request_records(engine), key=lambda r: r.arrival_time)
    assert [r.arrival_time for r in recs] == gaps
    for r in recs:
        assert r.first_scheduled_time >= r.arrival_time
        assert r.first_scheduled_time - r.arrival_time < 0.05  # idle engine: served at once
    assert engine.trace[-1].t_end >= 0.12


def test_workload_object_basics():
    """A workload has a length, iterates its requests, and gives each request without an id one from
    its index."""
    w = Workload("x", [WorkloadRequest(prompt_len=3), WorkloadRequest(prompt_len=2,
                                                                      request_id="b")])
    assert len(w) == 2 and w.ids() == ["req-0", "b"] and list(w)[1].request_id == "b"


def test_step_arrivals_never_have_negative_queue_time():
    """A request arriving at step s is stamped before step s starts being scheduled."""
    info = sim_model_info()
    engine = Engine((SimModel(CostModel(), SimClock(), info.config.vocab_size), info),
                    policy="continuous", max_num_seqs=3, attention_backend="torch")
    run_workload(engine, get_workload("seed-r1-r4"))
    for r in metrics.request_records(engine):
        assert metrics.queue_time(r) >= 0.0 and metrics.ttft(r) >= 0.0


def test_requests_arriving_together_on_an_idle_engine_start_together():
    """Arrivals at 0, 10, 10, 10: the engine is idle at 10, and the three tied requests join
    the same first step (fed one at a time, two of them queued a step behind the first)."""
    w = make_workload(4, prompt_lengths=8, output_lengths=2, arrival="times",
                      arrival_times_s=[0.0, 10.0, 10.0, 10.0])
    engine = make_sim_engine("h100-like", policy="continuous")
    run_workload(engine, w)
    late = [r for r in metrics.request_records(engine) if r.arrival_time == 10.0]
    assert len({r.first_scheduled_step for r in late}) == 1
    assert all(metrics.queue_time(r) == 0.0 for r in late)


def test_declaration_says_what_was_drawn():
    """Poisson gaps are exponential whatever `burstiness` says, so it declares 1.0; gamma names
    its shape; cancellations declare their threshold and draw from their own stream, so the
    same seed gives the same prompts with or without them."""
    poisson = make_workload(4, prompt_lengths=4, output_lengths=2, arrival="poisson",
                            rate=2.0, burstiness=0.25)
    assert (poisson.declaration["arrival_process"], poisson.declaration["burstiness"]) \
        == ("poisson", 1.0)
    gamma = make_workload(4, prompt_lengths=4, output_lengths=2, arrival="gamma", rate=2.0,
                          burstiness=1.0)
    assert gamma.declaration["arrival_process"] == "gamma (shape=1.0)"
    plain = make_workload(8, prompt_lengths="uniform:4:20", output_lengths=3, seed=5)
    cancelling = make_workload(8, prompt_lengths="uniform:4:20", output_lengths=3, seed=5,
                               cancel_fraction=0.5, cancel_after_tokens=2)
    assert [r.prompt_token_ids for r in plain] == [r.prompt_token_ids for r in cancelling]
    assert sum(r.cancel_after_tokens is not None for r in cancelling) == 4
    assert cancelling.declaration["cancel_after_tokens"] == 2
    assert plain.declaration["cancel_after_tokens"] is None


def test_dynamic_batching_waiting_on_the_clock_takes_no_steps():
    """A lone request under dynamic batching in seconds waits 0.05 s for company: that wait is
    time, not steps (not 50 one-millisecond empty steps counted in its TTFT)."""
    w = make_workload(2, prompt_lengths=8, output_lengths=4, arrival="times",
                      arrival_times_s=[0.0, 5.0])
    engine = make_sim_engine("h100-like", policy="dynamic", batch_timeout=0.05,
                             batch_timeout_in_seconds=True)
    run_workload(engine, w)
    # per request: the step it arrived in, then a prefill and 3 decodes; the wait is no step
    assert len(engine.trace) == 2 * (1 + 4)
    for row in metrics.per_request(metrics.request_records(engine)):
        assert row["queue_s"] == pytest.approx(0.05, abs=0.002)
        # returned whole: TTFT is E2E; the step it arrived in counts (it waited through that
        # step), the 0.05 s after it does not
        assert row["e2e_steps"] == row["ttft_steps"] == 5
        assert row["arrival_step"] in (1, 6)


# --------------------------------------------------------------------------- generators
def test_uniform_lengths_include_both_ends():
    """Uniform lengths include both bounds, and equal bounds give that one length."""
    rng = np.random.default_rng(0)
    assert set(Lengths.uniform(3, 5).sample(500, rng)) == {3, 4, 5}
    assert Lengths.parse("uniform:7:7").sample(3, rng) == [7, 7, 7]


def test_shared_prefix_is_the_same_for_every_seed():
    """The shared prefix is the same for every seed while the rest of the prompt changes, and the
    declared lengths count what follows the prefix."""
    from minicb.benchmark.workload import shared_prefix
    a, b = shared_prefix(4, seed=0, prefix_len=32), shared_prefix(4, seed=1, prefix_len=32)
    assert a.requests[0].prompt_token_ids[:32] == b.requests[3].prompt_token_ids[:32]
    assert a.requests[0].prompt_token_ids[32:] != b.requests[0].prompt_token_ids[32:]
    drawn = a.declaration["prompt_lengths"]  # the declared lengths say the prefix comes first
    assert drawn["after_shared_prefix"] == 32
    assert all(drawn["low"] + 32 <= r.prompt_len <= drawn["high"] + 32 for r in a.requests)
    assert "after_shared_prefix" not in make_workload(2).declaration["prompt_lengths"]


def test_sampled_runs_seed_each_request_by_its_index():
    """With a temperature, submit seeds each request with its index in the workload."""
    engine = make_sim_engine("h100-like")
    ids = submit(engine, make_workload(3, "fixed:8", "fixed:4"), temperature=0.7)
    assert [engine.requests[i].params.seed for i in ids] == [0, 1, 2]


def test_online_step_arrivals_join_at_their_step_while_the_engine_is_busy():
    """A request arriving at a step while others run is recorded as arriving at that step and is
    prefilled in it beside their decodes (R4 at 31), never before."""
    engine = make_sim_engine("h100-like", policy="continuous", max_num_seqs=3)
    run_workload(engine, get_workload("seed-r1-r4"))  # fed online: R4 comes at step 31
    r4 = {r.request_id: r for r in metrics.request_records(engine)}["R4"]
    assert r4.arrival_step == 31
    step_31 = next(rec for rec in engine.trace if rec.step == 31)
    kinds = {m.request_id: m.kind for m in step_31.members}
    assert kinds.pop("R4") == "prefill" and set(kinds.values()) == {"decode"}  # joins the busy step
    assert not any(m.request_id == "R4" for rec in engine.trace if rec.step < 31
                   for m in rec.members)


def test_cancel_fraction_rounds_to_the_nearest_count():
    """The cancel fraction is rounded to the nearest number of requests (0.3 of 5 marks 2)."""
    w = make_workload(5, "fixed:8", "fixed:4", cancel_fraction=0.3)  # 1.5 -> 2
    assert sum(r.cancel_after_tokens is not None for r in w.requests) == 2


# --------------------------------------------------------------------------- replayed traces
FIELDS = ("request_id", "arrival_time", "arrival_step", "max_tokens", "priority", "tenant",
          "deadline", "cancel_after_tokens")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_saved_workload_replays_the_same_requests(tmp_path, suffix):
    """A workload saved as JSONL or CSV loads back with the same token ids and fields, declared as a
    replayed trace with its source, priorities, length range and rate."""
    w = get_workload("mixed-chat", num_requests=6, rate=3.0, seed=2)
    w.requests[1].priority, w.requests[2].tenant = 2, "team-a"
    w.requests[3].deadline, w.requests[4].cancel_after_tokens = 1.5, 2
    back = load_workload_file(save_workload_file(w, tmp_path / f"trace{suffix}"))
    assert [r.token_ids(i) for i, r in enumerate(back)] == [r.token_ids(i) for i, r in
                                                             enumerate(w)]
    assert [[getattr(r, f) for f in FIELDS] for r in back] == \
        [[getattr(r, f) for f in FIELDS] for r in w]
    decl = back.declaration
    assert decl["arrival_process"] == "replayed trace" and decl["num_requests"] == 6
    assert decl["source"].startswith("replayed from") and decl["priorities"] == [0, 2]
    lengths = [r.prompt_len for r in w]
    assert (decl["prompt_lengths"]["min"], decl["prompt_lengths"]["max"]) == \
        (min(lengths), max(lengths))
    times = [r.arrival_time for r in w]
    assert decl["rate_rps"] == pytest.approx(5 / (max(times) - min(times)))


def test_step_arrivals_round_trip(tmp_path):
    """A workload with step arrivals saves and loads back with the same ids, arrival steps and
    lengths."""
    w = get_workload("seed-r1-r4")
    back = load_workload_file(save_workload_file(w, tmp_path / "r.jsonl"))
    assert [(r.request_id, r.arrival_step, r.max_tokens) for r in back] == \
        [(r.request_id, r.arrival_step, r.max_tokens) for r in w]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_trace_keeps_the_long_request_dec_at_p_is_measured_around(tmp_path, suffix):
    """long-prefill's long prompt is marked long_prefill in the trace and is the replay's
    long_request_id (dec@P and short_P need it); cut off by num_requests, there is none. The
    recommended options are not in the trace: replay_flags gives them."""
    w = get_workload("long-prefill", num_short=3, long_prompt_len=40)
    path = save_workload_file(w, tmp_path / f"lp{suffix}")
    back = load_workload_file(path)
    assert w.long_request_id == "long" and back.long_request_id == "long"
    assert back.declaration["long_request_id"] == "long"
    assert load_workload_file(path, num_requests=3).long_request_id is None
    assert replay_flags(w) == "--max-num-seqs 4" and replay_flags(back) == ""
    mixed = get_workload("mixed-chat", num_requests=3)
    assert "long_prefill" not in save_workload_file(mixed, tmp_path / "m.jsonl").read_text()
    assert load_workload_file(tmp_path / "m.jsonl").long_request_id is None


def test_a_trace_marks_at_most_one_long_request(tmp_path):
    """A trace marks at most one long-prefill request, and long_prefill must be true or false, with
    the line named."""
    path = tmp_path / "two.jsonl"
    row = '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4, "long_prefill": %s}\n'
    path.write_text(row % "true" + row % "true")
    with pytest.raises(ValueError, match="long_prefill is true on 2 requests"):
        load_workload_file(path)
    path.write_text(row % "false" + row % "true")
    assert load_workload_file(path).long_request_id == "req-1"
    path.write_text(row % '"yes"')
    with pytest.raises(ValueError, match="line 1: long_prefill must be true or false"):
        load_workload_file(path)


def test_a_trace_with_lengths_only_is_sorted_by_arrival_and_says_so(tmp_path):
    """A trace of lengths only is sorted by arrival, keeps ids from its file order, says it was
    sorted, draws prompts of the given length, and num_requests takes the first requests."""
    path = tmp_path / "real.jsonl"
    path.write_text('{"arrival_s": 0.5, "prompt_tokens": 12, "output_tokens": 3}\n\n'
                    '{"arrival_s": 0.0, "prompt_tokens": 40, "output_tokens": 9, '
                    '"priority": -1}\n')
    w = load_workload_file(path)
    assert [r.arrival_time for r in w] == [0.0, 0.5] and [r.request_id for r in w] == \
        ["req-1", "req-0"]  # ids follow the file's order
    assert w.declaration["arrival_process"].endswith("(sorted by arrival: the file was not)")
    assert w.requests[0].prompt_len == 40 and len(w.requests[0].token_ids(1)) == 40
    assert len(load_workload_file(path, num_requests=1)) == 1


@pytest.mark.parametrize("line, match", [
    ('{"arrival_s": 0, "output_tokens": 4}', "line 2: give prompt_tokens or prompt_token_ids"),
    ('{"arrival_s": 0, "prompt_tokens": -3, "output_tokens": 4}', "line 2: prompt_tokens"),
    ('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4, "prio": 1}',
     r"line 2: unknown field\(s\) \['prio'\]"),
    ('{"arrival_s": -1, "prompt_tokens": 3, "output_tokens": 4}', "line 2: arrival_s"),
    ('{"prompt_tokens": 3, "output_tokens": 4}', "give arrival_s or arrival_step"),
    ('{"arrival_s": 0, "prompt_tokens": 3}', "line 2: give output_tokens"),
    ('{"arrival_s": 0, "prompt_token_ids": [1, "a"], "output_tokens": 4}',
     r"prompt_token_ids\[1\]"),
    ('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4, "priority": 1.5}', "priority"),
    ('{"arrival_step": 2, "prompt_tokens": 3, "output_tokens": 4}', "every request arrival_s"),
    ("[1, 2]", "line 2: each line must be a JSON object"),
    ("{oops", "line 2: not JSON"),
    pytest.param('{"arrival_s": 0, "prompt_tokens": 1' + "0" * 5000 + "}",
                 "line 2: not JSON .*4300 digits", id="an-integer-of-5001-digits"),
])
def test_bad_trace_lines_are_named(tmp_path, line, match):
    """A bad trace line (missing or negative field, unknown field, bad token id, fractional
    priority, mixed times and steps, not an object, not JSON) is refused with its line number and
    the problem."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        load_workload_file(path)


def test_bad_csv_cells_are_named(tmp_path):
    """A non-numeric CSV cell is refused with its line and column, and a missing file says so."""
    path = tmp_path / "bad.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0,12,3\n0.5,twelve,3\n")
    with pytest.raises(ValueError, match="line 3: prompt_tokens must be a number"):
        load_workload_file(path)
    with pytest.raises(ValueError, match="no such file"):
        load_workload_file(tmp_path / "missing.jsonl")


def test_trace_with_a_byte_order_mark_loads(tmp_path):
    """Excel saves CSV with a UTF-8 byte-order mark; it is not part of the first field name."""
    csv_path, jsonl_path = tmp_path / "bom.csv", tmp_path / "bom.jsonl"
    csv_path.write_bytes(b"\xef\xbb\xbfarrival_s,prompt_tokens,output_tokens\n0,12,3\n0.5,8,2\n")
    jsonl_path.write_bytes(b'\xef\xbb\xbf{"arrival_s": 0, "prompt_tokens": 12, '
                           b'"output_tokens": 3}\n')
    assert [r.prompt_len for r in load_workload_file(csv_path).requests] == [12, 8]
    assert load_workload_file(jsonl_path).requests[0].max_tokens == 3


@pytest.mark.parametrize("name, data, match", [
    ("latin.csv", b"arrival_s,prompt_tokens,output_tokens\n0,12,3\n\xe90,1,1\n",
     r"latin\.csv: not UTF-8 text"),
    ("utf16.jsonl", '{"arrival_s": 0}\n'.encode("utf-16"), r"utf16\.jsonl: not UTF-8 text"),
    ("epoch.jsonl", b'{"arrival_s": 1764000000.0, "prompt_tokens": 3, "output_tokens": 4}\n'
                    b'{"arrival_s": 1764000001.5, "prompt_tokens": 3, "output_tokens": 4}\n',
     r"epoch\.jsonl: the first arrival_s is 1764000000\.0.*subtract the first timestamp"),
    ("trace.txt", b"arrival_s,prompt_tokens,output_tokens\n0,12,3\n",
     r"trace\.txt, line 1: not JSON .*must end in \.csv"),
], ids=["latin-1", "utf-16", "epoch-seconds", "csv-not-named-csv"])
def test_unreadable_traces_name_the_file(tmp_path, name, data, match):
    """A trace that is not UTF-8, uses epoch seconds, or is CSV without a .csv name is refused with
    the file's name and what to do."""
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match):
        load_workload_file(path)


def test_trace_path_that_is_a_directory_says_so(tmp_path):
    """A directory given as a trace is refused as a directory."""
    with pytest.raises(ValueError, match="is a directory, not a trace file"):
        load_workload_file(tmp_path)


def test_csv_trace_with_a_long_prompt_cell_round_trips(tmp_path):
    """A CSV trace with a prompt cell longer than the csv module's default field limit saves and
    loads back whole."""
    ids = [12345] * 30_000  # over the csv module's default 131072 characters in one cell
    w = Workload("long", [WorkloadRequest(prompt_token_ids=ids, max_tokens=2)], {})
    back = load_workload_file(save_workload_file(w, tmp_path / "long.csv"))
    assert back.requests[0].prompt_token_ids == ids


def test_a_closed_loop_keeps_at_most_n_requests_in_flight():
    """max_concurrency=N (vLLM's --max-concurrency): at no step are more than N requests sent
    and unfinished; a request held back arrives when it is sent, never before its own arrival,
    so its queue time and TTFT do not include the client's wait; the offered 40 requests/s is
    not reached. N at least the number of requests is the open loop, step for step."""
    wl = make_workload(40, prompt_lengths="uniform:16:256", output_lengths="uniform:8:64",
                       arrival="poisson", rate=40, seed=3)

    def run(cap):
        engine = make_sim_engine("h100-like", policy="pd", max_num_seqs=16)
        run_workload(engine, wl, max_concurrency=cap)
        return engine

    closed, open_ = run(4), run(None)
    for rec in closed.trace:
        assert len(set(rec.page_tables) | set(rec.waiting)) <= 4
    assert max(len(set(r.page_tables) | set(r.waiting)) for r in open_.trace) > 4
    records = {r.request_id: r for r in metrics.request_records(closed)}
    finishes = sorted(r.finish_time for r in records.values())
    for i, req in enumerate(wl.requests):
        got = records[req.request_id or f"req-{i}"]
        assert got.arrival_time >= req.arrival_time - 1e-12
        if got.arrival_time > req.arrival_time + 1e-9:  # held back: sent as one came back
            assert any(abs(got.arrival_time - f) < 1e-9 for f in finishes)
    held = sum(records[r.request_id or f"req-{i}"].arrival_time > r.arrival_time + 1e-9
               for i, r in enumerate(wl.requests))
    assert held > 10
    span = max(r.arrival_time for r in records.values())
    assert len(records) / span < 30  # the clients could not send at 40 requests/s
    same = run(40)
    assert [len(r.members) for r in same.trace] == [len(r.members) for r in open_.trace]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_concurrency must be a positive integer"):
            run_workload(make_sim_engine(policy="pd"), wl, max_concurrency=bad)


def test_a_generated_workload_declares_the_rate_its_arrivals_deliver(tmp_path):
    """A short Poisson sample comes off the rate asked for (200 requests at 20/s arrive at
    22.8/s with seed 2): the declaration keeps the rate asked for and adds what was drawn, the
    same numbers a replay of the saved trace declares; arrivals drawn all at once say so."""
    from minicb.benchmark.workload import load_workload_file, save_workload_file
    w = make_workload(200, arrival="poisson", rate=20, seed=2)
    times = [r.arrival_time for r in w.requests]
    observed = w.declaration["observed"]
    assert w.declaration["rate_rps"] == 20
    assert observed["rate_rps"] == pytest.approx(199 / (max(times) - min(times)))
    assert observed["rate_rps"] == pytest.approx(22.85, abs=0.01)
    replay = load_workload_file(save_workload_file(w, tmp_path / "t.jsonl")).declaration
    assert replay["rate_rps"] == pytest.approx(observed["rate_rps"])
    assert replay["burstiness"] == pytest.approx(observed["burstiness"])
    clumped = make_workload(50, arrival="gamma", rate=1, burstiness=1e-6, seed=0)
    assert clumped.declaration["observed"]["rate_rps"] is None
    assert "observed" not in make_workload(4, arrival="steps", arrival_steps=[1, 2, 3, 4]
                                           ).declaration


def test_poisson_gaps_have_mean_one_over_the_rate():
    """Poisson gaps average 1/rate seconds (gamma gaps of shape 1)."""
    gaps = poisson_gaps(20_000, 8.0, np.random.default_rng(3))
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.05)
    assert np.array_equal(gaps, gamma_gaps(20_000, 8.0, 1.0, np.random.default_rng(3)))


def test_poisson_arrivals_ignore_burstiness():
    """A Poisson process ignores the burstiness it is given: its gaps are exponential, as its
    declaration (Poisson, burstiness 1.0) says."""
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
    """A lognormal length is rounded to the nearest token, not truncated (a median of 10.7
    draws 11)."""
    assert Lengths.lognormal(10.7, 0.0).sample(3, np.random.default_rng(0)) == [11, 11, 11]
    assert Lengths.lognormal(10.2, 0.0).sample(2, np.random.default_rng(0)) == [10, 10]
    assert Lengths.parse("lognormal:0.2:0:3:9").sample(2, np.random.default_rng(0)) == [3, 3]
    assert Lengths.parse("lognormal:50:0:3:9").sample(2, np.random.default_rng(0)) == [9, 9]


def test_the_cancelled_requests_follow_the_seed():
    """Which requests are cancelled follows the workload's seed: the same seed cancels the
    same ones, another seed others."""
    def cancelled(seed):
        w = make_workload(40, prompt_lengths=4, output_lengths=2, seed=seed,
                          cancel_fraction=0.5, cancel_after_tokens=1)
        return {i for i, r in enumerate(w.requests) if r.cancel_after_tokens is not None}
    assert len(cancelled(0)) == 20 and cancelled(3) == cancelled(3)
    assert len({frozenset(cancelled(seed)) for seed in range(4)}) == 4


def test_num_requests_keeps_the_earliest_arrivals_of_an_unsorted_trace(tmp_path):
    """num_requests keeps the earliest arrivals of a trace, whatever the order of its
    lines."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(f'{{"arrival_s": {t}, "prompt_tokens": 4, "output_tokens": 2}}\n'
                            for t in (3.0, 1.0, 2.0, 0.5)))
    w = load_workload_file(path, num_requests=2)
    assert [r.arrival_time for r in w.requests] == [0.5, 1.0]
    assert [r.request_id for r in w.requests] == ["req-3", "req-1"]  # named by file line


def test_a_request_arriving_exactly_at_the_clock_joins_the_next_step():
    """A request whose arrival time equals the engine clock joins that step: B, arriving at
    2.0 s, runs in the step that starts at 2.0 s."""
    engine = make_sim_engine(CostModel(a=1.0), policy="continuous", max_num_seqs=4)
    run_workload(engine, Workload("t", [
        WorkloadRequest(prompt_len=4, max_tokens=6, arrival_time=0.0, request_id="A"),
        WorkloadRequest(prompt_len=4, max_tokens=2, arrival_time=2.0, request_id="B")]))
    b = {r.request_id: r for r in metrics.request_records(engine)}["B"]
    assert (b.first_scheduled_step, b.first_scheduled_time, b.first_token_time) == (3, 2.0, 3.0)
    assert metrics.queue_time(b) == 0.0


# --------------------------------------------------------------------------- trace files
OK = '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4}\n'


def write(tmp_path, text: str, name: str = "t.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name, text, match", [
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
    """The trace reader refuses, naming the line and the field, what WorkloadRequest would
    refuse without them (a deadline_s of 0, a bad arrival_step, both of a pair of alternatives,
    a bool priority, a fractional CSV count, more cells than the header); an empty file and
    repeated request ids are refused for the whole file."""
    with pytest.raises(ValueError, match=match):
        load_workload_file(write(tmp_path, text, name))


def test_token_id_zero_is_a_valid_prompt_token(tmp_path):
    """A trace's prompt_token_ids may hold id 0, as WorkloadRequest's may."""
    w = load_workload_file(write(tmp_path, '{"arrival_s": 0, "prompt_token_ids": [0, 7], '
                                           '"output_tokens": 2}\n'))
    assert w.requests[0].prompt_token_ids == [0, 7]


def test_the_declaration_summarises_what_the_trace_holds(tmp_path):
    """A replayed trace declares what the file holds: burstiness as 1/CV^2 of the gaps, the
    observed rate and span, prompt and output lengths each from their own column, the tenants
    and deadlines given, the cancel fraction; step arrivals are declared as steps, with no rate
    or burstiness."""
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
    """A replayed trace saved again keeps each length-only request's own prompt ids (drawn from
    its index) and its priority, negative ones included."""
    path = write(tmp_path, '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n'
                           '{"arrival_s": 0.5, "prompt_tokens": 5, "output_tokens": 2, '
                           '"priority": -1}\n')
    first = load_workload_file(path)
    again = load_workload_file(save_workload_file(first, tmp_path / f"again{suffix}"))
    assert [r.token_ids(i) for i, r in enumerate(again)] == \
        [r.token_ids(i) for i, r in enumerate(first)]
    assert [r.priority for r in again] == [0, -1]


@pytest.mark.parametrize("count", [0, -1, 2.5])
def test_load_workload_file_checks_num_requests(tmp_path, count):
    """load_workload_file refuses a num_requests that is not an integer >= 1, whoever calls it
    (-1 would drop the last request, 0 keep none, 2.5 fail in the slice)."""
    with pytest.raises(ValueError, match="num_requests must be an integer >= 1"):
        load_workload_file(write(tmp_path, OK * 2), num_requests=count)


def test_a_csv_trace_may_say_long_prefill_0_on_every_other_request(tmp_path):
    """A CSV trace's long_prefill cell reads "0" and "FALSE" as false: a trace written by hand
    with 1 on its long request and 0 on the others names that one request."""
    trace = tmp_path / "t.csv"
    trace.write_text("request_id,arrival_s,prompt_tokens,output_tokens,long_prefill\n"
                     "a,0.0,8,2,0\nb,0.1,64,2,1\nc,0.2,8,2,FALSE\n")
    workload = load_workload_file(trace)
    assert workload.long_request_id == "b"
    assert workload.declaration["long_request_id"] == "b"


def _trace(path, arrivals):
    path.write_text("".join(json.dumps({"arrival_s": a, "prompt_tokens": 3, "output_tokens": 2})
                            + "\n" for a in arrivals))
    return path


def test_a_trace_longer_than_a_day_that_starts_near_zero_loads(tmp_path):
    """The guard against clock times (epoch seconds) looks at the first arrival: a trace longer
    than a day, as offsets from its start, loads; a first arrival of a day exactly loads, and
    one later than that is refused."""
    long = load_workload_file(_trace(tmp_path / "long.jsonl", [0.0, 90_000.0]))
    assert [r.arrival_time for r in long.requests] == [0.0, 90_000.0]
    assert load_workload_file(_trace(tmp_path / "day.jsonl", [86_400.0, 86_401.0])).requests
    with pytest.raises(ValueError, match="more than a day"):
        load_workload_file(_trace(tmp_path / "late.jsonl", [86_400.5, 86_401.0]))


def test_loading_a_long_csv_cell_leaves_the_csv_field_limit_as_it_was(tmp_path):
    """Reading a CSV trace with a prompt cell over the csv module's field size limit leaves
    that process-wide limit as it was for every later csv reader."""
    before = csv.field_size_limit()
    w = Workload("long", [WorkloadRequest(prompt_token_ids=[12345] * 30_000, max_tokens=2)], {})
    load_workload_file(save_workload_file(w, tmp_path / "long.csv"))
    assert csv.field_size_limit() == before


def test_only_a_bad_first_line_suggests_the_trace_is_csv(tmp_path):
    """The hint that a CSV trace's name must end in .csv comes only when the first line is not
    JSON; a JSON Lines file with one broken later line gets that line's error alone."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2}\n{"arrival_s": 1,\n')
    with pytest.raises(ValueError, match=r"line 2: not JSON") as info:
        load_workload_file(path)
    assert ".csv" not in str(info.value)


def test_an_unreadable_trace_names_its_path(tmp_path, monkeypatch):
    """A trace file that exists but cannot be read (permissions) is one line naming it and
    why, not an OSError traceback."""
    import pathlib
    trace = _trace(tmp_path / "t.jsonl", [0.0])

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(pathlib.Path, "read_text", denied)
    with pytest.raises(ValueError, match=r"t\.jsonl: cannot read it \(Permission denied\)"):
        load_workload_file(trace)


def test_a_bad_trace_line_gives_the_json_error_without_its_column_of_line_1(tmp_path):
    """A trace line that is not JSON is named by its line in the file, with the JSON error's
    message alone: its own "line 1 column 1" would name another line."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 4}\nnope\n')
    with pytest.raises(ValueError) as info:
        load_workload_file(path)
    assert str(info.value) == f"{path}, line 2: not JSON (Expecting value)"
