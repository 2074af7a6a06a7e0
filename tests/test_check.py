"""The exercise checks (`minicb.course.check`): planted bugs in the reference solutions are
caught with a message that names the problem, a check runs every case and says how many
passed, hidden cases come from the grader's seed, and minicb's own code (or the check
module's) is never an answer."""

from __future__ import annotations

import functools
import random
import re
import time

import numpy as np
import pytest
import torch
from helpers import SOLUTION_OBJECTS, caught, first_failure, solution, variant

from minicb import kv_cache
from minicb.course import check
from minicb.kv_cache import page_hash, prompt_page_hashes
from minicb.model import quant
from minicb.request import Status


@pytest.fixture(autouse=True)
def stop_at_first(monkeypatch):
    """A planted bug's first failed case is all most tests read: the checks stop there (a
    test of the counts sets check.STOP_AT_FIRST back to False)."""
    monkeypatch.setattr(check, "STOP_AT_FIRST", True)


def test_pd_scheduler_serving_prefill_before_decodes_is_caught():
    """A learner's PD scheduler that schedules prefill chunks before the decodes gets a message
    naming the step, the decodes left waiting and the long prefill, whatever the scheduler's
    name."""
    from minicb.request import Status
    from minicb.scheduler import Scheduler, schedule_prefill_chunks

    class PrefillFirst(Scheduler):
        name = "my-pd"

        def schedule(self, ctx):
            budget = schedule_prefill_chunks(ctx, ctx.config.max_num_batched_tokens)
            for req in self.decoding(ctx):
                if budget > 0 and req.status is Status.RUNNING and \
                        ctx.reserve_or_preempt(req, 1):
                    ctx.schedule(req, 1)
                    budget -= 1
            return ctx.batch

    message = caught("pd_scheduler", PrefillFirst)
    assert "decodes were left waiting at step 3" in message
    assert "short-0, short-1, short-2" in message and "long prefill 32" in message

    class NamedPD(PrefillFirst):  # the engine's own pd invariant fires first: same message
        name = "pd"

    assert "decodes were left waiting at step 3" in caught("pd_scheduler", NamedPD)


def test_a_prompt_in_the_decode_loop_is_named():
    """A decode loop over ctx.running that gives a half-prefilled prompt one token gets a
    message saying so, not only the two steps side by side."""
    from minicb.request import Status
    from minicb.scheduler import Scheduler, schedule_prefill_chunks

    class RunningAsDecodes(Scheduler):
        name = "my-pd"

        def schedule(self, ctx):
            budget = ctx.config.max_num_batched_tokens
            for req in list(ctx.running):
                if req.status is Status.RUNNING and ctx.reserve_or_preempt(req, 1):
                    ctx.schedule(req, 1)
                    budget -= 1
            schedule_prefill_chunks(ctx, budget, min_chunk=ctx.config.min_chunk)
            return ctx.batch

    message = caught("pd_scheduler", RunningAsDecodes)
    assert "long prefill 1] (4 tokens)" in message
    assert "Yours gave 'long', whose prompt was not yet done, a single token" in message
    assert "self.decoding(ctx)" in message


def test_page_pool_that_forgets_a_ref_count_is_caught():
    """The reason comes first: a gradebook's feedback keeps a failure's first line, so that line
    names what went wrong, not a header ("pool of 4 pages (random sequence 0); the last
    operations:")."""
    base = solution("01_paged_kv.ipynb")["MyPagePool"]

    class ShareForgets(base):
        def share(self, pages):
            for page in pages:
                if self.ref_count[page] == 0:
                    raise ValueError("free")

    class ReleaseFreesAll(base):
        def release(self, pages):
            if any(self.ref_count[page] <= 0 for page in pages):
                raise ValueError("free")
            for page in pages:
                self.ref_count[page] = 0
                self.free.append(page)

    for bug in (ShareForgets, ReleaseFreesAll):
        message = caught("page_pool", bug)
        first, *rest = message.splitlines()  # a gradebook's feedback shows the first only
        assert re.search(r"ref count should be [2-9]", first), message
        assert "a reference was forgotten" in first
        assert "share(" in "\n".join(rest)  # the operations that led there are listed

    class NotAllOrNothing(base):
        def allocate(self, n):
            pages = self.free[:n]
            del self.free[:n]
            for page in pages:
                self.ref_count[page] = 1
            return pages

    assert "must raise MemoryError and take nothing" in caught("page_pool", NotAllOrNothing)

    class RefusesTooLate(base):  # not to be blamed on "a reference was forgotten"
        def release(self, pages):
            for page in pages:
                self.ref_count[page] -= 1
                if self.ref_count[page] < 0:
                    raise ValueError("free")
                if self.ref_count[page] == 0:
                    self.free.append(page)

    message = caught("page_pool", RefusesTooLate)
    assert "release([0]) of a free page raised ValueError, rightly, but changed the pool first" \
        in message and "ref counts [0, 0, 0, 0] -> [-1, 0, 0, 0]" in message, message


def test_unchained_hash_and_uncapped_prefix_hit_are_caught():
    """Page hashes that do not chain on the previous page, and a prefix match that covers the whole
    prompt, each get a message saying so (a match must be capped)."""
    from minicb.kv_cache import page_hash

    def unchained(tokens, page_size):
        return [page_hash(None, tokens[i:i + page_size])
                for i in range(0, len(tokens) - page_size + 1, page_size)]

    assert "the chain" in caught("prefix_hashes", unchained)

    hashes = solution("01_paged_kv.ipynb")["my_prompt_page_hashes"]

    def uncapped(cached, tokens, page_size):
        pages = []
        for h in hashes(tokens, page_size):
            if h not in cached:
                break
            pages.append(cached[h])
        return pages

    message = caught("match_prefix", uncapped)
    assert "whole prompt" in message and "Cap the hit" in message


def test_quantization_bugs_are_caught():
    """An int8 quantizer with one scale for the whole matrix, no floor under the scale, truncation,
    float output, a column of scales or scales not in float32 gets a message naming that mistake."""
    import torch

    def one_scale(weight):  # the whole matrix shares the largest weight's scale
        scale = (weight.abs().max() / 127).expand(weight.shape[0])
        return torch.round(weight / scale[:, None]).to(torch.int8), scale

    def divides_by_zero(weight):
        scale = weight.abs().amax(dim=1) / 127
        return torch.round(weight / scale[:, None]).to(torch.int8), scale

    def truncates(weight):
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
        return (weight / scale[:, None]).to(torch.int8), scale

    def keeps_floats(weight):
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
        return torch.round(weight / scale[:, None]), scale

    assert "one scale per row" in caught("quantize_int8", one_scale)
    assert "floor under the scale" in caught("quantize_int8", divides_by_zero)
    assert "do not truncate" in caught("quantize_int8", truncates)
    assert "torch.int8" in caught("quantize_int8", keeps_floats)

    def column_of_scales(weight):  # keepdim: passes the numbers, breaks q * scale[:, None]
        scale = (weight.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        return torch.round(weight / scale).to(torch.int8), scale

    def half_scales(weight):  # as Int8Linear stores them, but the check wants float32
        q, scale = solution("01_paged_kv.ipynb")["my_quantize_int8"](weight)
        return q, scale.to(torch.bfloat16)

    def float16_scales(weight):
        q, scale = solution("01_paged_kv.ipynb")["my_quantize_int8"](weight)
        return q, scale.half()

    assert "(shape [6, 32]): scale has shape [6, 1], expected [6]" in caught(
        "quantize_int8", column_of_scales)
    assert "keep it in float32" in caught("quantize_int8", half_scales)
    message = caught("quantize_int8", float16_scales)
    assert "keep it in float32" in message and "11 significant bits" in message


def test_a_refused_release_part_way_through_a_list_is_caught():
    """Exercise 1.1: a refused call changes nothing, also when the bad page comes after a good
    one in the list (the check's release([held, free]))."""
    pool_class = solution("01_paged_kv.ipynb")["MyPagePool"]

    class HalfwayRelease(pool_class):
        def release(self, pages):
            for page in pages:
                if self.ref_count[page] <= 0:
                    raise ValueError(f"page {page}")
                self.ref_count[page] -= 1
                if self.ref_count[page] == 0:
                    self.free.append(page)

    class HalfwayShare(pool_class):
        def share(self, pages):
            for page in pages:
                if self.ref_count[page] == 0:
                    raise ValueError(f"page {page}")
                self.ref_count[page] += 1

    class BackwardsRelease(pool_class):  # refuses before changing only if the bad page is last
        def release(self, pages):
            for page in reversed(pages):
                if self.ref_count[page] <= 0:
                    raise ValueError(f"page {page}")
                self.ref_count[page] -= 1
                if self.ref_count[page] == 0:
                    self.free.append(page)

    class CountsEachPageOnce(pool_class):  # checks first, but a page listed twice goes to -1
        def release(self, pages):
            if any(self.ref_count[page] <= 0 for page in pages):
                raise ValueError("free")
            for page in pages:
                self.ref_count[page] -= 1
                if self.ref_count[page] == 0:
                    self.free.append(page)

    assert "a page listed twice loses two references" in caught("page_pool", CountsEachPageOnce)
    for cls, call in ((HalfwayRelease, "release(["), (HalfwayShare, "share(["),
                      (BackwardsRelease, "release([")):
        message = caught("page_pool", cls)
        assert "changed the pool first" in message and re.search(
            re.escape(call) + r"\d+, \d+\]\) \(page \d+ is free\)", message), message


def test_batching_bugs_are_caught():
    """A static batch that lets a request jump ahead, a next_chunk that ignores min_chunk, and
    static finish steps computed as continuous ones each get a message naming the request, the
    pages left or the expected steps."""
    def jumps_ahead(queue, max_num_seqs, free_pages, page_size):
        batch = []
        for rid, n in queue:
            need = -(-n // page_size)
            if len(batch) < max_num_seqs and need <= free_pages:
                free_pages -= need
                batch.append(rid)
        return batch

    message = caught("static_batch", jumps_ahead)
    # the first mismatch: r0 takes 2 of 3 free pages, r1 needs 3; the message says what is left
    assert "'r1' does not fit (3 pages needed, 1 left after ['r0'])" in message
    assert "must not jump ahead" in message

    def shortest_first(queue, max_num_seqs, free_pages, page_size):
        return jumps_ahead(sorted(queue, key=lambda q: q[1]), max_num_seqs, free_pages,
                           page_size)

    # full at max_num_seqs, not short of pages: the message must not say a request "does not fit"
    message = caught("static_batch", shortest_first)
    assert "The batch is full at max_num_seqs=3" in message and "does not fit" not in message

    def ignores_min_chunk(remaining, chunk_size, budget, min_chunk=1):
        return min(remaining, chunk_size, budget)

    assert "min_chunk=8" in caught("next_chunk", ignores_min_chunk)

    continuous = solution("03_continuous_batching.ipynb")["continuous_finish_steps"]
    message = caught("static_finish_steps", continuous)
    assert "[30, 200, 80, 260]" in message and "request 4" in message


def test_scheduler_bugs_meet_the_engine_rules():
    """A renamed correct scheduler passes; one that splits prompts without whole_prompts, schedules
    without reserving pages, returns nothing, or lets decodes ride along in a chunked step gets a
    message naming the engine's rule."""
    from minicb.scheduler import Scheduler

    mine = solution("03_continuous_batching.ipynb")["MyContinuousScheduler"]

    class Renamed(mine):  # the engine goes by attributes, not by names
        name = "mine"

    check.continuous_scheduler(Renamed)

    class NotWhole(mine):  # budget enforced: the long prompt is refused by the engine
        whole_prompts = False

    message = caught("continuous_scheduler", NotWhole)
    assert "the engine refused the batch" in message and "max_num_batched_tokens" in message
    assert "`whole_prompts = True` (yours is missing" in message

    class Unreserved(Scheduler):
        def schedule(self, ctx):
            for req in list(ctx.running):
                ctx.schedule(req, 1)
            if ctx.waiting:
                req = ctx.waiting[0]
                n = ctx.admit(req, req.num_tokens)
                if n:
                    ctx.schedule(req, n)
            return ctx.batch

    assert "reserve them first" in caught("continuous_scheduler", Unreserved)

    class ReturnsNothing(solution("05_pd_interleaving.ipynb")["MyPDScheduler"]):
        def schedule(self, ctx):
            super().schedule(ctx)

    assert "it must return ctx.batch" in caught("pd_scheduler", ReturnsNothing)

    class DecodesRideAlong(Scheduler):  # PD written out by hand: not prefill-first
        def schedule(self, ctx):
            budget = ctx.config.max_num_batched_tokens - self.schedule_decodes(ctx)
            for req in self.prefilling(ctx):
                n = min(req.num_remaining, ctx.config.chunk_size, budget)
                if n and ctx.reserve(req, n):
                    ctx.schedule(req, n)
                    budget -= n
            while ctx.waiting and budget > 0:
                req = ctx.waiting[0]
                n = ctx.admit(req, min(ctx.config.chunk_size, budget))
                if not n:
                    break
                ctx.schedule(req, n)
                budget -= n
            return ctx.batch

    message = caught("chunked_scheduler", DecodesRideAlong)
    assert "step 3: minicb's chunked scheduler ran [long prefill 32]" in message


def test_metric_bugs_are_caught():
    """Goodput counting cancelled requests, E2E or TTFT measured before a held batch's release,
    per-tenant TTFTs of unfinished requests or dropping the None tenant, and a dec@P window from
    the first chunk each get a message naming the rule."""
    goodput = solution("06_benchmarking.ipynb")["goodput"]
    latencies = solution("06_benchmarking.ipynb")["latencies"]

    def counts_cancelled(records, slo):
        done = [r for r in records if r.finish_reason != "cancelled" or True]
        span = goodput(records, {})  # only for the None case
        if span is None:
            return None
        first = min(r.arrival_time for r in records)
        last = max(r.finish_time for r in records if r.finish_time is not None)
        ok = [r for r in done if all((latencies(r)[k] is None and k == "tpot")
                                     or (latencies(r)[k] is not None and latencies(r)[k] <= v)
                                     for k, v in slo.items())]
        return len(ok) / (last - first)

    assert "Cancelled and failed requests never count" in caught("goodput", counts_cancelled)

    def e2e_to_the_finish(record):  # ignores a static batch's hold: E2E ends at the release
        out = latencies(record)
        if out["e2e"] is not None and record.finish_time is not None:
            out["e2e"] = record.finish_time - record.arrival_time
        return out

    assert "released_time" in caught("latencies", e2e_to_the_finish)

    def ttft_at_the_computation(record):  # a static batch's user sees no token before release
        out = latencies(record)
        if out["ttft"] is not None:
            out["ttft"] = record.first_token_time - record.arrival_time
        return out

    assert "returned_whole" in caught("latencies", ttft_at_the_computation)

    per_tenant = solution("06_benchmarking.ipynb")["per_tenant"]

    def every_first_token(records):  # cancelled and failed requests' TTFTs counted too
        out = per_tenant(records)
        for tenant, row in out.items():
            ttfts = [latencies(r)["ttft"] for r in records if r.tenant == tenant]
            ttfts = [t for t in ttfts if t is not None]
            if ttfts:
                row["ttft_p50"] = float(np.percentile(ttfts, 50))
                row["ttft_p99"] = float(np.percentile(ttfts, 99))
        return out

    assert "Only completed requests count" in caught("per_tenant", every_first_token)
    assert "None is a tenant too" in caught(
        "per_tenant", lambda records: {t: row for t, row in per_tenant(records).items()
                                       if t is not None})

    def window_from_first_chunk(trace, records, long_id):
        long = next(r for r in records if r.request_id == long_id)
        end = long.first_token_step or trace[-1].step
        return sum(1 for rec in trace if (long.first_scheduled_step or 0) <= rec.step <= end
                   for m in rec.members if m.kind == "decode" and m.request_id != long_id)

    assert "arrival_step" in caught("dec_at_p", window_from_first_chunk)


def short_p_selecting(alive):
    """short_P computed over the other requests for which `alive(r, long, window_end)`."""
    def fn(trace, records, long_id):
        long = next(r for r in records if r.request_id == long_id)
        end = next((s for s in (long.first_token_step, long.finish_step) if s is not None),
                   trace[-1].step)
        shorts = [r for r in records if r is not long and alive(r, long, end)]
        if not shorts:
            return 0
        if any(r.finish_step is None for r in shorts):
            return None
        return max(r.finish_step for r in shorts) - long.arrival_step + 1
    return fn


def test_short_p_is_tested_on_both_bounds_of_alive():
    """A short_P missing either bound of "alive with the long one", or with a strict bound, fails
    with the trace that shows it, and the edge traces put their requests exactly on or just past
    each bound."""
    def not_done_before(r, long):
        return r.finish_step is None or r.finish_step >= long.arrival_step

    def every_other(trace, records, lid):  # no alive test at all
        long = next(r for r in records if r.request_id == lid)
        f = [r.finish_step for r in records if r.request_id != lid]
        return 0 if not f else None if None in f else max(f) - long.arrival_step + 1

    wrong = {
        "after the window ended": short_p_selecting(
            lambda r, long, end: not_done_before(r, long)),  # no arrival bound
        "before the long one arrived": short_p_selecting(
            lambda r, long, end: r.arrival_step <= end),  # finished before it: counted
        "finished at 3": short_p_selecting(  # strict >: finishing on its arrival step
            lambda r, long, end: r.arrival_step <= end and (
                r.finish_step is None or r.finish_step > long.arrival_step)),
        "arrived at step 5, finished at 17": short_p_selecting(  # strict <: arriving at its end
            lambda r, long, end: r.arrival_step < end and not_done_before(r, long)),
    }
    for named, fn in [*wrong.items(), ("after the window ended", every_other)]:
        message = caught("short_p", fn)
        assert "Alive with the long one" in message and named in message, (named, message)
    # the edge traces put their requests where their labels say: on or just past a bound
    traces = {label.split(" ")[0]: {r.request_id: r for r in records}
              for label, _, records, _ in check.pd_traces()}
    edges, none = traces["alive-edges"], traces["none-alive"]
    assert edges["edge-finish"].finish_step == edges["long"].arrival_step
    assert edges["edge-arrive"].arrival_step == edges["long"].first_token_step
    assert edges["after"].arrival_step == edges["long"].first_token_step + 1
    assert edges["after"].finish_step > edges["edge-arrive"].finish_step > \
        edges["short-0"].finish_step
    assert traces["finish-edge"]["edge-finish"].finish_step == \
        traces["finish-edge"]["long"].arrival_step
    assert none["early"].finish_step < none["long"].arrival_step < none["after"].arrival_step
    cancelled = traces["cancelled"]
    assert cancelled["long"].first_token_step is None and cancelled["long"].finish_reason == \
        "cancelled" and cancelled["long"].finish_step < cancelled["after"].arrival_step
    assert cancelled["after"].finish_step > cancelled["short-0"].finish_step


def test_a_cancelled_long_requests_window_ends_at_its_finish_step():
    """dec@P and short_P for a long request cancelled before its first token end its window at its
    finish step; ending it at the trace's end fails on the cancelled trace."""
    def window_end(with_finish_step):  # without its finish step: at the trace's end
        def end(trace, long):
            steps = (long.first_token_step, long.finish_step) if with_finish_step \
                else (long.first_token_step,)
            return next((s for s in steps if s is not None), trace[-1].step)
        return end

    def short_p(end):
        def fn(trace, records, long_id):
            long = next(r for r in records if r.request_id == long_id)
            shorts = [r for r in records if r is not long and r.arrival_step <= end(trace, long)
                      and (r.finish_step is None or r.finish_step >= long.arrival_step)]
            if any(r.finish_step is None for r in shorts):
                return None
            return max((r.finish_step - long.arrival_step + 1 for r in shorts), default=0)
        return fn

    def dec_at_p(end):
        def fn(trace, records, long_id):
            long = next(r for r in records if r.request_id == long_id)
            return sum(m.kind == "decode" and m.request_id != long_id for rec in trace
                       if long.arrival_step <= rec.step <= end(trace, long) for m in rec.members)
        return fn

    for name, fn in ("short_p", short_p), ("dec_at_p", dec_at_p):
        getattr(check, name)(fn(window_end(True)))
        message = caught(name, fn(window_end(False)))
        assert "trace of cancelled under 'pd'" in message
        assert "it ended (cancelled) at step 4 before its first token" in message
        if name == "short_p":
            assert "after (arrived at step 6, after the window ended at step 4)" in message


def test_chunked_scheduler_budget_bugs_are_caught():
    """A chunked scheduler that does not charge running prefills to the budget, admits past the
    budget, or admits before continuing running prefills fails the busy-budget case with the
    batch it ran."""
    from minicb.scheduler import Scheduler

    next_chunk = solution("04_chunked_prefill.ipynb")["next_chunk"]

    def chunked(running_first=True, admit_all=False, charge_running=True):
        class Chunked(Scheduler):
            name = "my-chunked"

            def schedule(self, ctx):
                budget, size = ctx.config.max_num_batched_tokens, ctx.config.chunk_size

                def running():
                    nonlocal budget
                    for req in self.prefilling(ctx):
                        if req.request_id in ctx.scheduled_ids:
                            continue
                        n = next_chunk(req.num_remaining, size, budget)
                        if n and ctx.reserve(req, n):
                            ctx.schedule(req, n)
                            budget -= n if charge_running else 0

                if running_first:
                    running()
                while ctx.waiting and budget > 0:
                    req = ctx.waiting[0]
                    n = ctx.admit(req, size if admit_all else min(size, budget))
                    if not n:
                        break
                    ctx.schedule(req, n)
                    budget -= n
                if not running_first:
                    running()
                if not ctx.batch.items:
                    self.schedule_decodes(ctx)
                return ctx.batch
        return Chunked

    check.chunked_scheduler(chunked())  # the helper itself is right
    assert "busy-budget" in caught("chunked_scheduler", chunked(charge_running=False))
    assert "busy-budget" in caught("chunked_scheduler", chunked(admit_all=True))
    message = caught("chunked_scheduler", chunked(running_first=False))
    assert "busy-budget" in message and "[c prefill 16, a prefill 16, b prefill 8]" in message


def continuous_like(decodes_first=True, stop_at_misfit=True, alone=True, preempting=True,
                    schedules=True, decodes_count=False, off_by_one=False):
    """Exercise 3.2's scheduler, with one of its rules broken on demand."""
    from minicb.scheduler import Scheduler

    class Continuous(Scheduler):
        name = "continuous"
        whole_prompts = True

        def decodes(self, ctx):
            if preempting:
                self.schedule_decodes(ctx)
            else:
                for req in self.decoding(ctx):
                    if ctx.reserve(req, 1):
                        ctx.schedule(req, 1)

        def schedule(self, ctx):
            if decodes_first:
                self.decodes(ctx)
            budget = ctx.config.max_num_batched_tokens
            budget -= len(ctx.batch.items) if decodes_count else 0
            tokens = 0
            for req in list(ctx.waiting):
                if ctx.batch.preempted:
                    break
                total = tokens + req.num_tokens
                if (tokens or not alone) and (total >= budget if off_by_one else total > budget):
                    if stop_at_misfit:
                        break
                    continue
                n = ctx.admit(req, req.num_tokens)
                if not n:
                    break
                if schedules:
                    ctx.schedule(req, n)
                tokens += n
            if not decodes_first:
                self.decodes(ctx)
            return ctx.batch
    return Continuous


def test_continuous_scheduler_queue_order_and_decodes_first_are_checked():
    """A continuous scheduler that skips past a request that does not fit, reserves prompts before
    decodes, charges decodes to the prompt budget, or leaves an exact fit for the next step fails
    the case named for it."""
    check.continuous_scheduler(continuous_like())  # the helper itself is right
    message = caught("continuous_scheduler", continuous_like(stop_at_misfit=False))
    assert "'queue-order'" in message and "[a prefill 50, c prefill 10]" in message
    message = caught("continuous_scheduler", continuous_like(decodes_first=False))
    assert "'late-pages'" in message and "yours preempted ['p1']" in message
    # pd's rule (chapter 05) carried back: decodes subtracted from the budget
    message = caught("continuous_scheduler", continuous_like(decodes_count=True))
    assert "'decodes-beside-prompts'" in message and "[d0 decode, d1 decode, d2 decode, x " \
        "prefill 30] (33 tokens)" in message
    # off by one: a prompt that fills the budget exactly left for the next step
    message = caught("continuous_scheduler", continuous_like(off_by_one=True))
    assert "'exact-fit'" in message and "yours ran [a prefill 32] (32 tokens)" in message


def test_finish_steps_of_requests_listed_out_of_arrival_order():
    """Finish-step functions that walk requests in list order instead of arrival order fail on
    requests listed out of arrival order, with the hint to sort by (arrival step, index)."""
    def unsorted(policy):  # the reference solutions, without their sort
        def fn(max_tokens, arrivals, max_num_seqs):
            queue, finish, running, step = list(range(len(max_tokens))), [0] * len(max_tokens), \
                [], 0
            while queue:
                step += 1
                if policy == "continuous" or all(finish[i] < step for i in running):
                    running = [i for i in running if finish[i] >= step]
                    while queue and len(running) < max_num_seqs and arrivals[queue[0]] <= step:
                        i = queue.pop(0)
                        finish[i] = step + max_tokens[i] - 1
                        running.append(i)
            return finish
        return fn

    for policy in ("static", "continuous"):
        notebook, name = SOLUTION_OBJECTS[f"{policy}_finish_steps"]
        for case in ([30, 200, 80, 60], [1, 1, 1, 31], 3), ([4, 2, 6], [1, 2, 2], 2):
            assert unsorted(policy)(*case) == solution(notebook)[name](*case)  # sorted: right
        message = caught(f"{policy}_finish_steps", unsorted(policy))
        assert "arrival_steps=[9, 1, 1]" in message and "[15, 5, 10]" in message
        assert "sort the indices by (arrival_steps[i], i)" in message


def test_finish_steps_admitting_the_arrived_in_list_order_are_caught():
    """Finish-step functions that admit whoever has arrived in list order, rather than the earliest
    arrival first, fail with the expected steps and the hint to sort."""
    def scanning(policy):  # takes whoever has arrived, in list order
        def fn(max_tokens, arrivals, max_num_seqs):
            finish, running, step = [None] * len(max_tokens), [], 0
            while None in finish:
                step += 1
                if policy == "continuous" or all(finish[i] < step for i in running):
                    running = [i for i in running if finish[i] >= step]
                    for i, a in enumerate(arrivals):
                        if finish[i] is None and a <= step and len(running) < max_num_seqs:
                            finish[i] = step + max_tokens[i] - 1
                            running.append(i)
            return finish
        return fn

    for policy in ("static", "continuous"):  # the engine: R3 came at step 2, before R2
        assert check._finish_steps_real(policy, [10, 3, 3], [1, 5, 2], 1) == [10, 16, 13]
        message = caught(f"{policy}_finish_steps", scanning(policy))
        assert "arrival_steps=[1, 5, 2]" in message and "yours says [10, 13, 16]" in message
        assert "sort the indices by (arrival_steps[i], i)" in message


def test_scheduler_stalls_and_refusals_name_their_cause():
    """A scheduler that never runs a too-long prompt alone, does not preempt when no page is free,
    admits without scheduling, or decodes a request preempted earlier in the step gets a message
    naming that cause."""
    message = caught("continuous_scheduler", continuous_like(alone=False))
    assert "'long' (100 tokens) waits" in message
    assert "must still run when it is alone" in message
    message = caught("continuous_scheduler", continuous_like(preempting=False))
    assert "no page was free" in message and "must preempt" in message
    message = caught("continuous_scheduler", continuous_like(schedules=False))
    assert "admitted (ctx.admit) but never scheduled" in message  # not "got no chunk"

    from minicb.request import Status
    from minicb.scheduler import Scheduler, schedule_prefill_chunks

    def pd(status_check=True, preempting=True):
        class PD(Scheduler):
            name = "my-pd"

            def schedule(self, ctx):
                budget = ctx.config.max_num_batched_tokens
                for req in self.decoding(ctx):
                    if status_check and req.status is not Status.RUNNING:
                        continue
                    if (ctx.reserve_or_preempt if preempting else ctx.reserve)(req, 1):
                        ctx.schedule(req, 1)
                        budget -= 1
                schedule_prefill_chunks(ctx, budget, min_chunk=ctx.config.min_chunk)
                return ctx.batch
        return PD

    message = caught("pd_scheduler", pd(status_check=False))
    assert "'p3' was preempted earlier in this step" in message
    assert "req.status is not Status.RUNNING" in message
    assert "must preempt" in caught("pd_scheduler", pd(preempting=False))


def test_page_pool_allocate_is_all_or_nothing_and_raises_memory_error():
    """A page pool whose allocate takes pages before running out, or raises something other than
    MemoryError, gets a message saying allocate is all or nothing and must raise MemoryError."""
    base = solution("01_paged_kv.ipynb")["MyPagePool"]

    class OneByOne(base):  # takes pages until it runs out, then raises
        def allocate(self, n):
            pages = []
            for _ in range(n):
                if not self.free:
                    raise MemoryError
                pages.append(self.free.pop(0))
                self.ref_count[pages[-1]] = 1
            return pages

    class Runtime(base):
        def allocate(self, n):
            if n > len(self.free):
                raise RuntimeError("out of pages")
            return super().allocate(n)

    message = caught("page_pool", OneByOne)
    assert "allocate must be all or nothing" in message and "not dropped" not in message
    message = caught("page_pool", Runtime)
    assert "must raise MemoryError, but yours raised RuntimeError: out of pages" in message


def test_an_error_in_the_learners_code_names_the_input():
    """An exception in a learner's function fails the check with the input and the learner's line,
    keeps the traceback as the cause, and an untouched stub raises its own NotImplementedError."""
    dec_at_p = solution("05_pd_interleaving.ipynb")["dec_at_p"]

    def unfinished_is_none(trace, records, long_id):  # no window end when the prefill is cut
        long = next(r for r in records if r.request_id == long_id)
        if long.first_token_step is None:
            return sum(1 for rec in trace if rec.step <= long.first_token_step)
        return dec_at_p(trace, records, long_id)

    with pytest.raises(check.CheckFailed) as info:
        check.dec_at_p(unfinished_is_none)
    message = str(info.value)
    assert "stopped after 4 steps" in message and "raised TypeError" in message
    assert "rec.step <= long.first_token_step" in message  # the learner's line
    assert isinstance(info.value.__cause__, TypeError)  # its traceback is kept

    latencies = solution("06_benchmarking.ipynb")["latencies"]

    def no_none(r):
        return {**latencies(r), "queue": r.first_scheduled_time - r.arrival_time}

    message = caught("latencies", no_none)
    assert "first_scheduled_time=None" in message and "raised TypeError" in message

    class BadShare(solution("01_paged_kv.ipynb")["MyPagePool"]):
        def share(self, pages):
            super().share(pages)
            return self.shared[0]  # no such attribute

    message = caught("page_pool", BadShare)
    assert "share([" in message and "raised AttributeError" in message.splitlines()[0]

    class Stub(solution("01_paged_kv.ipynb")["MyPagePool"]):  # untouched: the stub's own error
        def allocate(self, n):
            raise NotImplementedError("write MyPagePool.allocate")

    with pytest.raises(NotImplementedError, match="write MyPagePool.allocate"):
        check.page_pool(Stub)


def tenant_ttfts(latencies, records, tenant):
    """The TTFTs of one tenant's completed requests, by the learner-style `latencies`."""
    ttfts = [latencies(r)["ttft"] for r in records
             if r.tenant == tenant and r.finish_reason in ("stop", "length")]
    return [t for t in ttfts if t is not None]


def test_numpy_integers_pass_and_float32_is_named():
    """NumPy integers and a pool whose `free` is a count pass; NumPy chunk sizes in a batch and
    latencies computed in float32 get a message naming the type."""
    import torch

    reference = solution("04_chunked_prefill.ipynb")["next_chunk"]
    check.next_chunk(lambda *args: np.int64(reference(*args)))

    class NumpyIds(solution("01_paged_kv.ipynb")["MyPagePool"]):
        def allocate(self, n):
            return list(np.array(super().allocate(n), dtype=np.int64))

    class CountOnly:  # `free` is a count here, not a list
        def __init__(self, n):
            self.ref_count, self.pages, self.free = [0] * n, list(range(n)), n

        @property
        def num_free(self):
            return self.free

        def allocate(self, n):
            if n > self.free:
                raise MemoryError
            got, self.pages, self.free = self.pages[:n], self.pages[n:], self.free - n
            for p in got:
                self.ref_count[p] = 1
            return got

        def share(self, pages):
            if any(self.ref_count[p] == 0 for p in pages):
                raise ValueError
            for p in pages:
                self.ref_count[p] += 1

        def release(self, pages):
            if any(self.ref_count[p] < pages.count(p) for p in pages):
                raise ValueError
            for p in pages:
                self.ref_count[p] -= 1
                if self.ref_count[p] == 0:
                    self.pages.append(p)
                    self.free += 1

    check.page_pool(NumpyIds)
    check.page_pool(CountOnly)

    class NumpyChunks(solution("04_chunked_prefill.ipynb")["MyChunkedScheduler"]):
        def schedule(self, ctx):
            super().schedule(ctx)
            ctx.batch.items = [(r, np.int64(n)) for r, n in ctx.batch.items]
            return ctx.batch

    assert "needs a Python int" in caught("chunked_scheduler", NumpyChunks)

    latencies = solution("06_benchmarking.ipynb")["latencies"]
    per_tenant = solution("06_benchmarking.ipynb")["per_tenant"]

    def in_float32(record):
        return {k: None if v is None else float(np.float32(v))
                for k, v in latencies(record).items()}

    def torch_quantile(records):
        out = per_tenant(records)
        for tenant, row in out.items():
            ttfts = tenant_ttfts(latencies, records, tenant)
            if ttfts:
                q = torch.quantile(torch.tensor(ttfts), torch.tensor([0.5, 0.99]))
                row["ttft_p50"], row["ttft_p99"] = q.tolist()
        return out

    assert "computed in float32" in caught("latencies", in_float32)
    assert "computed in float32" in caught("per_tenant", torch_quantile)


def test_goodput_and_per_tenant_hints_fire_only_for_their_cause(monkeypatch):
    """Each goodput and per-tenant hint names its own cause: TTFT and E2E that ignore a static
    batch's release get the released_time hint (in some failed case, and never the "counted
    every request" one), a span of 0 is named, a percentile without interpolation too."""
    goodput = solution("06_benchmarking.ipynb")["goodput"]
    latencies = solution("06_benchmarking.ipynb")["latencies"]

    def ends_at_the_finish(records, slo):  # TTFT and E2E without the release of a static batch
        def unreleased(r):
            out = dict(latencies(r))
            if r.first_token_time is not None:
                out["ttft"] = r.first_token_time - r.arrival_time
                out["e2e"] = r.finish_time - r.arrival_time
            return out

        span = goodput(records, {})
        if span is None:
            return None
        span = max(r.finish_time for r in records if r.finish_time is not None) - \
            min(r.arrival_time for r in records)
        return sum(1 for r in records if r.finish_reason in ("stop", "length") and all(
            (unreleased(r)[k] is None and k == "tpot") or
            (unreleased(r)[k] is not None and unreleased(r)[k] <= v) for k, v in slo.items())
        ) / span

    monkeypatch.setattr(check, "STOP_AT_FIRST", False)
    with pytest.raises(check.CheckFailed):
        check.goodput(ends_at_the_finish)
    monkeypatch.setattr(check, "STOP_AT_FIRST", True)
    failed = [r.message for r in check.RESULTS["goodput"].results if not r.passed]
    assert any("released_time" in m for m in failed)
    assert not any("counted every request" in m for m in failed)

    def zero_when_no_span(records, slo):
        got = goodput(records, slo)
        return 0.0 if got is None and records else got

    assert "a span of 0" in caught("goodput", zero_when_no_span)

    per_tenant = solution("06_benchmarking.ipynb")["per_tenant"]

    def nearest(records):
        out = per_tenant(records)
        for tenant, row in out.items():
            ttfts = tenant_ttfts(latencies, records, tenant)
            if ttfts:
                row["ttft_p50"] = float(np.percentile(ttfts, 50, method="nearest"))
        return out

    assert "without interpolation" in caught("per_tenant", nearest)


def test_minicbs_own_function_is_not_an_answer():
    """Passing minicb's own prompt_page_hashes or quantize_rows as the answer fails with a message
    saying it is minicb's own."""
    assert "minicb's own" in caught("prefix_hashes", kv_cache.prompt_page_hashes)
    assert "minicb's own" in caught("quantize_int8", quant.quantize_rows)


def _minicbs_own_behind_a_lambda():
    """A wrong 'answer' per function exercise: minicb's own version, called from a lambda or a
    subclass rather than handed over itself."""
    from minicb import SamplingParams
    from minicb.attention import build_metadata, torch_ref
    from minicb.benchmark import metrics
    from minicb.speculative import NgramIndex, verify

    class InheritedPool(kv_cache.PagePool):
        def __init__(self, num_pages):
            super().__init__(num_pages, 16)

    def greedy_verify(draft, target):
        logits = torch.full((len(target), max(target + draft) + 1), -1.0)
        logits[torch.arange(len(target)), torch.tensor(target)] = 1.0
        return verify(logits, draft, SamplingParams(temperature=0.0), None)

    def long_metric(key):
        return lambda t, r, long_id: metrics.long_prefill_metrics(t, r, long_id)[key]

    return {
        "page_pool": InheritedPool,
        "prefix_hashes": lambda tokens, ps: kv_cache.prompt_page_hashes(tokens, ps),
        "quantize_int8": lambda w: quant.quantize_rows(w),
        "dec_at_p": long_metric("dec_at_p"),
        "short_p": long_metric("short_p_steps"),
        "latencies": lambda r: {"queue": metrics.queue_time(r), "ttft": metrics.ttft(r),
                                "tpot": metrics.tpot(r), "e2e": metrics.e2e(r)},
        "goodput": lambda records, slo: metrics.summarize([], records, slo=slo)["goodput_rps"],
        "slot_mapping": lambda table, computed, new, ps:
            build_metadata([table], [computed], [new], ps).slot_mapping.tolist(),
        "paged_attention": lambda q, k, v, table, computed, scale: torch_ref.attend(
            q, k, v, build_metadata([table], [computed], [q.shape[0]], k.shape[1]), scale),
        "prompt_lookup": lambda ids, k, n_max, n_min: NgramIndex(n_max, n_min).propose(ids, k),
        "verify_greedy": greedy_verify,
    }


@pytest.mark.parametrize("exercise", ["page_pool", "prefix_hashes", "quantize_int8", "dec_at_p",
                                      "short_p", "latencies", "goodput", "slot_mapping",
                                      "paged_attention", "prompt_lookup", "verify_greedy"])
def test_minicbs_own_version_behind_a_wrapper_is_not_an_answer(exercise):
    """For every exercise, minicb's own version called from a learner's wrapper fails with "your
    code ran minicb's own"."""
    message = caught(exercise, _minicbs_own_behind_a_lambda()[exercise])
    assert "your code ran minicb's own" in message, message


def test_minicbs_building_blocks_of_6_1_and_6_2_are_not_an_answer():
    """An answer that calls `metrics.meets_slo` over `metrics.run_span` for goodput, or
    `metrics.first_token_seen` and `metrics.released` for TTFT and E2E, fails: those helpers are
    the whole of exercises 6.2 and 6.1."""
    from minicb.benchmark import metrics

    def goodput(records, slo):
        span = metrics.run_span(records)
        return sum(metrics.meets_slo(r, slo) for r in records) / span if span > 0 else None

    def latencies(r):
        def since(t):
            return None if t is None or r.arrival_time is None else t - r.arrival_time
        tpot = None
        if r.num_output_tokens >= 2 and r.first_token_time is not None \
                and r.finish_time is not None:
            tpot = (r.finish_time - r.first_token_time) / (r.num_output_tokens - 1)
        return {"queue": since(r.first_scheduled_time), "tpot": tpot,
                "ttft": since(metrics.first_token_seen(r)[0]), "e2e": since(metrics.released(r)[0])}

    for exercise, answer in (("goodput", goodput), ("latencies", latencies)):
        message = caught(exercise, answer)
        assert "your code ran minicb's own" in message, message


def test_minicbs_own_scheduler_is_not_an_answer():
    """minicb's policy, however it is reached (the class itself, a subclass that does not
    override, a call through it, a copied function, an error swallowed), fails the check and
    names what ran; minicb's functions are themselves again afterwards, and the building
    blocks the exercises offer (schedule_decodes; schedule_prefill_chunks in 5.1) still pass."""
    from minicb import scheduler as S

    class Subclass(S.ContinuousScheduler):
        pass

    class Delegates(S.Scheduler):
        def schedule(self, ctx):
            return S.ChunkedScheduler().schedule(ctx)

    class Swallows(S.Scheduler):
        def schedule(self, ctx):
            try:
                return S.PDScheduler.schedule(self, ctx)
            except Exception:
                return ctx.batch

    class UsesTheChunkLoop(S.Scheduler):  # fine in 5.1, not in 4.2 which asks for the loop
        def schedule(self, ctx):
            S.schedule_prefill_chunks(ctx, ctx.config.max_num_batched_tokens)
            if not ctx.batch.items:
                self.schedule_decodes(ctx)
            return ctx.batch

    copied = type("Copied", (S.Scheduler,), {"schedule": S.ContinuousScheduler.schedule})
    cases = [("continuous_scheduler", S.ContinuousScheduler, "ContinuousScheduler.schedule"),
             ("continuous_scheduler", Subclass, "ContinuousScheduler.schedule"),
             ("continuous_scheduler", copied, "ContinuousScheduler.schedule"),
             ("chunked_scheduler", Delegates, "ChunkedScheduler.schedule"),
             ("chunked_scheduler", UsesTheChunkLoop, "schedule_prefill_chunks"),
             ("pd_scheduler", Swallows, "PDScheduler.schedule")]
    for exercise, learner, name in cases:
        assert f"your scheduler ran minicb's own {name}:" in caught(exercise, learner), name
    assert S.ContinuousScheduler.schedule.__code__.co_name == "schedule"
    assert S.schedule_prefill_chunks.__code__.co_name == "schedule_prefill_chunks"
    assert not hasattr(S, check.TRIPPED)
    check.pd_scheduler(solution("05_pd_interleaving.ipynb")["MyPDScheduler"])


def test_static_batch_reference_matches_the_engines_first_batch():
    """The check's reference for exercise 2.1 is what minicb's static policy admits."""

    from minicb import Engine, SamplingParams
    from minicb.course.check import _reference_static_batch, tiny_model

    rng = random.Random(5)
    for _ in range(12):
        page_size, num_pages = rng.choice([4, 8, 16]), rng.randint(1, 12)
        max_num_seqs = rng.randint(1, 5)
        queue = [(f"r{i}", rng.randint(1, min(60, num_pages * page_size - 1)))
                 for i in range(rng.randint(1, 7))]
        engine = Engine(tiny_model(), policy="static", page_size=page_size, num_pages=num_pages,
                        max_num_seqs=max_num_seqs, enable_prefix_caching=False)
        for i, (rid, n) in enumerate(queue):
            engine.add_request([(7 * i + j) % 200 + 3 for j in range(n)],
                               SamplingParams(max_tokens=1, temperature=0.0), request_id=rid)
        first = engine.step()
        admitted = [m.request_id for m in first.members]
        assert admitted == _reference_static_batch(queue, max_num_seqs, num_pages, page_size)


def test_paged_attention_mistakes_are_named():
    """Each typical mistake fails with its own hint; the hints' variants are built by the
    check itself, so this also proves the variant without a mistake is minicb's attention."""
    _attention_variant = variant('_attention_variant')

    correct = solution("07_paged_attention.ipynb")["paged_attention"]
    check.paged_attention(lambda *a: _attention_variant(*a))
    for mistake, hint in ((dict(causal=False), "must not see the positions after its own"),
                          (dict(causal="top-left"), "SDPA's is_causal=True aligns its mask"),
                          (dict(heads="modulo"), "kv head h // (num_heads // num_kv_heads)"),
                          (dict(paged=False), "look each position's page up in page_table"),
                          (dict(new_in_context=False), "this step's tokens are in the cache")):
        assert hint in caught("paged_attention",
                              lambda *a, m=mistake: _attention_variant(*a, **m))
    assert "by scale" in caught("paged_attention", lambda q, k, v, t, n, s: correct(q, k, v, t,
                                                                                   n, 1.0))

    def sdpa_is_causal(q, k_cache, v_cache, page_table, num_computed, scale):
        num_new, heads, dim = q.shape
        page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        pos = torch.arange(num_computed + num_new)
        slots = torch.tensor(page_table)[pos // page_size] * page_size + pos % page_size
        k = k_cache.reshape(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, 1)
        v = v_cache.reshape(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, 1)
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            scale=scale).transpose(0, 1)

    assert "SDPA's is_causal=True" in caught("paged_attention", sdpa_is_causal)
    assert "[num_new, num_heads, head_dim]" in caught(
        "paged_attention", lambda q, k, v, t, n, s: correct(q, k, v, t, n, s)[-1])


def test_slot_mapping_mistakes_are_named():
    """Slot mappings that return positions, count pages instead of slots, or start from position 0
    each get a message naming the mistake; NumPy integers pass."""
    def positions(table, num_computed, num_new, page_size):
        return list(range(num_computed, num_computed + num_new))

    def from_zero(table, num_computed, num_new, page_size):
        return [table[p // page_size] * page_size + p % page_size for p in range(num_new)]

    def numpy_ids(table, num_computed, num_new, page_size):  # numpy integers are fine
        pos = np.arange(num_computed, num_computed + num_new)
        return list(np.asarray(table)[pos // page_size] * page_size + pos % page_size)

    def pages_not_slots(table, num_computed, num_new, page_size):
        return [table[p // page_size] + p % page_size
                for p in range(num_computed, num_computed + num_new)]

    assert "Those are the positions" in caught("slot_mapping", positions)
    assert "counts pages, not slots" in caught("slot_mapping", pages_not_slots)
    assert "come after the" in caught("slot_mapping", from_zero)
    check.slot_mapping(numpy_ids)


def test_prompt_lookup_and_verification_mistakes_are_named():
    """Each mistake's hint fires on it alone (a variant that also gets every earlier case
    right); the variant without a mistake is minicb's NgramIndex on 3,000 sequences."""

    _lookup_variant = variant('_lookup_variant')
    from minicb.speculative import NgramIndex

    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randint(1, rng.choice([2, 3, 6])) for _ in range(rng.randint(1, 25))]
        n_max, k = rng.randint(1, 4), rng.randint(1, 5)
        n_min = rng.randint(1, n_max)
        assert _lookup_variant(ids, k, n_max, n_min) == NgramIndex(n_max, n_min).propose(ids, k)
    for mistake, hint in ((dict(pick="earliest"), "take the latest earlier occurrence"),
                          (dict(pick="latest"), "take the earliest instead"),
                          (dict(pick="latest roomy"), "not the latest of those that have k"),
                          (dict(include_last=True), "match themselves"),
                          (dict(include_last=True, uncapped=True), "n is at most len"),
                          (dict(shorter=False), "down to n_min")):
        message = caught("prompt_lookup", lambda *a, m=mistake: _lookup_variant(*a, **m))
        assert hint in message and message.count("It looks like") == 1, (mistake, message)

    def latest_with_room(token_ids, k, n_max, n_min):  # the other reading of the rule
        for n in range(min(n_max, len(token_ids) - 1), n_min - 1, -1):
            hits = [i for i in range(len(token_ids) - n) if token_ids[i:i + n] == token_ids[-n:]]
            if hits:
                roomy = [i for i in hits if i + n + k <= len(token_ids)]
                start = roomy[-1] if roomy else hits[0]
                return token_ids[start + n:start + n + k]
        return []
    assert "not the latest of those that have k" in caught("prompt_lookup", latest_with_room)

    def self_matching(token_ids, k, n_max, n_min):  # a learner's own loop, n capped right
        for n in range(min(n_max, len(token_ids) - 1), n_min - 1, -1):
            hits = [i for i in range(len(token_ids) - n + 1)
                    if token_ids[i:i + n] == token_ids[-n:]]
            if hits:
                start = hits[-1] if hits[-1] + n + k <= len(token_ids) else hits[0]
                return token_ids[start + n:start + n + k]
        return []
    def loops_on_long_inputs(token_ids, k, n_max, n_min):  # wrong first, endless later
        while len(token_ids) > 8:
            pass
        return []
    started = time.perf_counter()
    assert "expected [7, 8], got []" in caught("prompt_lookup", loops_on_long_inputs)
    assert time.perf_counter() - started < 30  # not the grader's timeout

    # its first wrong answer is also what "no shorter n" gives: all its answers tell them apart
    message = caught("prompt_lookup", self_matching)
    assert "match themselves" in message and "down to n_min" not in message
    assert "minicb's own" in caught("prompt_lookup", check._lookup_variant)
    assert "minicb's own" in caught("prompt_lookup", NgramIndex.propose)

    verify = solution("08_speculative_decoding.ipynb")["verify_greedy"]
    assert "never yields fewer than one token" in caught(
        "verify_greedy", lambda d, t: verify(d, t)[:-1])
    _verify_variant = variant('_verify_variant')
    assert "Stop at the first guess" in caught(
        "verify_greedy", lambda d, t: _verify_variant(d, t, "no stop"))
    assert "target[accepted], not the last row's" in caught(
        "verify_greedy", lambda d, t: _verify_variant(d, t, "last row"))
    assert "not the rejected guess" in caught(
        "verify_greedy", lambda d, t: _verify_variant(d, t, "the guess"))
    # one too many (it did stop at the first disagreement): no hint rather than a wrong one
    message = caught("verify_greedy", lambda d, t: t[:len(verify(d, t)) + 1])
    assert "Stop at the first guess" not in message and "last row" not in message
    # tensors, arrays and tuples of the right ints are right answers
    check.verify_greedy(lambda d, t: torch.tensor(verify(d, t)))
    check.prompt_lookup(lambda *a: np.array(_lookup_variant(*a), dtype=np.int64))
    slots = solution("07_paged_attention.ipynb")["slot_mapping"]
    check.slot_mapping(lambda *a: torch.tensor(slots(*a)))


def test_best_setting_mistakes_are_named():
    """Exercise 6.4: the usual slips each get their own message: quality None taken as a
    failure, a queue age at the limit taken as over it, no tie-break, no fairness at all, an
    index instead of the row, and minicb's own function behind a lambda."""
    from minicb.benchmark import sweep
    mine = solution("06_benchmarking.ipynb")["best_setting"]

    def keep(rule):
        def pick(rows, max_queue_age=None):
            fit = [r for r in rows if rule(r, max_queue_age)]
            return max(fit, key=lambda r: (r["goodput_rps"], r["output_tokens_per_s"]),
                       default=None)
        return pick

    def base(r, limit):
        return r["errors"] == 0 and r["cancellations_honoured"] and r["same_tokens"] is not False

    def fair(r, limit):
        return limit is None or (r["max_queue_age_s"] is not None
                                 and r["max_queue_age_s"] <= limit)
    assert "does not fail the quality requirement" in caught("best_setting", keep(
        lambda r, lim: base(r, lim) and fair(r, lim) and r["same_tokens"] is True))
    assert "A queue age equal to the limit is within it" in caught("best_setting", keep(
        lambda r, lim: base(r, lim) and (lim is None or (r["max_queue_age_s"] or 1e9) < lim)))
    assert "its oldest request waited 0.6 s, over the limit of 0.5 s" in caught(
        "best_setting", keep(base))
    assert "Ties on goodput go to the most output_tokens_per_s" in caught(
        "best_setting", lambda rows, lim=None: max(
            [r for r in rows if base(r, lim) and fair(r, lim)],
            key=lambda r: r["goodput_rps"], default=None) if rows else None)

    def last_of_ties(rows, limit=None):  # `>=` in a loop picks the last of equal rows
        best = None
        for r in rows:
            if base(r, limit) and fair(r, limit) and (best is None or (
                    r["goodput_rps"], r["output_tokens_per_s"]) >= (
                    best["goodput_rps"], best["output_tokens_per_s"])):
                best = r
        return best
    assert "Among rows equal on both, the first in the list" in caught("best_setting",
                                                                        last_of_ties)
    assert "return one of the rows (the dict itself) or None" in caught(
        "best_setting", lambda rows, lim=None: (rows.index(mine(rows, lim))
                                                if mine(rows, lim) is not None else None))
    assert "ran minicb's own best_setting" in caught(
        "best_setting", lambda rows, lim=None: sweep.best_setting(rows, lim))


def test_swap_break_even_mistakes_are_named():
    """Exercise 6.5: each slip the hints name is caught with its hint (planted through the
    check's own variants, and once written out by hand); minicb's own function is refused; a
    non-number is named; a float32 answer gets the float32 note."""
    from minicb.benchmark import sim
    break_even = variant("_break_even_variant")
    for mistake, hint in check._BREAK_EVEN_HINTS.items():
        def planted(cost, n, cached, page_size, chunk_size, mistake=mistake):
            return break_even(cost, n, cached, page_size, chunk_size, mistake)
        assert hint.strip() in caught("swap_break_even", planted), mistake

    mine = solution("06_benchmarking.ipynb")["swap_break_even"]

    def recompute_seconds(cost, n, cached, page_size, chunk_size):  # mine times its copies
        copies = 2 * -(-n // page_size) - cached // page_size
        return mine(cost, n, cached, page_size, chunk_size) * copies

    def out_only(cost, n, cached, page_size, chunk_size):  # written as a learner would
        return recompute_seconds(cost, n, cached, page_size, chunk_size) / -(-n // page_size)
    assert "Swap copies pages twice" in caught("swap_break_even", out_only)

    def floor_pages(cost, n, cached, page_size, chunk_size):  # guarded against n < page_size
        return recompute_seconds(cost, n, cached, page_size, chunk_size) / (
            2 * max(1, n // page_size) - cached // page_size)
    assert "The last page counts even when it is not full" in caught("swap_break_even",
                                                                     floor_pages)

    def every_page_back(cost, n, cached, page_size, chunk_size):
        return recompute_seconds(cost, n, cached, page_size, chunk_size) / (
            2 * -(-n // page_size))
    assert "shares its prompt pages still in the prefix index" in caught("swap_break_even",
                                                                         every_page_back)
    assert "in ms or µs: return seconds" in caught("swap_break_even", lambda *args: mine(
        *args) * 1e6)
    assert "ran minicb's own swap_break_even" in caught(
        "swap_break_even", lambda *args: sim.swap_break_even(*args))
    assert "ran minicb's own recompute_seconds" in caught(
        "swap_break_even", lambda cost, n, cached, page, chunk:
        sim.recompute_seconds(cost, n, cached, chunk) / (2 * -(-n // page)))
    assert "must return seconds per page as a number" in caught(
        "swap_break_even", lambda *args: "0.1 ms")
    assert "computed in float32" in caught("swap_break_even", lambda *args: torch.tensor(
        mine(*args), dtype=torch.float32).item() * (1 + 3e-7))


def pool_base():
    return solution("01_paged_kv.ipynb")["MyPagePool"]


def test_page_pool_ref_count_needs_exactly_one_entry_per_page():
    """A page pool with more ref counts than pages gets a message giving both numbers."""
    class OneCountTooMany(pool_base()):
        def __init__(self, num_pages):
            super().__init__(num_pages)
            self.ref_count = [0] * (num_pages + 1)

    assert "ref_count has 5 entries, expected one per page (4)" in caught("page_pool",
                                                                         OneCountTooMany)


def test_page_pool_release_that_keeps_a_shared_reference_is_caught():
    """A release that drops a shared page's reference only for its last holder gets a message that a
    reference was not dropped."""
    class ReleaseKeepsShared(pool_base()):  # only the last holder's release counts
        def release(self, pages):
            for page in pages:
                if self.ref_count[page] <= 0:
                    raise ValueError("free")
                if self.ref_count[page] == 1:
                    self.ref_count[page] = 0
                    self.free.append(page)

    message = caught("page_pool", ReleaseKeepsShared)
    assert "a reference was not dropped" in message and "release(" in message


def test_page_pool_num_free_too_low_is_caught():
    """A num_free one short of the free pages gets a message giving the right count."""
    class NumFreeOneShort(pool_base()):
        @property
        def num_free(self):
            return max(len(self.free) - 1, 0)

    assert "num_free should be 4" in caught("page_pool", NumFreeOneShort)


def test_page_pool_free_list_holding_a_page_in_use_is_caught():
    """A release that puts a page still held by another request on the free list gets a message
    naming the page."""
    class FreesOnEveryRelease(pool_base()):  # counts right, but the free list is not
        @property
        def num_free(self):
            return self.ref_count.count(0)

        def release(self, pages):
            for page in pages:
                if self.ref_count[page] <= 0:
                    raise ValueError("free")
                self.ref_count[page] -= 1
                self.free.append(page)  # even while another request still holds it

    assert "is on your free list but" in caught("page_pool", FreesOnEveryRelease)


def test_page_pool_failed_allocate_that_touched_the_ref_counts_is_blamed_on_allocate():
    """An allocate that sets ref counts before raising MemoryError is blamed on allocate not being
    all or nothing, with the ref counts shown."""
    class CountsThenRaises(pool_base()):  # sets ref counts, then finds it has too few pages
        def allocate(self, n):
            for page in self.free[:n]:
                self.ref_count[page] = 1
            if n > len(self.free):
                raise MemoryError
            return super().allocate(n)

    message = caught("page_pool", CountsThenRaises)
    assert "allocate must be all or nothing" in message and "ref counts [" in message


def test_page_pool_allocate_returning_one_page_twice_is_caught():
    """An allocate that returns the same page more than once gets a message that it must return n
    different pages."""
    class SamePageTwice(pool_base()):
        def allocate(self, n):
            pages = super().allocate(n)
            return pages[:1] * n

    assert "must return 4 different pages" in caught("page_pool", SamePageTwice)


def test_page_pool_page_ids_must_be_zero_based():
    """A page pool with page ids 1..num_pages gets a message that the id is not in
    0..num_pages-1."""
    class OneBased:  # counts kept in a dict by page id, ids 1..num_pages
        def __init__(self, num_pages):
            self.num_pages, self.counts = num_pages, {}
            self.free = list(range(1, num_pages + 1))

        @property
        def ref_count(self):
            return [self.counts.get(p, 0) for p in range(self.num_pages)]

        @property
        def num_free(self):
            return len(self.free)

        def allocate(self, n):
            if n > len(self.free):
                raise MemoryError
            pages, self.free = self.free[:n], self.free[n:]
            for p in pages:
                self.counts[p] = 1
            return pages

        def share(self, pages):
            if any(not self.counts.get(p) for p in pages):
                raise ValueError("free")
            for p in pages:
                self.counts[p] += 1

        def release(self, pages):
            for p in pages:
                if not self.counts.get(p):
                    raise ValueError("free")
                self.counts[p] -= 1
                if not self.counts[p]:
                    self.free.append(p)

    message = caught("page_pool", OneBased)
    assert "not a page id in 0..3" in message


def test_page_pool_must_not_hand_out_a_page_still_held():
    """An allocate that hands out a page still held gets a message that only pages with ref count 0
    may be allocated."""
    class HandsOutHeld(pool_base()):  # its free list (not named `free`) gets shared pages
        def __init__(self, num_pages):
            super().__init__(num_pages)
            self.unused = self.free
            del self.free

        @property
        def num_free(self):
            return self.ref_count.count(0)

        def allocate(self, n):
            if n > self.num_free:
                raise MemoryError
            pages = list(dict.fromkeys(self.unused))[:n]
            self.unused = [p for p in self.unused if p not in pages]
            for page in pages:
                self.ref_count[page] = 1
            return pages

        def release(self, pages):
            for page in pages:
                if self.ref_count[page] <= 0:
                    raise ValueError("free")
                self.ref_count[page] -= 1
                self.unused.append(page)  # even while another request still holds it

    message = caught("page_pool", HandsOutHeld)
    assert "only pages with ref count 0 may be allocated" in message


@pytest.mark.parametrize("method", ["release", "share"])
def test_page_pool_must_raise_for_a_free_page(method):
    """A release or share of a free page that does not raise ValueError gets a message naming the
    call."""
    base = pool_base()

    def ignore_free(self, pages):
        getattr(base, method)(self, [p for p in pages if self.ref_count[p] > 0])

    lenient = type("Lenient", (base,), {method: ignore_free})
    message = caught("page_pool", lenient)
    assert f"{method}([0]) of a free page must raise ValueError" in message
    assert "but yours did not" in message


def test_page_pool_off_by_one_at_an_exact_fit_is_caught():
    """An allocate that raises MemoryError when asked for exactly the free pages gets a message that
    it must succeed."""
    class RefusesExactFit(pool_base()):  # MemoryError when n equals the free pages
        def allocate(self, n):
            if n and n >= len(self.free):
                raise MemoryError
            return super().allocate(n)

    assert "must succeed, but yours raised MemoryError" in caught("page_pool", RefusesExactFit)


def test_prefix_hashes_hints_name_the_page_count_mistakes():
    """Hashing a partial last page, or dropping a page that ends the prompt exactly, gets a message
    with the hash counts and a hint for that mistake only."""
    def partial_too(tokens, page_size):  # the last partial page gets a hash too
        out, previous = [], None
        for i in range(0, len(tokens), page_size):
            previous = page_hash(previous, tokens[i:i + page_size])
            out.append(previous)
        return out

    def drops_exact_last(tokens, page_size):  # a page that ends the prompt exactly is lost
        out, previous = [], None
        for i in range(0, (len(tokens) - 1) // page_size * page_size, page_size):
            previous = page_hash(previous, tokens[i:i + page_size])
            out.append(previous)
        return out

    message = caught("prefix_hashes", partial_too)
    assert "returned 1 hashes; expected 0" in message and "a partial page" in message
    message = caught("prefix_hashes", drops_exact_last)
    assert "returned 0 hashes; expected 1" in message and "exactly full counts too" in message
    assert "partial page" not in message


def test_prefix_hashes_first_page_hint_names_the_missing_none():
    """A hash chain seeded from anything but None gets a message that page 0's hash differs and
    should be page_hash(None, first_page_tokens)."""
    def seeded(tokens, page_size):  # the chain starts from the empty page's hash, not None
        out, previous = [], page_hash(None, [])
        for i in range(0, len(tokens) - page_size + 1, page_size):
            previous = page_hash(previous, tokens[i:i + page_size])
            out.append(previous)
        return out

    message = caught("prefix_hashes", seeded)
    assert "hash of page 0 differs" in message and "page_hash(None, first_page_tokens)" in message


def test_match_prefix_pages_in_the_wrong_order_fail_and_the_cap_is_spelled_out():
    """A prefix match with its pages reversed fails with both lists, and an uncapped match gets the
    cap spelled out as (len - 1) // page_size pages."""
    match = solution("01_paged_kv.ipynb")["my_match_prefix"]
    message = caught("match_prefix", lambda cached, tokens, ps: match(cached, tokens, ps)[::-1])
    assert "expected pages [7, 3, 5], got [5, 3, 7]" in message

    def uncapped(cached, tokens, page_size):
        pages = []
        for h in prompt_page_hashes(tokens, page_size):
            if h not in cached:
                break
            pages.append(cached[h])
        return pages

    # 12 tokens in pages of 4: one token must stay, so at most 11 // 4 = 2 pages
    assert "(len - 1) // page_size = 2 pages" in caught("match_prefix", uncapped)


def test_quantize_int8_scale_off_by_a_level_is_named_as_the_scale():
    """A scale of max|row| / 128 gets a message that the scale must map the largest weight to
    exactly 127."""
    def over_128(weight):  # int8 has 128 negative levels: but the scale maps max to 127
        scale = (weight.abs().amax(dim=1) / 128).clamp(min=1e-12)
        return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale

    message = caught("quantize_int8", over_128)
    assert "expected scales max|row| / 127" in message and "must map to exactly 127" in message


def test_quantize_int8_any_positive_scale_for_an_all_zero_row_is_right():
    """Any positive scale for an all-zero row passes."""
    def floor_of_one(weight):
        scale = weight.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale

    check.quantize_int8(floor_of_one)


def test_quantize_int8_wrong_scale_of_a_one_row_weight_is_not_called_a_shared_scale():
    """A scale wrong only for a one-row weight gets a message about the single row and the ratio,
    not about sharing one scale."""
    mine = solution("01_paged_kv.ipynb")["my_quantize_int8"]

    def one_row_twice(weight):  # right on every weight but the one-row one
        q, scale = mine(weight)
        return (q, scale * 2) if weight.shape[0] == 1 else (q, scale)

    message = caught("quantize_int8", one_row_twice)
    assert "a single row" in message and "Yours are about 2x" in message
    assert "share one scale" not in message


def test_finish_steps_must_be_listed_per_request_not_in_arrival_order():
    """Right finish steps listed in arrival order rather than per request fail with the input and
    the learner's list."""
    steps = solution("03_continuous_batching.ipynb")["continuous_finish_steps"]

    def in_arrival_order(max_tokens, arrivals, max_num_seqs):  # right steps, wrong places
        got = steps(max_tokens, arrivals, max_num_seqs)
        return [got[i] for i in sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i))]

    message = caught("continuous_finish_steps", in_arrival_order)
    assert "arrival_steps=[9, 1, 1]" in message and "yours says [5, 10, 15]" in message


def test_a_static_batch_that_leaves_out_a_request_arriving_as_it_forms_is_caught():
    """A batch formed at step s takes the requests that arrived by s, one arriving at s itself
    included; an answer counting only those that arrived while the last batch ran fails."""
    def wrong(max_tokens, arrival_steps, max_num_seqs):
        order = sorted(range(len(max_tokens)), key=lambda i: (arrival_steps[i], i))
        finish, last_end = [0] * len(max_tokens), 0
        while order:
            start = max(last_end + 1, arrival_steps[order[0]])
            batch = [i for i in order[:max_num_seqs]
                     if arrival_steps[i] <= max(last_end, arrival_steps[order[0]])]
            for i in batch:
                finish[i] = start + max_tokens[i] - 1
                order.remove(i)
            last_end = max(finish[i] for i in batch)
        return finish

    assert "yours says [3, 3, 6, 9]" in caught("static_finish_steps", wrong)


def test_a_scheduler_returning_something_else_than_ctx_batch_is_named():
    """A scheduler that returns its batch's items instead of ctx.batch gets a message that it must
    return ctx.batch."""
    mine = solution("05_pd_interleaving.ipynb")["MyPDScheduler"]

    class ReturnsItems(mine):
        def schedule(self, ctx):
            return list(super().schedule(ctx).items)

    assert "it must return ctx.batch" in caught("pd_scheduler", ReturnsItems)


def test_minicbs_own_scheduler_is_named_even_behind_a_working_fallback():
    """A scheduler that tries minicb's own ContinuousScheduler.schedule before its own code is named
    as running minicb's own."""
    from minicb.scheduler import ContinuousScheduler

    mine = solution("03_continuous_batching.ipynb")["MyContinuousScheduler"]

    class TriesMinicbsFirst(mine):  # minicb's raises in the check; its own then does the work
        def schedule(self, ctx):
            try:
                return ContinuousScheduler.schedule(self, ctx)
            except RuntimeError:
                return super().schedule(ctx)

    message = caught("continuous_scheduler", TriesMinicbsFirst)
    assert "your scheduler ran minicb's own ContinuousScheduler.schedule" in message


def test_next_chunk_off_by_one_gets_the_take_more_hint_not_the_last_tokens_one():
    """A next_chunk that waits at exactly min_chunk gets the failing input and the "take as much as"
    hint, not the min_chunk one."""
    def waits_at_the_bound(remaining, chunk_size, budget, min_chunk=1):  # <= for <
        n = min(remaining, chunk_size, max(budget, 0))
        return 0 if n <= min(min_chunk, remaining) else n

    message = caught("next_chunk", waits_at_the_bound)
    assert "remaining=1, chunk_size=32, budget=1, min_chunk=1): expected 1, got 0" in message
    assert "Take as much as" in message and "less than min_chunk" not in message


def test_next_chunk_must_be_an_int_not_a_float():
    """A next_chunk that returns a float fails with the expected int and the float it got."""
    reference = solution("04_chunked_prefill.ipynb")["next_chunk"]
    message = caught("next_chunk", lambda *args: float(reference(*args)))
    assert "expected 32, got 32.0" in message


def goodput_like(strict=False, one_token_fails_tpot=False):
    """Exercise 6.2's goodput, with one of its rules broken on demand."""
    latencies = solution("06_benchmarking.ipynb")["latencies"]

    def goodput(records, slo):
        arrivals = [r.arrival_time for r in records if r.arrival_time is not None]
        finishes = [r.finish_time for r in records if r.finish_time is not None]
        if not arrivals or not finishes or max(finishes) - min(arrivals) <= 0:
            return None

        def meets(r):
            if r.finish_reason not in ("stop", "length"):
                return False
            values = latencies(r)
            for key, limit in slo.items():
                if values[key] is None and key == "tpot" and not one_token_fails_tpot:
                    continue
                if values[key] is None or (values[key] >= limit if strict else
                                           values[key] > limit):
                    return False
            return True

        return sum(1 for r in records if meets(r)) / (max(finishes) - min(arrivals))
    return goodput


def test_goodput_limits_are_inclusive_and_one_token_requests_pass_tpot():
    """A goodput with strict limits, or that fails one-token requests under a TPOT limit, gets a
    message naming that case."""
    check.goodput(goodput_like())  # the helper itself is right
    assert "a request exactly at its TTFT limit" in caught("goodput", goodput_like(strict=True))
    assert "one-token requests under a TPOT limit" in caught(
        "goodput", goodput_like(one_token_fails_tpot=True))


def test_per_tenant_lists_only_tenants_that_sent_requests():
    """A per-tenant table with a row for a tenant that sent no request fails with both tenant
    lists."""
    per_tenant = solution("06_benchmarking.ipynb")["per_tenant"]

    def always_none_row(records):  # a row for the "no tenant" tenant even without its requests
        out = per_tenant(records)
        out.setdefault(None, {"requests": 0, "completed": 0, "ttft_p50": None,
                              "ttft_p99": None, "output_tokens": 0})
        return out

    message = caught("per_tenant", always_none_row)
    assert "no records: the tenants are [], yours are [None]" in message


def test_latencies_rounded_for_display_are_not_blamed_on_float32():
    """Latencies rounded to four digits fail with the learner's value, and the message does not
    blame float32."""
    latencies = solution("06_benchmarking.ipynb")["latencies"]

    def four_digits(record):  # 0.06823 for 0.0682333...: off by 5e-5, far more than float32
        return {k: None if v is None else float(f"{v:.4g}") for k, v in latencies(record).items()}

    message = caught("latencies", four_digits)
    assert "yours is 0.06823." in message and "float32" not in message


def test_a_float_tensor_is_not_a_chunk_size():
    """A next_chunk that returns a float tensor fails with the expected int and the tensor it
    got."""
    reference = solution("04_chunked_prefill.ipynb")["next_chunk"]
    message = caught("next_chunk", lambda *args: torch.tensor(float(reference(*args))))
    assert "expected 32, got tensor(32.)" in message


def test_tuples_of_the_right_ints_are_right_answers():
    """Slot mappings and greedy verifications returned as tuples of the right ints pass."""
    slots = solution("07_paged_attention.ipynb")["slot_mapping"]
    verify = solution("08_speculative_decoding.ipynb")["verify_greedy"]
    check.slot_mapping(lambda *a: tuple(slots(*a)))
    check.verify_greedy(lambda d, t: tuple(verify(d, t)))


def test_minicbs_own_function_behind_functools_wraps_is_not_an_answer():
    """minicb's own prompt_page_hashes behind functools.wraps fails with a message naming it."""
    @functools.wraps(prompt_page_hashes)
    def wrapper(tokens, page_size):
        return prompt_page_hashes(tokens, page_size)

    assert "that is minicb's own `prompt_page_hashes`" in caught("prefix_hashes", wrapper)


def test_an_error_names_the_deepest_line_of_the_learners_code():
    """An exception raised in a learner's helper is reported at the helper's line, the deepest of
    the learner's code."""
    def helper(tokens):
        return tokens[0] // 0

    def hashes(tokens, page_size):
        return [helper(tokens)] if tokens else []

    message = caught("prefix_hashes", hashes)
    assert "raised ZeroDivisionError" in message and "(at `return tokens[0] // 0`)" in message


def test_an_untouched_stub_raises_its_own_not_implemented_error():
    """An untouched exercise stub raises its own NotImplementedError, not a check failure."""
    def stub(tokens, page_size):
        raise NotImplementedError("write my_prompt_page_hashes")

    with pytest.raises(NotImplementedError, match="write my_prompt_page_hashes"):
        check.prefix_hashes(stub)


def test_short_p_hint_counts_a_request_arriving_at_the_last_step_of_a_cut_trace():
    """In a trace cut before the long request's first token, the short_P hint counts a request
    arriving at the last step as alive and one arriving after it as not, and an unfinished alive
    request makes short_P None."""
    from dataclasses import replace

    from minicb.benchmark import metrics

    label, trace, records, long_id = next(t for t in check.pd_traces()
                                          if "stopped after 4 steps" in t[0])
    long = next(r for r in records if r.request_id == long_id)
    last = trace[-1].step
    assert long.first_token_step is None  # the window ends with the trace
    short = next(r for r in records if r.request_id != long_id)
    at_end = replace(short, request_id="at-end", arrival_step=last, finish_step=None)
    after = replace(short, request_id="after", arrival_step=last + 1, finish_step=None)
    hint = check._who_is_alive(trace, [*records, at_end, after], long)
    alive, not_alive = hint.split("; not: ")
    assert f"at-end (arrived at step {last}," in alive
    assert f"after (arrived at step {last + 1}, after the window ended at step {last})" in \
        not_alive
    # as in minicb.benchmark.metrics: the unfinished request at the window's end makes short_P None
    assert metrics.long_prefill_metrics(trace, [*records, at_end], long_id)[
        "short_p_steps"] is None


def test_a_scheduler_class_must_subclass_scheduler():
    """A scheduler class that does not subclass Scheduler gets a message saying a Scheduler subclass
    is expected."""
    mine = solution("03_continuous_batching.ipynb")["MyContinuousScheduler"]
    forgot_the_base = type("MyScheduler", (), {"name": "continuous",
                                               "schedule": mine.schedule})
    message = caught("continuous_scheduler", forgot_the_base)
    assert "expected a Scheduler subclass" in message


def pd_like(min_chunk=True):
    """Exercise 5.1's scheduler written with the building blocks, min_chunk optional."""
    from minicb.scheduler import Scheduler, schedule_prefill_chunks

    class PD(Scheduler):
        name = "my-pd"

        def schedule(self, ctx):
            budget = ctx.config.max_num_batched_tokens - self.schedule_decodes(ctx)
            schedule_prefill_chunks(ctx, budget,
                                    **({"min_chunk": ctx.config.min_chunk} if min_chunk else {}))
            return ctx.batch
    return PD


def test_pd_scheduler_that_ignores_min_chunk_is_caught():
    """A PD scheduler that ignores min_chunk fails on the min-chunk workload."""
    check.pd_scheduler(pd_like())  # the helper itself is right
    assert "workload 'min-chunk'" in caught("pd_scheduler", pd_like(min_chunk=False))


def test_next_chunk_below_min_chunk_is_not_blamed_on_the_budget():
    """A next_chunk that returns fewer tokens than min_chunk fails with the input and the min_chunk
    hint, not the budget one."""
    def ignores_min_chunk(remaining, chunk_size, budget, min_chunk=1):
        return min(remaining, chunk_size, budget)

    message = caught("next_chunk", ignores_min_chunk)
    assert "budget=5, min_chunk=8): expected 0, got 5" in message
    assert "fewer than min_chunk=8" in message and "must fit in the step's" not in message


def test_slot_mapping_with_one_slot_too_many_says_one_per_token():
    """A slot mapping with one slot too many gets a message that there is one slot per new token,
    and how many."""
    slots = solution("07_paged_attention.ipynb")["slot_mapping"]

    def one_more(table, num_computed, num_new, page_size):  # the slot after the last, too
        return slots(table, num_computed, num_new, page_size) + [0]

    assert "One slot per new token: 4 of them." in caught("slot_mapping", one_more)


def test_paged_attention_in_half_precision_is_not_close_enough():
    """Paged attention computed in float16 fails with how far it differs from minicb's."""
    correct = solution("07_paged_attention.ipynb")["paged_attention"]

    def in_half(q, k, v, table, num_computed, scale):
        return correct(q.half(), k.half(), v.half(), table, num_computed, scale).float()

    assert "your output differs from minicb's by up to" in caught("paged_attention", in_half)


def test_paged_attention_nan_hint_only_for_nan():
    """A wrong paged-attention output gets the NaN hint only when it holds NaN or inf."""
    message = caught("paged_attention", lambda q, *rest: torch.zeros_like(q))
    assert "differs from minicb's" in message and "NaN" not in message
    message = caught("paged_attention", lambda q, *rest: torch.full_like(q, float("nan")))
    assert "Your output holds NaN or inf" in message


def test_per_tenant_row_missing_a_key_is_named():
    """A per-tenant row missing a key gets a message listing the keys it needs."""
    per_tenant = solution("06_benchmarking.ipynb")["per_tenant"]

    def no_output_tokens(records):
        out = per_tenant(records)
        for row in out.values():
            del row["output_tokens"]
        return out

    assert "needs the keys ['completed', 'output_tokens'," in caught("per_tenant",
                                                                   no_output_tokens)


@pytest.mark.parametrize("exercise", ["dec_at_p", "short_p"])
def test_long_prefill_metrics_returning_none_fail(exercise):
    """A dec@P or short_P that returns None where a number is due fails with "got None"."""
    assert "got None" in caught(exercise, lambda trace, records, long_id: None)


def test_verify_greedy_hint_only_when_that_mistake_explains_every_case():
    """A greedy verification that stops accepting after two guesses fails with the expected and
    actual tokens and no hint, since no known mistake explains every case."""
    def keeps_at_most_two(draft, target):  # stops accepting after two guesses
        accepted = 0
        while accepted < min(len(draft), 2) and draft[accepted] == target[accepted]:
            accepted += 1
        return target[:accepted + 1]

    message = caught("verify_greedy", keeps_at_most_two)
    assert message.endswith("expected [1, 2, 3, 4], got [1, 2, 3].")  # no hint: none fits


def test_pd_scheduler_that_gives_prefill_the_pages_first_is_caught():
    """A budget split right whose chunk reserves its pages before the decodes do (a decode then
    loses its page and is preempted) fails on 'pages-mid-prefill', the workload with a prompt
    mid-prefill when pages run out."""
    from minicb.scheduler import Scheduler, schedule_prefill_chunks

    class PagesToPrefillFirst(Scheduler):
        name = "my-pd"

        def schedule(self, ctx):
            decoding = [r for r in self.decoding(ctx) if r.status is Status.RUNNING]
            schedule_prefill_chunks(ctx, ctx.config.max_num_batched_tokens - len(decoding),
                                    min_chunk=ctx.config.min_chunk)
            self.schedule_decodes(ctx)
            return ctx.batch

    assert "workload 'pages-mid-prefill'" in caught("pd_scheduler", PagesToPrefillFirst)


def test_latencies_that_take_ttft_from_any_released_time_are_caught():
    """The engine sets released_time on every finished request (at its finish unless a static
    batch held it), so TTFT follows `returned_whole`: an answer that switches to the release
    whenever released_time is set, giving E2E as TTFT on every real record, fails."""
    latencies = solution("06_benchmarking.ipynb")["latencies"]

    def ttft_from_released(record):
        values = latencies(record)
        if record.released_time is not None and record.first_token_time is not None:
            values["ttft"] = record.released_time - record.arrival_time
        return values

    assert "ttft" in caught("latencies", ttft_from_released)


def test_schedulers_that_schedule_more_than_admit_made_room_for_are_caught():
    """3.2 and 4.2: `ctx.admit` returns fewer tokens than asked when the prompt's first pages
    are cached (prefix caching is on by default); a scheduler that schedules what it asked for
    made the real engine refuse its batch ("asks to advance 50 tokens but has 2 left"), yet
    the checks' prompts never shared a page. 'prefix-hit' shares 48 tokens."""
    from minicb.scheduler import Scheduler
    next_chunk = solution("04_chunked_prefill.ipynb")["next_chunk"]

    class WholePromptsIgnoringAdmit(Scheduler):
        name, whole_prompts = "continuous", True

        def schedule(self, ctx):
            self.schedule_decodes(ctx)
            prefill = 0
            while ctx.waiting and not ctx.batch.preempted:
                req = ctx.waiting[0]
                if prefill and prefill + req.num_tokens > ctx.config.max_num_batched_tokens:
                    break
                if not ctx.admit(req, req.num_tokens):
                    break
                ctx.schedule(req, req.num_tokens)
                prefill += req.num_tokens
            return ctx.batch

    class ChunksIgnoringAdmit(Scheduler):
        name = "my-chunked"

        def schedule(self, ctx):
            budget, chunk = ctx.config.max_num_batched_tokens, ctx.config.chunk_size
            for req in self.prefilling(ctx):
                n = next_chunk(req.num_remaining, chunk, budget)
                if n and ctx.reserve(req, n):
                    ctx.schedule(req, n)
                    budget -= n
            while ctx.waiting and budget > 0:
                req = ctx.waiting[0]
                want = min(chunk, budget, req.num_tokens)
                if not ctx.admit(req, want):
                    break
                ctx.schedule(req, want)
                budget -= want
            if not ctx.batch.items:
                self.schedule_decodes(ctx)
            return ctx.batch

    for exercise, cls in (("continuous_scheduler", WholePromptsIgnoringAdmit),
                          ("chunked_scheduler", ChunksIgnoringAdmit)):
        message = caught(exercise, cls)
        assert "workload 'prefix-hit'" in message and "has 2 left to compute" in message


def test_quantize_int8_that_overwrites_the_callers_weight_is_caught():
    """An int8 quantizer that changes the weight it was given in place gets a message saying so."""
    def in_place(weight):
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
        return weight.div_(scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale

    assert "changed the weight it was given" in caught("quantize_int8", in_place)


def test_page_pool_refusing_allocate_zero_when_full_is_caught():
    """A full page pool that refuses allocate(0) gets a message naming allocate(0)."""
    base = solution("01_paged_kv.ipynb")["MyPagePool"]

    class ZeroRefusedWhenFull(base):
        def allocate(self, n):
            if not self.free:
                raise MemoryError("no page free")
            return super().allocate(n)

    assert "allocate(0)" in caught("page_pool", ZeroRefusedWhenFull)


def test_paged_attention_that_ignores_its_scale_argument_is_caught():
    """Paged attention that computes its own scale instead of using the given one fails on a random
    case with another scale."""
    reference = solution("07_paged_attention.ipynb")["paged_attention"]

    def own_scale(q, k_cache, v_cache, page_table, num_computed, scale):
        return reference(q, k_cache, v_cache, page_table, num_computed, q.shape[-1] ** -0.5)

    assert "random case 1" in caught("paged_attention", own_scale)


# ------------------------------------------------------------------------------ cases and points
def floor_pages(queue, max_num_seqs, free_pages, page_size):
    """Exercise 2.1 with one planted bug: pages rounded down, so a partial page is free."""
    batch = []
    for request_id, prompt_len in queue[:max_num_seqs]:
        need = prompt_len // page_size
        if need > free_pages:
            break
        free_pages -= need
        batch.append(request_id)
    return batch


def test_a_check_runs_every_case_and_counts_those_that_passed(monkeypatch):
    """A failed case does not stop the check: every case runs, the message gives the count,
    the first failed case in full and one line for each other reason, and the results hold
    each case by name and group."""
    monkeypatch.setattr(check, "STOP_AT_FIRST", False)
    with pytest.raises(check.CheckFailed) as info:
        check.static_batch(floor_pages)
    message = str(info.value)
    results = check.RESULTS["static_batch"]
    passed = sum(r.passed for r in results.results)
    assert results.total == len(results.results) == 159 and 0 < passed < 159
    assert message.startswith(f"[static_batch] {passed} of 159 cases passed. The first that "
                              "failed, edge queue 3: ")
    assert "Your batch needs 6 pages but only 3 are free." in first_failure(message)
    others = message.split("\nAlso failed (", 1)[1].splitlines()
    assert others[0] == f"{158 - passed}):" and len(others) == 1 + check.MAX_OTHER_FAILURES + 1
    assert others[-1].startswith("  - ... and ")
    assert {r.group for r in results.results} == {"edge", "random"}
    assert [r.name for r in results.results][:2] == ["edge queue 0", "edge queue 1"]


def test_an_exercise_earns_its_points_in_proportion_to_its_cases():
    """Points are max_points times the weight passed over the weight of all cases: each case
    weighs 1 unless a weight names its group or itself; a case never run counts as failed;
    a refused answer earns nothing."""
    summary = {"total": 4, "refused": False, "cases": [["a", "edge", True, ""],
                                                       ["b", "random", False, "why"],
                                                       ["c", "random", True, ""]]}
    assert check.case_points(summary, 2) == 1.0  # 2 of 4 (one never ran)
    assert check.case_points(summary, 2, {"edge": 5}) == round(2 * 6 / 8, 4)
    assert check.case_points(summary, 2, {"b": 0}) == round(2 * 2 / 3, 4)
    assert check.case_points({**summary, "refused": True}, 2) == 0
    assert check.case_points({"total": 0, "cases": []}, 2) == 0


def test_score_returns_the_points_and_prints_what_failed(capsys, monkeypatch):
    """check.score (an nbgrader test cell's last line) never raises: it prints the mark or
    what failed, and returns the points the cases earned; an untouched stub earns 0."""
    monkeypatch.setattr(check, "STOP_AT_FIRST", False)
    right = solution("02_static_batching.ipynb")["form_static_batch"]
    assert check.score(check.static_batch, right, points=2) == 2
    assert capsys.readouterr().out.startswith("✓ static_batch: ")
    partial = check.score(check.static_batch, floor_pages, points=2)
    assert 0 < partial < 2 and capsys.readouterr().out.startswith("✗ CheckFailed: ")

    def stub(*args):
        raise NotImplementedError("write form_static_batch (exercise static_batch)")
    assert check.score(check.static_batch, stub) == 0
    assert "NotImplementedError: write form_static_batch" in capsys.readouterr().out


@pytest.fixture
def hidden_seed(monkeypatch):
    """Set the check module's hidden seed for one test."""
    def set_seed(seed):
        monkeypatch.setattr(check, "HIDDEN_SEED", seed)
    return set_seed


def test_hidden_cases_come_only_from_the_hidden_seed(hidden_seed, capsys):
    """Without a hidden seed a check runs its public cases only; with one it adds hidden
    cases drawn from it: the same for the same seed, others for another seed."""
    right = solution("04_chunked_prefill.ipynb")["next_chunk"]

    def inputs_with(seed):
        hidden_seed(seed)
        seen = []
        check.next_chunk(lambda *args: seen.append(args) or right(*args))
        groups = [r.group for r in check.RESULTS["next_chunk"].results]
        return seen, groups

    public, groups = inputs_with(None)
    assert "hidden" not in groups
    seven, groups = inputs_with(7)
    assert seven[:len(public)] == public and groups.count("hidden") == len(seven) - len(public)
    assert inputs_with(7)[0] == seven and inputs_with(8)[0][len(public):] != seven[len(public):]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_reference_solutions_pass_their_hidden_cases(seed, hidden_seed, capsys):
    """Every reference solution passes every hidden case of its check, whatever the seed (a
    random workload, trace or input that the reference itself trips on would fail them)."""
    hidden_seed(seed)
    for exercise, (notebook, name) in SOLUTION_OBJECTS.items():
        getattr(check, exercise)(solution(notebook)[name])
        results = check.RESULTS[exercise]
        assert any(r.group == "hidden" for r in results.results), exercise
        assert all(r.passed for r in results.results), exercise


def _static_finish(policy):
    return lambda m, a, s: check._finish_steps_real(policy, m, a, s)


@pytest.mark.parametrize("exercise, answer", [
    ("static_batch", lambda: check._reference_static_batch),
    ("static_batch", lambda: functools.partial(check._reference_static_batch)),
    ("static_finish_steps", lambda: _static_finish("static")),
    ("continuous_finish_steps", lambda: _static_finish("continuous")),
    ("next_chunk", lambda: check._reference_next_chunk),
    ("match_prefix", lambda: check._reference_match),
    ("goodput", lambda: check._reference_goodput),
    ("per_tenant", lambda: check._reference_per_tenant),
    ("slot_mapping", lambda: lambda t, c, n, p: check._reference_metadata(t, c, n, p)
     .slot_mapping.tolist()),
    ("paged_attention", lambda: check._attention_variant),
    ("prompt_lookup", lambda: check._lookup_variant),
    ("verify_greedy", lambda: check._verify_variant),
    ("swap_break_even", lambda: check._break_even_variant),
])
def test_the_check_modules_own_references_are_not_an_answer(exercise, answer):
    """The check module's own reference functions, directly or wrapped, are refused like
    minicb's: the check stops at once, names the function, and the answer earns nothing."""
    with pytest.raises(check.ReferenceRefused) as info:
        getattr(check, exercise)(answer())
    assert "minicb's own check." in str(info.value)
    results = check.RESULTS[exercise]
    assert results.refused and check.case_points(results.summary(), 1) == 0


def test_a_learners_release_is_kept_by_the_checks_wrapper():
    """The check wraps a learner's scheduler; the engine still asks the learner's own `release`
    when a response reaches its user, so static batching holds finished responses to batch end
    under the check exactly as it does alone."""
    from minicb.scheduler import StaticScheduler

    wl = check.CONTINUOUS_WORKLOADS[0]  # r1-r4: requests of different lengths in one batch
    alone = check._run(StaticScheduler, wl, "static", learner=False)
    wrapped = check._run(StaticScheduler, wl, "static", learner=True)
    released = [{rid: r.metrics.released_step for rid, r in run.engine.requests.items()}
                for run in (alone, wrapped)]
    finished = {rid: r.metrics.finish_step for rid, r in alone.engine.requests.items()}
    assert released[0] != finished  # static batching does hold a response here
    assert released[1] == released[0]
