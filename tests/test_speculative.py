"""Speculative decoding by prompt lookup (chapter 08): the guesser, the verification (greedy
and sampled, the output distribution unchanged), and the engine producing the same greedy
tokens with and without it under every policy, within the budget, leaking nothing."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import run_beside_single

from minicb.benchmark import metrics
from minicb.benchmark.sim import make_sim_engine
from minicb.config import POLICIES
from minicb.course.check import _lookup_variant
from minicb.request import SamplingParams
from minicb.speculative import NgramIndex, verify

GREEDY = dict(temperature=0.0, ignore_eos=True)


def propose_ngram(ids, k, n_max=4, n_min=2):
    """A fresh index's guess: the lookup over the whole of `ids`."""
    return NgramIndex(n_max, n_min).propose(ids, k)


def test_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    """Prompt lookup finds the latest earlier occurrence of the longest tail n-gram (n_max down to
    n_min, never the overlapping tail itself) and proposes up to k tokens that followed it, or
    nothing when no n-gram recurs."""
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram(ids, 3, n_max=3) == [7, 8, 5]  # the later of two "1 2 3"s
    assert propose_ngram(ids, 1, n_max=3) == [7]
    assert propose_ngram([4, 5, 6, 4, 5], 5, n_max=2) == [6, 4, 5]  # up to the end
    assert propose_ngram([7] * 6, 3, n_max=2) == [7, 7, 7]  # not the overlapping last "7 7"
    # the longest n first: "6 5" occurs nowhere else, so n=1 finds the last earlier "5"
    assert propose_ngram([5, 1, 6, 5], 2, n_max=2, n_min=1) == [1, 6]
    assert propose_ngram([5, 1, 6, 5], 2, n_max=2, n_min=2) == []
    assert propose_ngram([1, 2, 3, 4], 4) == [] and propose_ngram([7], 4, n_min=1) == []


def test_greedy_verification_keeps_the_guesses_the_model_agrees_with():
    """Greedy verification keeps the guesses up to the first that differs from the model's argmax
    and adds the model's own next token, so it yields at least one token."""
    logits = torch.full((4, 10), -1.0)
    for row, token in enumerate([3, 4, 5, 6]):  # the model's argmax after each position
        logits[row, token] = 1.0
    params = SamplingParams(temperature=0.0)
    assert verify(logits, [3, 4, 5], params) == [3, 4, 5, 6]  # every guess, then its own
    assert verify(logits, [3, 9, 5], params) == [3, 4]  # up to the first disagreement
    assert verify(logits, [8, 4, 5], params) == [3]  # none: still one token


def test_sampled_verification_keeps_the_models_distribution():
    """Draw from p at each position and keep going while the draw equals the guess: the first
    token is distributed as p whatever the guess (here a likely and an unlikely one), and the
    guess is kept with probability p(guess)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    params = SamplingParams(temperature=1.0, seed=0)
    p = torch.softmax(logits[0], -1)
    for guess in (0, 3):
        gen = torch.Generator().manual_seed(guess)
        firsts, accepted = torch.zeros(4), 0
        n = 20_000
        for _ in range(n):
            out = verify(logits, [guess], params, gen)
            firsts[out[0]] += 1
            accepted += len(out) == 2  # the guess was kept, and the model drew one more
        assert torch.allclose(firsts / n, p, atol=0.012), (guess, firsts / n)
        assert accepted / n == pytest.approx(float(p[guess]), abs=0.012)


def repetitive_prompt(rng: random.Random, length: int) -> list[int]:
    """A prompt that repeats a short phrase with noise: prompt lookup finds guesses in it."""
    phrase = [rng.randrange(3, 250) for _ in range(rng.randint(2, 6))]
    out = []
    while len(out) < length:
        out += phrase if rng.random() < 0.7 else [rng.randrange(3, 250)]
    return out[:length]


def test_guesses_the_model_keeps_save_steps():
    """The simulated model always predicts the same token T: a prompt of T's makes every guess
    right, so each decode step yields k + 1 tokens (the first comes from the prefill)."""
    for k, steps in ((0, 1 + 24), (3, 1 + 6), (5, 1 + 4)):
        engine = make_sim_engine(policy="pd", num_speculative_tokens=k, check_invariants=True)
        t = engine.model.token
        engine.add_request([t] * 8, SamplingParams(max_tokens=25, **GREEDY))
        out = engine.run()[0]
        assert out.token_ids == [t] * 25 and len(engine.trace) == steps, (k, len(engine.trace))
        summary = metrics.summarize(engine.trace, metrics.request_records(engine))
        guessed = 24 - (steps - 1)  # the decode tokens no step of the model's own produced
        assert summary["draft_tokens"] == summary["accepted_draft_tokens"] == guessed
        assert summary["draft_acceptance_rate"] == (1.0 if k else None)
        # tokens of one step arrive together: one gap per step after the first
        gaps = metrics.itls(metrics.request_records(engine)[0])
        assert len(gaps) == steps - 1 and 0.0 not in gaps


def test_same_greedy_text_as_without_guesses_on_smollm2(smollm2_dir):
    """The real model over real pages: a prompt that asks for a list it contains is guessed
    from itself, and the text is the same token for token, in about half the steps."""
    from minicb import Engine
    prompt = ("Repeat this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, "
              "oranges, peaches, apricots, figs, dates.\nList: apples, pears,")
    runs = {}
    for k in (0, 4):
        engine = Engine(str(smollm2_dir), policy="pd", num_speculative_tokens=k,
                        check_invariants=True, device="cpu")
        engine.add_request(prompt, SamplingParams(max_tokens=24, **GREEDY))
        runs[k] = engine, engine.run()[0].token_ids
    assert runs[4][1] == runs[0][1]
    assert all(r.ngram_index is None for r in runs[4][0].requests.values())  # freed at finish
    summary = metrics.summarize(runs[4][0].trace, metrics.request_records(runs[4][0]))
    assert summary["draft_acceptance_rate"] > 0.5
    assert len(runs[4][0].trace) < 0.75 * len(runs[0][0].trace)


def test_end_of_sequence_among_kept_guesses_ends_the_request_on_smollm2(smollm2_dir):
    """A chat reply whose end-of-sequence token arrives in a step with guesses after it: the request
    ends there, with the same tokens as without guesses."""
    from minicb import LLM
    prompt = [{"role": "user", "content": "Rename the variable x to total in this Python code:"
                                          "\nx = 0\nfor price in prices:\n    x = x + price\n"
                                          "print(x)"}]
    outs = {}
    for k in (0, 4):
        llm = LLM(str(smollm2_dir), policy="pd", num_speculative_tokens=k, device="cpu",
                  check_invariants=True)
        outs[k] = llm.chat(prompt, SamplingParams(max_tokens=64, temperature=0.0))[0]
        trace = llm.engine.trace
    assert (outs[4].token_ids, outs[4].finish_reason) == (outs[0].token_ids, "stop")
    guessed, kept = trace[-1].speculated[outs[4].request_id]
    assert guessed >= 1 and kept == 0  # the EOS came first in a step that had guesses after it


def test_a_stop_token_among_accepted_guesses_ends_the_request_there(make_engine):
    """Greedy output of the same run without speculation, then a stop token chosen from the
    middle of it: with guesses, the request still ends at its first occurrence."""
    rng = random.Random(3)
    prompt = repetitive_prompt(rng, 40)
    plain = make_engine("pd")
    plain.add_request(prompt, SamplingParams(max_tokens=30, **GREEDY))
    tokens = plain.run()[0].token_ids
    stop = tokens[len(tokens) // 2]
    want = tokens[:tokens.index(stop) + 1]
    for k in (0, 3):
        engine = make_engine("pd", num_speculative_tokens=k)
        engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0.0,
                                                  stop_token_ids=[stop]))
        out = engine.run()[0]
        assert (out.token_ids, out.finish_reason) == (want, "stop")
        assert engine.pool.num_used == 0


def test_a_seeded_request_gets_its_tokens_whatever_is_guessed_or_shares_its_batch(
        make_engine):
    """A seeded sampled request's tokens do not change with guesses or with the batch beside
    it (the guesses depend on the budget others leave): one draw per token, as without."""
    rng = random.Random(4)
    prompt = repetitive_prompt(rng, 30)
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=7, ignore_eos=True)
    runs = []
    for k, beside in ((0, False), (4, False), (4, True)):
        engine = make_engine("pd", num_speculative_tokens=k, prompt_lookup_min=1,
                             max_num_batched_tokens=64, chunk_size=64)
        rid = engine.add_request(prompt, params)
        if beside:  # a long prompt takes most of the budget while it prefills
            engine.add_request(repetitive_prompt(rng, 120), SamplingParams(max_tokens=4))
        engine.run()
        runs.append(engine.requests[rid].output_token_ids)
    assert runs[0] == runs[1] == runs[2]


def test_the_lookup_index_agrees_with_a_scan():
    """As a request's tokens grow, its index guesses what a scan of them all guesses."""
    rng = random.Random(0)
    for _ in range(200):
        index = NgramIndex(n_max=3, n_min=1)
        ids = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        for _ in range(30):  # the request's tokens grow; the index follows
            k = rng.randint(1, 5)
            assert index.propose(ids, k) == _lookup_variant(ids, k, 3, 1), (ids, k)
            ids.extend(rng.randrange(4) for _ in range(rng.randint(1, 3)))


def test_a_kept_guess_after_a_stop_token_is_not_counted():
    """The simulated model always predicts T. T is the stop token, banned for 3 tokens (so the
    first three are 0s); then the prompt's "T 0 0 0 T T T" makes the guesses T T T, all right,
    but the first ends the request: one token delivered, no guess counted as kept."""
    engine = make_sim_engine(policy="pd", num_speculative_tokens=3, check_invariants=True)
    t = engine.model.token
    rid = engine.add_request([t, 0, 0, 0, t, t, t, t], SamplingParams(
        max_tokens=10, temperature=0.0, stop_token_ids=[t], min_tokens=3, ignore_eos=True))
    out = engine.run()[0]
    assert (out.token_ids, out.finish_reason) == ([0, 0, 0, t], "stop")
    assert engine.trace[-1].speculated[rid] == (3, 0)
    assert metrics.summarize(engine.trace, metrics.request_records(engine))[
        "accepted_draft_tokens"] == 0


def test_sampled_requests_speculate_and_end_at_max_tokens(make_engine):
    """Sampled (temperature 0.7, top-k) requests with speculation on make guesses, each ends with
    exactly max_tokens and finish reason length, and every page is freed."""
    engine = make_engine("pd", num_speculative_tokens=3)
    rng = random.Random(1)
    for i in range(4):
        engine.add_request(repetitive_prompt(rng, 30),
                           SamplingParams(max_tokens=25, temperature=0.7, top_k=5, seed=i,
                                          ignore_eos=True))
    outs = engine.run()
    assert all(len(o.token_ids) == 25 and o.finish_reason == "length" for o in outs)
    assert sum(d for rec in engine.trace for d, _ in rec.speculated.values()) > 0
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("bad, message", [
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(num_speculative_tokens=True), "num_speculative_tokens"),
    (dict(prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(prompt_lookup_min=5, prompt_lookup_max=3), "prompt_lookup_min"),
])
def test_bad_settings_are_refused(make_engine, bad, message):
    """A negative or boolean num_speculative_tokens, prompt_lookup_min below 1, or prompt_lookup_min
    above prompt_lookup_max raises ValueError naming the setting."""
    with pytest.raises(ValueError, match=message):
        make_engine("pd", **bad)


workloads = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 16), st.integers(1, 12)),
                     min_size=1, max_size=6)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(workload=workloads, seed=st.integers(0, 1000), k=st.integers(1, 4),
       num_pages=st.sampled_from([14, 64]))
def test_speculation_never_changes_greedy_tokens(make_engine, policy, workload, seed, k,
                                                 num_pages):
    """Random repetitive prompts and arrivals, pools small enough to preempt: every policy
    with guesses gives the tokens of `single` without them; a decode member advances its last
    token plus its guesses; guesses never push a step past the token budget; nothing leaks."""
    rng = random.Random(seed)
    cfg = dict(max_num_seqs=3, max_num_batched_tokens=16, chunk_size=8, page_size=4,
               num_pages=num_pages)
    engine = make_engine(policy, num_speculative_tokens=k, prompt_lookup_min=1, **cfg)
    reference = make_engine("single", page_size=4, num_pages=64)
    jobs = [(repetitive_prompt(rng, n), SamplingParams(max_tokens=m, **GREEDY), a)
            for n, m, a in workload]
    run_beside_single(engine, reference, jobs)
    for rec in engine.trace:
        for m in rec.members:
            guessed, kept = rec.speculated.get(m.request_id, (0, 0))
            assert m.kind != "decode" or m.num_tokens == 1 + guessed
            assert 0 <= kept <= guessed <= k
        if policy in ("pd", "chunked"):
            assert rec.num_tokens <= cfg["max_num_batched_tokens"]
    engine.pool.check([])
    assert engine.pool.num_used == 0


def test_guesses_stay_within_the_token_budget_beside_a_prefill():
    """Three decodes guessing 4 tokens each while a 40-token prompt is chunked in: every step,
    guesses included, stays within max_num_batched_tokens."""
    from minicb.benchmark.sim import make_sim_engine
    e = make_sim_engine(policy="pd", max_num_seqs=4, max_num_batched_tokens=16, chunk_size=8,
                        num_speculative_tokens=4, check_invariants=True)
    token = e.model.token
    greedy = dict(temperature=0.0, ignore_eos=True)
    for i in range(3):
        e.add_request([token] * 8, SamplingParams(max_tokens=30, **greedy), request_id=f"d{i}")
    e.add_request(list(range(1, 41)), SamplingParams(max_tokens=2, **greedy), request_id="long",
                  arrival_step=3)
    e.run()
    assert any(rec.speculated for rec in e.trace)
    mixed = [rec for rec in e.trace if rec.speculated and rec.num_prefill_tokens]
    assert mixed, "the scenario must guess beside a prefill chunk"
    assert max(rec.num_tokens for rec in e.trace) <= 16


def _params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                             **kw})


def test_no_guess_is_proposed_past_max_tokens():
    """A member is given at most `max_tokens - len(outputs) - 1` guesses: the step's own token comes
    after them, so a guess past that could never be kept."""
    e = make_sim_engine(policy="pd", num_speculative_tokens=5, check_invariants=True)
    t = e.model.token  # the simulated model always predicts t: every guess of t is right
    rid = e.add_request([t] * 8, _params(5))
    out = e.run()[0]
    assert out.token_ids == [t] * 5 and len(e.trace) == 2
    assert e.trace[-1].speculated[rid] == (3, 3)
    assert e.requests[rid].num_service_tokens == 8 + 5 - 1  # nothing computed in vain


def test_guesses_may_take_the_last_free_page():
    """Guesses that need exactly the pages left get them."""
    e = make_sim_engine(policy="pd", num_speculative_tokens=4, page_size=4, num_pages=4,
                        check_invariants=True)
    t = e.model.token
    rid = e.add_request([t] * 8, _params(8))  # 8 + 8 tokens: the whole pool
    out = e.run()[0]
    assert out.token_ids == [t] * 8
    assert e.trace[1].speculated[rid] == (4, 4)  # 9 tokens + 4 guesses need page 4, the last
    assert len(e.trace) == 3
