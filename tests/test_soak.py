"""Soak (hardening): thousands of random requests with random lengths, arrivals, priorities,
tenants and cancellations through a tiny checkpoint whose page pool is too small for them all,
under every policy, and under every preemption order and mode. Nothing leaks, every request
ends, and a sampled tenth match the single-request tokens."""

import random

import pytest

from minicb import Engine, SamplingParams
from minicb.config import POLICIES, PREEMPTION_MODES

# requests per policy: 5,000 in total across the batched policies plus a smaller v1 run
SOAK = {"single": 200, "static": 960, "dynamic": 960, "continuous": 960, "chunked": 960,
        "pd": 960}
# (preemption, priority_aging_steps): every order, priority aging included
ORDERS = [("newest", None), ("priority", None), ("priority", 4), ("deadline", None),
          ("fair", None)]


def soak(tiny_model, engine: Engine, rng: random.Random, n: int) -> None:
    """Add `n` random requests (a shared system prompt now and then, a far deadline that orders
    the queue without firing), cancel a twentieth of them on the way, run to the end, check."""
    jobs = []
    step = 1
    for _ in range(n):
        step += rng.choice([0, 0, 0, 1, 2])
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(1, 60))]
        if rng.random() < 0.2 and jobs:
            prompt = jobs[0][1][:16] + prompt
        params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0,
                                ignore_eos=rng.random() < 0.5)
        rid = engine.add_request(prompt[:90], params, arrival_step=step,
                                 priority=rng.randint(0, 3), tenant=rng.choice("abc"),
                                 deadline=1e4 + rng.random())
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
    assert len(engine.pool.swap_free) == engine.pool.num_swap_pages
    ref = Engine(tiny_model, policy="single", num_pages=64, page_size=8)
    sample = [j for j in rng.sample(jobs, n // 10)
              if engine.requests[j[0]].finish_reason != "cancelled"]
    ref_ids = [ref.add_request(prompt, params) for _, prompt, params in sample]
    ref.run()
    for (rid, _, _), ref_id in zip(sample, ref_ids):
        assert engine.requests[rid].output_token_ids == ref.requests[ref_id].output_token_ids


def small_pool(tiny_model, **options) -> Engine:
    return Engine(tiny_model, max_num_seqs=32, max_num_batched_tokens=96, chunk_size=32,
                  page_size=8, num_pages=48, batch_timeout=3, check_invariants=True, **options)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_random_requests_on_a_small_pool_all_end_and_leak_nothing(tiny_model, policy):
    """Under each policy, many random requests on a small pool (shared prefixes, priorities,
    tenants, a twentieth cancelled) all finish as stop, length or cancelled and leave the pool
    empty; every batching policy runs the pool out at least once."""
    rng = random.Random(POLICIES.index(policy))  # hash(str) changes every run
    engine = small_pool(tiny_model, policy=policy, preemption="priority")
    soak(tiny_model, engine, rng, SOAK[policy])
    if policy != "single":
        assert sum(len(rec.preempted) for rec in engine.trace) > 0, "the pool must run out"


@pytest.mark.slow
@pytest.mark.parametrize("mode", PREEMPTION_MODES)
@pytest.mark.parametrize("order", ORDERS, ids=lambda o: o[0] + ("-aging" if o[1] else ""))
def test_soak_every_preemption_order_and_mode(tiny_model, order, mode):
    """Forward progress (docs/reliability.md) under each order and mode, the policy rotating
    through the batched ones; a swap space of a third of the pool, so it fills too."""
    i = ORDERS.index(order) * 2 + PREEMPTION_MODES.index(mode)
    policy = POLICIES[1 + i % (len(POLICIES) - 1)]
    engine = small_pool(tiny_model, policy=policy, preemption=order[0],
                        priority_aging_steps=order[1], preemption_mode=mode,
                        num_swap_pages=16 if mode == "swap" else None)
    soak(tiny_model, engine, random.Random(100 + i), 300)
    assert sum(len(rec.preempted) for rec in engine.trace) > 0, "the pool must run out"
