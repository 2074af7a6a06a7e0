"""The public API driven at random (hypothesis): adds, steps, cancels, streams and reads in any
order, under every policy, every preemption order and both preemption modes, on the tiny
checkpoint with a small pool and the invariant checks on. Every request ends within a bound of
steps, every page and host page comes back, and every greedy request gets the `single`
policy's tokens (a cancelled one, a prefix of them; a stream, exactly what it yielded)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minicb import LLM, Engine, SamplingParams
from minicb.config import POLICIES, PREEMPTION_MODES

# (preemption, priority_aging_steps): every order, priority aging included
ORDERS = [("newest", None), ("priority", None), ("priority", 2), ("deadline", None),
          ("fair", None)]
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 14), st.integers(1, 10), st.integers(0, 2)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("stream"), st.integers(1, 14), st.integers(1, 10), st.integers(0, 2)),
    st.tuples(st.just("next"), st.integers(0, 4)),
    st.tuples(st.just("read"), st.integers(0, 20))), max_size=24)


@pytest.fixture(scope="module")
def single_tokens(tiny_model):
    """The `single` policy's greedy tokens of (prompt, max_tokens), computed once each."""
    engine = Engine(tiny_model, policy="single", num_pages=64, page_size=4)
    known: dict[tuple, list[int]] = {}

    def tokens(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in known:
            rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens,
                                                            temperature=0.0))
            engine.run()
            known[key] = engine.requests[rid].output_token_ids
        return known[key]

    return tokens


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(policy=st.sampled_from(POLICIES), order=st.sampled_from(ORDERS),
       mode=st.sampled_from(PREEMPTION_MODES), num_pages=st.sampled_from([6, 12]), ops=OPS)
def test_the_api_at_random_keeps_every_rule(tiny_model, single_tokens, policy, order, mode,
                                            num_pages, ops):
    """Any random mix of add, step, cancel, stream and read, under every policy, order and
    preemption mode, finishes every request with the single-request tokens (a cancelled one with
    a prefix of them), streams and reads agree with the outputs, and the pool ends empty."""
    preemption, aging = order
    llm = LLM(tiny_model, policy=policy, num_pages=num_pages, page_size=4, max_num_seqs=3,
              max_num_batched_tokens=16, chunk_size=8, batch_timeout=2, preemption=preemption,
              priority_aging_steps=aging, preemption_mode=mode, check_invariants=True)
    engine = llm.engine
    asked: dict[str, tuple[list[int], int]] = {}  # request id -> (prompt, max_tokens)
    streams: list[list] = []  # [generator, its request id, tokens it yielded]
    reads: list[tuple[str, list[int]]] = []

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0)

    for n, op in enumerate(ops):
        kind, *args = op
        prompt = [3 + (7 * n + i) % 200 for i in range(args[0])] if kind in ("add", "stream") \
            else None
        if kind == "add":  # a deadline far away: it orders the queue, never fires
            rid = engine.add_request(prompt, params(args[1]), priority=args[2],
                                     deadline=100.0 + 10 * args[2], tenant="ab"[args[2] % 2])
            asked[rid] = (prompt, args[1])
        elif kind == "step":
            for _ in range(args[0]):
                engine.step()
        elif kind == "cancel" and asked:
            engine.cancel(list(asked)[args[0] % len(asked)])
        elif kind == "stream":
            streams.append([llm.stream([prompt], params(args[1])), None, [], (prompt, args[1])])
        elif kind == "next" and streams:
            stream = streams[args[0] % len(streams)]
            for rid, new_tokens, _ in stream[0]:
                stream[1] = rid
                stream[2] += new_tokens
                asked[rid] = stream[3]
                break
        elif kind == "read" and asked:
            rid = list(asked)[args[0] % len(asked)]
            reads.append((rid, engine.output(rid).token_ids))
    for stream in streams:  # read each stream to its end: its requests finish
        for rid, new_tokens, _ in stream[0]:
            stream[1] = rid
            stream[2] += new_tokens
            asked[rid] = stream[3]
    bound = 8 * sum(len(p) + m for p, m in asked.values()) + 50
    engine.run(max_steps=bound)

    assert not engine.has_unfinished(), f"not finished within {bound} steps"
    for rid, (prompt, max_tokens) in asked.items():
        req = engine.requests[rid]
        assert req.metrics.finish_step - req.metrics.arrival_step <= bound
        want = single_tokens(prompt, max_tokens)
        if req.finish_reason == "cancelled":
            assert req.output_token_ids == want[:len(req.output_token_ids)]
        else:
            assert req.finish_reason in ("stop", "length") and req.output_token_ids == want
    for stream in streams:
        if stream[1] is not None:
            assert stream[2] == engine.requests[stream[1]].output_token_ids
    for rid, tokens in reads:
        assert engine.requests[rid].output_token_ids[:len(tokens)] == tokens
    engine.pool.check([])
    assert engine.pool.num_used == 0 and len(engine.pool.swap_free) == engine.pool.num_swap_pages
