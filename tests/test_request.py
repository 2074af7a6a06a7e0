"""A request's state and what it asks for (chapter 01): `SamplingParams` refuses bad and absurd
values naming the field, keeps its lists as tuples, and bounds what every step reads; a
`Request` is prefill until its prompt is in the cache."""

from __future__ import annotations

import pytest

from minicb.benchmark.sim import make_sim_engine
from minicb.request import MAX_STOP_TOKEN_IDS, SamplingParams
from minicb.sampler import make_generator


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=1e30), "max_tokens"), (dict(max_tokens=10**30), "max_tokens"),
    (dict(max_tokens=2**24 + 1), "max_tokens"), (dict(max_tokens=float("inf")), "max_tokens"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=1e300), "repetition_penalty"),
    (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(logprobs=-1), "logprobs"), (dict(logprobs=21), "logprobs"),
    (dict(logprobs=2.0), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(stop_token_ids=range(MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    (dict(stop_token_ids=iter(range(10**6))), "stop_token_ids"),
])
def test_bad_or_absurd_sampling_params_are_refused_naming_the_field(kwargs, field):
    """An out-of-range, non-finite, wrongly typed or unboundedly long sampling value (max_tokens,
    the three penalties, logprobs, stop_token_ids) raises ValueError naming its field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_the_limits_themselves_are_accepted():
    """Each bound is inclusive, and the neutral penalties are no penalty."""
    params = SamplingParams(max_tokens=2**24, presence_penalty=-2, frequency_penalty=2.0,
                            repetition_penalty=0.01, logprobs=20,
                            stop_token_ids=range(MAX_STOP_TOKEN_IDS))
    assert params.penalised and len(params.stop_token_ids) == MAX_STOP_TOKEN_IDS
    assert not SamplingParams(logprobs=0, repetition_penalty=1).penalised


def test_a_seed_up_to_two_to_the_64_is_accepted():
    """Seeds span torch's generator range, [-2**63, 2**64)."""
    params = SamplingParams(seed=2**64 - 1)
    assert make_generator(params.seed).initial_seed() == 2**64 - 1
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)


def test_stop_token_ids_from_any_iterable_are_kept_as_a_tuple():
    """Stop tokens are stored as the tuple the check built: params from a list equal and hash
    as the same from a tuple, and stop tokens given as a generator still stop the request."""
    a, b = SamplingParams(stop_token_ids=[5, 7]), SamplingParams(stop_token_ids=(5, 7))
    assert a == b and hash(a) == hash(b) and a.stop_token_ids == (5, 7)
    engine = make_sim_engine(policy="pd", check_invariants=True)
    t = engine.model.token
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0,
                                                 stop_token_ids=(i for i in [t])))
    out = engine.run()[0]
    assert (out.token_ids, out.finish_reason) == ([t], "stop")


class CountingTuple(tuple):
    """A tuple that counts how often it is read whole."""

    reads = 0

    def __iter__(self):
        CountingTuple.reads += 1
        return super().__iter__()


def test_stop_tokens_are_read_once_per_request_not_per_step():
    """The stop tokens (with the end-of-sequence ones) become one set when the request is
    added: however many steps it runs, its stop_token_ids are read a bounded number of times,
    so a long list does not slow every step."""
    engine = make_sim_engine(policy="pd", check_invariants=True)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,  # none is 100
                            stop_token_ids=range(1000, 1000 + MAX_STOP_TOKEN_IDS))
    object.__setattr__(params, "stop_token_ids", CountingTuple(params.stop_token_ids))
    CountingTuple.reads = 0
    rid = engine.add_request([1, 2, 3], params)
    engine.run()
    assert len(engine.requests[rid].output_token_ids) == 40
    assert CountingTuple.reads <= 3


def test_a_prompts_last_single_token_is_still_prefill():
    """A one-token prompt, and the last one-token chunk of a longer prompt, are prefill rows:
    their tokens count as prefill and the first output token belongs to a prefill step."""
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
