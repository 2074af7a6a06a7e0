"""More planted bugs for `minicb.course.check`, found by a mutation review of check.py.

Each test breaks a reference answer in one plausible way and asserts that the check fails it
with the message that names the cause, or that an answer which is right in a way the reference
is not (a different floor, a tuple, ...) still passes. Fast: no kernels, no notebooks.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_exercises import caught, solution

from minicb.course import check
from minicb.kv_cache import page_hash, prompt_page_hashes
from minicb.request import Status


# ------------------------------------------------------------------------------ 1.1 page pool
def pool_base():
    return solution("01_paged_kv.ipynb")["MyPagePool"]


def test_page_pool_ref_count_needs_exactly_one_entry_per_page():
    class OneCountTooMany(pool_base()):
        def __init__(self, num_pages):
            super().__init__(num_pages)
            self.ref_count = [0] * (num_pages + 1)

    assert "ref_count has 5 entries, expected one per page (4)" in caught("page_pool",
                                                                         OneCountTooMany)


def test_page_pool_release_that_keeps_a_shared_reference_is_caught():
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
    class NumFreeOneShort(pool_base()):
        @property
        def num_free(self):
            return max(len(self.free) - 1, 0)

    assert "num_free should be 4" in caught("page_pool", NumFreeOneShort)


def test_page_pool_free_list_holding_a_page_in_use_is_caught():
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
    class SamePageTwice(pool_base()):
        def allocate(self, n):
            pages = super().allocate(n)
            return pages[:1] * n

    assert "must return 4 different pages" in caught("page_pool", SamePageTwice)


def test_page_pool_page_ids_must_be_zero_based():
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
    base = pool_base()

    def ignore_free(self, pages):
        getattr(base, method)(self, [p for p in pages if self.ref_count[p] > 0])

    lenient = type("Lenient", (base,), {method: ignore_free})
    message = caught("page_pool", lenient)
    assert f"{method}([0]) of a free page must raise ValueError" in message
    assert "but yours did not" in message


def test_page_pool_off_by_one_at_an_exact_fit_is_caught():
    class RefusesExactFit(pool_base()):  # MemoryError when n equals the free pages
        def allocate(self, n):
            if n and n >= len(self.free):
                raise MemoryError
            return super().allocate(n)

    assert "must succeed, but yours raised MemoryError" in caught("page_pool", RefusesExactFit)


# ------------------------------------------------------------------------------ 1.2, 1.3 hashes
def test_prefix_hashes_hints_name_the_page_count_mistakes():
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
    def seeded(tokens, page_size):  # the chain starts from the empty page's hash, not None
        out, previous = [], page_hash(None, [])
        for i in range(0, len(tokens) - page_size + 1, page_size):
            previous = page_hash(previous, tokens[i:i + page_size])
            out.append(previous)
        return out

    message = caught("prefix_hashes", seeded)
    assert "hash of page 0 differs" in message and "page_hash(None, first_page_tokens)" in message


def test_match_prefix_pages_in_the_wrong_order_fail_and_the_cap_is_spelled_out():
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


# ------------------------------------------------------------------------------ 1.4 int8
def test_quantize_int8_scale_off_by_a_level_is_named_as_the_scale():
    def over_128(weight):  # int8 has 128 negative levels: but the scale maps max to 127
        scale = (weight.abs().amax(dim=1) / 128).clamp(min=1e-12)
        return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale

    message = caught("quantize_int8", over_128)
    assert "expected scales max|row| / 127" in message and "must map to exactly 127" in message


def test_quantize_int8_any_positive_scale_for_an_all_zero_row_is_right():
    def floor_of_one(weight):
        scale = weight.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale

    assert check.quantize_int8(floor_of_one) is True


def test_quantize_int8_wrong_scale_of_a_one_row_weight_is_not_called_a_shared_scale():
    mine = solution("01_paged_kv.ipynb")["my_quantize_int8"]

    def one_row_twice(weight):  # right on every weight but the one-row one
        q, scale = mine(weight)
        return (q, scale * 2) if weight.shape[0] == 1 else (q, scale)

    message = caught("quantize_int8", one_row_twice)
    assert "a single row" in message and "Yours are about 2x" in message
    assert "share one scale" not in message


# ------------------------------------------------------------------------------ 2.2, 3.1 steps
def test_finish_steps_must_be_listed_per_request_not_in_arrival_order():
    steps = solution("03_continuous_batching.ipynb")["continuous_finish_steps"]

    def in_arrival_order(max_tokens, arrivals, max_num_seqs):  # right steps, wrong places
        got = steps(max_tokens, arrivals, max_num_seqs)
        return [got[i] for i in sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i))]

    message = caught("continuous_finish_steps", in_arrival_order)
    assert "arrival_steps=[9, 1, 1]" in message and "yours says [5, 10, 15]" in message


def test_a_static_batch_that_leaves_out_a_request_arriving_as_it_forms_is_caught():
    """From a review: a batch formed at step s takes the requests that arrived by s, one
    arriving at s itself included; an answer counting only those that arrived while the last
    batch ran passed every workload."""
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


# ------------------------------------------------------------------------------ schedulers
def test_a_scheduler_returning_something_else_than_ctx_batch_is_named():
    mine = solution("05_pd_interleaving.ipynb")["MyPDScheduler"]

    class ReturnsItems(mine):
        def schedule(self, ctx):
            return list(super().schedule(ctx).items)

    assert "it must return ctx.batch" in caught("pd_scheduler", ReturnsItems)


def test_minicbs_own_scheduler_is_named_even_behind_a_working_fallback():
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


# ------------------------------------------------------------------------------ 4.1 next chunk
def test_next_chunk_off_by_one_gets_the_take_more_hint_not_the_last_tokens_one():
    def waits_at_the_bound(remaining, chunk_size, budget, min_chunk=1):  # <= for <
        n = min(remaining, chunk_size, max(budget, 0))
        return 0 if n <= min(min_chunk, remaining) else n

    message = caught("next_chunk", waits_at_the_bound)
    assert "remaining=1, chunk_size=32, budget=1, min_chunk=1): expected 1, got 0" in message
    assert "Take as much as" in message and "less than min_chunk" not in message


def test_next_chunk_must_be_an_int_not_a_float():
    reference = solution("04_chunked_prefill.ipynb")["next_chunk"]
    message = caught("next_chunk", lambda *args: float(reference(*args)))
    assert "expected 32, got 32.0" in message


# ------------------------------------------------------------------------------ 6 metrics
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
    assert check.goodput(goodput_like()) is True  # the helper itself is right
    assert "a request exactly at its TTFT limit" in caught("goodput", goodput_like(strict=True))
    assert "one-token requests under a TPOT limit" in caught(
        "goodput", goodput_like(one_token_fails_tpot=True))


def test_per_tenant_lists_only_tenants_that_sent_requests():
    per_tenant = solution("06_benchmarking.ipynb")["per_tenant"]

    def always_none_row(records):  # a row for the "no tenant" tenant even without its requests
        out = per_tenant(records)
        out.setdefault(None, {"requests": 0, "completed": 0, "ttft_p50": None,
                              "ttft_p99": None, "output_tokens": 0})
        return out

    message = caught("per_tenant", always_none_row)
    assert "no records: the tenants are [], yours are [None]" in message


def test_latencies_rounded_for_display_are_not_blamed_on_float32():
    latencies = solution("06_benchmarking.ipynb")["latencies"]

    def four_digits(record):  # 0.06823 for 0.0682333...: off by 5e-5, far more than float32
        return {k: None if v is None else float(f"{v:.4g}") for k, v in latencies(record).items()}

    message = caught("latencies", four_digits)
    assert "yours is 0.06823." in message and "float32" not in message


# ------------------------------------------------------------------------------ answers' types
def test_a_float_tensor_is_not_a_chunk_size():
    reference = solution("04_chunked_prefill.ipynb")["next_chunk"]
    message = caught("next_chunk", lambda *args: torch.tensor(float(reference(*args))))
    assert "expected 32, got tensor(32.)" in message


def test_tuples_of_the_right_ints_are_right_answers():
    slots = solution("07_paged_attention.ipynb")["slot_mapping"]
    verify = solution("08_speculative_decoding.ipynb")["verify_greedy"]
    assert check.slot_mapping(lambda *a: tuple(slots(*a))) is True
    assert check.verify_greedy(lambda d, t: tuple(verify(d, t))) is True


def test_minicbs_own_function_behind_functools_wraps_is_not_an_answer():
    @functools.wraps(prompt_page_hashes)
    def wrapper(tokens, page_size):
        return prompt_page_hashes(tokens, page_size)

    assert "that is minicb's own `prompt_page_hashes`" in caught("prefix_hashes", wrapper)


def test_an_error_names_the_deepest_line_of_the_learners_code():
    def helper(tokens):
        return tokens[0] // 0

    def hashes(tokens, page_size):
        return [helper(tokens)] if tokens else []

    message = caught("prefix_hashes", hashes)
    assert "raised ZeroDivisionError" in message and "(at `return tokens[0] // 0`)" in message


def test_an_untouched_stub_raises_its_own_not_implemented_error():
    def stub(tokens, page_size):
        raise NotImplementedError("write my_prompt_page_hashes")

    with pytest.raises(NotImplementedError, match="write my_prompt_page_hashes"):
        check.prefix_hashes(stub)


# ------------------------------------------------------------------------------ 5.3 short_P
def test_short_p_hint_counts_a_request_arriving_at_the_last_step_of_a_cut_trace():
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
    assert check.pd_scheduler(pd_like())  # the helper itself is right
    assert "workload 'min-chunk'" in caught("pd_scheduler", pd_like(min_chunk=False))


def test_next_chunk_below_min_chunk_is_not_blamed_on_the_budget():
    def ignores_min_chunk(remaining, chunk_size, budget, min_chunk=1):
        return min(remaining, chunk_size, budget)

    message = caught("next_chunk", ignores_min_chunk)
    assert "budget=5, min_chunk=8): expected 0, got 5" in message
    assert "fewer than min_chunk=8" in message and "must fit in the step's" not in message


def test_slot_mapping_with_one_slot_too_many_says_one_per_token():
    slots = solution("07_paged_attention.ipynb")["slot_mapping"]

    def one_more(table, num_computed, num_new, page_size):  # the slot after the last, too
        return slots(table, num_computed, num_new, page_size) + [0]

    assert "One slot per new token: 4 of them." in caught("slot_mapping", one_more)


# ------------------------------------------------------------------------------ 7.2 attention
def test_paged_attention_in_half_precision_is_not_close_enough():
    correct = solution("07_paged_attention.ipynb")["paged_attention"]

    def in_half(q, k, v, table, num_computed, scale):
        return correct(q.half(), k.half(), v.half(), table, num_computed, scale).float()

    assert "your output differs from minicb's by up to" in caught("paged_attention", in_half)


def test_paged_attention_nan_hint_only_for_nan():
    message = caught("paged_attention", lambda q, *rest: torch.zeros_like(q))
    assert "differs from minicb's" in message and "NaN" not in message
    message = caught("paged_attention", lambda q, *rest: torch.full_like(q, float("nan")))
    assert "Your output holds NaN or inf" in message


# ------------------------------------------------------------------------------ 5.2, 6.3 answers
def test_per_tenant_row_missing_a_key_is_named():
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
    assert "got None" in caught(exercise, lambda trace, records, long_id: None)


# ------------------------------------------------------------------------------ 8.2 verification
def test_verify_greedy_hint_only_when_that_mistake_explains_every_case():
    def keeps_at_most_two(draft, target):  # stops accepting after two guesses
        accepted = 0
        while accepted < min(len(draft), 2) and draft[accepted] == target[accepted]:
            accepted += 1
        return target[:accepted + 1]

    message = caught("verify_greedy", keeps_at_most_two)
    assert message.endswith("expected [1, 2, 3, 4], got [1, 2, 3].")  # no hint: none fits


def test_pd_scheduler_that_gives_prefill_the_pages_first_is_caught():
    """Found by a learner review: the budget split right, but the chunk reserves its pages
    before the decodes do; a decode then loses its page and is preempted. It passed the four
    workloads (none had a prompt mid-prefill when pages ran out): 'pages-mid-prefill' does."""
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
    """Found by a learner review: the engine sets released_time on every finished request
    (at its finish unless a static batch held it), so TTFT must follow `returned_whole`; one
    that switched to the release whenever released_time was set passed the checks, and gave
    E2E as TTFT on every real record."""
    latencies = solution("06_benchmarking.ipynb")["latencies"]

    def ttft_from_released(record):
        values = latencies(record)
        if record.released_time is not None and record.first_token_time is not None:
            values["ttft"] = record.released_time - record.arrival_time
        return values

    assert "ttft" in caught("latencies", ttft_from_released)


# --- holes a review found in exercises 1, 3, 4 and 7 (each wrong answer passed the check) -----
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
    def in_place(weight):
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
        return weight.div_(scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale

    assert "changed the weight it was given" in caught("quantize_int8", in_place)


def test_page_pool_refusing_allocate_zero_when_full_is_caught():
    base = solution("01_paged_kv.ipynb")["MyPagePool"]

    class ZeroRefusedWhenFull(base):
        def allocate(self, n):
            if not self.free:
                raise MemoryError("no page free")
            return super().allocate(n)

    assert "allocate(0)" in caught("page_pool", ZeroRefusedWhenFull)


def test_paged_attention_that_ignores_its_scale_argument_is_caught():
    reference = solution("07_paged_attention.ipynb")["paged_attention"]

    def own_scale(q, k_cache, v_cache, page_table, num_computed, scale):
        return reference(q, k_cache, v_cache, page_table, num_computed, q.shape[-1] ** -0.5)

    assert "random case 1" in caught("paged_attention", own_scale)
