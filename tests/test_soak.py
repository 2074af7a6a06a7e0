"""Soak (hardening): thousands of random requests with random lengths, arrivals, priorities and
cancellations through a tiny checkpoint whose page pool is too small for them all, under every
policy. Nothing leaks, every request ends, and a sampled tenth match the single-request tokens."""

import random

import pytest

from minicb import Engine, SamplingParams
from minicb.config import POLICIES

# requests per policy: 5,000 in total across the batched policies plus a smaller v1 run
SOAK = {"single": 200, "static": 960, "dynamic": 960, "continuous": 960, "chunked": 960,
        "pd": 960}


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_soak(tiny_model, policy):
    rng = random.Random(POLICIES.index(policy))  # hash(str) changes every run
    engine = Engine(tiny_model, policy=policy, max_num_seqs=32, max_num_batched_tokens=96,
                    chunk_size=32, page_size=8, num_pages=48, preemption="priority",
                    batch_timeout=3, check_invariants=True)
    n = SOAK[policy]
    jobs = []
    step = 1
    for _ in range(n):
        step += rng.choice([0, 0, 0, 1, 2])
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(1, 60))]
        if rng.random() < 0.2 and jobs:  # a shared system prompt now and then
            prompt = jobs[0][1][:16] + prompt
        params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0,
                                ignore_eos=rng.random() < 0.5)
        rid = engine.add_request(prompt[:90], params, arrival_step=step,
                                 priority=rng.randint(0, 3))
        jobs.append((rid, prompt[:90], params))
    cancel_at = {rng.randrange(1, step + 50): rid for rid, _, _ in rng.sample(jobs, n // 20)}
    while engine.has_unfinished():
        record = engine.step()
        if record.step in cancel_at:
            engine.cancel(cancel_at[record.step])
    reasons = {r.finish_reason for r in engine.requests.values()}
    assert reasons <= {"stop", "length", "cancelled"}, reasons
    assert all(r.is_finished for r in engine.requests.values())
    engine.pool.check([])
    assert engine.pool.num_used == 0 and not engine.running and not engine.waiting
    if policy != "single":
        assert sum(len(rec.preempted) for rec in engine.trace) > 0, "the pool was meant to run out"
    # a sampled tenth against the single-request path
    ref = Engine(tiny_model, policy="single", num_pages=64, page_size=8)
    sample = [j for j in rng.sample(jobs, n // 10)
              if engine.requests[j[0]].finish_reason != "cancelled"]
    ref_ids = [ref.add_request(prompt, params) for _, prompt, params in sample]
    ref.run()
    for (rid, _, _), ref_id in zip(sample, ref_ids):
        assert engine.requests[rid].output_token_ids == ref.requests[ref_id].output_token_ids
