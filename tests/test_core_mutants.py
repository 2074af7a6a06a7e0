"""Planted-bug tests from a mutation review of the engine loop and the schedulers
(minicb/engine.py, minicb/scheduler.py, minicb/request.py): each test fails on the bug its
docstring names and passes on the real code. They run on the simulated executor, whose
schedules are exact, so each takes well under a second."""

from __future__ import annotations

import pytest

from minicb import SamplingParams
from minicb.benchmark.sim import make_sim_engine
from minicb.engine import SchedulerError
from minicb.scheduler import Scheduler

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **{**GREEDY, **kw})


def test_requests_without_deadlines_wait_first_come_first_served_under_deadline():
    """preemption="deadline" ranked equal deadlines newest first (`-seq_index` as the tie key):
    two requests without a deadline (both rank at infinity) queued behind a running one ran
    last-come first-served."""
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
    """The step indexed a prompt's pages after a chunk only while `num_computed_tokens <
    num_prompt_tokens` (for `<=`): the chunk that completes the prompt was never indexed, so a
    request with the same prompt arriving while the first still decodes found no cached page
    (a whole-prompt policy then shared nothing until the first finished)."""
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
    """`preempt` did not index the victim's prompt pages (pages released straight to the free
    list). The step indexes prompt pages only while a chunk stays within the prompt; a
    readmitted request recomputes prompt and outputs in one chunk (continuous), so when it is
    preempted again only `preempt` can keep its prompt pages findable: its next readmission
    then computes all but the prompt's two full pages again."""
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
    """The deadlock breaker of `schedule_prefill_chunks` (preempt to let a stuck prompt go on)
    ran even with decodes running: it preempted the half-prefilled prompt (the newest) and
    threw away its 20 computed tokens, where the decode could run in its own page, finish,
    and free the page the prompt was waiting for."""
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
    """`release_slot` (static batching gives back a whole batch's slots at once) appended the
    slots without sorting the free list: with slots 2 and 3 never used, the next batch's
    first member took slot 2, not the lowest free slot, 0."""
    e = make_sim_engine(policy="static", max_num_seqs=4, check_invariants=True)
    e.add_request([1] * 4, _params(3), request_id="a")
    e.add_request([2] * 4, _params(2), request_id="b")
    e.add_request([3] * 4, _params(2), request_id="c", arrival_step=2)  # waits for the next batch
    e.run()
    slots = {m.request_id: m.slot for rec in e.trace for m in rec.members}
    assert slots == {"a": 0, "b": 1, "c": 0}


def test_a_victims_slot_goes_to_the_next_admission():
    """`preempt` gave the victim's slot back without sorting the free list: with slot 3 never
    used, the next admission (a more important arrival, ahead of the victim) took slot 3, not
    the victim's freed slot 2."""
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


def test_no_guess_is_proposed_past_max_tokens():
    """`_propose_drafts` allowed `max_tokens - len(outputs)` guesses, one too many (the step's
    own token comes after the guesses): with every guess right, the last guess could never be
    kept, yet the step computed it and `speculated` counted it as proposed."""
    e = make_sim_engine(policy="pd", num_speculative_tokens=5, check_invariants=True)
    t = e.model.token  # the simulated model always predicts t: every guess of t is right
    rid = e.add_request([t] * 8, _params(5))
    out = e.run()[0]
    assert out.token_ids == [t] * 5 and len(e.trace) == 2
    assert e.trace[-1].speculated[rid] == (3, 3)
    assert e.requests[rid].num_service_tokens == 8 + 5 - 1  # nothing computed in vain


def test_guesses_may_take_the_last_free_page():
    """`_propose_drafts` required more free pages than its guesses need (`>=` for `>`): four
    guesses needing exactly the one page left were dropped, costing a step."""
    e = make_sim_engine(policy="pd", num_speculative_tokens=4, page_size=4, num_pages=4,
                        check_invariants=True)
    t = e.model.token
    rid = e.add_request([t] * 8, _params(8))  # 8 + 8 tokens: the whole pool
    out = e.run()[0]
    assert out.token_ids == [t] * 8
    assert e.trace[1].speculated[rid] == (4, 4)  # 9 tokens + 4 guesses need page 4, the last
    assert len(e.trace) == 3


def test_a_request_may_fill_the_models_context_exactly():
    """`check_request` refused prompt + max_tokens equal to the model's context (`>=` for `>`):
    a request the model can hold exactly was rejected. One token more is refused with a clear
    error, and the engine still runs the one that fits."""
    e = make_sim_engine(policy="pd", max_position_embeddings=16, check_invariants=True)
    with pytest.raises(ValueError, match="exceeds the model's context of 16"):
        e.add_request([1] * 8, _params(9))
    assert not e.requests and not e.has_unfinished()
    rid = e.add_request([1] * 8, _params(8))
    out = e.run()[0]
    assert out.request_id == rid and len(out.token_ids) == 8 and out.finish_reason == "length"


def test_a_generated_id_skips_ids_the_caller_took():
    """`add_request` named a request "req-<n>" without skipping ids already taken by the
    caller: after a caller's own "req-0", the next unnamed request was refused as a
    duplicate."""
    e = make_sim_engine(policy="pd", check_invariants=True)
    e.add_request([1] * 4, _params(2), request_id="req-0")
    auto = e.add_request([2] * 4, _params(2))
    assert auto != "req-0" and set(e.requests) == {"req-0", auto}
    e.run()
    assert all(r.finish_reason == "length" for r in e.requests.values())


def test_cancelling_a_finished_request_changes_nothing():
    """`cancel` lacked its `is_finished` guard: cancelling a request that had already ended
    rewrote its finish_reason to "cancelled", moved its finish time, and listed it as finished
    again in the next step's record."""
    e = make_sim_engine(policy="pd", check_invariants=True)
    done = e.add_request([1] * 4, _params(2), deadline=100.0)
    e.run()
    before = (e.requests[done].finish_reason, e.requests[done].metrics.finish_step,
              e.requests[done].metrics.finish_time)
    e.cancel(done)
    other = e.add_request([2] * 4, _params(2))
    e.run()
    r = e.requests[done]
    assert (r.finish_reason, r.metrics.finish_step, r.metrics.finish_time) == before
    assert before[0] == "length"
    assert all(done not in rec.finished for rec in e.trace if rec.step > before[1])
    assert e.requests[other].finish_reason == "length"


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
    """`_validate` counted only the advancing members against max_num_seqs, not the idle ones
    (finished members a static batch still holds a slot for): a policy holding a dead slot and
    admitting beside it ran two members on one slot."""
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
    """`_validate` dropped its `n < 1` rule: a member asking for 0 (or -1) tokens ran as a
    do-nothing (or negative) row instead of being refused with the rule named."""
    e = make_sim_engine(policy=_Advances(n))
    e.add_request([1] * 4, _params(2), request_id="a")
    with pytest.raises(SchedulerError, match=f"asks to advance {n} tokens"):
        e.step()


def test_fair_preemption_picks_the_most_served_tenant_not_the_newest():
    """`pick_victim` ranked candidates without the tenants' service under "fair" (a bare
    `queue_rank("fair")`): it preempted the newest request, of the lighter tenant, instead of
    the heavy tenant's, which was served twice as many tokens."""
    e = make_sim_engine(policy="continuous", max_num_seqs=4, page_size=4, num_pages=6,
                        preemption="fair", enable_prefix_caching=False, check_invariants=True)
    e.add_request([1] * 4, _params(6), request_id="x", tenant="light")
    e.add_request([2] * 16, _params(2), request_id="y", tenant="heavy")
    e.add_request([3] * 4, _params(6), request_id="z", tenant="light")
    e.step()  # 6 pages full; x's first decode needs a seventh
    record = e.step()
    assert record.preempted == ["y"]


def test_a_prompt_token_id_equal_to_the_vocabulary_size_is_refused():
    """`check_request` let a token id equal to the vocabulary size through (`<=` for `<`): an
    id the embedding has no row for. It must be refused up front, leaving the engine usable."""
    e = make_sim_engine(policy="pd", vocab=128, check_invariants=True)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 128\), got \[128\]"):
        e.add_request([1, 128], _params(2))
    assert not e.requests and not e.has_unfinished()
    e.add_request([1, 127], _params(2))
    assert e.run()[0].finish_reason == "length"


def test_a_negative_arrival_time_is_refused():
    """`add_request` dropped the `arrival_time < 0` guard: a request arriving before the engine
    started was queued with a negative arrival time, corrupting its latencies."""
    e = make_sim_engine(policy="pd", check_invariants=True)
    with pytest.raises(ValueError, match="arrival_time must be a finite number >= 0"):
        e.add_request([1] * 4, _params(2), arrival_time=-1.0)
    assert not e.requests and not e.has_unfinished()


def test_a_steps_waiting_count_leaves_out_requests_not_yet_arrived():
    """StepRecord.num_waiting counted pending requests (added, arrival step not reached) as
    waiting: queue-length plots showed a queue before anyone had arrived."""
    e = make_sim_engine(policy="pd", max_num_seqs=1, check_invariants=True)
    e.add_request([1] * 4, _params(3), request_id="now")
    e.add_request([2] * 4, _params(2), request_id="later", arrival_step=50)
    e.add_request([3] * 4, _params(2), request_id="queued")
    record = e.step()
    assert record.num_waiting == 1  # "queued" only


def test_the_deadlock_breaker_runs_the_oldest_stuck_prompt_in_the_same_step():
    """Two half-prefilled prompts hold every page and no decode runs: the breaker of
    `schedule_prefill_chunks` must preempt the newest and give its pages to the oldest's chunk
    in that step. Breaking the tie with the newest stuck prompt (`stuck[-1]` for `stuck[0]`)
    asked pages for the newest, which then preempted itself: a step that ran nothing, and the
    oldest went on a step late."""
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


def test_an_idle_engine_does_not_skip_steps_past_a_timed_arrival():
    """With nothing to run, `_skip_idle_time` jumps the step counter to the next arrival step
    only when every pending request arrives by step: a request arriving by time may come
    first. Jumping whenever any request had an arrival step (`if steps:`) moved a request due
    at 0.5 s to step 50, where it started beside the request due then."""
    e = make_sim_engine(policy="pd", check_invariants=True)
    e.add_request([1] * 4, _params(2), request_id="by_step", arrival_step=50)
    e.add_request([2] * 4, _params(2), request_id="by_time", arrival_time=0.5)
    e.run()
    by_time, by_step = e.requests["by_time"].metrics, e.requests["by_step"].metrics
    assert by_time.first_scheduled_step == 1 and by_time.first_scheduled_time == 0.5
    assert by_time.finish_step < 50
    assert by_step.arrival_step == by_step.first_scheduled_step == 50


@pytest.mark.parametrize("policy", ["continuous", "pd"])
def test_a_step_that_preempts_admits_no_one(policy):
    """A step that had to preempt admits no new request (`not ctx.batch.preempted` in the
    admission loops of the continuous policy and of `schedule_prefill_chunks`): the pages the
    victim freed go to the running decodes. Without that stop, the waiting "W" (ranked ahead
    of the preempted "B" under priority) took B's last freed page at once, and the next step
    "C"'s decode needed that page: W was preempted after one step, its prefill thrown away."""
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


def test_a_timed_arrival_counts_from_the_step_it_joined():
    """Found by the mutation review: a request arriving by `arrival_time` got the step AFTER
    the one that admitted it as its arrival step, so a request served at once had queue_steps
    -1 and every ttft/e2e in steps one short. Now a timed arrival scheduled the step it arrives
    is 0 steps in the queue and has its first token in its first step (steps count inclusive),
    as a request added between steps has."""
    from minicb.benchmark import metrics
    engine = make_sim_engine(policy="pd")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request([5] * 8, params, request_id="now")
    engine.add_request([5] * 8, params, request_id="later", arrival_time=0.02)
    engine.run()
    for r in engine.request_records():
        assert r.arrival_step == r.first_scheduled_step, r
    summary = metrics.summarize(engine.trace, engine.request_records())
    assert summary["queue_steps"]["p99"] == 0 and summary["ttft_steps"]["p99"] == 1
