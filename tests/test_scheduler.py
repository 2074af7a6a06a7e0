"""The batching policies (chapters 02-05) on the real engine loop: the chapter's own examples,
and invariants over random workloads for every policy."""

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import random_jobs, run_beside_single

from minicb import SamplingParams
from minicb.benchmark import metrics
from minicb.benchmark.sim import make_sim_engine
from minicb.config import POLICIES
from minicb.scheduler import Scheduler, SchedulerError

GREEDY = dict(temperature=0.0, ignore_eos=True)


def r1_r4(make_engine, policy):
    """R1, R2, R3 need 30, 200, 80 tokens; R4 arrives at step 31; three slots."""
    engine = make_engine(policy, max_num_seqs=3, max_num_batched_tokens=64, chunk_size=64)
    for rid, n in (("R1", 30), ("R2", 200), ("R3", 80)):
        engine.add_request([5 + len(rid), 7, 9, 11], SamplingParams(max_tokens=n, **GREEDY),
                           request_id=rid)
    engine.add_request([4, 8, 15, 16], SamplingParams(max_tokens=20, **GREEDY),
                       request_id="R4", arrival_step=31)
    engine.run()
    return engine


def members_at(engine, step):
    return {m.request_id: m for m in engine.trace[step - 1].members}


@pytest.mark.parametrize("policy", ["continuous", "pd"])
def test_r4_takes_r1_slot_at_step_31(make_engine, policy):
    """Under continuous and pd, R1 finishes at step 30 and R4 prefills in its slot 0 at step 31
    beside R2's and R3's decodes; R3 finishes at step 80, R2 at step 200, and no slot idles."""
    engine = r1_r4(make_engine, policy)
    r1 = engine.requests["R1"].metrics
    assert r1.finish_step == 30, "R1's 30 tokens come from steps 1..30"
    at31 = members_at(engine, 31)
    assert set(at31) == {"R2", "R3", "R4"}
    assert at31["R4"].slot == members_at(engine, 30)["R1"].slot == 0
    assert at31["R4"].kind == "prefill" and at31["R2"].kind == "decode"
    assert engine.requests["R3"].metrics.finish_step == 80
    assert engine.requests["R2"].metrics.finish_step == 200, "R2 runs on untouched"
    assert all(m.kind != "idle" for rec in engine.trace for m in rec.members)


def test_chunked_r4_prefill_pauses_the_decodes(make_engine):
    """Under chunked (prefill first), R4's prefill at step 31 runs alone in slot 0, so R2 finishes
    one step later, at 201."""
    engine = r1_r4(make_engine, "chunked")
    at31 = members_at(engine, 31)
    assert set(at31) == {"R4"} and at31["R4"].slot == 0, "prefill-first: decodes wait a step"
    assert engine.requests["R2"].metrics.finish_step == 201


def test_static_r4_waits_for_r2(make_engine):
    """Under static batching, R4 starts only at step 201 after R2; R1's finished slot idles from
    step 31 to 200, and every member is returned whole at step 200, so its TTFT equals its E2E."""
    engine = r1_r4(make_engine, "static")
    assert engine.requests["R2"].metrics.finish_step == 200
    assert engine.requests["R4"].metrics.first_scheduled_step == 201
    # R1's slot sits idle from step 31 to 200: the chapter's dead slot, counted
    idle_r1 = [rec.step for rec in engine.trace
               for m in rec.members if m.request_id == "R1" and m.kind == "idle"]
    assert idle_r1 == list(range(31, 201))
    assert all({m.request_id for m in engine.trace[s].members} == {"R1", "R2", "R3"}
               for s in range(200))
    # a static batch returns whole: R1 is done at step 30, its user gets it at step 200
    r1 = engine.requests["R1"].metrics
    assert r1.finish_step == 30 and r1.released_step == 200
    assert r1.released_time > r1.finish_time
    e2e_steps = {r["request_id"]: r["e2e_steps"] for r in metrics.per_request(
        metrics.request_records(engine))}
    assert e2e_steps == {"R1": 200, "R2": 200, "R3": 200, "R4": 190}  # R4: steps 31-220
    # and its user saw no token before then, the slowest member's (R2, released at its
    # finish) included: TTFT is E2E for every member
    rows = metrics.per_request(metrics.request_records(engine))
    assert all(r.returned_whole for r in engine.requests.values())
    assert all(row["ttft_steps"] == row["e2e_steps"] and row["ttft_s"] == row["e2e_s"]
               for row in rows)


def test_iteration_level_policies_release_at_the_finish(make_engine):
    """Under continuous, each request is released at its finish step and time and streamed, and its
    E2E is finish time minus arrival time."""
    engine = r1_r4(make_engine, "continuous")
    for r in engine.requests.values():
        assert (r.metrics.released_step, r.metrics.released_time) == (
            r.metrics.finish_step, r.metrics.finish_time)
        assert not r.returned_whole  # streamed: TTFT ends at the first token computed
    assert metrics.e2e(metrics.request_records(engine)[0]) == pytest.approx(
        engine.requests["R1"].metrics.finish_time - engine.requests["R1"].metrics.arrival_time)


def test_a_cancelled_static_member_is_released_at_once(make_engine):
    """A static batch member cancelled at step 3 is released at step 3, not returned whole, and the
    other member is released at its finish."""
    engine = make_engine("static", max_num_seqs=2)
    p = SamplingParams(max_tokens=20, **GREEDY)
    engine.add_request([1, 2, 3], p, request_id="a")
    engine.add_request([4, 5, 6], p, request_id="b")
    for _ in range(3):
        engine.step()
    engine.cancel("a")
    assert engine.requests["a"].metrics.released_step == 3
    assert not engine.requests["a"].returned_whole
    engine.run()
    assert engine.requests["b"].metrics.released_step == engine.requests["b"].metrics.finish_step


def test_dynamic_waits_for_a_full_batch_or_the_timeout(make_engine):
    """Dynamic batching starts a batch when it is full (step 3 for two slots) or when its oldest
    request has waited batch_timeout steps (step 6 for a timeout of 5)."""
    engine = make_engine("dynamic", max_num_seqs=3, batch_timeout=5)
    p = SamplingParams(max_tokens=3, **GREEDY)
    engine.add_request([1, 2, 3], p, request_id="a")
    engine.add_request([4, 5, 6], p, request_id="b", arrival_step=2)
    engine.run()
    assert engine.requests["a"].metrics.first_scheduled_step == 6, "timeout of 5 steps"
    assert engine.requests["b"].metrics.first_scheduled_step == 6
    engine = make_engine("dynamic", max_num_seqs=2, batch_timeout=50)
    engine.add_request([1, 2, 3], p, request_id="a")
    engine.add_request([4, 5, 6], p, request_id="b", arrival_step=3)
    engine.run()
    assert engine.requests["a"].metrics.first_scheduled_step == 3, "full batch at step 3"


def long_prefill(make_engine, policy, long_len=300):
    engine = make_engine(policy, max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32,
                         num_pages=128)
    for i in range(3):
        engine.add_request([10 + i] * 8, SamplingParams(max_tokens=40, **GREEDY),
                           request_id=f"short{i}")
    engine.add_request([i % 250 + 3 for i in range(long_len)],
                       SamplingParams(max_tokens=4, **GREEDY), request_id="long", arrival_step=5)
    engine.run()
    window = [rec for rec in engine.trace if 5 <= rec.step
              and rec.step <= engine.requests["long"].metrics.first_token_step]
    dec_at_p = sum(m.num_tokens for rec in window for m in rec.members
                   if m.kind == "decode" and m.request_id != "long")
    return engine, window, dec_at_p


def test_pd_keeps_decodes_going_during_a_long_prefill(make_engine):
    """Under pd, a 300-token prompt is prefilled in chunks over several steps while the short
    requests still decoding get a token in each of them, within the 64-token budget."""
    engine, window, dec_at_p = long_prefill(make_engine, "pd")
    assert len(window) >= 300 // 64
    assert dec_at_p > 0
    for rec in window:  # decode first, then one chunk with what is left of the budget
        assert rec.num_tokens <= 64
        assert {m.request_id for m in rec.members if m.kind == "decode"} == \
            {r for r in ("short0", "short1", "short2")
             if engine.requests[r].metrics.finish_step >= rec.step}


def test_chunked_prefill_first_starves_decodes(make_engine):
    """Under chunked, no decode token is produced while a 300-token prompt prefills, and no chunk
    exceeds chunk_size 32."""
    engine, window, dec_at_p = long_prefill(make_engine, "chunked")
    assert dec_at_p == 0, "the chapter's problem two: no decode token during the prefill window"
    assert all(m.num_tokens <= 32 for rec in window for m in rec.members)


def test_continuous_runs_a_long_prompt_in_one_step(make_engine):
    """Under continuous, a 300-token prompt is prefilled whole in one step."""
    engine, window, _ = long_prefill(make_engine, "continuous")
    step = engine.requests["long"].metrics.first_scheduled_step
    assert members_at(engine, step)["long"].num_tokens == 300, "problem one: one huge step"


def test_min_chunk_defers_a_small_chunk(make_engine):
    """A prefill chunk smaller than min_chunk (6) waits until that much budget is free (step 11),
    and every non-final chunk is at least min_chunk tokens."""
    engine = make_engine("pd", max_num_seqs=4, max_num_batched_tokens=8, chunk_size=8,
                         min_chunk=6)
    for i in range(3):  # three decodes leave 8 - 3 = 5 tokens of budget: less than min_chunk
        engine.add_request([3 + i, 4], SamplingParams(max_tokens=10 + i, **GREEDY))
    engine.add_request([9] * 20, SamplingParams(max_tokens=2, **GREEDY), request_id="long",
                       arrival_step=3)
    engine.run()
    assert engine.requests["long"].metrics.first_scheduled_step == 11, \
        "deferred until a decode finished and 6 tokens of budget were free"
    for rec in engine.trace:
        for m in rec.members:
            final = engine.requests[m.request_id].metrics.first_token_step == rec.step
            if m.kind == "prefill" and not final:
                assert m.num_tokens >= 6, f"step {rec.step}: chunk of {m.num_tokens} < min_chunk"


@pytest.mark.parametrize("max_preemptions", [None, 1])
def test_preemption_when_pages_run_out_recomputes_and_matches(make_engine, max_preemptions):
    """With `max_preemptions=1` a request preempted once comes back holding its whole life's
    pages and is never preempted again: the same tokens."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(20)] for i in range(6)]
    p = SamplingParams(max_tokens=40, **GREEDY)
    small = make_engine("continuous", num_pages=12, page_size=8, max_num_seqs=6,
                        enable_prefix_caching=True, max_preemptions=max_preemptions)
    ids = [small.add_request(x, p) for x in prompts]
    small.run()
    assert max(r.num_preemptions for r in small.requests.values()) <= (max_preemptions or 99)
    assert sum(r.num_preemptions for r in small.requests.values()) > 0
    assert sum(len(rec.preempted) for rec in small.trace) > 0
    assert sum(r.num_recomputed_tokens for r in small.requests.values()) > 0
    ref = make_engine("single")
    ref_ids = [ref.add_request(x, p) for x in prompts]
    ref.run()
    assert [small.requests[i].output_token_ids for i in ids] == \
        [ref.requests[i].output_token_ids for i in ref_ids]
    assert small.pool.num_used == 0


def test_newest_means_the_latest_arrival_not_the_latest_added(make_engine):
    """Preemption "newest" takes the request that arrived last, even when it was added first
    (a trace replayed out of order, a client adding future arrivals): arrival order is set as
    a request joins the queue."""
    engine = make_engine("pd", num_pages=8, page_size=4)
    p = SamplingParams(max_tokens=20, **GREEDY)
    engine.add_request(list(range(10, 18)), p, request_id="added-first", arrival_step=3)
    engine.add_request(list(range(30, 38)), p, request_id="arrived-first", arrival_step=1)
    engine.run()
    victims = [rid for rec in engine.trace for rid in rec.preempted]
    assert victims and set(victims) == {"added-first"}
    assert engine.requests["arrived-first"].seq_index < engine.requests["added-first"].seq_index


def test_priority_preemption_picks_the_least_important(make_engine):
    """With preemption=priority, a full pool preempts the request with the largest priority number
    and never the priority-0 one."""
    engine = make_engine("continuous", num_pages=10, page_size=8, max_num_seqs=4,
                         preemption="priority", enable_prefix_caching=False)
    p = SamplingParams(max_tokens=30, **GREEDY)
    engine.add_request([3] * 14, p, request_id="vip", priority=0)
    engine.add_request([4] * 14, p, request_id="low", priority=5)
    engine.add_request([5] * 14, p, request_id="mid", priority=1)
    engine.run()
    assert engine.requests["low"].num_preemptions >= 1
    assert engine.requests["vip"].num_preemptions == 0


@pytest.mark.parametrize("aging, max_wait", [(None, None), (8, 8 + 4)])
def test_priority_aging_bounds_how_long_a_low_priority_request_waits(make_engine, aging,
                                                                     max_wait):
    """One slot; a priority-1 job arrives behind a chat, then a new priority-0 chat arrives
    every 4 steps, each needing 4 steps. Without aging every chat goes first and the job waits
    for the stream to end; with aging it outranks newcomers after `aging` steps, so it starts
    once the slot next frees after that: within `aging` + one chat's 4 steps."""
    engine = make_engine("continuous", max_num_seqs=1, preemption="priority",
                         priority_aging_steps=aging)
    p = SamplingParams(max_tokens=4, **GREEDY)
    engine.add_request([1, 2], p, request_id="chat-0")
    engine.add_request([3, 4], p, request_id="job", priority=1, arrival_step=2)
    for i, step in enumerate(range(4, 60, 4)):
        engine.add_request([5 + i, 6], p, request_id=f"chat-{i + 1}", arrival_step=step)
    engine.run()
    job = engine.requests["job"].metrics
    waited = job.first_scheduled_step - job.arrival_step
    if aging is None:
        assert job.first_scheduled_step > max(r.metrics.first_scheduled_step
                                              for r in engine.requests.values()
                                              if r.request_id != "job")
    else:
        assert aging <= waited <= max_wait, waited


# --- invariants over random workloads -------------------------------------------------------

workloads = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(1, 12)),
                     min_size=1, max_size=7)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(workload=workloads, seed=st.integers(0, 1000), num_pages=st.sampled_from([14, 64]))
def test_every_policy_returns_single_tokens(make_engine, tiny_model, policy, workload, seed,
                                           num_pages):
    """Batching never changes results, steps respect every limit, nothing leaks."""
    cfg = dict(max_num_seqs=3, max_num_batched_tokens=16, chunk_size=8, page_size=4,
               num_pages=num_pages)
    engine = make_engine(policy, **cfg)
    reference = make_engine("single", page_size=4, num_pages=64)
    ids = run_beside_single(engine, reference, random_jobs(workload, seed, GREEDY))
    assert all(engine.requests[i].finish_reason in ("stop", "length") for i in ids)
    for rec in engine.trace:
        assert len(rec.members) <= cfg["max_num_seqs"]
        for m in rec.members:
            assert m.kind != "decode" or m.num_tokens == 1
        if policy in ("pd", "chunked"):
            assert rec.num_tokens <= cfg["max_num_batched_tokens"]
            assert all(m.num_tokens <= cfg["chunk_size"] for m in rec.members
                       if m.kind == "prefill")
    if policy == "static":
        batches: dict[int, set] = {}
        for rec in engine.trace:  # membership (active + idle) never changes inside a batch
            if rec.members:
                key = min(engine.requests[m.request_id].metrics.first_scheduled_step
                          for m in rec.members)
                batches.setdefault(key, {m.request_id for m in rec.members})
                assert {m.request_id for m in rec.members} <= batches[key]
    engine.pool.check([])
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("policy", ["chunked", "pd"])
def test_half_prefilled_prompts_that_hold_every_page_do_not_deadlock(make_engine, policy):
    """Three long prompts in chunks, 14 pages of 4 tokens: two prompts admitted chunk by chunk
    hold all 14 pages, each needing one more, and no decode runs to free one. The newest is
    preempted and recomputed later, and every request returns the single-request tokens."""
    cfg = dict(max_num_seqs=3, max_num_batched_tokens=16, chunk_size=8, page_size=4)
    rng = random.Random(0)
    jobs = [([rng.randrange(3, 250) for _ in range(n)], m, a)
            for n, m, a in [(35, 3, 12), (34, 2, 3), (33, 7, 4)]]
    engine = make_engine(policy, num_pages=14, **cfg)
    reference = make_engine("single", page_size=4, num_pages=64)
    for e in (engine, reference):
        for i, (prompt, max_tokens, arrival) in enumerate(jobs):
            e.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY),
                          request_id=f"r{i}", arrival_step=arrival)
        e.run()
    assert all(engine.requests[r].output_token_ids == reference.requests[r].output_token_ids
               for r in reference.requests)
    assert engine.pool.num_used == 0


def test_deadline_preemption_picks_the_most_slack(make_engine):
    """With preemption=deadline, a full pool preempts the request without a deadline, never the
    earliest-deadline one, and every request still ends by length."""
    engine = make_engine("continuous", num_pages=10, page_size=8, max_num_seqs=4,
                         preemption="deadline", enable_prefix_caching=False)
    p = SamplingParams(max_tokens=30, **GREEDY)
    engine.add_request([3] * 14, p, request_id="urgent", deadline=600.0)
    engine.add_request([4] * 14, p, request_id="relaxed")  # no deadline: the most slack
    engine.add_request([5] * 14, p, request_id="soon", deadline=900.0)
    engine.run()
    assert engine.requests["relaxed"].num_preemptions >= 1
    assert engine.requests["urgent"].num_preemptions == 0
    assert all(r.finish_reason == "length" for r in engine.requests.values())


def test_deadline_order_is_earliest_first():
    """With preemption=deadline, a single slot admits requests earliest deadline first, those
    without one last; with newest it admits them in arrival order."""
    from minicb.benchmark.sim import make_sim_engine
    order = {}
    for mode in ("newest", "deadline"):
        engine = make_sim_engine(policy="continuous", max_num_seqs=1, preemption=mode)
        p = SamplingParams(max_tokens=4, **GREEDY)
        for rid, deadline in (("none", None), ("late", 50.0), ("early", 20.0)):
            engine.add_request([1, 2, 3], p, request_id=rid, deadline=deadline)
        engine.run()
        order[mode] = sorted(engine.requests, key=lambda r: engine.requests[r].metrics
                             .first_scheduled_step)
    assert order == {"newest": ["none", "late", "early"], "deadline": ["early", "late", "none"]}


def test_a_missed_deadline_ends_the_request_and_frees_its_pages():
    """One slot, three 20-token requests at once (simulated clock). Measured without deadlines
    first; then the second must finish before the first does (it expires waiting, nothing done)
    and the third, which then runs second, halfway through that run (it expires running)."""
    from minicb.benchmark import metrics
    from minicb.benchmark.sim import make_sim_engine

    def run(deadlines):
        engine = make_sim_engine(policy="pd", max_num_seqs=1, check_invariants=True)
        for i, deadline in enumerate(deadlines):
            engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=20, **GREEDY),
                               request_id=f"r{i}", deadline=deadline)
        engine.run()
        return engine

    free = run([None, None, None])
    finish = [free.requests[f"r{i}"].metrics.finish_time for i in range(3)]
    engine = run([None, finish[0] / 2, (finish[0] + finish[1]) / 2])
    r0, r1, r2 = (engine.requests[f"r{i}"] for i in range(3))
    assert r0.finish_reason == "length" and len(r0.output_token_ids) == 20
    assert r1.finish_reason == "deadline" and r1.output_token_ids == []
    assert r2.finish_reason == "deadline" and 0 < len(r2.output_token_ids) < 20
    assert r2.metrics.finish_time >= r2.deadline_time
    assert engine.pool.num_used == 0 and not engine.has_unfinished()
    listed = [rid for rec in engine.trace for rid in rec.finished]
    assert sorted(listed) == ["r0", "r1", "r2"]
    summary = metrics.summarize(engine.trace, metrics.request_records(engine))
    assert summary["deadline_missed"] == 2 and summary["completed"] == 1


def test_no_step_looks_for_expired_deadlines_when_no_request_has_one(monkeypatch):
    """Without deadlines a step does not scan the queue for them (with 10,000 waiting requests that
    scan would be most of a simulated run); once one request has a deadline, steps check again."""
    from minicb.benchmark.sim import make_sim_engine
    from minicb.request import Request
    checked = []
    monkeypatch.setattr(Request, "deadline_time", property(
        lambda r: checked.append(r.request_id) or float("inf")))
    engine = make_sim_engine(policy="pd", max_num_seqs=2)
    for i in range(6):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, **GREEDY), request_id=f"r{i}")
    engine.run()
    assert checked == []
    engine.add_request([1, 2], SamplingParams(max_tokens=3, **GREEDY), request_id="d",
                       deadline=5.0)
    engine.add_request([1, 2], SamplingParams(max_tokens=3, **GREEDY), request_id="e")
    engine.run()
    assert "d" in checked and "e" in checked
    checked.clear()
    engine.add_request([1, 2], SamplingParams(max_tokens=3, **GREEDY), request_id="f")
    engine.run()
    assert checked == []  # d finished: no deadline is left to check


def test_fair_order_serves_the_least_served_tenant_first():
    """One slot. Tenant a sends four requests, then tenant b one, all at once: first come first
    served makes b wait for all of a's; "fair" runs b's as soon as a has been served once."""
    from minicb.benchmark.sim import make_sim_engine
    order = {}
    for mode in ("newest", "fair"):
        engine = make_sim_engine(policy="continuous", max_num_seqs=1, preemption=mode)
        p = SamplingParams(max_tokens=4, **GREEDY)
        for rid, tenant in (("a0", "a"), ("a1", "a"), ("a2", "a"), ("a3", "a"), ("b0", "b")):
            engine.add_request([1, 2, 3], p, request_id=rid, tenant=tenant)
        engine.run()
        order[mode] = sorted(engine.requests, key=lambda r: engine.requests[r].metrics
                             .first_scheduled_step)
        assert engine.tenant_service == {"a": 4 * (3 + 3), "b": 3 + 3}  # prompt + 3 decodes
        assert {r.tenant for r in metrics.request_records(engine)} == {"a", "b"}
    assert order == {"newest": ["a0", "a1", "a2", "a3", "b0"],
                     "fair": ["a0", "b0", "a1", "a2", "a3"]}


def test_fair_preemption_picks_the_most_served_tenant(make_engine):
    """With preemption=fair, a full pool preempts a request of the tenant with two requests, never
    the one with one."""
    engine = make_engine("continuous", num_pages=10, page_size=8, max_num_seqs=4,
                         preemption="fair", enable_prefix_caching=False)
    p = SamplingParams(max_tokens=30, **GREEDY)
    engine.add_request([3] * 14, p, request_id="light", tenant="light")
    engine.add_request([4] * 14, p, request_id="heavy-0", tenant="heavy")
    engine.add_request([5] * 14, p, request_id="heavy-1", tenant="heavy")
    engine.run()
    assert engine.requests["light"].num_preemptions == 0
    assert sum(engine.requests[f"heavy-{i}"].num_preemptions for i in range(2)) >= 1


@pytest.mark.parametrize("deadline", [0, -1.0, float("nan"), float("inf"), "soon"])
def test_a_bad_deadline_is_refused(make_engine, deadline):
    """A deadline that is not a positive finite number, or a tenant that is not a string, raises
    ValueError naming it, and nothing is queued or allocated."""
    engine = make_engine("pd")
    with pytest.raises(ValueError, match="deadline"):
        engine.add_request([1, 2], SamplingParams(**GREEDY), deadline=deadline)
    with pytest.raises(ValueError, match="tenant"):
        engine.add_request([1, 2], SamplingParams(**GREEDY), tenant=7)
    assert not engine.requests and engine.pool.num_used == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(1, 30),
                               st.one_of(st.none(), st.floats(0.001, 0.3)),
                               st.sampled_from([None, "a", "b"])),
                     min_size=1, max_size=12),
       policy=st.sampled_from(["continuous", "chunked", "pd"]),
       preemption=st.sampled_from(["newest", "priority", "deadline", "fair"]),
       num_pages=st.sampled_from([20, 200]))  # 20 x 4 tokens: the longest job fits, barely
def test_deadlines_hold_under_any_workload(jobs, policy, preemption, num_pages):
    """Simulated clock, random prompts, outputs, arrivals, deadlines and tenants, under every
    queue order: a request that leaves for its deadline had passed it when its last step
    began; one that completes began its last step before the deadline; each tenant's service is
    the tokens its requests computed for the first time; every page comes back; invariants hold
    every step."""
    from minicb.benchmark.sim import make_sim_engine
    engine = make_sim_engine(policy=policy, max_num_seqs=3, max_num_batched_tokens=32,
                             chunk_size=16, page_size=4, num_pages=num_pages,
                             preemption=preemption, check_invariants=True)
    for i, (prompt_len, max_tokens, arrival, deadline, tenant) in enumerate(jobs):
        engine.add_request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens,
                                                                          **GREEDY),
                           request_id=f"r{i}", arrival_step=arrival, deadline=deadline,
                           tenant=tenant)
    engine.run()
    starts = {rec.step: rec.t_start for rec in engine.trace}
    for req in engine.requests.values():
        assert req.finish_reason in ("length", "deadline")
        began = starts[req.metrics.finish_step]
        if req.finish_reason == "deadline":
            assert req.deadline is not None and began >= req.deadline_time
        else:
            assert len(req.output_token_ids) == req.params.max_tokens
            assert began < req.deadline_time
    computed = Counter()
    for rec in engine.trace:
        for m in rec.members:
            computed[engine.requests[m.request_id].tenant] += m.num_tokens
    for req in engine.requests.values():  # recomputed work is not service
        computed[req.tenant] -= req.num_recomputed_tokens
    assert +computed == +engine.tenant_service
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("leave", ["deadline", "cancel"])
def test_a_static_batch_returns_when_its_last_member_leaves_early(leave):
    """A finishes at step 2 and is held (a static batch returns whole); B, the last running
    member, leaves at step 3 by its deadline or a cancel: A is returned then, not when the
    next batch (C) ends."""
    from minicb.benchmark.sim import make_sim_engine
    engine = make_sim_engine(policy="static", max_num_seqs=2, check_invariants=True)
    engine.add_request([1] * 8, SamplingParams(max_tokens=2, **GREEDY), request_id="A")
    engine.add_request([2] * 8, SamplingParams(max_tokens=400, **GREEDY), request_id="B",
                       deadline=None if leave == "cancel" else 1e9)
    engine.step()
    engine.step()
    b = engine.requests["B"]
    if leave == "cancel":
        engine.cancel("B")
    else:
        b.deadline = engine.clock() - b.metrics.arrival_time  # passed now, as if set so
    engine.add_request([3] * 8, SamplingParams(max_tokens=30, **GREEDY), request_id="C")
    engine.run()
    a = engine.requests["A"].metrics
    assert a.finish_step == 2 and a.released_step <= 3 < engine.requests["C"].metrics.finish_step
    assert b.finish_reason == ("cancelled" if leave == "cancel" else "deadline")


@pytest.mark.parametrize("mode", ["priority", "deadline"])
def test_a_preempted_request_waits_behind_more_urgent_ones(mode):
    """The victim of preemption rejoins the queue by its rank, not at the front: a more urgent
    request that arrives after the preemption is admitted before the victim comes back."""
    from minicb.benchmark.sim import make_sim_engine
    engine = make_sim_engine(policy="continuous", max_num_seqs=3, page_size=4, num_pages=9,
                             preemption=mode, enable_prefix_caching=False,
                             check_invariants=True)
    engine.add_request([1] * 8, SamplingParams(max_tokens=12, **GREEDY), request_id="relaxed",
                       priority=5)
    engine.add_request([2] * 8, SamplingParams(max_tokens=12, **GREEDY), request_id="soon",
                       deadline=50.0)
    engine.add_request([3] * 8, SamplingParams(max_tokens=4, **GREEDY), request_id="urgent",
                       deadline=10.0, arrival_step=11)
    engine.run()
    relaxed = engine.requests["relaxed"]
    assert relaxed.num_preemptions >= 1
    prefills = [(rec.step, m.request_id) for rec in engine.trace for m in rec.members
                if m.kind == "prefill"]
    back = next(step for step, rid in prefills if rid == "relaxed" and step > 1)
    assert next(step for step, rid in prefills if rid == "urgent") < back


# --- boundaries (simulated executor: schedules are exact) ---
@pytest.mark.parametrize("preemption", ["newest", "priority"])
def test_a_preempted_request_goes_back_to_the_front_of_the_queue(preemption):
    """The victim is scheduled again no later than D, which was waiting before it; under
    "priority" all four share one priority, and the victim, the earlier arrival, still goes
    first (first come first served among equal ranks)."""
    from minicb.benchmark.sim import make_sim_engine
    e = make_sim_engine(policy="continuous", max_num_seqs=3, page_size=4, num_pages=6,
                        enable_prefix_caching=False, check_invariants=True,
                        preemption=preemption)
    for rid, tok in (("A", 1), ("B", 2), ("C", 3)):
        e.add_request([tok] * 8, SamplingParams(max_tokens=12, **GREEDY), request_id=rid,
                      priority=1)
    e.add_request([4] * 8, SamplingParams(max_tokens=4, **GREEDY), request_id="D",
                  arrival_step=2, priority=1)
    e.run()
    preempted = [(rec.step, rid) for rec in e.trace for rid in rec.preempted]
    assert preempted, "the scenario must preempt"
    step, victim = preempted[0]
    back = min(rec.step for rec in e.trace if rec.step > step
               for m in rec.members if m.request_id == victim)
    assert back <= e.requests["D"].metrics.first_scheduled_step, (preempted, back)


def test_exactly_enough_pages_never_preempt():
    """8 prompt + 8 output tokens in pages of 4: the 4 pages of the pool are enough."""
    from minicb.benchmark.sim import make_sim_engine
    e = make_sim_engine(policy="continuous", page_size=4, num_pages=4,
                        enable_prefix_caching=False, check_invariants=True)
    e.add_request([1] * 8, SamplingParams(max_tokens=8, **GREEDY), request_id="A")
    e.run()
    assert e.requests["A"].num_preemptions == 0 and e.requests["A"].finish_reason == "length"


def test_prompts_that_fill_the_budget_exactly_join_together():
    """Continuous batching: two 32-token prompts under a 64-token budget run in step 1."""
    from minicb.benchmark.sim import make_sim_engine
    e = make_sim_engine(policy="continuous", max_num_seqs=4, max_num_batched_tokens=64)
    for rid in ("a", "b", "c"):
        e.add_request([7] * 32, SamplingParams(max_tokens=2, **GREEDY), request_id=rid)
    e.step()
    assert sorted(m.request_id for m in e.trace[0].members) == ["a", "b"]


@pytest.mark.parametrize("added", ["in arrival order", "later arrival first"])
@pytest.mark.parametrize("preemption", ["priority", "deadline"])
def test_equal_rank_waits_first_come_first_served(preemption, added):
    """Two requests of the same rank behind a running one: the earlier arrival goes first,
    whichever was added first."""
    from minicb.benchmark.sim import make_sim_engine
    e = make_sim_engine(policy="continuous", max_num_seqs=1, preemption=preemption)
    e.add_request([1] * 4, SamplingParams(max_tokens=3, **GREEDY), request_id="running")
    arrivals = [("first", 2), ("second", 3)]
    for rid, arrival in (arrivals if added == "in arrival order" else arrivals[::-1]):
        e.add_request([2] * 4, SamplingParams(max_tokens=2, **GREEDY), request_id=rid,
                      arrival_step=arrival, priority=1, deadline=50.0)
    e.run()
    start = {rid: e.requests[rid].metrics.first_scheduled_step for rid in ("first", "second")}
    assert start["first"] < start["second"]


def scheduled_tokens(engine) -> dict[str, int]:
    """Tokens each request was scheduled for over the run, recomputation included."""
    scheduled = dict.fromkeys(engine.requests, 0)
    for rec in engine.trace:
        for m in rec.members:
            scheduled[m.request_id] += m.num_tokens
    return scheduled


def test_preemption_counts_the_work_it_throws_away_and_the_work_redone():
    """Each preemption adds the victim's computed tokens to num_discarded_tokens (twice for a
    request preempted twice), worked out here from the trace; prompt pages found in the cache
    on readmission are recomputation saved, not cached prompt tokens: num_cached_tokens keeps
    what the first admission found (nothing, for these distinct prompts), and
    num_recomputed_tokens counts only what was computed again: every token scheduled beyond the
    first computation of each position (the request's final cache length)."""
    from minicb.benchmark.sim import make_sim_engine
    e = make_sim_engine(policy="continuous", max_num_seqs=4, page_size=4, num_pages=9,
                        check_invariants=True)
    for i in range(4):
        e.add_request([10 + i] * 8, SamplingParams(max_tokens=12 + 2 * i, **GREEDY),
                      request_id=f"r{i}")
    e.run()
    computed, thrown, last_thrown, readmitted_with_hits = {}, {}, {}, False
    scheduled = scheduled_tokens(e)
    for rec in e.trace:
        for rid in rec.preempted:
            thrown[rid] = thrown.get(rid, 0) + computed.get(rid, 0)
            last_thrown[rid], computed[rid] = computed.get(rid, 0), 0
        for m in rec.members:
            if computed.get(m.request_id) == 0 and m.request_id in thrown:
                # without a hit, a readmission recomputes everything it had, and one more
                readmitted_with_hits |= m.num_tokens < last_thrown[m.request_id]
            computed[m.request_id] = computed.get(m.request_id, 0) + m.num_tokens
    assert max(r.num_preemptions for r in e.requests.values()) >= 2
    assert readmitted_with_hits, "the scenario must readmit a request onto cached pages"
    assert {rid: r.num_discarded_tokens for rid, r in e.requests.items()
            if r.num_discarded_tokens} == thrown
    assert all(r.num_cached_tokens == 0 for r in e.requests.values())
    for rid, r in e.requests.items():
        assert r.num_recomputed_tokens == scheduled[rid] - r.num_computed_tokens, rid
    summary = metrics.summarize(e.trace, metrics.request_records(e))
    assert summary["discarded_tokens"] == sum(thrown.values())
    assert 0 < summary["recomputed_tokens"] < summary["discarded_tokens"]  # the hits saved some


def test_a_deadline_counts_from_the_arrival():
    """A deadline is seconds after the request's arrival, not after the clock's start: a request
    arriving at 1.0 s with a 0.5 s deadline finishes by length."""
    from minicb.benchmark.sim import make_sim_engine
    from minicb.benchmark.workload import Workload, WorkloadRequest, run_workload
    engine = make_sim_engine("h100-like", policy="continuous")
    w = Workload("w", [WorkloadRequest(prompt_len=8, max_tokens=4, arrival_time=1.0,
                                       deadline=0.5, request_id="late-comer")])
    run_workload(engine, w)
    assert engine.requests["late-comer"].finish_reason == "length"


# --- a bound on preemption loss (chapter 06) ---
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(1, 20)),
                     min_size=1, max_size=10),
       policy=st.sampled_from(POLICIES),
       preemption=st.sampled_from(["newest", "priority", "fair"]),
       limit=st.sampled_from([0, 1, 2]))
def test_max_preemptions_bounds_each_requests_loss(jobs, policy, preemption, limit):
    """Twenty pages of 4 tokens for three slots: preemption is common without a bound. With
    one, no request is preempted more than `max_preemptions` times, so none throws away more
    than that many lifetimes of work; every request still completes and every page returns."""
    from minicb.benchmark.sim import make_sim_engine
    engine = make_sim_engine(policy=policy, max_num_seqs=3, max_num_batched_tokens=32,
                             chunk_size=16, page_size=4, num_pages=20, preemption=preemption,
                             max_preemptions=limit, check_invariants=True)
    for i, (prompt_len, max_tokens, arrival) in enumerate(jobs):
        engine.add_request([1 + i] * prompt_len, SamplingParams(max_tokens=max_tokens, **GREEDY),
                           request_id=f"r{i}", arrival_step=arrival, priority=i % 3,
                           tenant="ab"[i % 2])
    engine.run()
    scheduled = scheduled_tokens(engine)
    for req in engine.requests.values():
        assert req.finish_reason == "length"
        assert req.num_preemptions <= limit
        assert req.num_discarded_tokens <= limit * req.max_total_tokens
        # every scheduled token computes a position for the first time or again (the prompts
        # share nothing, so the only cache hits are a preempted request's own pages)
        assert scheduled[req.request_id] == (req.num_computed_tokens - req.num_cached_tokens
                                             + req.num_recomputed_tokens)
        assert req.num_recomputed_tokens <= req.num_discarded_tokens
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


def _params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                             **kw})


def test_requests_without_deadlines_wait_first_come_first_served_under_deadline():
    """Under preemption="deadline", requests with equal deadlines (none at all included) wait first
    come first served."""
    e = make_sim_engine(policy="continuous", max_num_seqs=1, preemption="deadline",
                        check_invariants=True)
    e.add_request([1] * 4, _params(3), request_id="running")
    e.add_request([2] * 4, _params(2), request_id="first", arrival_step=2)
    e.add_request([3] * 4, _params(2), request_id="second", arrival_step=3)
    e.run()
    start = {rid: e.requests[rid].metrics.first_scheduled_step for rid in ("first", "second")}
    assert start["first"] < start["second"], start


@pytest.mark.parametrize("policy", ["continuous", "pd"])
def test_a_prompt_is_shared_as_soon_as_its_prefill_completes(policy):
    """A prompt's full pages are indexed by the step that completes its prefill: a request with the
    same prompt arriving while the first still decodes shares them."""
    e = make_sim_engine(policy=policy, max_num_seqs=4, page_size=4, num_pages=32,
                        chunk_size=16, max_num_batched_tokens=32, check_invariants=True)
    prompt = list(range(10, 19))  # 9 tokens: 2 full pages can be shared
    e.add_request(prompt, _params(20), request_id="first")
    e.add_request(prompt, _params(2), request_id="second", arrival_step=3)
    e.run()
    assert e.requests["second"].metrics.first_scheduled_step < \
        e.requests["first"].metrics.finish_step
    assert e.requests["second"].num_cached_tokens == 8
    second = [m.num_tokens for rec in e.trace for m in rec.members
              if m.request_id == "second"]
    assert second[0] == 1  # only the last prompt token is computed


def test_a_request_preempted_after_a_recompute_keeps_its_prompt_pages_indexed():
    """`preempt` indexes the victim's computed prompt pages, so a request preempted again after a
    recompute finds them cached at its next readmission and recomputes only the rest."""
    e = make_sim_engine(policy="continuous", max_num_seqs=4, page_size=4, num_pages=10,
                        max_num_batched_tokens=32, check_invariants=True)
    e.add_request([1] * 4, _params(13), request_id="r0")
    e.add_request([3] * 10, _params(14), request_id="r1", arrival_step=2)
    e.add_request([1] * 10, _params(8), request_id="r2", arrival_step=3)
    r2 = e.requests["r2"]
    while r2.num_preemptions < 2:
        e.step()
    assert r2.status.value == "preempted" and r2.num_computed_tokens == 0
    assert len(e.pool.match_prefix(r2.all_token_ids)) == 2  # both full prompt pages
    e.run()
    readmission = [m.num_tokens for rec in e.trace for m in rec.members
                   if m.request_id == "r2"][-1]
    assert readmission == r2.num_tokens - 1 - 8  # the last token is sampled, not computed


def test_a_stuck_prompt_waits_while_a_decode_can_still_run():
    """`schedule_prefill_chunks` preempts to unstick a prompt only when no decode runs: a decode
    that can finish frees the page the prompt waits for, and the prompt's work is kept."""
    e = make_sim_engine(policy="chunked", max_num_seqs=2, page_size=4, num_pages=6,
                        max_num_batched_tokens=4, chunk_size=4, enable_prefix_caching=False,
                        check_invariants=True)
    e.add_request([1] * 3, _params(2), request_id="short")  # 4 tokens to compute: one page
    e.add_request([2] * 22, _params(1), request_id="long", arrival_step=2)
    e.run()
    assert [rid for rec in e.trace for rid in rec.preempted] == []
    assert e.requests["long"].num_recomputed_tokens == 0
    assert all(r.finish_reason == "length" for r in e.requests.values())


def test_a_new_static_batch_takes_the_lowest_slots():
    """The free slots stay sorted when a static batch gives its slots back: the next batch's first
    member takes slot 0."""
    e = make_sim_engine(policy="static", max_num_seqs=4, check_invariants=True)
    e.add_request([1] * 4, _params(3), request_id="a")
    e.add_request([2] * 4, _params(2), request_id="b")
    e.add_request([3] * 4, _params(2), request_id="c", arrival_step=2)  # waits for the next batch
    e.run()
    slots = {m.request_id: m.slot for rec in e.trace for m in rec.members}
    assert slots == {"a": 0, "b": 1, "c": 0}


def test_a_victims_slot_goes_to_the_next_admission():
    """The free slots stay sorted when a victim gives its slot back: the next admission takes the
    lowest free slot, the victim's."""
    e = make_sim_engine(policy="continuous", max_num_seqs=4, page_size=4, num_pages=7,
                        preemption="priority", enable_prefix_caching=False,
                        check_invariants=True)
    for rid, tok, priority in (("A", 1, 0), ("B", 2, 0), ("C", 3, 1)):
        e.add_request([tok] * 8, _params(12), request_id=rid, priority=priority)
    e.add_request([4] * 2, _params(1), request_id="D", arrival_step=3)
    e.run()
    assert [rid for rec in e.trace for rid in rec.preempted][:1] == ["C"]
    first = {}
    for rec in e.trace:
        for m in rec.members:
            first.setdefault(m.request_id, (rec.step, m.slot))
    assert first["D"] == (3, 2)


class _KeepsDeadSlots(Scheduler):
    """A learner's static-like policy that lists every finished member as idle (holding its
    slot) yet admits a new request beside them: more members than slots."""

    name = "keeps-dead-slots"

    def __init__(self) -> None:
        self.members: list = []

    def schedule(self, ctx):
        ctx.batch.idle.extend(r for r in self.members if r.is_finished)
        for req in ctx.running:
            ctx.schedule(req, req.num_remaining)
        if not ctx.running and ctx.waiting:
            req = ctx.waiting[0]
            ctx.schedule(req, ctx.admit(req, req.num_tokens))
            self.members.append(req)
        return ctx.batch


def test_idle_members_count_against_max_num_seqs():
    """Idle members (finished, holding a slot) count against max_num_seqs: a policy that admits
    beside its dead slots past the limit is refused."""
    e = make_sim_engine(policy=_KeepsDeadSlots(), max_num_seqs=1)
    e.add_request([1] * 4, _params(2), request_id="a")
    e.add_request([2] * 4, _params(2), request_id="b", arrival_step=3)
    e.step()
    e.step()
    assert e.requests["a"].finish_reason == "length"
    with pytest.raises(SchedulerError, match="exceed max_num_seqs=1"):
        e.step()


class _Advances(Scheduler):
    """A learner's policy that admits the first waiting request and asks for `n` tokens."""

    name = "advances-n"

    def __init__(self, n: int) -> None:
        self.n = n

    def schedule(self, ctx):
        if ctx.waiting:
            req = ctx.waiting[0]
            ctx.admit(req, req.num_tokens)
            ctx.schedule(req, self.n)
        return ctx.batch


@pytest.mark.parametrize("n", [0, -1])
def test_a_batch_advancing_a_request_by_no_tokens_is_refused(n):
    """A member asking to advance by fewer than one token is refused, the rule named."""
    e = make_sim_engine(policy=_Advances(n))
    e.add_request([1] * 4, _params(2), request_id="a")
    with pytest.raises(SchedulerError, match=f"asks to advance {n} tokens"):
        e.step()


def test_fair_preemption_picks_the_most_served_tenant_not_the_newest():
    """Under "fair" the victim is a request of the most-served tenant, even when another tenant's
    request is newer."""
    e = make_sim_engine(policy="continuous", max_num_seqs=4, page_size=4, num_pages=6,
                        preemption="fair", enable_prefix_caching=False, check_invariants=True)
    e.add_request([1] * 4, _params(6), request_id="x", tenant="light")
    e.add_request([2] * 16, _params(2), request_id="y", tenant="heavy")
    e.add_request([3] * 4, _params(6), request_id="z", tenant="light")
    e.step()  # 6 pages full; x's first decode needs a seventh
    record = e.step()
    assert record.preempted == ["y"]


def test_the_deadlock_breaker_runs_the_oldest_stuck_prompt_in_the_same_step():
    """Two half-prefilled prompts hold every page and no decode runs: `schedule_prefill_chunks`
    preempts the newest and gives its pages to the oldest's chunk in the same step."""
    e = make_sim_engine(policy="chunked", max_num_seqs=2, page_size=4, num_pages=6,
                        max_num_batched_tokens=8, chunk_size=4, enable_prefix_caching=False,
                        check_invariants=True)
    e.add_request([1] * 20, _params(1), request_id="old")
    e.add_request([2] * 20, _params(1), request_id="new")
    for _ in range(3):  # 4 tokens each per step: 3 pages each, the whole pool
        e.step()
    record = e.step()
    assert record.preempted == ["new"]
    assert [(m.request_id, m.num_tokens) for m in record.members] == [("old", 4)]
    e.run()
    assert e.requests["old"].num_preemptions == 0
    assert e.requests["old"].metrics.finish_step < e.requests["new"].metrics.finish_step
    assert all(rec.members for rec in e.trace)  # no step ran empty


@pytest.mark.parametrize("policy", ["continuous", "pd"])
def test_a_step_that_preempts_admits_no_one(policy):
    """A step that had to preempt admits no new request: the pages the victim freed go to the
    running decodes, not to an arrival that the next decode would preempt again."""
    e = make_sim_engine(policy=policy, max_num_seqs=4, page_size=4, num_pages=4,
                        preemption="priority", enable_prefix_caching=False,
                        check_invariants=True)
    e.add_request([1] * 4, _params(6), request_id="A")  # its 5th token needs a page at step 2
    e.add_request([2] * 3, _params(6), request_id="C")  # and C's at step 3
    e.add_request([3] * 8, _params(6), request_id="B", priority=5)  # the victim
    e.add_request([4] * 3, _params(3), request_id="W", arrival_step=2)
    e.step()  # A, C and B fill all 4 pages
    record = e.step()
    assert record.preempted == ["B"]
    assert [m.request_id for m in record.members] == ["A", "C"]
    e.run()
    assert e.requests["W"].num_preemptions == 0
    assert e.requests["W"].num_recomputed_tokens == 0
    assert all(r.finish_reason == "length" for r in e.requests.values())
