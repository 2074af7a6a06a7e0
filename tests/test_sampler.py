"""The sampler (chapter 01): top-k, top-p and temperature, vLLM's presence, frequency and
repetition penalties against a reference, the logprobs a request asks for, and both through
the engine, with speculative decoding (chapter 08) and under every policy."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import run_beside_single

from minicb.config import POLICIES
from minicb.request import SamplingParams
from minicb.sampler import (
    TokenCounts,
    draw,
    filter_logits,
    make_generator,
    penalise,
    probabilities,
    sample,
    top_logprobs,
)

GREEDY = dict(temperature=0.0, ignore_eos=True)
PENALTIES = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.8)


# --- top-k, top-p, temperature -----------------------------------------------------------------
def test_top_k_one_is_greedy_even_between_tied_logits():
    """top_k=1 is greedy: it takes the argmax, even where topk would keep several tied tokens
    for a seeded request to draw from."""
    params = SamplingParams(temperature=1.0, top_k=1)
    assert params.greedy
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    picks = {sample(logits, [SamplingParams(temperature=1.0, top_k=1, seed=s)],
                    [make_generator(s)])[0] for s in range(16)}
    assert picks == {1}


def test_top_p_keeps_the_nucleus_of_unsorted_logits():
    """The nucleus is found in sorted order and kept in vocabulary order."""
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    kept = torch.isfinite(filter_logits(logits, 0, 0.7))
    assert kept.tolist() == [[False, True, False, True]]


def test_top_p_applies_to_the_tempered_distribution():
    """The nucleus is taken from the distribution the request samples from: temperature 2
    flattens [.5, .3, .2] so that two tokens are needed to reach 0.5; temperature 0.5 sharpens
    it so that the first alone reaches 0.6."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    probs = probabilities(logits, SamplingParams(temperature=2.0, top_p=0.5))
    assert (probs > 0).tolist() == [True, True, False]
    probs = probabilities(logits, SamplingParams(temperature=0.5, top_p=0.6))
    assert (probs > 0).tolist() == [True, False, False]


def test_huge_logits_under_a_tiny_temperature_do_not_overflow():
    """The largest logit is subtracted before dividing by the temperature: logits of 3e34 at
    temperature 1e-5 pick the favourite instead of overflowing float32 to inf."""
    logits = torch.tensor([[3e34, 2.9e34, 0.0]])
    params = SamplingParams(temperature=1e-5, seed=0)
    assert not params.greedy
    assert sample(logits, [params], [make_generator(0)]) == [0]


def test_draw_scales_the_uniform_number_by_the_total():
    """`draw` takes weights that need not sum to 1: 1 : 3 draws token 1 about 3 times in 4."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.tensor([1.0, 3.0])
    ones = sum(draw(weights, gen) for _ in range(400))
    assert 240 < ones < 360


# --- penalties ---------------------------------------------------------------------------------
def reference_penalties(logits: list[float], prompt: list[int], output: list[int],
                        params: SamplingParams) -> list[float]:
    """vLLM's definitions, one token at a time."""
    out = []
    for token, logit in enumerate(logits):
        if token in prompt or token in output:
            r = params.repetition_penalty
            logit = logit / r if logit > 0 else logit * r
        logit -= params.frequency_penalty * output.count(token)
        logit -= params.presence_penalty * (token in output)
        out.append(logit)
    return out


def random_case(rng: random.Random, vocab: int = 24):
    params = SamplingParams(presence_penalty=rng.uniform(-2, 2),
                            frequency_penalty=rng.uniform(-2, 2),
                            repetition_penalty=rng.choice([1.0, rng.uniform(0.01, 3)]),
                            temperature=0.0)
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
    output = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
    logits = [rng.choice([0.0, rng.gauss(0, 3)]) for _ in range(vocab)]
    return params, prompt, output, logits


def test_penalties_match_the_reference_over_random_logits_and_histories():
    """`penalise` gives the reference's logits, for counts made at once or one token at a
    time, and greedy sampling takes the argmax of the penalised logits."""
    rng = random.Random(0)
    for _ in range(300):
        params, prompt, output, logits = random_case(rng)
        want = reference_penalties(logits, prompt, output, params)
        split = rng.randint(0, len(output))
        counts = TokenCounts(prompt, output[:split], len(logits), torch.device("cpu"))
        for token in output[split:]:
            counts.add(token)
        got = penalise(torch.tensor(logits), params, counts)
        assert got.tolist() == pytest.approx(want, abs=1e-5)
        top = max(want)
        assert want[sample(torch.tensor([logits]), [params], [None], None, [counts])[0]] \
            == pytest.approx(top, abs=1e-5)


def test_penalties_come_after_bans_and_leave_the_logits_unchanged():
    """A banned token stays banned whatever a negative penalty adds, and `sample` leaves the
    logits it is given as they were (the raw logprobs are read from them)."""
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    before = logits.clone()
    params = SamplingParams(temperature=0.0, presence_penalty=-2.0, frequency_penalty=-2.0)
    counts = TokenCounts([0], [1, 1, 2], 3, torch.device("cpu"))
    assert sample(logits, [params], [None], [[1]], [counts]) == [2]
    assert torch.equal(logits, before)


def test_a_penalty_changes_greedy_text_and_neutral_penalties_change_nothing(make_engine):
    """On the tiny model, a frequency penalty breaks greedy decoding's repetition; penalties at
    their neutral values give exactly today's tokens."""
    prompt = [5, 6, 7, 8]
    outs = {}
    for name, extra in (("plain", {}), ("neutral", dict(presence_penalty=0.0,
                        frequency_penalty=0.0, repetition_penalty=1.0)),
                        ("penalised", dict(frequency_penalty=2.0, repetition_penalty=2.0))):
        engine = make_engine("pd")
        rid = engine.add_request(prompt, SamplingParams(max_tokens=24, **GREEDY, **extra))
        req = engine.requests[rid]
        while engine.has_unfinished():
            engine.step()
            if req.token_counts is not None and not req.is_finished:  # counted as appended
                want = torch.bincount(torch.tensor(req.output_token_ids), minlength=256)
                assert torch.equal(req.token_counts.output[:256].long(), want)
        outs[name] = engine.output(rid).token_ids
        assert engine.pool.num_used == 0
    assert outs["neutral"] == outs["plain"]
    assert outs["penalised"] != outs["plain"]
    assert len(set(outs["penalised"])) > len(set(outs["plain"]))  # fewer repeats


@pytest.mark.parametrize("policy", POLICIES)
def test_penalised_greedy_tokens_are_the_single_policys(make_engine, policy):
    """Batching, chunking and preemption do not change a penalised greedy request's tokens: its
    counts follow its output, recomputed or not."""
    rng = random.Random(3)
    jobs = [([rng.randrange(3, 250) for _ in range(rng.randint(3, 30))],
             SamplingParams(max_tokens=rng.randint(4, 20), **GREEDY, **PENALTIES), i % 3 + 1)
            for i in range(6)]
    engine = make_engine(policy, num_pages=14, max_num_seqs=4, max_num_batched_tokens=32,
                         chunk_size=16)
    run_beside_single(engine, make_engine("single"), jobs)
    assert engine.pool.num_used == 0
    assert all(r.token_counts is None for r in engine.requests.values())  # freed at the finish


# --- logprobs ----------------------------------------------------------------------------------
def test_top_logprobs_are_the_raw_log_softmax_with_the_sampled_token_last():
    """For each row: the k most likely tokens in rank order, then the sampled token if it is
    not among them, with the log-softmax of the logits as given."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [1.0, 0.0, 0.0, 0.5]])
    raw = torch.log_softmax(logits, -1)
    out = top_logprobs(logits, [0, 0], [2, 0])
    assert list(out[0]) == [1, 3, 0] and list(out[1]) == [0]
    for row, pairs in zip(raw, out):
        assert all(pairs[t] == pytest.approx(row[t].item()) for t in pairs)


def test_an_engine_reports_logprobs_only_to_who_asked(make_engine, monkeypatch):
    """A request with logprobs=k gets one dict per output token: its greedy token first (the
    most likely), k entries, values <= 0; one without gets None; with no request asking, none
    are computed."""
    from minicb import runner
    engine = make_engine("pd")
    asked = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, logprobs=3, **GREEDY))
    plain = engine.add_request([5, 6, 8], SamplingParams(max_tokens=6, **GREEDY))
    engine.run()
    out = engine.output(asked)
    assert len(out.logprobs) == len(out.token_ids) == 6
    for token, pairs in zip(out.token_ids, out.logprobs):
        assert list(pairs)[0] == token and len(pairs) == 3 and max(pairs.values()) <= 0
        assert list(pairs.values()) == sorted(pairs.values(), reverse=True)
    assert engine.output(plain).logprobs is None
    monkeypatch.setattr(runner, "top_logprobs", lambda *a: pytest.fail("computed"))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    engine.run()


def test_logprobs_come_before_penalties_and_temperature(make_engine):
    """The first token's logprobs are the model's raw distribution: the same for a greedy
    request, a penalised one and a hot sampled one with the same prompt."""
    firsts = []
    for extra in (GREEDY, dict(GREEDY, **PENALTIES), dict(temperature=1.7, seed=1)):
        engine = make_engine("pd")
        engine.add_request([9, 8, 7, 6], SamplingParams(max_tokens=3, logprobs=5, **extra))
        firsts.append(engine.run()[0].logprobs[0])
    top = [list(f.items())[:5] for f in firsts]
    assert [t for t, _ in top[1]] == [t for t, _ in top[0]] == [t for t, _ in top[2]]
    for other in top[1:]:
        assert [v for _, v in other] == pytest.approx([v for _, v in top[0]], abs=1e-5)


def test_logprobs_are_cut_with_the_tokens_a_stop_string_drops(make_engine):
    """`stop_at` drops the logprobs of the tokens it drops: one dict per token kept."""
    engine = make_engine("pd")
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, logprobs=1, **GREEDY))
    for _ in range(5):
        engine.step()
    engine.stop_at(rid, 2)
    out = engine.output(rid)
    assert len(out.token_ids) == len(out.logprobs) == 2 and out.finish_reason == "stop"


# --- with speculative decoding (chapter 08) ----------------------------------------------------
def test_a_request_with_penalties_or_logprobs_gets_no_guesses(make_engine):
    """Penalties and logprobs are computed one token at a time: such a request is never given
    guesses, and gets the tokens (and logprobs) it gets without speculation, while a plain
    request beside it still speculates."""
    phrase = [11, 12, 13, 14]
    prompt = phrase * 6
    runs = []
    for k in (0, 3):
        engine = make_engine("pd", num_speculative_tokens=k, prompt_lookup_min=1)
        ids = [engine.add_request(prompt, SamplingParams(max_tokens=12, **GREEDY, **extra))
               for extra in (PENALTIES, dict(logprobs=2), {})]
        engine.run()
        guessed = {rid for rec in engine.trace for rid in rec.speculated}
        runs.append([(engine.output(r).token_ids, engine.output(r).logprobs) for r in ids])
        assert ids[0] not in guessed and ids[1] not in guessed
        assert (ids[2] in guessed) == (k > 0)
    assert runs[0][0] == runs[1][0]
    assert runs[0][1][0] == runs[1][1][0]
    for lp0, lp1 in zip(runs[0][1][1], runs[1][1][1]):
        assert list(lp0) == list(lp1)
        assert list(lp0.values()) == pytest.approx(list(lp1.values()), abs=1e-5)
