"""Planted-bug tests from a mutation review of the page pool and prefix index
(`minicb/kv_cache.py`), the request state (`minicb/request.py`), the sampler
(`minicb/sampler.py`) and speculative decoding (`minicb/speculative.py`): each test fails on the
bug its docstring names and passes on the real code. (Every planted bug in speculative.py was
already caught by test_speculative.py and test_core_mutants.py, or changed nothing.)"""

from __future__ import annotations

import pytest
import torch

from minicb.kv_cache import PagePool
from minicb.request import SamplingParams
from minicb.sampler import draw, filter_logits, make_generator, probabilities, sample


# --- kv_cache ----------------------------------------------------------------------------------
def test_a_page_already_indexed_is_not_indexed_again_under_other_tokens():
    """`PrefixIndex.register` lost its `page in self.hash_of` guard: a page indexed for one
    prompt was indexed again for a second prompt's tokens, so that prompt hit pages holding
    another prompt's K/V, and after the page was evicted the first hash still named it."""
    pool = PagePool(4, 2)
    table = pool.allocate(2)
    pool.register_prompt_pages([1, 2, 3, 4], table, 4)
    pool.register_prompt_pages([5, 6, 7, 8], table, 4)  # the same pages: already taken
    assert pool.match_prefix([5, 6, 7, 8, 0]) == []
    assert pool.match_prefix([1, 2, 3, 4, 0]) == table
    pool.release(table)
    fresh = pool.allocate(4)  # every page, the two cached ones evicted
    assert pool.match_prefix([1, 2, 3, 4, 0]) == [] and pool.match_prefix([5, 6, 7, 8, 0]) == []
    pool.check([fresh])


def test_after_a_reset_every_page_allocated_leaves_none_available():
    """`PrefixIndex.forget` did not take the page off the LRU list: after
    `reset_prefix_cache` the freed pages were both free and still listed as cached, and once
    the index held anything again they counted as available twice (an allocation then
    "evicted" a page some request was using). `check` did not see it: it reads the LRU list
    only while the index is non-empty (`if self.prefix`, a PrefixIndex's length)."""
    pool = PagePool(4, 2)
    table = pool.allocate(2)
    pool.register_prompt_pages([1, 2, 3, 4], table, 4)
    pool.release(table)
    pool.reset_prefix_cache()
    assert (pool.num_free, pool.num_cached) == (4, 0)
    every = pool.allocate(4)
    pool.register_prompt_pages([5, 6, 7, 8], every, 4)  # the index is not empty again
    assert (pool.num_available, pool.num_used) == (0, 4)
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.check([every])


# --- request -----------------------------------------------------------------------------------
def test_top_k_one_is_greedy_even_between_tied_logits():
    """`SamplingParams.greedy` dropped `or self.top_k == 1`: top_k=1 sampled among every token
    tied for the largest logit (topk keeps ties) instead of taking the argmax, so a seeded
    request could pick a different token from a greedy one."""
    params = SamplingParams(temperature=1.0, top_k=1)
    assert params.greedy
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    picks = {sample(logits, [SamplingParams(temperature=1.0, top_k=1, seed=s)],
                    [make_generator(s)])[0] for s in range(16)}
    assert picks == {1}


def test_a_seed_up_to_two_to_the_64_is_accepted():
    """The seed check used `< 2**63`: seeds torch's generator takes (up to 2**64 - 1) were
    refused."""
    params = SamplingParams(seed=2**64 - 1)
    assert make_generator(params.seed).initial_seed() == 2**64 - 1
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)


def test_stop_token_ids_from_any_iterable_are_kept_as_a_tuple():
    """`SamplingParams.__post_init__` checked the stop tokens but did not store them as the
    tuple it built: params from a list were unhashable and unequal to the same from a tuple,
    and stop tokens given as a generator were used up by the check (the request never
    stopped)."""
    from minicb.benchmark.sim import make_sim_engine
    a, b = SamplingParams(stop_token_ids=[5, 7]), SamplingParams(stop_token_ids=(5, 7))
    assert a == b and hash(a) == hash(b) and a.stop_token_ids == (5, 7)
    engine = make_sim_engine(policy="pd", check_invariants=True)
    t = engine.model.token
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0,
                                                 stop_token_ids=(i for i in [t])))
    out = engine.run()[0]
    assert (out.token_ids, out.finish_reason) == ([t], "stop")


def test_a_prompts_last_single_token_is_still_prefill():
    """`Request.is_prefill` dropped `not self.output_token_ids or`: a one-token prompt, and the
    last one-token chunk of a longer prompt, were traced as decode rows (no prefill tokens
    counted, and the first token attributed to a decode step)."""
    from minicb.benchmark.sim import make_sim_engine
    engine = make_sim_engine(policy="chunked", chunk_size=4, max_num_seqs=2,
                             max_num_batched_tokens=4, check_invariants=True)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request([7], params, request_id="one")
    engine.add_request([1, 2, 3, 4, 5], params, request_id="five", arrival_step=3)
    engine.run()
    steps = [[(m.request_id, m.kind, m.num_tokens) for m in rec.members] for rec in engine.trace]
    assert steps == [[("one", "prefill", 1)], [("one", "decode", 1)], [("five", "prefill", 4)],
                     [("five", "prefill", 1)], [("five", "decode", 1)]]
    assert [rec.num_prefill_tokens for rec in engine.trace] == [1, 0, 4, 1, 0]


# --- sampler -----------------------------------------------------------------------------------
def test_top_p_keeps_the_nucleus_of_unsorted_logits():
    """`filter_logits` applied the drop mask in sorted order without scattering it back to the
    vocabulary order: with logits not already sorted, the wrong tokens were kept."""
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    kept = torch.isfinite(filter_logits(logits, 0, 0.7))
    assert kept.tolist() == [[False, True, False, True]]


def test_top_p_applies_to_the_tempered_distribution():
    """`probabilities` filtered top-p on the raw logits and divided by the temperature after:
    the nucleus must be taken from the distribution the request samples from (temperature 2
    flattens [.5, .3, .2] so that two tokens are needed to reach 0.5; temperature 0.5
    sharpens it so that the first alone reaches 0.6)."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    probs = probabilities(logits, SamplingParams(temperature=2.0, top_p=0.5))
    assert (probs > 0).tolist() == [True, True, False]
    probs = probabilities(logits, SamplingParams(temperature=0.5, top_p=0.6))
    assert (probs > 0).tolist() == [True, False, False]  # sharpened, the top holds .66 alone


def test_huge_logits_under_a_tiny_temperature_do_not_overflow():
    """`probabilities` divided the logits by the temperature without first subtracting the
    largest, the guard its comment promises: logits of 3e34 at temperature 1e-5 overflowed
    float32 to inf and sampling raised instead of picking the favourite (real models' logits
    are far smaller; the test pins the guarantee)."""
    logits = torch.tensor([[3e34, 2.9e34, 0.0]])
    params = SamplingParams(temperature=1e-5, seed=0)
    assert not params.greedy
    assert sample(logits, [params], [make_generator(0)]) == [0]


def test_draw_scales_the_uniform_number_by_the_total():
    """`draw` used a uniform number in [0, 1) without multiplying it by the cdf's total: weights
    that do not sum to 1 (here 1 : 3) were drawn from the wrong distribution (always the first
    token). In the engine `draw` gets a softmax, whose float32 total is 1 within rounding, so
    there the bug shifts about 1e-7 of the mass; this pins `draw`'s own contract."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.tensor([1.0, 3.0])
    ones = sum(draw(weights, gen) for _ in range(400))
    assert 240 < ones < 360  # about 300 of 400 draws pick token 1
