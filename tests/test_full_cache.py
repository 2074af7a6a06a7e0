"""Answers to a full KV cache beyond preempt-and-recompute (chapter 06): swap (a victim's K/V
copied to host memory and back, `preemption_mode="swap"`) and reject (`reject_when_full`)."""

from collections import deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minicb.benchmark import metrics
from minicb.benchmark.sim import CostModel, make_sim_engine
from minicb.config import POLICIES, EngineConfig
from minicb.engine import InvariantError
from minicb.kv_cache import PagePool
from minicb.request import Request, SamplingParams, Status
from minicb.scheduler import ScheduledBatch, Scheduler, SchedulerContext
from tests.tiny_models import random_jobs, run_beside_single, three_in_six

GREEDY = dict(temperature=0.0, ignore_eos=True)


def tight_run(make_engine, **options):
    """Six 20-token prompts of 40 tokens each in 12 pages of 8: preemptions are certain."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(20)] for i in range(6)]
    p = SamplingParams(max_tokens=40, **GREEDY)
    engine = make_engine("continuous", num_pages=12, page_size=8, max_num_seqs=6, **options)
    ids = [engine.add_request(x, p) for x in prompts]
    engine.run()
    ref = make_engine("single")
    ref_ids = [ref.add_request(x, p) for x in prompts]
    ref.run()
    same = [engine.requests[i].output_token_ids for i in ids] == \
        [ref.requests[i].output_token_ids for i in ref_ids]
    return engine, same


# --- swap --------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix_caching", [False, True])
def test_swap_keeps_the_kv_and_returns_the_same_tokens(make_engine, prefix_caching):
    """Every preemption swaps (64 host pages hold every victim at once): no token is discarded
    or recomputed, and the tokens are the single-request ones, which they would not be if the
    copied K/V were wrong. Without a prefix cache every page copied out is copied back; with
    one, a victim's prompt pages still cached when it returns are shared instead, fewer copies
    for the same tokens."""
    engine, same = tight_run(make_engine, preemption_mode="swap", num_swap_pages=64,
                             enable_prefix_caching=prefix_caching)
    s = metrics.summarize(engine.trace, metrics.request_records(engine))
    assert same
    assert s["preemptions"] > 0
    assert s["discarded_tokens"] == s["recomputed_tokens"] == 0
    if prefix_caching:
        assert 0 < s["swapped_in_pages"] < s["swapped_out_pages"]
    else:
        assert s["swapped_out_pages"] == s["swapped_in_pages"] > 0
    assert engine.pool.num_used == 0 and len(engine.pool.swap_free) == 64


class AdmitFirst(Scheduler):
    """A learner's plausible policy: admit from the queue first, then give every decode its
    token (schedule_decodes preempts the newest unscheduled request when pages run out, which
    can be one just admitted from swap), then schedule the admitted chunks still running."""
    name = "admit-first"

    def schedule(self, ctx):
        admitted = []
        for req in self.prefilling(ctx):
            n = min(req.num_remaining, ctx.config.chunk_size)
            if ctx.reserve(req, n):
                admitted.append((req, n))
        while ctx.waiting and len(admitted) < 2:
            req = ctx.waiting[0]
            n = ctx.admit(req, min(req.num_remaining, ctx.config.chunk_size))
            if not n:
                break
            admitted.append((req, n))
        self.schedule_decodes(ctx)
        for req, n in admitted:
            if req.status is Status.RUNNING and req.request_id not in ctx.scheduled_ids:
                ctx.schedule(req, n)
        return ctx.batch


def test_a_request_swapped_in_and_preempted_in_one_step_keeps_its_kv(make_engine):
    """A request admitted from swap and preempted in the same step keeps the host pages it had (the
    copy back was only planned), and every request gets the single-request tokens."""
    jobs = [([235, 178, 208, 220, 230, 50, 169, 62, 173, 40, 225, 60], 9),
            ([21, 139, 219, 57], 13), ([113, 35], 4), ([216, 40, 24, 226, 206, 210], 12),
            ([193, 114, 246, 38, 206, 227, 68, 94, 220], 11)]
    outputs = {}
    for name, engine in (
            ("single", make_engine("single", page_size=4)),
            ("swap", make_engine(AdmitFirst(), num_pages=9, page_size=4, max_num_seqs=4,
                                 max_num_batched_tokens=256, chunk_size=256,
                                 enable_prefix_caching=False, preemption_mode="swap"))):
        ids = [engine.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in jobs]
        both = []
        while engine.has_unfinished():
            swapped = {r.request_id: list(r.swapped_pages) for r in engine.waiting
                       if r.status is Status.SWAPPED}
            rec = engine.step()
            both += [rid for rid in rec.swapped if rid in swapped]
            for rid in rec.swapped:
                if rid in swapped:  # back in the host pages it left, nothing copied for it
                    assert engine.requests[rid].swapped_pages == swapped[rid]
        outputs[name] = [engine.requests[i].output_token_ids for i in ids]
        if name == "swap":
            assert both, "no request was swapped in and preempted in one step"
            assert engine.pool.num_used == 0 and len(engine.pool.swap_free) == 9
    assert outputs["swap"] == outputs["single"]


def test_verbs_refuse_the_wrong_request_before_changing_anything(make_engine):
    """ctx.admit of a running request, ctx.preempt of a waiting one: a SchedulerError naming the
    verb, and the pool, the slots, the queues and the page tables as they were."""
    from minicb.engine import SchedulerError
    engine = make_engine("pd", num_pages=16, page_size=4, max_num_seqs=2)
    for prompt in ([5, 6, 7, 8, 9], [10, 11, 12], [13, 14]):
        engine.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    ctx = SchedulerContext(engine.waiting, engine.running, engine.pool, engine.config,
                           engine.step_count + 1, 0.0, engine.free_slots)
    before = (engine.pool.num_free, list(engine.free_slots), list(engine.waiting),
              list(engine.running), [list(r.page_table) for r in engine.running])
    with pytest.raises(SchedulerError, match=r"ctx.admit\(req-0\): only a request in the "
                                             r"waiting queue can be admitted; it is running"):
        ctx.admit(engine.running[0], 8)
    with pytest.raises(SchedulerError, match=r"ctx.preempt\(req-2\): only a running request "
                                             r"can be preempted; it is waiting"):
        ctx.preempt(engine.waiting[0])
    assert before == (engine.pool.num_free, list(engine.free_slots), list(engine.waiting),
                      list(engine.running), [list(r.page_table) for r in engine.running])
    engine.run()  # still usable
    assert all(r.finish_reason == "length" for r in engine.requests.values())


@pytest.mark.parametrize("staged", [False, True])
def test_swap_copies_scattered_pages_out_and_back(monkeypatch, staged):
    """PagePool.swap_out and swap_in move every layer's K and V of scattered pages to host pages
    and back. On CUDA they go through page-locked bounce buffers (`stage_swaps`); that path runs
    here on the CPU with plain buffers standing in, so its gathers and shapes are tested too."""
    pool = PagePool(8, 4, num_layers=3, num_kv_heads=2, head_dim=5, num_swap_pages=6)
    if staged:
        staging = []

        def plain_buffer(num_pages):  # what _staging pins on CUDA
            shape = (*pool.swap_store.shape[:2], num_pages, *pool.swap_store.shape[3:])
            staging.append(torch.full(shape, float("nan")))
            return staging[-1]

        pool.stage_swaps = True
        monkeypatch.setattr(pool, "_staging", plain_buffer)
    kv = torch.randn(pool.every_layer.shape)
    pool.every_layer.copy_(kv)
    pool.swap_out([(6, 4), (1, 0), (3, 5)])
    assert torch.equal(pool.swap_store[:, :, [4, 0, 5]], kv[:, :, [6, 1, 3]])
    pool.every_layer.zero_()
    pool.swap_in([(0, 2), (5, 7), (4, 0)])
    assert torch.equal(pool.every_layer[:, :, [2, 7, 0]], kv[:, :, [1, 3, 6]])
    assert torch.count_nonzero(pool.every_layer[:, :, [1, 3, 4, 5, 6]]) == 0
    if staged:
        assert len(staging) == 2  # one bounce buffer each way
    else:
        assert not pool.stage_swaps  # a CPU pool copies directly


def test_the_bounce_buffer_is_pinned_and_holds_the_pages_in_flight(monkeypatch):
    """`_staging` asks torch for page-locked memory shaped like the pages in flight (every
    layer, K and V); on a CPU-only torch that cannot be allocated, so pinning is recorded and
    dropped here."""
    from minicb import kv_cache
    asked = []
    real_empty = torch.empty

    def empty(*shape, pin_memory=False, **kw):
        asked.append((shape, pin_memory))
        return real_empty(*shape, **kw)

    pool = PagePool(8, 4, num_layers=3, num_kv_heads=2, head_dim=5, num_swap_pages=6)
    pool.stage_swaps = True
    monkeypatch.setattr(kv_cache.torch, "empty", empty)
    pool.every_layer.normal_()
    kv = pool.every_layer.clone()
    pool.swap_out([(6, 4), (1, 0)])
    pool.every_layer.zero_()
    pool.swap_in([(4, 2), (0, 3)])
    assert asked == [(((3, 2, 2, 4, 2, 5),), True)] * 2
    assert torch.equal(pool.every_layer[:, :, [2, 3]], kv[:, :, [6, 1]])


def test_the_swap_space_defaults_to_the_pool_size(make_engine):
    """With preemption_mode="swap" and no num_swap_pages, the swap space has as many pages as the
    pool."""
    assert make_engine(num_pages=12, preemption_mode="swap").pool.num_swap_pages == 12


def test_recompute_mode_copies_nothing(make_engine):
    """Under recompute, a run tight enough to preempt discards tokens, keeps the single-request
    tokens, and swaps no page out or in (no swap space at all)."""
    engine, same = tight_run(make_engine)
    s = metrics.summarize(engine.trace, metrics.request_records(engine))
    assert same and s["preemptions"] > 0 and s["discarded_tokens"] > 0
    assert s["swapped_out_pages"] == s["swapped_in_pages"] == 0
    assert engine.pool.num_swap_pages == 0


def test_a_full_swap_space_falls_back_to_recompute(make_engine):
    """Three host pages hold few victims: the others are recomputed; the tokens still match."""
    engine, same = tight_run(make_engine, preemption_mode="swap", num_swap_pages=3)
    s = metrics.summarize(engine.trace, metrics.request_records(engine))
    assert same
    assert s["swapped_out_pages"] > 0 and s["discarded_tokens"] > 0
    assert len(engine.pool.swap_free) == 3


def test_a_swapped_request_holds_host_pages_until_it_returns(make_engine):
    """Step by step: a victim is SWAPPED with host pages for exactly its computed tokens, and
    is RUNNING again with its computed count kept when it is admitted back."""
    engine = make_engine("pd", num_pages=6, page_size=4, max_num_seqs=3,
                         preemption_mode="swap", enable_prefix_caching=False)
    p = SamplingParams(max_tokens=12, **GREEDY)
    for i in range(3):
        engine.add_request([3 + i] * 6, p, request_id=f"r{i}")
    seen = []
    while engine.has_unfinished():
        rec = engine.step()
        for rid in rec.preempted:
            req = engine.requests[rid]
            seen.append(rid)
            assert req.status is Status.SWAPPED and not req.page_table
            assert len(req.swapped_pages) == engine.pool.pages_needed(req.num_computed_tokens)
            assert req.num_computed_tokens > 0 and req.num_discarded_tokens == 0
        for rid in {m.request_id for m in rec.members} & set(seen):
            assert engine.requests[rid].status in (Status.RUNNING, Status.FINISHED)
    assert seen and all(r.num_discarded_tokens == 0 for r in engine.requests.values())


def test_a_swapped_request_shares_its_prompt_pages_still_cached_when_it_returns():
    """Step by step, with the prefix cache: a victim whose full prompt pages are still in the
    index when it is admitted again shares them (its page table starts with those very pages,
    their ref counts go up) and only the rest of its K/V is copied in; every host page it held
    is free again after that step, and the books balance throughout."""
    engine = make_sim_engine(policy="pd", num_pages=10, page_size=4, max_num_seqs=4,
                             preemption_mode="swap", check_invariants=True)
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    for i in range(4):
        engine.add_request([3 + i] * 13, p, request_id=f"r{i}")  # 3 full prompt pages each
    shared_seen = 0
    while engine.has_unfinished():
        returning = [r for r in engine.waiting if r.status is Status.SWAPPED]
        held = {r.request_id: (list(r.swapped_pages), engine.pool.match_prefix(
            r.all_token_ids, r.page_hashes or None)[:r.num_computed_tokens // 4])
            for r in returning}
        engine.step()
        for rid, (host, hit) in held.items():
            req = engine.requests[rid]
            if req.status is Status.SWAPPED:
                continue  # not admitted this step
            assert req.page_table[:len(hit)] == hit and not req.swapped_pages
            assert set(host) <= set(engine.pool.swap_free)
            shared_seen += len(hit)
    assert shared_seen == 6  # two victims, each back to its 3 prompt pages
    s = metrics.summarize(engine.trace, metrics.request_records(engine))
    assert s["swapped_out_pages"] - s["swapped_in_pages"] == shared_seen
    assert len(engine.pool.swap_free) == 10 and engine.pool.num_used == 0


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_request_that_ends_while_swapped_gives_its_host_pages_back(how):
    """Cancelled, or out of time, while its K/V waits in host memory: the host pages return."""
    engine = make_sim_engine(policy="pd", num_pages=6, page_size=4, max_num_seqs=3,
                             preemption_mode="swap", check_invariants=True,
                             enable_prefix_caching=False)
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request([3 + i] * 6, p, request_id=f"r{i}",
                           deadline=0.05 if how == "deadline" and i == 2 else None)
    while not any(r.status is Status.SWAPPED for r in engine.requests.values()):
        engine.step()
    victim = next(r for r in engine.requests.values() if r.status is Status.SWAPPED)
    assert len(engine.pool.swap_free) < 6
    if how == "cancel":
        engine.cancel(victim.request_id)
    engine.run()
    assert len(engine.pool.swap_free) == 6
    if how == "cancel":
        assert victim.finish_reason == "cancelled"
    assert all(not r.swapped_pages for r in engine.requests.values())


def test_swap_copies_every_layer_both_ways():
    """Swapping out and back in copies each page's keys and values in every layer to the target
    page, and writes no other page."""
    pool = PagePool(4, 2, num_layers=3, num_kv_heads=2, head_dim=5, num_swap_pages=3)
    pool.every_layer.copy_(torch.randn_like(pool.every_layer))
    before = pool.every_layer.clone()
    host = pool.allocate_swap(2)
    pool.swap_out([(3, host[0]), (1, host[1])])
    pool.every_layer.zero_()
    pool.swap_in([(host[0], 0), (host[1], 2)])
    assert torch.equal(pool.every_layer[:, :, 0], before[:, :, 3])
    assert torch.equal(pool.every_layer[:, :, 2], before[:, :, 1])
    assert not pool.every_layer[:, :, [1, 3]].any()  # only the targets were written
    assert torch.equal(pool.k[1][2], before[1, 0, 1]) and torch.equal(pool.v[2][0], before[2, 1, 3])


def test_swap_space_books_balance():
    """The pool's check fails when swap pages are lost or owned twice; allocating more swap pages
    than are free raises MemoryError and takes none; a negative swap size is refused."""
    pool = PagePool(4, 2, num_swap_pages=3)
    held = pool.allocate_swap(2)
    pool.check([], [held])
    with pytest.raises(AssertionError, match="swap pages do not balance"):
        pool.check([], [])  # held pages nobody owns: lost
    with pytest.raises(AssertionError, match="swap pages do not balance"):
        pool.check([], [held, held[:1]])
    with pytest.raises(MemoryError, match="2 swap pages, only 1 free"):
        pool.allocate_swap(2)
    assert len(pool.swap_free) == 1  # all or nothing
    pool.release_swap(held)
    pool.check([], [])
    with pytest.raises(ValueError, match="num_swap_pages"):
        PagePool(4, 2, num_swap_pages=-1)


def test_the_simulated_executor_charges_swap_copies():
    """`s` seconds per page copied, on top of the forward: the clock gap between the same run
    with s and without it is s times the pages copied."""
    runs = []
    for s in (0.0, 0.25):
        cost = CostModel(a=0.01, b=1e-4, c=1e-4, s=s)
        e = make_sim_engine(cost, policy="pd", num_pages=6, page_size=4, max_num_seqs=3,
                            preemption_mode="swap", enable_prefix_caching=False)
        for i in range(3):
            e.add_request([3 + i] * 6, SamplingParams(max_tokens=12, ignore_eos=True))
        e.run()
        copied = sum(r.pages_swapped_out + r.pages_swapped_in for r in e.trace)
        runs.append((e.clock(), copied))
    (plain, copied), (charged, copied_again) = runs
    assert copied == copied_again > 0
    assert charged - plain == pytest.approx(0.25 * copied)
    assert CostModel.from_dict({"a": 1, "s": 2e-5}).s == 2e-5
    with pytest.raises(ValueError, match="coefficient s"):
        CostModel.from_dict({"a": 1, "s": -1})


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(workload=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(1, 12)),
                         min_size=1, max_size=7),
       seed=st.integers(0, 1000), num_swap_pages=st.sampled_from([2, 5, None]))
def test_swap_under_every_policy_returns_single_tokens(make_engine, policy, workload, seed,
                                                       num_swap_pages):
    """Random workloads in 14 pages of 4, swap space of 2, 5 or 14 pages: swap-outs and
    swap-ins in the same step, fallbacks to recompute, prefix sharing: every request returns
    the single-request tokens, the invariants hold every step, nothing leaks on either side."""
    engine = make_engine(policy, max_num_seqs=3, max_num_batched_tokens=16, chunk_size=8,
                         page_size=4, num_pages=14, preemption_mode="swap",
                         num_swap_pages=num_swap_pages)
    reference = make_engine("single", page_size=4, num_pages=64)
    run_beside_single(engine, reference, random_jobs(workload, seed, GREEDY))
    assert engine.pool.num_used == 0
    assert len(engine.pool.swap_free) == engine.pool.num_swap_pages == (num_swap_pages or 14)


# --- reject ------------------------------------------------------------------------------------

def test_reject_when_full_turns_away_what_the_cache_cannot_take(make_engine):
    """A burst of five 20-token prompts into 8 pages of 8: three fit (3 pages each, 9 > 8:
    two fit whole, the third's pages are not there), the rest are rejected at arrival: no
    token, no page, finish_reason "rejected", listed as finished in the step they arrived;
    the admitted ones return the single-request tokens."""
    engine = make_engine("pd", num_pages=8, page_size=8, max_num_seqs=6, reject_when_full=True)
    p = SamplingParams(max_tokens=4, **GREEDY)
    prompts = [[10 + i] * 20 for i in range(5)]
    ids = [engine.add_request(x, p, request_id=f"r{i}") for i, x in enumerate(prompts)]
    engine.run()
    reasons = {i: engine.requests[i].finish_reason for i in ids}
    assert reasons == {"r0": "length", "r1": "length", "r2": "rejected", "r3": "rejected",
                       "r4": "rejected"}
    for rid in ("r2", "r3", "r4"):
        req = engine.requests[rid]
        assert not req.output_token_ids and req.metrics.first_scheduled_step is None
        assert rid in engine.trace[0].finished and rid in engine.trace[0].arrived
    s = metrics.summarize(engine.trace, metrics.request_records(engine))
    assert s["rejected"] == 3 and s["completed"] == 2 and s["slo_attainment"] == 2 / 5
    ref = make_engine("single")
    for i in (0, 1):
        ref.add_request(prompts[i], p, request_id=f"r{i}")
    ref.run()
    assert all(engine.requests[r].output_token_ids == ref.requests[r].output_token_ids
               for r in ref.requests)
    assert engine.pool.num_used == 0


def test_without_reject_the_same_burst_waits(make_engine):
    """Without reject_when_full, a burst larger than the pool waits its turn and every request
    finishes by length."""
    engine = make_engine("pd", num_pages=8, page_size=8, max_num_seqs=6)
    for i in range(5):
        engine.add_request([10 + i] * 20, SamplingParams(max_tokens=4, **GREEDY))
    engine.run()
    assert all(r.finish_reason == "length" for r in engine.requests.values())


def test_reject_counts_prefix_hits_on_pages_in_use():
    """A prompt sharing a running request's prompt pages needs only its own: it is accepted
    where a fresh prompt of the same length is not."""
    engine = make_sim_engine(policy="pd", num_pages=8, page_size=8, max_num_seqs=6,
                             reject_when_full=True, check_invariants=True)
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    shared = [5] * 40
    engine.add_request(shared, p, request_id="first")
    engine.step()  # its 5 prompt pages are computed and indexed; 3 pages are left
    engine.add_request([6] * 33, p, request_id="fresh")  # 5 pages
    engine.add_request(shared[:33], p, request_id="copy")  # 4 shared + 1 of its own
    engine.run()
    assert engine.requests["fresh"].finish_reason == "rejected"
    assert engine.requests["copy"].finish_reason == "length"
    assert engine.requests["copy"].num_cached_tokens == 32


def after_a_cached_prompt():
    """A reject_when_full engine whose only run left its 40-token prompt's 5 pages cached (8
    pages of 8 tokens, all available): (engine, params, that prompt)."""
    engine = make_sim_engine(policy="pd", num_pages=8, page_size=8, max_num_seqs=6,
                             reject_when_full=True, check_invariants=True)
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    shared = [5] * 40
    engine.add_request(shared, p, request_id="first")
    engine.run()
    assert engine.pool.num_cached == 5 and engine.pool.num_available == 8
    return engine, p, shared


def test_reject_counts_cached_pages_as_taken_when_reused():
    """Once the run is over, unreferenced cached pages are available like free ones, and a
    prompt reusing them takes them (they stop being available): 8 available pages take the
    cached copy's 5 and a 3-page prompt, and a third prompt is rejected."""
    engine, p, shared = after_a_cached_prompt()
    engine.add_request(shared[:33], p, request_id="cached-copy")
    engine.add_request([7] * 20, p, request_id="later")
    engine.add_request([8] * 9, p, request_id="one-more")
    engine.run()
    assert [engine.requests[r].finish_reason for r in ("cached-copy", "later", "one-more")] \
        == ["length", "length", "rejected"]
    assert engine.requests["cached-copy"].num_cached_tokens == 32


def test_reject_counts_cached_pages_two_arrivals_share_once():
    """Two copies of a cached prompt arriving together share its 4 cached pages: they take
    4 + 1 + 1 = 6 of the 8 available, so both are accepted (charging each the 4 would make
    5 + 5 > 8); a third, fresh 3-page prompt would make 9 and is rejected."""
    engine, p, shared = after_a_cached_prompt()
    for rid in ("copy-1", "copy-2"):
        engine.add_request(shared[:33], p, request_id=rid)
    engine.add_request([7] * 20, p, request_id="fresh")
    engine.run()
    assert [engine.requests[r].finish_reason for r in ("copy-1", "copy-2", "fresh")] \
        == ["length", "length", "rejected"]
    assert not any(rec.preempted for rec in engine.trace)


def test_a_rejected_arrival_claims_no_cached_pages():
    """A request rejected at arrival shares nothing: the cached pages it would have reused
    are still charged to the next arrival that reuses them. 8 available: "fresh" takes 3;
    "big" (4 cached pages + 3 new) would make 10 and is rejected; "copy" (4 cached + 1) makes
    8; a 2-page "last" would make 10 and is rejected."""
    engine, p, shared = after_a_cached_prompt()
    engine.add_request([7] * 20, p, request_id="fresh")
    engine.add_request(shared[:32] + [9] * 17, p, request_id="big")
    engine.add_request(shared[:33], p, request_id="copy")
    engine.add_request([8] * 9, p, request_id="last")
    engine.run()
    assert [engine.requests[r].finish_reason for r in ("fresh", "big", "copy", "last")] \
        == ["length", "rejected", "length", "rejected"]
    assert not any(rec.preempted for rec in engine.trace)
    assert engine.requests["copy"].num_cached_tokens == 32


def test_reject_counts_what_the_waiting_queue_will_take():
    """One slot: the second request waits for the slot with its pages promised, so a third
    that would fit the free pages alone is rejected."""
    engine = make_sim_engine(policy="pd", num_pages=10, page_size=4, max_num_seqs=1,
                             reject_when_full=True, check_invariants=True,
                             enable_prefix_caching=False)
    p = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request([1] * 14, p, request_id="a")  # 4 pages
    engine.add_request([2] * 14, p, request_id="b")  # 4 pages, waits for the slot
    engine.add_request([3] * 14, p, request_id="c")  # 10 - 4 - 4 = 2 < 4
    engine.run()
    assert [engine.requests[r].finish_reason for r in "abc"] == ["length", "length", "rejected"]


@pytest.mark.parametrize("options, message", [
    (dict(preemption_mode="spill"), "preemption_mode must be one of"),
    (dict(num_swap_pages=8), "needs preemption_mode='swap'"),
    (dict(preemption_mode="swap", num_swap_pages=0), "num_swap_pages must be a positive"),
    (dict(preemption_mode="swap", num_swap_pages=True), "num_swap_pages must be a positive"),
    (dict(reject_when_full="yes"), "reject_when_full must be True or False"),
])
def test_bad_full_cache_options_are_refused(options, message):
    """An unknown preemption mode, swap pages without swap mode, a non-positive or boolean swap size
    and a non-boolean reject_when_full raise ValueError naming the option."""
    with pytest.raises(ValueError, match=message):
        make_sim_engine(policy="pd", **options)


def test_reserve_and_reject_counts_each_requests_whole_life():
    """With max_preemptions=0 a request is admitted only with pages for its whole life, so
    reject counts that: 8 pages take two lives of 4 pages, and a third request is rejected
    though its one-page prompt alone would fit."""
    engine = make_sim_engine(policy="pd", num_pages=8, page_size=8, max_num_seqs=6,
                             max_preemptions=0, reject_when_full=True, check_invariants=True)
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    for i in range(3):
        engine.add_request([10 + i] * 8, p, request_id=f"r{i}")
    engine.run()
    assert [engine.requests[f"r{i}"].finish_reason for i in range(3)] == \
        ["length", "length", "rejected"]
    assert metrics.summarize(engine.trace, metrics.request_records(engine))["preemptions"] == 0


def test_stats_show_the_swap_space_only_when_there_is_one():
    """stats() adds swap_pages_total and swap_pages_free only when there is a swap space, and
    otherwise matches the plain engine's."""
    plain = make_sim_engine(policy="pd", num_pages=8).stats()
    swapping = make_sim_engine(policy="pd", num_pages=8, preemption_mode="swap",
                               num_swap_pages=5).stats()
    assert not any(k.startswith("swap") for k in plain)
    assert swapping == {**plain, "swap_pages_total": 5, "swap_pages_free": 5}


def test_measured_swap_cost_is_a_plausible_copy_time():
    """Seconds per page of a SmolLM2-shaped page (30 layers, 3 KV heads of 64, 16 tokens in
    float32: 737 KB): between 1 microsecond (740 GB/s) and 10 ms (74 MB/s)."""
    from minicb.benchmark.sim import measure_swap_cost
    assert 1e-6 < measure_swap_cost(30, 3, 64, num_pages=8, repeats=3) < 1e-2


@pytest.mark.parametrize("mode, num_swap_pages, prefix", [
    ("swap", None, False), ("swap", 3, False), ("recompute", None, True)],
    ids=["swap", "swap-3-pages", "recompute-onto-cached-pages"])
def test_step_features_follow_each_members_context(mode, num_swap_pages, prefix):
    """The features rebuilt from the trace are the ones the model saw, every step: a swapped
    victim's context does not restart (`StepRecord.swapped`; with 3 host pages others are
    recomputed), and a recomputed victim readmitted onto its own prompt pages still cached
    starts at that hit (`Member.start`), which the trace's counts alone cannot tell."""
    import numpy as np

    from minicb.benchmark.sim import step_features
    cost = CostModel(a=0.01, b=1e-4, c=1e-4, d=1e-6, e=1e-8)
    engine = make_sim_engine(cost, policy="pd", num_pages=8, page_size=4, max_num_seqs=4,
                             preemption_mode=mode, num_swap_pages=num_swap_pages,
                             enable_prefix_caching=prefix)
    for i in range(4):
        engine.add_request([3 + i] * 6, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.run()
    swapped = [rid for rec in engine.trace for rid in rec.swapped]
    recomputed = [rid for rec in engine.trace for rid in rec.preempted if rid not in rec.swapped]
    assert (swapped or mode == "recompute") and (recomputed or num_swap_pages is None)
    assert all(set(rec.swapped) <= set(rec.preempted) for rec in engine.trace)
    if prefix:  # a readmitted victim's first chunk starts past 0: its cached prompt page
        readmitted = {rid for rec in engine.trace for rid in rec.preempted}
        assert any(m.start > 0 for rec in engine.trace for m in rec.members
                   if m.request_id in readmitted and m.kind == "prefill")
    predicted = cost.predict_features(step_features(engine.trace, metrics.request_records(engine)))
    forward = np.array([rec.t_forward for rec in engine.trace])
    assert np.allclose(forward, predicted, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_per_step_lost_work_adds_up_to_the_requests_counts(make_engine, mode):
    """Each step records the K/V its preemptions threw away and the tokens it computed again
    (what serve's /metrics counters add up), and over the run they equal the requests' own
    counts; with a swap space large enough for every victim both are 0."""
    options = dict(preemption_mode="swap", num_swap_pages=64) if mode == "swap" else {}
    engine, same = tight_run(make_engine, **options)
    records = metrics.request_records(engine)
    discarded = sum(rec.tokens_discarded for rec in engine.trace)
    recomputed = sum(rec.tokens_recomputed for rec in engine.trace)
    assert same and sum(r.num_preemptions for r in records) > 0
    assert discarded == sum(r.num_discarded_tokens for r in records)
    assert recomputed == sum(r.num_recomputed_tokens for r in records)
    assert (discarded > recomputed > 0) if mode == "recompute" else discarded == recomputed == 0


def test_pictures_tell_a_swap_from_a_recompute():
    """The timeline marks a swapped victim with "v" (its K/V went to host memory) and a
    recomputed one with "x"; a swapped victim comes back decoding, a recomputed one prefills
    its tokens again."""
    from minicb.course import viz
    texts = {}
    for mode in ("recompute", "swap"):
        e = make_sim_engine(policy="pd", num_pages=6, page_size=4, max_num_seqs=3,
                            preemption_mode=mode, enable_prefix_caching=False)
        for i in range(3):
            e.add_request([3 + i] * 6, SamplingParams(max_tokens=12, ignore_eos=True),
                          request_id=f"r{i}")
        e.run()
        data = viz.timeline_data(e)
        assert data.preemptions == {"r1": [8], "r2": [4]}
        assert data.swaps == ({"r1": [8], "r2": [4]} if mode == "swap" else {})
        after = [state for step, state in sorted(data.cells["r1"].items()) if step > 8
                 and state != "waiting"]
        assert after[0] == ("decode" if mode == "swap" else "prefill")
        texts[mode] = viz.render_text(e, width=80)
        labels = [h.get_label() for h in viz.plot_timeline(e).axes[0].get_legend().legend_handles]
        assert ("preempted (swapped to host)" in labels) == (mode == "swap")
    assert "r1    ▓██████x····▓" in texts["recompute"] and "v swapped" not in texts["recompute"]
    assert "r1    ▓██████v····█" in texts["swap"] and "v swapped to host" in texts["swap"]


def test_a_long_queue_waiting_for_slots_is_not_looked_up_at_every_arrival():
    """With pages to spare, the lower bound (pages each waiting request's tokens need) already
    admits an arrival: one prefix lookup per arrival (its own), not one per waiting request.
    Across a step the bound is recounted (arithmetic only)."""
    engine = make_sim_engine(policy="pd", num_pages=400, page_size=4, max_num_seqs=1,
                             reject_when_full=True)
    lookups = []
    to_admit = engine.admission.pages_to_admit
    engine.admission.pages_to_admit = lambda req: lookups.append(req.request_id) or to_admit(req)
    for i in range(30):
        engine.add_request([7 + i] * 10, SamplingParams(max_tokens=2, ignore_eos=True))
        if i % 10 == 9:
            engine.step()
    assert len(engine.waiting) > 20 and len(lookups) == 30
    assert {r.finish_reason for r in engine.requests.values()} <= {None, "length"}


def running_with_a_waiting_twin(num_pages: int):
    """Under reject_when_full, one slot: "run" holds a 32-token prompt's 8 pages and decodes;
    "twin", its prompt and one token more, waits for the slot (8 of its pages are hits on
    pages in use)."""
    engine = make_sim_engine(policy="pd", num_pages=num_pages, page_size=4, max_num_seqs=1,
                             reject_when_full=True)
    prompt = list(range(3, 35))
    engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True), request_id="run")
    engine.step()
    engine.add_request(prompt + [1], SamplingParams(max_tokens=1), request_id="twin",
                       arrival_step=engine.step_count + 1)
    engine.step()
    return engine


def test_prefix_hits_the_bound_leaves_out_still_admit():
    """The bound counts every waiting request's pages as taken; when that falls short, the
    exact count (prefix hits on pages in use cost nothing) decides: an arrival that fits only
    because a waiting request shares a running one's prompt pages is admitted, and one page
    more is rejected."""
    engine = running_with_a_waiting_twin(12)
    twin = engine.requests["twin"]
    assert twin in engine.waiting and engine.admission.pages_to_admit(twin) == 1  # 8 hits in use
    fits = engine.pool.num_available - 1  # by the exact count; the bound says 9 are taken
    assert fits > engine.pool.num_available - 9
    engine.add_request([90] * 4 * fits, SamplingParams(max_tokens=1), request_id="late")
    engine.add_request([91] * 4, SamplingParams(max_tokens=1), request_id="one-too-many")
    assert engine.requests["late"].finish_reason is None
    assert engine.requests["one-too-many"].finish_reason == "rejected"
    engine.run()
    assert engine.pool.num_used == 0


def test_the_bound_counts_a_reserving_queue_by_its_whole_lives():
    """Under max_preemptions=0 a waiting request will take its whole life's pages: the lower
    bound must count those too, or an arrival the waiting queue has already claimed the room
    for would be let in."""
    engine = make_sim_engine(policy="pd", num_pages=12, page_size=4, max_num_seqs=1,
                             max_preemptions=0, reject_when_full=True)
    engine.add_request([5] * 8, SamplingParams(max_tokens=8, ignore_eos=True), request_id="run")
    engine.step()  # reserves its 4 pages of life
    engine.add_request([6] * 4, SamplingParams(max_tokens=12, ignore_eos=True), request_id="w")
    assert engine.requests["w"] in engine.waiting and engine.pool.num_available == 8
    engine.step()  # w waits for the slot: 4 of its life's pages are claimed, 1 of its prompt's
    engine.add_request([7] * 16, SamplingParams(max_tokens=1), request_id="x")  # 5 pages of life
    assert engine.requests["x"].finish_reason == "rejected"
    engine.run()
    assert engine.pool.num_used == 0


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(jobs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 6),
                               st.booleans()), min_size=1, max_size=12),
       num_pages=st.sampled_from([6, 10, 20]), mode=st.sampled_from(["recompute", "swap"]),
       limit=st.sampled_from([None, 0, 1]))
def test_the_remembered_unclaimed_pages_decide_as_the_exact_count(jobs, num_pages, mode, limit):
    """reject_when_full remembers the pages unclaimed between arrivals instead of rescanning
    the queue for each, and counts a cheap lower bound first: at every arrival, over random
    arrivals between and within steps, cancels, prefix sharing, both preemption modes and
    max_preemptions None, 0 or 1, the value it decides on is at most a fresh exact scan of the
    waiting queue, equal to it whenever it rejects, and it rejects exactly when the exact count
    would."""
    engine = make_sim_engine(policy="pd", num_pages=num_pages, page_size=4, max_num_seqs=3,
                             max_num_batched_tokens=16, chunk_size=8, reject_when_full=True,
                             preemption_mode=mode, max_preemptions=limit,
                             check_invariants=True)
    remembered = engine.admission.pages_unclaimed
    checked = []

    def compare(need: int) -> int:
        exact = engine.pool.num_available - sum(engine.admission.pages_to_admit(r)
                                                for r in engine.waiting)
        value = remembered(need)
        assert value <= exact and (value < need) == (exact < need)
        assert value >= need or value == exact
        checked.append((value, exact))
        return value

    engine.admission.pages_unclaimed = compare
    shared, added = list(range(3, 43)), 0
    for i, (length, max_tokens, steps_before, cancel) in enumerate(jobs):
        for _ in range(steps_before):
            if engine.has_unfinished():
                engine.step()
        prompt = shared[:length] if i % 3 == 0 else [50 + i] * length
        if length + max_tokens > num_pages * 4:
            continue
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        added += 1
        queue = engine.waiting if i % 2 else engine.running  # a running one frees pages
        if cancel and queue:
            engine.cancel(queue[0].request_id)
    engine.run()
    assert len(checked) == added  # every arrival asked
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("computed", [8, 9])
def test_a_returning_victim_shares_only_the_pages_it_had_and_frees_its_host_pages_later(
        computed):
    """Scheduler level: a twin holds a 16-token prompt's pages (3 of them indexed: a prompt
    match always leaves its last token to compute). A victim of the same prompt swapped out
    mid-prefill with 8 or 9 tokens computed shares the 2 full pages it had, not the third: it
    will write positions from 8 or 9 on there, and a page another request reads must not be
    written (with 9, its third page is copied back in). Its host pages are released only with
    the step's copies (a swap-out later in the same step must not take them while they are
    written). The engine's reject rule counts what this admission takes."""
    pool = PagePool(8, 4, num_swap_pages=4)
    prompt = list(range(3, 19))
    twin = pool.allocate(4)
    pool.register_prompt_pages(prompt, twin, 16)
    req = Request("s", prompt, SamplingParams(max_tokens=4, ignore_eos=True),
                  status=Status.SWAPPED, num_computed_tokens=computed, num_preemptions=1)
    req.swapped_pages = host = pool.allocate_swap(pool.pages_needed(computed))
    engine = make_sim_engine(num_pages=8, page_size=4)
    engine.admission.pool = pool  # the same pool, seen by the engine's reject rule
    assert engine.admission.pages_to_admit(req) == pool.pages_needed(req.num_tokens) - 2
    ctx = SchedulerContext(deque([req]), [], pool, EngineConfig(preemption_mode="swap"), 1,
                           0.0, [0, 1])
    assert ctx.admit(req, 4) == 4
    assert req.page_table[:2] == twin[:2] and req.num_computed_tokens == computed
    assert all(pool.ref_count[p] == 1 for p in req.page_table[2:])  # its own to write
    assert ctx.batch.swap_in == list(zip(host[2:], req.page_table[2:]))
    assert ctx.batch.swap_release == host and not set(host) & set(pool.swap_free)


def test_a_swap_in_that_copies_nothing_still_gives_its_host_pages_back():
    """A victim preempted right after a page-aligned prefill comes back to its prompt pages,
    all still cached: nothing to copy in, yet its host pages must be released that step."""
    engine = make_sim_engine(policy="continuous", num_pages=9, page_size=4, max_num_seqs=2,
                             preemption_mode="swap", num_swap_pages=16, check_invariants=True)
    release_only = []
    move = engine.runner.copy_pages

    def spy(batch):
        if batch.swap_release and not (batch.swap_in or batch.swap_out):
            release_only.append(engine.step_count)
        return move(batch)
    engine.runner.copy_pages = spy
    for i in range(2):
        engine.add_request([10 + i] * 16, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.run()
    assert release_only and len(engine.pool.swap_free) == 16


def test_after_an_accept_by_the_bound_the_next_arrival_still_gets_the_exact_count():
    """The bound admits a small arrival; a big one right after, which fits only by the exact
    count (a waiting twin's prefix hits on a running request's pages), must not be refused on
    the bound's remembered value."""
    engine = running_with_a_waiting_twin(30)
    exact = engine.pool.num_available - sum(engine.admission.pages_to_admit(r)
                                            for r in engine.waiting)
    engine.add_request([90] * 4, SamplingParams(max_tokens=1), request_id="small")  # 2 pages
    engine.add_request([91] * (4 * (exact - 3)), SamplingParams(max_tokens=1), request_id="big")
    assert engine.requests["small"].finish_reason is None
    assert engine.requests["big"].finish_reason is None
    engine.run()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("fails_at", ["swap-out", "swap-in"])
def test_a_policy_that_raises_mid_schedule_still_gets_its_swap_copies(make_engine, fails_at):
    """A learner's policy preempts (swap) or readmits a swapped request, then raises in the
    same call. The pool and the request changed at once, so the copies they planned must still
    run: the engine carries on (the policy is fine again next step) with its books balanced and
    the single-request tokens, which zeroed K/V or lost host pages would not give."""
    from minicb.scheduler import PDScheduler

    class Flaky(PDScheduler):
        def schedule(self, ctx):
            if ctx.step == 4:
                ctx.preempt(ctx.running[-1])
                if fails_at == "swap-out":
                    raise RuntimeError("a learner's bug")
                return super().schedule(ctx)  # the decodes left; no readmission this step
            if ctx.step == 5 and fails_at == "swap-in":
                super().schedule(ctx)  # readmits the victim: its swap-in is planned
                planned.extend(ctx.batch.swap_in)
                raise RuntimeError("a learner's bug")
            return super().schedule(ctx)

    planned: list = []
    prompts = [list(range(10, 30)), list(range(40, 60))]
    p = SamplingParams(max_tokens=12, **GREEDY)
    engine = make_engine(Flaky(), page_size=4, num_pages=64, preemption_mode="swap",
                         num_swap_pages=16)
    ids = [engine.add_request(x, p) for x in prompts]
    with pytest.raises(RuntimeError, match="a learner's bug"):
        engine.run()
    engine.check_invariants()
    engine.run()
    ref = make_engine("single")
    ref_ids = [ref.add_request(x, p) for x in prompts]
    ref.run()
    assert [engine.requests[i].output_token_ids for i in ids] == \
        [ref.requests[i].output_token_ids for i in ref_ids]
    assert sum(r.pages_swapped_out for r in engine.trace) > 0 if fails_at == "swap-in" \
        else sum(r.pages_swapped_in for r in engine.trace) > 0  # the failed step has no record
    assert bool(planned) == (fails_at == "swap-in")
    assert engine.pool.num_used == 0 and len(engine.pool.swap_free) == 16


@pytest.mark.parametrize("policy", ["continuous", "pd"])
def test_prompt_pages_are_shareable_as_soon_as_they_are_computed(make_engine, policy):
    """After every step, each full prompt page a running request has computed is in the prefix
    index, also when a recomputation's chunk runs past the prompt's end (its cached pages were
    evicted while it waited): a twin arriving then shares them instead of computing them."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(20)] for i in range(6)]
    engine = make_engine(policy, num_pages=12, page_size=8, max_num_seqs=6,
                         enable_prefix_caching=True, chunk_size=64, max_num_batched_tokens=64)
    for x in prompts:
        engine.add_request(x, SamplingParams(max_tokens=40, **GREEDY))
    crossing = 0
    while engine.has_unfinished():
        record = engine.step()
        for m in record.members:
            req = engine.requests[m.request_id]
            start = req.num_computed_tokens - m.num_tokens
            crossing += m.kind == "prefill" and start < req.num_prompt_tokens < \
                req.num_computed_tokens
        for req in engine.running:
            full = min(req.num_computed_tokens, req.num_prompt_tokens) // 8
            assert all(h in engine.pool.prefix.page_of for h in req.page_hashes[:full]), \
                f"step {record.step}: {req.request_id}'s computed prompt pages not indexed"
    assert crossing > 0  # the case this test is about happened


NO_EOS = dict(ignore_eos=True)



def test_a_swap_space_exactly_the_victims_size_takes_it_and_the_step_counts_each_way():
    """A swap space exactly the victim's size takes it; each step counts its pages copied out
    and in, stats() and summarize count the swap space as it fills; a victim with no room left
    is recomputed."""
    engine = three_in_six(num_swap_pages=2)
    steps = {}
    while engine.has_unfinished():
        rec = engine.step()
        steps[rec.step] = (rec.preempted, rec.swapped, rec.pages_swapped_out,
                           rec.pages_swapped_in, engine.stats()["swap_pages_free"])
        if rec.swapped:  # mid-run, what summarize says: 2 out, none back yet
            s = metrics.summarize(engine.trace, metrics.request_records(engine))
            assert (s["swapped_out_pages"], s["swapped_in_pages"]) == (2, 0)
    moves = {s: v for s, v in steps.items() if v[0] or v[3]}
    assert list(moves.values()) == [(["r2"], ["r2"], 2, 0, 0), (["r1"], [], 0, 0, 0),
                                    ([], [], 0, 2, 2)]
    assert engine.requests["r2"].num_discarded_tokens == 0
    assert engine.requests["r1"].num_discarded_tokens == 12


def test_a_protected_request_swapped_back_gets_its_whole_life():
    """A protected request (max_preemptions) swapped back in holds pages for its whole life from
    the step it returns."""
    engine = three_in_six(max_preemptions=1)
    back = []
    while engine.has_unfinished():
        rec = engine.step()
        for rid in ("r1", "r2"):
            req = engine.requests[rid]
            if rec.pages_swapped_in and req.status is Status.RUNNING and rid not in back:
                back.append(rid)
                assert len(req.page_table) == engine.pool.pages_needed(req.max_total_tokens)
    assert sorted(back) == ["r1", "r2"]
    assert all(r.num_preemptions == 1 for r in map(engine.requests.get, back))


def swapped_context(num_pages, computed=8, prompt=10, **config):
    """A SchedulerContext over `num_pages` pages of 4 with one SWAPPED request at the front of
    the queue: `computed` tokens of its `prompt`-token prompt kept in host pages."""
    pool = PagePool(num_pages, 4, num_swap_pages=4, enable_prefix_caching=False)
    req = Request("s", list(range(3, 3 + prompt)), SamplingParams(max_tokens=8, **NO_EOS),
                  status=Status.SWAPPED, num_computed_tokens=computed, num_preemptions=1)
    req.swapped_pages = pool.allocate_swap(pool.pages_needed(computed))
    cfg = EngineConfig(preemption_mode="swap", **config)
    return SchedulerContext(deque([req]), [], pool, cfg, 1, 0.0, [0, 1]), req


def test_a_swapped_request_is_admitted_when_the_free_pages_just_fit():
    """A swapped request is admitted when the free pages just fit its computed tokens and chunk,
    not with one fewer."""
    ctx, req = swapped_context(3)
    host = list(req.swapped_pages)
    assert ctx.admit(req, 4) == 2  # its prompt's 2 remaining tokens
    assert req.status is Status.RUNNING and len(req.page_table) == 3
    assert ctx.batch.swap_in == list(zip(host, req.page_table[:2]))
    ctx, req = swapped_context(2, computed=8, prompt=12)
    assert ctx.admit(req, 4) == 0
    assert req.status is Status.SWAPPED and req.swapped_pages and not ctx.batch.swap_in


def test_a_swapped_request_mid_prefill_honours_min_chunk():
    """A swapped request mid-prefill comes back only for a chunk of at least min_chunk."""
    ctx, req = swapped_context(8, computed=4, prompt=16)
    assert ctx.admit(req, 2, min_tokens=4) == 0
    assert req.status is Status.SWAPPED and not ctx.batch.swap_in
    assert ctx.admit(req, 4, min_tokens=4) == 4 and req.status is Status.RUNNING


def running_context(computed, pages, mode="swap"):
    """A SchedulerContext over 8 pages of 4 with one RUNNING request (a 16-token prompt,
    `computed` tokens computed) holding `pages` pages, in slot 0."""
    pool = PagePool(8, 4, num_swap_pages=0 if mode == "recompute" else 8,
                    enable_prefix_caching=False)
    req = Request("v", list(range(3, 19)), SamplingParams(max_tokens=8, **NO_EOS),
                  status=Status.RUNNING, num_computed_tokens=computed, slot=0)
    req.page_table = pool.allocate(pages)
    ctx = SchedulerContext(deque(), [req], pool, EngineConfig(preemption_mode=mode), 1, 0.0,
                           [1])
    return ctx, req


def test_a_swap_copies_only_the_pages_holding_computed_tokens():
    """A swap copies only the pages that hold computed tokens, not pages reserved ahead."""
    ctx, req = running_context(computed=5, pages=3)
    device = list(req.page_table)
    ctx.preempt(req)
    assert req.status is Status.SWAPPED and len(req.swapped_pages) == 2
    assert ctx.batch.swap_out == list(zip(device[:2], req.swapped_pages))
    assert ctx.batch.swapped == [req] and ctx.pool.num_used == 0


def test_a_victim_with_nothing_computed_is_not_swapped():
    """A victim with nothing computed is preempted, not swapped: it has no K/V to keep."""
    ctx, req = running_context(computed=0, pages=2)
    ctx.preempt(req)
    assert req.status is Status.PREEMPTED and req.swapped_pages == []
    assert not ctx.batch.swap_out and not ctx.batch.swapped and ctx.batch.preempted == [req]


def test_a_recomputed_victim_counts_no_computed_tokens():
    """A victim to be recomputed has no computed tokens left, and its lost work is counted."""
    ctx, req = running_context(computed=9, pages=3, mode="recompute")
    ctx.preempt(req)
    assert req.status is Status.PREEMPTED and req.num_computed_tokens == 0
    assert req.num_discarded_tokens == 9 and req.num_tokens_before_preemption == 9
    assert req.num_remaining == 16


def test_swap_out_is_copied_before_swap_in_into_the_same_page(make_engine):
    """Swap copies run out before in (a page a victim gave up may be the one a returning request
    takes); the host pages the plan releases are free again."""
    engine = make_engine(num_pages=4, preemption_mode="swap", num_swap_pages=3)
    pool = engine.pool
    victim, returning = torch.full_like(pool.every_layer[:, :, 2], 1.0), \
        torch.full_like(pool.every_layer[:, :, 2], 2.0)
    pool.every_layer[:, :, 2] = victim
    host_in, host_out = pool.allocate_swap(2)
    pool.swap_store[:, :, host_in] = returning
    batch = ScheduledBatch(swap_out=[(2, host_out)], swap_in=[(host_in, 2)],
                           swap_release=[host_in])
    assert engine.runner.copy_pages(batch) == (1, 1)
    assert torch.equal(pool.swap_store[:, :, host_out], victim)
    assert torch.equal(pool.every_layer[:, :, 2], returning)
    assert sorted(pool.swap_free) == sorted([host_in, *set(range(3)) - {host_in, host_out}])


def test_a_one_page_victim_is_swapped_and_the_books_balance_every_step():
    """A victim keeping a single host page is swapped, and the books balance every step."""
    engine = make_sim_engine(policy="pd", num_pages=4, page_size=8, max_num_seqs=3,
                             preemption_mode="swap", enable_prefix_caching=False,
                             check_invariants=True)
    for i in range(3):
        engine.add_request([3 + i] * 4, SamplingParams(max_tokens=12, **NO_EOS),
                           request_id=f"r{i}")
    held = []
    while engine.has_unfinished():
        rec = engine.step()
        held += [len(engine.requests[r].swapped_pages) for r in rec.swapped]
    assert held == [1]
    assert sum(r.pages_swapped_in for r in engine.trace) == 1


def test_invariants_catch_a_swapped_request_without_host_pages():
    """The invariant check names a SWAPPED request without host pages."""
    engine = three_in_six()
    while not any(r.status is Status.SWAPPED for r in engine.requests.values()):
        engine.step()
    victim = next(r for r in engine.requests.values() if r.status is Status.SWAPPED)
    engine.check_invariants()
    engine.pool.release_swap(victim.swapped_pages)
    victim.swapped_pages = []
    with pytest.raises(InvariantError, match="is swapped with 0 swap pages"):
        engine.check_invariants()
