"""Forward progress (docs/reliability.md): under every preemption order and both preemption
modes, a workload whose requests each fit the pool alone finishes, with the single policy's
greedy tokens; and a scheduler that only ever recomputes is stopped with an error, not left to
spin."""

import random

import pytest

from minicb import Engine, SamplingParams, Scheduler
from minicb.config import PREEMPTION_MODES

# (preemption, priority_aging_steps): every order, priority aging included
ORDERS = [("newest", None), ("priority", None), ("priority", 5), ("deadline", None),
          ("fair", None)]


def three_tenants(tiny_model, **options) -> Engine:
    """Three long requests of three tenants in a pool that holds one of them whole: each
    preempts the others again and again."""
    engine = Engine(tiny_model, policy="pd", num_pages=10, max_num_batched_tokens=32,
                    chunk_size=16, check_invariants=True, **options)
    rng = random.Random(8)
    for i, tenant in enumerate("abc"):
        engine.add_request([rng.randrange(3, 250) for _ in range(5)],
                           SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True),
                           request_id=tenant, tenant=tenant, priority=i, deadline=1e3 + i)
    return engine


def test_fair_preemption_finishes_three_tenants_sharing_a_small_pool(tiny_model):
    """Recomputed work is not service: a tenant whose request was preempted is not charged
    again for computing what it lost, so whoever just regained its tokens is not the next
    victim, and all three finish."""
    engine = three_tenants(tiny_model, preemption="fair")
    engine.run(max_steps=2000)
    assert not engine.has_unfinished()
    assert all(len(r.output_token_ids) == 150 for r in engine.requests.values())
    assert sum(r.num_preemptions for r in engine.requests.values()) > 0
    # each computed its 5 prompt tokens and 149 outputs (the last is sampled, never computed)
    assert engine.tenant_service == {"a": 154, "b": 154, "c": 154}


@pytest.mark.parametrize("mode", PREEMPTION_MODES)
@pytest.mark.parametrize("order", ORDERS, ids=lambda o: o[0] + ("-aging" if o[1] else ""))
def test_every_order_and_mode_finishes_with_the_single_tokens(tiny_model, order, mode):
    """Three tenants under every preemption order and mode all finish, each with exactly the
    single-request tokens, and the pool ends empty."""
    preemption, aging = order
    engine = three_tenants(tiny_model, preemption=preemption, priority_aging_steps=aging,
                           preemption_mode=mode)
    engine.run(max_steps=2000)
    assert not engine.has_unfinished()
    single = Engine(tiny_model, policy="single", num_pages=16)
    for rid, req in engine.requests.items():
        ref = single.add_request(req.prompt_token_ids, req.params)
        single.run()
        assert req.output_token_ids == single.requests[ref].output_token_ids, rid
    engine.pool.check([])
    assert engine.pool.num_used == 0


class Churn(Scheduler):
    """Preempts every running request, then admits the front one for a 4-token chunk: from the
    second step on, every step computes only tokens a preemption threw away."""

    name = "churn"

    def schedule(self, ctx):
        for req in list(ctx.running):
            ctx.preempt(req)
        req = ctx.waiting[0]
        num_tokens = ctx.admit(req, 4)
        if num_tokens:
            ctx.schedule(req, num_tokens)
        return ctx.batch


def test_steps_that_only_recompute_are_stopped_like_a_stall(tiny_model, monkeypatch):
    """A step that computes something but gains no request a new token is no progress: after
    the stall limit of them `step()` raises, naming the livelock, and nothing leaks."""
    import minicb.engine
    monkeypatch.setattr(minicb.engine, "STALL_STEPS", 30)
    engine = Engine(tiny_model, policy=Churn(), num_pages=16, check_invariants=True)
    engine.add_request([5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="'churn' computed only tokens it had computed "
                                           "before .* for 30 steps"):
        for _ in range(200):
            engine.step()
    assert engine.step_count == 32  # the first step gained 4 tokens; 31 more gained none
    engine.cancel("req-0")
    engine.pool.check([])
    assert engine.pool.num_used == 0
