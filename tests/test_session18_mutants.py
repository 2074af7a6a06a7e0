"""Planted-bug tests from a mutation review of session 18's code (commits 94bf25f..eb69537: two
more answers to a full KV cache, preemption_mode="swap" and reject_when_full, and their plumbing
through bench, serve and the client): each test fails on the bug its docstring names and passes
on the real code."""

from __future__ import annotations

import itertools
import json
from collections import deque

import pytest
import torch

from minicb.benchmark import bench, metrics, runs, sim
from minicb.benchmark.sim import CostModel, make_sim_engine
from minicb.config import EngineConfig
from minicb.course import viz
from minicb.engine import InvariantError
from minicb.kv_cache import PagePool
from minicb.request import Request, SamplingParams, Status
from minicb.scheduler import ScheduledBatch, SchedulerContext
from minicb.serving import client
from minicb.serving.worker import EngineWorker
from minicb.trace import StepRecord

NO_EOS = dict(ignore_eos=True)


def three_in_six(**options):
    """Three 6-token prompts, 12 tokens each, in 6 pages of 4: r2 is preempted at step 4 with
    8 computed tokens (2 pages), r1 at step 8 with 12 (3 pages)."""
    engine = make_sim_engine(policy="pd", num_pages=6, page_size=4, max_num_seqs=3,
                             preemption_mode="swap", enable_prefix_caching=False,
                             check_invariants=True, **options)
    for i in range(3):
        engine.add_request([3 + i] * 6, SamplingParams(max_tokens=12, **NO_EOS),
                           request_id=f"r{i}")
    return engine


# ------------------------------------------------------------------------------ scheduler
def test_a_swap_space_exactly_the_victims_size_takes_it_and_the_step_counts_each_way():
    """Planted: `keep < len(swap_free)` for `<=` (a swap space exactly the victim's size
    recomputed it), the step's (out, in) counts swapped in `_move_pages`' return or the record,
    and stats() showing the swap space's size as free. Two host pages hold r2's two pages:
    it is swapped, the step copies 2 out and 0 in, stats say 0 free, and r1 (3 pages, no room
    left) is recomputed; r2 comes back with 2 pages copied in. Also: summarize's two counts
    swapped (equal at the end of most runs, not mid-run)."""
    engine = three_in_six(num_swap_pages=2)
    steps = {}
    while engine.has_unfinished():
        rec = engine.step()
        steps[rec.step] = (rec.preempted, rec.swapped, rec.pages_swapped_out,
                           rec.pages_swapped_in, engine.stats()["swap_pages_free"])
        if rec.swapped:  # mid-run, what summarize says: 2 out, none back yet
            s = metrics.summarize(engine.trace, engine.request_records())
            assert (s["swapped_out_pages"], s["swapped_in_pages"]) == (2, 0)
    moves = {s: v for s, v in steps.items() if v[0] or v[3]}
    assert list(moves.values()) == [(["r2"], ["r2"], 2, 0, 0), (["r1"], [], 0, 0, 0),
                                    ([], [], 0, 2, 2)]
    assert engine.requests["r2"].num_discarded_tokens == 0
    assert engine.requests["r1"].num_discarded_tokens == 12


def test_a_protected_request_swapped_back_gets_its_whole_life():
    """Planted: `_swap_in` without the `is_protected` clause. With max_preemptions=1 a swapped
    victim returns protected, never to be preempted again, so it must hold pages for its whole
    life (6 + 12 tokens: 5 pages of 4) from the step it is back; with only the pages for its
    next token it would need more later with no way to get them but preempting others."""
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
    """Planted: `total_pages >= num_available` for `>` in `_swap_in`. Its 8 computed tokens and
    a 4-token chunk need 3 pages: 3 free pages admit it (copies planned host -> device), 2 do
    not (nothing changes)."""
    ctx, req = swapped_context(3)
    host = list(req.swapped_pages)
    assert ctx.admit(req, 4) == 2  # its prompt's 2 remaining tokens
    assert req.status is Status.RUNNING and len(req.page_table) == 3
    assert ctx.batch.swap_in == list(zip(host, req.page_table[:2]))
    ctx, req = swapped_context(2, computed=8, prompt=12)
    assert ctx.admit(req, 4) == 0
    assert req.status is Status.SWAPPED and req.swapped_pages and not ctx.batch.swap_in


def test_a_swapped_request_mid_prefill_honours_min_chunk():
    """Planted: `_swap_in` without its `min_tokens` check. A swapped request with 12 prompt
    tokens left and a budget of 2 under min_chunk 4 waits (as a fresh prompt would), rather
    than coming back for a chunk smaller than the policy allows; with the budget it comes."""
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
    """Planted: `keep = len(page_table)`. Pages reserved ahead (speculative decoding reserves
    pages for its guesses) hold no K/V yet: copying them wastes host pages, and a swap-in that
    needs fewer pages would leave the extra host pages held forever. 5 computed tokens in 3
    pages of 4: 2 pages go out."""
    ctx, req = running_context(computed=5, pages=3)
    device = list(req.page_table)
    ctx.preempt(req)
    assert req.status is Status.SWAPPED and len(req.swapped_pages) == 2
    assert ctx.batch.swap_out == list(zip(device[:2], req.swapped_pages))
    assert ctx.batch.swapped == [req] and ctx.pool.num_used == 0


def test_a_victim_with_nothing_computed_is_not_swapped():
    """Planted: `0 <= keep` for `0 < keep`. A request admitted but not yet computed (a learner's
    policy may preempt one) has no K/V to keep: swapped with no host pages it would break the
    SWAPPED-has-host-pages rule; it is PREEMPTED, with nothing copied."""
    ctx, req = running_context(computed=0, pages=2)
    ctx.preempt(req)
    assert req.status is Status.PREEMPTED and req.swapped_pages == []
    assert not ctx.batch.swap_out and not ctx.batch.swapped and ctx.batch.preempted == [req]


def test_a_recomputed_victim_counts_no_computed_tokens():
    """Planted: the recompute branch of `preempt` no longer zeroing `num_computed_tokens`. Its
    pages are freed, so none of its K/V is left; the request waiting to be recomputed must say
    so (what the step-through pictures and `num_remaining` read), while its lost work is
    counted."""
    ctx, req = running_context(computed=9, pages=3, mode="recompute")
    ctx.preempt(req)
    assert req.status is Status.PREEMPTED and req.num_computed_tokens == 0
    assert req.num_discarded_tokens == 9 and req.num_tokens_before_preemption == 9
    assert req.num_remaining == 16


# ------------------------------------------------------------------------------ engine
def test_swap_out_is_copied_before_swap_in_into_the_same_page(make_engine):
    """Planted: `_move_pages` copying in before out. A page a victim gave up this step may be
    the one a returning request takes: copying in first overwrites the victim's K/V before it
    reaches host memory. Also: the host pages the plan releases are free again, and the
    counts come back (out, in)."""
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


def test_the_swap_space_is_host_memory_whatever_the_pools_device():
    """Planted: the swap store allocated on the pool's device. On a GPU that is no swap at all
    (the point is to free device memory); "meta" stands in for a device here."""
    pool = PagePool(4, 2, num_layers=1, num_kv_heads=1, head_dim=2, device="meta",
                    num_swap_pages=2)
    assert pool.every_layer.device.type == "meta" and pool.swap_store.device.type == "cpu"


def test_a_one_page_victim_is_swapped_and_the_books_balance_every_step():
    """Planted: the invariant check counting only swapped requests holding two host pages or
    more (a false alarm on a correct run). 4-token prompts in 4 pages of 8: r2, preempted with
    6 tokens computed, keeps one host page, and check_invariants runs every step."""
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


def test_a_step_record_built_by_hand_swaps_nothing():
    """Planted: a StepRecord default of 1 swapped page. Records built outside the engine (the
    chapters' seed example, a learner's hand-made trace) name no swap, and `summarize` must not
    invent swapped pages from them."""
    rec = StepRecord(1, [], [], [], [], 0, 0, 0.0, 0.1)
    assert (rec.pages_swapped_out, rec.pages_swapped_in, rec.swapped) == (0, 0, [])
    seed = viz.seed_example("continuous")
    assert sum(r.pages_swapped_out + r.pages_swapped_in for r in seed) == 0


def test_invariants_catch_a_swapped_request_without_host_pages():
    """Planted: the check that SWAPPED goes with host pages dropped. A request SWAPPED whose
    host pages went back to the free list (lost K/V: it would come back with nothing to copy)
    balances the swap books, so only that rule names it."""
    engine = three_in_six()
    while not any(r.status is Status.SWAPPED for r in engine.requests.values()):
        engine.step()
    victim = next(r for r in engine.requests.values() if r.status is Status.SWAPPED)
    engine.check_invariants()
    engine.pool.release_swap(victim.swapped_pages)
    victim.swapped_pages = []
    with pytest.raises(InvariantError, match="is swapped with 0 swap pages"):
        engine.check_invariants()


# ------------------------------------------------------------------------------ sim
def test_measure_swap_cost_is_the_median_time_per_page_copied():
    """Planted: dividing by the pages swapped out only (each is copied out and back: 2 copies),
    and taking the slowest repeat for the median. A clock that makes the three repeats take
    1, 9 and 2 s for 4 pages each way reads 2 / 8 s per page."""
    ticks = itertools.accumulate([0.0, 1.0, 0.0, 9.0, 0.0, 2.0])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sim.time, "perf_counter", lambda: next(ticks))
        assert sim.measure_swap_cost(1, 1, 2, page_size=2, num_pages=4, repeats=3) == 0.25


def test_cost_models_carry_s_in_their_dict_and_the_h100_preset_charges_swaps():
    """Planted: `to_dict` without s's meaning (a saved model explains every coefficient), and
    the h100-like preset without s (swap would then be free in every simulated GPU run)."""
    data = CostModel(a=1.0, s=3e-5).to_dict()
    assert data["s"] == 3e-5 and "host memory" in data["meaning"]["s"]
    assert "s*pages_swapped" in data["formula"]
    assert CostModel.from_dict(data).s == 3e-5
    assert sim.PRESETS["h100-like"].s > 0


# ------------------------------------------------------------------------------ bench
def test_a_recompute_declaration_names_no_swap_space_and_the_schema_needs_rejected(tmp_path):
    """Planted: the declaration's num_swap_pages 0 (for None) under recompute (the JSON would
    claim a swap space of 0 pages rather than none); RESULT_KEYS without "rejected" (the schema
    check would pass a result that lacks the count)."""
    out = tmp_path / "r.json"
    assert bench.main_bench(["--executor", "sim", "--num-requests", "4", "--no-progress",
                             "--out", str(out)]) == 0
    options = json.loads(out.read_text())["declaration"]["policy_options"]
    assert (options["preemption_mode"], options["num_swap_pages"]) == ("recompute", None)
    assert "pd.rejected" in runs.results_schema_ok({"declaration": {}, "results": {"pd": {}}})


# ------------------------------------------------------------------------------ serve
def test_the_servers_swap_counters_grow_each_way_as_the_steps_copy():
    """Planted: the swapped-in counter adding the step's pages swapped out. Over a whole run the
    two are equal when every victim comes back, so read /metrics' counters step by step: the
    step that swaps r2 out adds 2 out and 0 in, the step that brings it back 0 out and 2 in."""
    engine = three_in_six(num_swap_pages=2)
    worker = EngineWorker(engine)  # not started: its per-step counting is driven here
    seen = []
    while engine.has_unfinished():
        rec = engine.step()
        before = (worker.stats.value("kv_pages_swapped_out"),
                  worker.stats.value("kv_pages_swapped_in"))
        worker._count(rec)
        worker._retire(rec)
        grew = (worker.stats.value("kv_pages_swapped_out") - before[0],
                worker.stats.value("kv_pages_swapped_in") - before[1])
        if grew != (0, 0):
            seen.append(grew)
    assert seen == [(2, 0), (0, 2)]
    assert worker.stats.value("kv_swap_pages_free") == 2


# ------------------------------------------------------------------------------ client
@pytest.mark.parametrize("status, body", [
    (500, '{"error": {"code": "cache_full"}}'),  # only a 503 is the full-cache answer
    (503, '{"error": "busy"}'),  # an error that is no object
    (503, "[1, 2]"),  # JSON with no .get
    (503, "busy"),  # no JSON
])
def test_only_a_503_with_code_cache_full_is_a_rejection(status, body):
    """Planted: `_is_rejection` without its status check, its `isinstance(error, dict)` or
    AttributeError in its except: a 500 would count as rejected, and an odd body would crash
    the client's run instead of counting an error."""
    assert client._is_rejection(status, body) is False
    assert client._is_rejection(503, '{"error": {"code": "cache_full"}}') is True
