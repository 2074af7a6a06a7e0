"""The public API (chapter 00-01): LLM/Engine, sampling, prefix reuse, cancellation, streaming,
faults contained, and bad input refused with a clear message and nothing left allocated."""

import pytest
import torch

from minicb import (
    LLM,
    Engine,
    EngineConfig,
    SamplingParams,
    Scheduler,
    SchedulerError,  # the public name a learner imports
)
from minicb.benchmark.sim import make_sim_engine
from minicb.engine import InvariantError
from minicb.scheduler import PDScheduler, ScheduledBatch

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def llm(tiny_model):
    return LLM(tiny_model, policy="pd", num_pages=64, check_invariants=True)


def test_generate_returns_outputs_in_prompt_order(llm):
    """generate returns one output per prompt in prompt order, each with max_tokens tokens, no text
    without a tokenizer, ordered timestamps and one time and step per token, and frees every
    page."""
    outs = llm.generate([[5, 6, 7], [8, 9, 10, 11, 12]], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [8, 9, 10, 11, 12]]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
    assert outs[0].text is None, "no tokenizer, no text"
    m = outs[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert len(m.token_times) == 12 and m.token_steps == sorted(m.token_steps)
    assert llm.engine.stats()["pages_used"] == 0


def test_params_per_prompt_and_eos(tiny_model):
    """Each prompt takes its own SamplingParams; a request ends at its first stop token or at an
    end-of-sequence token (included, finish reason stop) unless ignore_eos, which runs it to
    max_tokens."""
    llm = LLM(tiny_model, policy="continuous", num_pages=64)
    eos = llm.engine.info.eos_token_ids[0]
    first = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
    stop_at = first[3]
    outs = llm.generate([[5, 6, 7], [5, 6, 7]],
                        [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,)),
                         SamplingParams(max_tokens=2, temperature=0)], use_tqdm=False)
    assert outs[0].token_ids == first[:first.index(stop_at) + 1]
    assert outs[0].finish_reason == "stop"
    assert outs[1].finish_reason in ("length", "stop") and len(outs[1].token_ids) <= 2
    # the tiny model never emits its EOS id: make its 4th greedy token the EOS, so that
    # generation must end there (unless ignore_eos), without being a stop token of the request
    llm.engine.info.eos_token_ids = (first[3],)  # the model info is shared: put it back
    try:
        plain = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0),
                             use_tqdm=False)[0]
        ignoring = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    finally:
        llm.engine.info.eos_token_ids = (eos,)
    assert plain.token_ids == first[:first.index(first[3]) + 1]
    assert plain.finish_reason == "stop"
    assert ignoring.token_ids == first and ignoring.finish_reason == "length"


def test_sampler_topk1_is_greedy_and_seeds_repeat(llm):
    """top_k=1 gives the greedy tokens at any temperature; a seed repeats its tokens (with top_p
    too), another seed differs, and a seeded request gets the same tokens alone or batched."""
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    greedy = llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
    topk1 = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.8, top_k=1,
                                                ignore_eos=True), use_tqdm=False)[0].token_ids
    assert topk1 == greedy

    def sampled(seed, **kw):
        p = SamplingParams(max_tokens=12, temperature=1.5, seed=seed, ignore_eos=True, **kw)
        return llm.generate(prompt, p, use_tqdm=False)[0].token_ids

    assert sampled(1) == sampled(1)
    assert sampled(1) != sampled(2)
    assert sampled(3, top_p=0.5) == sampled(3, top_p=0.5)
    # a seeded request gives the same tokens alone or batched with others
    alone = sampled(7)
    p = SamplingParams(max_tokens=12, temperature=1.5, seed=7, ignore_eos=True)
    batched = llm.generate(prompt + [[8, 8, 8], [9, 9]], [p, GREEDY, GREEDY], use_tqdm=False)
    assert batched[0].token_ids == alone


def test_draw_follows_the_distribution_and_never_picks_a_zero(monkeypatch):
    """Inverse-transform sampling: frequencies over 20,000 draws within 4 standard errors of the
    probabilities, a token with probability 0 never drawn, one with all the mass always, and a
    point that rounds up to the total still lands on a token with mass."""
    import torch

    from minicb.sampler import draw
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(20_000)]),
                            minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    freq, std = counts / 20_000, (probs.double() * (1 - probs.double()) / 20_000).sqrt()
    assert ((freq - probs.double()).abs() <= 4 * std + 1e-12).all(), freq.tolist()
    assert draw(torch.tensor([0.0, 0.0, 1.0, 0.0]), gen) == 2
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))
    assert draw(torch.tensor([0.25, 0.75, 0.0]), None) == 1
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(1, dtype=torch.float64))
    assert draw(torch.tensor([0.0, 0.5, 0.5]), None) == 1  # the first token with mass


def test_top_p_keeps_only_the_nucleus():
    """top_p keeps the most likely tokens until their mass reaches it (0.5 + 0.3 for 0.7), and top_k
    keeps the k most likely."""
    import torch

    from minicb.sampler import filter_logits
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, 0, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, 3, 1.0))
    assert kept.tolist() == [[True, True, True, False]]


def test_forget_drops_a_request_everywhere_even_its_tenants_service():
    """forget removes a request from the requests, from the next step's finished list and from its
    tenant's service count; forgetting a tenant's last request drops the tenant."""
    from minicb.benchmark.sim import make_sim_engine
    engine = make_sim_engine(policy="pd", preemption="fair")
    for rid, tenant in (("a", "x"), ("b", "x"), ("c", "y")):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0,
                                                     ignore_eos=True),
                           request_id=rid, tenant=tenant)
    engine.step()
    engine.cancel("c")  # listed in the next StepRecord, unless forgotten first
    engine.forget("c")
    assert "c" not in engine.step().finished
    engine.run()
    assert engine.tenant_service == {"x": 2 * (3 + 2)}  # y's share went with c
    engine.forget("a")
    assert engine.tenant_service == {"x": 3 + 2}
    engine.forget("b")
    assert engine.tenant_service == {} and not engine.requests


def test_banning_every_token_leaves_the_row_as_it_was():
    """min_tokens bans stop and EOS tokens; if nothing else could follow, the ban is dropped
    for that row rather than sampling from nothing."""
    import torch

    from minicb.sampler import sample
    logits = torch.tensor([[1.0, 2.0], [0.0, 3.0], [float("-inf"), 5.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0)]
    assert sample(logits, params, [None] * 3, [[0, 1], [0, 1], [1]]) == [1, 1, 1]
    assert sample(logits, params[:1], [None], [[1]]) == [0]  # one banned: the other


def test_top_p_stops_where_the_mass_reaches_it():
    """top_p keeps the fewest tokens whose mass reaches it exactly: two of four equal tokens for
    0.5, and two of 0.5, 0.25, 0.25 for 0.75."""
    import torch

    from minicb.sampler import filter_logits
    kept = torch.isfinite(filter_logits(torch.zeros(1, 4), 0, 0.5))  # four tokens of 0.25
    assert kept.sum() == 2
    kept = torch.isfinite(filter_logits(torch.log(torch.tensor([[.5, .25, .25]])), 0, 0.75))
    assert kept.sum() == 2


def test_a_tiny_temperature_samples_the_most_likely_token():
    """logits / 1e-40 would overflow float32 to inf (softmax: NaN): below 1e-5 a request is
    greedy (as in vLLM), and 1e-3 and 1e-5 really sample, each picking the clear favourite."""
    import torch

    from minicb.sampler import sample
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [-4.0, -3.0, -2.0, -2.5]])
    for temperature in (1e-3, 1e-5, 1e-6, 1e-40, 5e-324):
        params = [SamplingParams(temperature=temperature, seed=0)] * 2
        assert sample(logits, params, [None, None]) == [1, 2]
    nan = torch.full((1, 4), float("nan"))  # a broken forward: an error, not a silent token
    with pytest.raises(ValueError, match="not finite"):
        sample(nan, [SamplingParams(seed=0)], [None])


def test_a_huge_integer_temperature_samples_instead_of_failing_the_request(llm):
    """2**70 is a finite temperature SamplingParams accepts: the request samples (almost
    uniformly), not ends with finish_reason "error" (torch cannot divide by an int past int64)."""
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=3, temperature=2**70, seed=1),
                       use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3, out.error
    assert out.token_ids == llm.generate([[5, 6]], SamplingParams(
        max_tokens=3, temperature=float(2**70), seed=1), use_tqdm=False)[0].token_ids


def test_min_tokens_keeps_stop_and_eos_tokens_from_being_sampled(llm):
    """vLLM's meaning: before min_tokens outputs, stop and EOS tokens are not generated (not
    generated and then ignored)."""
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
    eos = llm.engine.info.eos_token_ids[0]
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
        out = llm.generate(prompt, SamplingParams(max_tokens=12, min_tokens=5,
                                                  stop_token_ids=(first[0],), **sampling),
                           use_tqdm=False)[0]
        assert first[0] not in out.token_ids[:5] and eos not in out.token_ids[:5]
        assert len(out.token_ids) >= 5
        assert out.finish_reason == ("stop" if out.token_ids[-1] in (first[0], eos) else "length")
    ignored = llm.generate(prompt, SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0,
                                                  ignore_eos=True), use_tqdm=False)[0]
    assert ignored.token_ids == first[:6]  # nothing to ban: EOS is ignored, no stop ids


def test_prefix_reuse_counts_pages_and_keeps_tokens(tiny_model):
    """A prompt sharing two full pages with a finished one reuses them (32 cached tokens, only the
    rest computed) with the same tokens as without the cache; a prompt of exactly two cached
    pages reuses only the first, so at least one token is computed."""
    system = list(range(3, 3 + 40))  # 40 shared tokens = 2 full pages of 16 (+ 8)
    a, b = system + [100, 101, 102], system + [200, 201]
    with_cache = LLM(tiny_model, policy="single", num_pages=64, check_invariants=True)
    no_cache = LLM(tiny_model, policy="single", num_pages=64, enable_prefix_caching=False)
    out_a, out_b = with_cache.generate([a, b], GREEDY, use_tqdm=False)
    assert out_a.num_cached_tokens == 0 and out_b.num_cached_tokens == 32
    first_b = next(rec for rec in with_cache.engine.trace if rec.members
                   and rec.members[0].request_id == out_b.request_id)
    assert first_b.members[0].num_tokens == len(b) - 32, "only the rest is computed"
    ref_a, ref_b = no_cache.generate([a, b], GREEDY, use_tqdm=False)
    assert (out_a.token_ids, out_b.token_ids) == (ref_a.token_ids, ref_b.token_ids)
    assert ref_b.num_cached_tokens == 0
    # a full hit never covers the whole prompt: the same prompt again still computes a token
    again = with_cache.generate([system[:32]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 16
    assert with_cache.engine.stats()["pages_cached"] > 0


def test_cancel_waiting_and_running_frees_pages(make_engine):
    """Cancelling a running and a waiting request frees their pages and finishes them as cancelled;
    cancelling again does nothing, an unknown id raises ValueError, and the engine serves the next
    request."""
    engine = make_engine("continuous", max_num_seqs=1)
    running = engine.add_request([5] * 20, GREEDY)
    waiting = engine.add_request([6] * 20, GREEDY)
    engine.step()
    assert engine.pool.num_used > 0
    engine.cancel(running)
    engine.cancel(waiting)
    assert engine.pool.num_used == 0 and not engine.has_unfinished()
    assert engine.requests[running].finish_reason == "cancelled"
    engine.cancel(running)  # cancelling a finished request is a no-op
    with pytest.raises(ValueError, match="unknown request_id"):
        engine.cancel("nope")
    rid = engine.add_request([7, 8], GREEDY)  # still serving
    assert engine.run()[0].request_id == rid


def test_stream_yields_every_token_once(llm):
    """stream yields each request's tokens one at a time, each exactly once, the same as generate;
    closing it early cancels the rest and frees every page."""
    ref = llm.generate([[5, 6, 7], [1, 2]], GREEDY, use_tqdm=False)
    got: dict[str, list[int]] = {}
    for rid, new, delta in llm.stream([[5, 6, 7], [1, 2]], GREEDY):
        assert delta == "" and len(new) == 1
        got.setdefault(rid, []).extend(new)
    assert sorted(got.values()) == sorted(o.token_ids for o in ref)
    # a consumer that stops early cancels the rest
    stream = llm.stream([[5, 6, 7]], GREEDY)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_used == 0


def test_two_streams_read_in_turn_each_get_every_token(llm):
    """Two streams read in turn each get every token of their request, the same as generate, even
    when the second stream's request finishes in steps the first stream runs."""
    ref = llm.generate([[5, 6], [7, 8]], [GREEDY, SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True)], use_tqdm=False)
    long, short = llm.stream([[5, 6]], GREEDY), llm.stream([[7, 8]], SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True))
    got = [next(long), next(short)]
    got += list(long) + list(short)
    per_request: dict[str, list[int]] = {}
    for rid, new, _ in got:
        per_request.setdefault(rid, []).extend(new)
    assert list(per_request.values()) == [o.token_ids for o in ref]
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_used == 0


def test_a_failing_forward_fails_only_that_step(make_engine):
    """A forward that raises for one request finishes it with reason error and the exception's text,
    frees its pages, and later requests still run to length."""
    engine = make_engine("continuous")
    a = engine.add_request([5, 6], GREEDY)
    engine.step()
    b = engine.add_request([7, 8], GREEDY, arrival_step=engine.step_count + 2)

    def boom(items):
        if any(r.request_id == a for r, _ in items):
            raise RuntimeError("injected fault")

    engine._failure_hook = boom
    engine.step()
    assert engine.requests[a].finish_reason == "error"
    assert "injected fault" in engine.requests[a].error
    assert engine.pool.num_used == 0
    engine.run()
    assert engine.requests[b].finish_reason == "length"


class OverBudget(Scheduler):
    name = "learner"

    def schedule(self, ctx):
        for req in list(ctx.waiting):
            n = ctx.admit(req, req.num_tokens)
            if n:
                ctx.schedule(req, n)
        return ctx.batch


class Unreserved(Scheduler):
    def schedule(self, ctx):
        for req in list(ctx.waiting):
            if ctx.admit(req, 1):
                ctx.schedule(req, req.num_remaining)  # more tokens than its pages hold
        return ctx.batch


def test_a_learner_scheduler_runs_and_bad_batches_are_refused(tiny_model):
    """A Scheduler subclass runs as a policy; a batch over max_num_batched_tokens, a prefill chunk
    over chunk_size, or tokens beyond the request's reserved pages raise SchedulerError naming the
    limit, even with invariant checks off."""
    class MyPD(PDScheduler):
        name = "my-pd"

    engine = Engine(tiny_model, policy=MyPD(), num_pages=64, check_invariants=True)
    engine.add_request([1, 2, 3], GREEDY)
    assert engine.run()[0].finish_reason == "length"
    engine = Engine(tiny_model, policy=OverBudget(), max_num_batched_tokens=8, num_pages=64)
    engine.add_request([1] * 20, GREEDY)
    with pytest.raises(SchedulerError, match="exceed max_num_batched_tokens=8"):
        engine.step()
    # chunk_size too, before the forward, with the invariant checks off
    engine = Engine(tiny_model, policy=OverBudget(), chunk_size=8, num_pages=64)
    engine.add_request([1] * 20, GREEDY)
    with pytest.raises(SchedulerError, match="a prefill chunk of 20 tokens exceeds chunk_size=8"):
        engine.step()
    engine = Engine(tiny_model, policy=Unreserved(), num_pages=64)
    engine.add_request([1] * 40, GREEDY)
    with pytest.raises(SchedulerError, match="need more pages"):
        engine.step()


def test_the_engine_goes_by_a_policys_attributes_not_its_name(tiny_model):
    """`whole_prompts` lets one long prompt exceed the budget whatever the policy is called;
    `decodes_every_step` holds a policy to running every decode, named "pd" or not."""
    from minicb.scheduler import POLICY_FLAGS, ContinuousScheduler, Scheduler

    # the flags a wrapper passes on (check._Returns) are every one the base class declares
    declared = {k for k, v in vars(Scheduler).items() if isinstance(v, bool)}
    assert set(POLICY_FLAGS) == declared

    class Named(ContinuousScheduler):
        name = "anything"

    class NotWhole(ContinuousScheduler):
        whole_prompts = False

    for policy, refused in ((Named(), False), (NotWhole(), True)):
        engine = Engine(tiny_model, policy=policy, max_num_batched_tokens=8, num_pages=64)
        engine.add_request([1] * 20, GREEDY)
        if refused:
            with pytest.raises(SchedulerError, match="exceed max_num_batched_tokens=8"):
                engine.step()
        else:
            assert engine.step().members[0].num_tokens == 20

    class SkipsOne(PDScheduler):  # leaves the oldest decode out once it has two
        name = "strict"

        def schedule(self, ctx):
            super().schedule(ctx)
            decodes = [r for r, n in ctx.batch.items if not r.is_prefill]
            if len(decodes) == 2:
                ctx.batch.items = [(r, n) for r, n in ctx.batch.items if r is not decodes[0]]
            return ctx.batch

    class Lax(SkipsOne):
        name = "pd"
        decodes_every_step = False

    for policy, flagged in ((SkipsOne(), True), (Lax(), False)):
        engine = Engine(tiny_model, policy=policy, num_pages=64, check_invariants=True)
        for prompt in ([1, 2, 3], [4, 5, 6, 7]):
            engine.add_request(prompt, GREEDY)
        if flagged:
            with pytest.raises(InvariantError, match="'strict' .* left running decodes out"):
                engine.run()
        else:
            assert [o.finish_reason for o in engine.run()] == ["length", "length"]


def test_invariant_checker_names_the_broken_rule(make_engine):
    """check_invariants raises InvariantError naming the step, the page pool and the page whose
    reference count is wrong."""
    engine = make_engine("pd")
    engine.add_request([1, 2, 3], GREEDY, request_id="x")
    engine.step()
    engine.pool.ref_count[engine.requests["x"].page_table[0]] += 1  # plant a bug
    with pytest.raises(InvariantError, match="step 1: page pool: page .* ref count 2"):
        engine.check_invariants()


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(seed="x"), "seed"), (dict(min_tokens=99), "min_tokens"),
    (dict(temperature=10**400), "temperature"),
    (dict(seed=2**70), "seed"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(top_p=True), "top_p"), (dict(min_tokens=True), "min_tokens"),
    (dict(ignore_eos="false"), "ignore_eos"), (dict(ignore_eos=None), "ignore_eos"),
])
def test_bad_sampling_params(kwargs, field):
    """A max_tokens below 1, a negative or non-finite temperature, top_p outside (0, 1], a negative
    top_k, a seed torch cannot take, min_tokens above max_tokens, a non-list or boolean
    stop_token_ids, or a non-boolean ignore_eos raises ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(page_size=12), "power of two"), (dict(num_pages=0), "num_pages"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(policy="fifo"), "policy"),
    (dict(max_num_batched_tokens=4, max_num_seqs=8), "max_num_batched_tokens"),
    (dict(chunk_size=-1), "chunk_size"),
    (dict(chunk_size=8, max_num_seqs=16), "chunk_size"),
    (dict(attention_backend="cuda"), "attention_backend"),
    (dict(device="gpu"), "device must be"), (dict(device="mps"), "device must be"),
    (dict(dtype="bogus"), "dtype"), (dict(batch_timeout=float("nan")), "batch_timeout"),
    (dict(policy="pd", max_num_batched_tokens=16, chunk_size=32, min_chunk=32), "min_chunk"),
    (dict(policy=PDScheduler), "pass an instance"),
    (dict(priority_aging_steps=10), "needs preemption='priority'"),
    (dict(preemption="priority", priority_aging_steps=0), "priority_aging_steps"),
    (dict(policy="chunked", max_num_batched_tokens=2, max_num_seqs=4), "under policy 'chunked'"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be True or False"),
    (dict(check_invariants="yes"), "check_invariants"), (dict(use_cuda_graphs=None), "use_cuda"),
    (dict(trace_snapshots=1), "trace_snapshots"),
    (dict(max_preemptions=-1), "max_preemptions"), (dict(max_preemptions=1.0), "max_preemptions"),
])
def test_bad_engine_config(kwargs, field):
    """An EngineConfig with an invalid value (page size, pool and batch limits, policy, chunk sizes,
    backend, device, dtype, timeouts, preemption settings, flags of the wrong type) raises
    ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_a_scheduler_instance_serves_one_engine():
    """A scheduler instance serves one engine: a static batch kept by the instance would hand
    the first engine's requests (and their slots) to the second."""
    from minicb.benchmark.sim import make_sim_engine
    from minicb.scheduler import StaticScheduler
    shared = StaticScheduler()
    first = make_sim_engine(policy=shared, max_num_seqs=3)
    for i in range(5):
        first.add_request([1 + i] * 5, SamplingParams(max_tokens=3 + i, temperature=0.0,
                                                      ignore_eos=True))
    first.run()
    with pytest.raises(ValueError, match=r"another Engine.*policy=StaticScheduler\(\)"):
        make_sim_engine(policy=shared, max_num_seqs=3)
    fresh = make_sim_engine(policy=StaticScheduler(), max_num_seqs=3, check_invariants=True)
    fresh.add_request([9] * 5, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert fresh.run()[0].finish_reason == "length"


def test_a_cuda_device_torch_cannot_use_is_refused_with_the_reason(monkeypatch):
    """Not a traceback from inside torch: the config says what is missing and what to do."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match="CPU-only build: install a CUDA build"):
        EngineConfig(device="cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ValueError, match="no GPU is visible"):
        EngineConfig(device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="sees 1 CUDA GPU"):
        EngineConfig(device="cuda:1")
    assert EngineConfig(device="cuda:0").device == "cuda:0"


def test_bad_requests_are_refused_before_any_work(tiny_model):
    """A bad prompt, bad params, a prompt that can never fit the pool or the context, a bad arrival,
    priority or option raises ValueError naming it, and leaves no request, queue entry or page
    behind (not even for a batch's good prompts); a request_id already in use is refused."""
    llm = LLM(tiny_model, num_pages=8, page_size=16)
    engine = llm.engine
    cases = [
        (lambda: llm.generate([[]], GREEDY), "empty"),
        (lambda: llm.generate(["hello"], GREEDY), "no tokenizer"),
        (lambda: llm.generate([[1, 2], [3]], [GREEDY]), "one per prompt"),
        (lambda: llm.generate([[1, 2], [99999]], GREEDY), r"token ids must be in \[0, 256\)"),
        (lambda: llm.generate([[1] * 100], SamplingParams(max_tokens=100)), "page pool"),
        (lambda: llm.generate([[1] * 10], SamplingParams(max_tokens=4000)), "context"),
        (lambda: engine.add_request([1], GREEDY, arrival_step=0), "arrival_step"),
        (lambda: engine.add_request([1], GREEDY, arrival_step=True), "arrival_step"),
        (lambda: engine.add_request([1], GREEDY, priority=True), "priority"),
        (lambda: engine.add_request([1], GREEDY, arrival_time=float("nan")), "arrival_time"),
        (lambda: llm.generate([[1]], SamplingParams(stop_token_ids=[300])), "stop_token_ids"),
        (lambda: llm.generate([[1]], {"max_tokens": 3}), "got a dict"),
        (lambda: llm.generate(None, GREEDY), "prompts must be a prompt"),
        (lambda: llm.generate(7, GREEDY), "prompts must be a prompt"),
        (lambda: llm.generate([[1]], "greedy"), "params must be a SamplingParams"),
        (lambda: llm.generate([[1]], 3), "params must be a SamplingParams"),
        (lambda: llm.chat([{"role": "user", "content": "hi"}]), "chat template"),
        (lambda: Engine(tiny_model, bogus=1), "unknown engine option"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert not engine.has_unfinished() and engine.pool.num_used == 0
        assert not engine.requests  # no record either, not even of a batch's good prompts
    assert engine.step().finished == []
    engine.add_request([1], GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([2], GREEDY, request_id="dup")
    assert llm.generate((1, 2, 3), GREEDY)[0].prompt_token_ids == [1, 2, 3]  # a tuple of ids


def test_an_arrival_step_already_past_counts_from_when_the_engine_saw_it(tiny_model):
    """Added at step 10 with arrival_step=1: it waited no steps, not ten phantom ones."""
    engine = Engine(tiny_model, policy="pd")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True))
    for _ in range(10):
        engine.step()
    late = engine.add_request([4, 5, 6], GREEDY, arrival_step=1)
    soon = engine.add_request([4, 5, 7], GREEDY, arrival_step=12)
    engine.run()
    metrics = {rid: engine.requests[rid].metrics for rid in (late, soon)}
    assert metrics[late].arrival_step == 11 == metrics[late].first_scheduled_step
    assert metrics[soon].arrival_step == 12 == metrics[soon].first_scheduled_step


def test_min_tokens_bans_stop_tokens_on_the_logits_device(monkeypatch):
    """The banned ids are built on the logits' device: a CPU index into CUDA logits raised,
    failing every member of the step on a GPU. No GPU here: the test sees what `sample` asks
    torch.tensor for."""
    from minicb import sampler

    asked = []
    real_tensor = torch.tensor

    def spy(data, *args, **kwargs):
        asked.append(kwargs.get("device"))
        return real_tensor(data, *args, **kwargs)

    monkeypatch.setattr(sampler.torch, "tensor", spy)
    logits = torch.zeros(2, 8)
    logits[:, 3] = 5.0
    out = sampler.sample(logits, [GREEDY, GREEDY], [None, None], banned=[[3], []])
    assert out[0] != 3 and out[1] == 3
    assert asked and all(device == logits.device for device in asked)  # never left to default


class Lazy(Scheduler):
    """Never schedules anything: a stalled policy."""
    name = "lazy"

    def schedule(self, ctx):
        return ctx.batch


class ReturnsNothing(Scheduler):
    name = "returns-nothing"

    def schedule(self, ctx):
        return None


def test_dynamic_batching_may_wait_a_step_timeout_longer_than_the_stall_limit(monkeypatch):
    """A timeout in steps is empty steps the policy is meant to wait: with the stall limit at 50
    and a 120-step timeout the batch forms at step 120 (both guards, the engine's and
    run_workload's, raised at the limit), while a policy that never schedules still stops."""
    import minicb.engine
    from minicb.benchmark.sim import CostModel, make_sim_engine
    from minicb.benchmark.workload import make_workload, run_workload
    monkeypatch.setattr(minicb.engine, "STALL_STEPS", 50)
    engine = make_sim_engine(CostModel(), policy="dynamic", num_pages=64, page_size=4,
                             batch_timeout=120, max_num_seqs=4)
    assert engine.stall_limit == 170
    run_workload(engine, make_workload(num_requests=2, prompt_lengths="uniform:4:8",
                                       output_lengths="uniform:2:3", seed=0))
    assert engine.trace[120].members and not any(r.members for r in engine.trace[:120])
    assert make_sim_engine(CostModel(), policy="pd", num_pages=64).stall_limit == 50


def test_a_stalled_policy_raises_instead_of_spinning_and_leaves_nothing(tiny_model,
                                                                         monkeypatch):
    """LLM.generate, stream and Engine.run all stop on a scheduler that never schedules, with
    a message saying so; generate cancels its requests, so the engine is empty afterwards."""
    import minicb.engine
    monkeypatch.setattr(minicb.engine, "STALL_STEPS", 50)
    llm = LLM(tiny_model, policy=Lazy(), num_pages=16)
    with pytest.raises(RuntimeError, match="'lazy' scheduled nothing for 50 steps"):
        llm.generate([[1, 2, 3]], GREEDY)
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_used == 0
    with pytest.raises(RuntimeError, match="scheduled nothing"):
        list(llm.stream([[1, 2, 3]], GREEDY))
    assert not llm.engine.has_unfinished()
    engine = Engine(tiny_model, policy=ReturnsNothing(), num_pages=16)
    engine.add_request([1, 2], GREEDY)
    with pytest.raises(SchedulerError, match="must return ctx.batch.*got NoneType"):
        engine.step()

    class ReturnsACopy(PDScheduler):  # its record's preemptions and swaps would not be its own
        def schedule(self, ctx):
            super().schedule(ctx)
            return ScheduledBatch(items=list(ctx.batch.items))

    engine = Engine(tiny_model, policy=ReturnsACopy(), num_pages=16)
    engine.add_request([1, 2], GREEDY)
    with pytest.raises(SchedulerError, match="must return ctx.batch.*another ScheduledBatch"):
        engine.step()


def test_a_seed_torch_cannot_take_leaves_the_engine_untouched(tiny_model):
    """A seed outside torch's range raises ValueError with no request recorded, and the engine then
    serves normally."""
    llm = LLM(tiny_model, num_pages=16, check_invariants=True)
    with pytest.raises(ValueError, match="seed"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=3, seed=2**70))
    assert llm.engine.requests == {}
    assert llm.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "length"


def test_bad_model_names(tmp_path):
    """An LLM of an unknown model name raises ValueError naming the bundled models; a directory
    without config.json raises ValueError naming it."""
    with pytest.raises(ValueError, match="bundled"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_token_slice_equals_the_full_list_slice():
    """Request.token_ids_slice(start, stop) equals the slice of prompt plus output for every start
    and stop."""
    from minicb.request import Request
    req = Request("r", [1, 2, 3, 4], SamplingParams(), output_token_ids=[5, 6, 7])
    for start in range(8):
        for stop in range(start, 8):
            assert req.token_ids_slice(start, stop) == req.all_token_ids[start:stop]


def test_a_caller_can_stop_a_request_itself(make_engine):
    """cancel(request_id, reason="stop") finishes a running request as stop, frees its pages and
    lists it in the next step's finished; any other reason raises ValueError."""
    engine = make_engine("continuous")
    rid = engine.add_request([5, 6, 7], GREEDY)
    engine.step()
    engine.cancel(rid, reason="stop")  # e.g. a server that matched a stop string
    assert engine.requests[rid].finish_reason == "stop" and engine.pool.num_used == 0
    assert rid in engine.step().finished
    with pytest.raises(ValueError, match="reason"):
        engine.cancel(rid, reason="done")


def test_cuda_page_pool_is_sized_from_free_memory(monkeypatch):
    """On CUDA the pool takes `gpu_memory_utilization` of the free memory, less 512 MiB for
    activations, in pages of 2 (K, V) x layers x page_size x kv heads x head_dim x dtype bytes
    (chapter 07); on the CPU it is a fixed 1024 pages. No GPU needed: the free-memory query is
    replaced."""
    from types import SimpleNamespace

    import torch

    from minicb.config import EngineConfig
    from minicb.runner import default_num_pages
    smollm2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64,
                              max_position_embeddings=8192)
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # two GPUs, as far as
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)     # the config can tell
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: asked.append(device) or (10 * 2**30, 80 * 2**30))
    # torch's cache is emptied first: a dropped engine's pool must count as free
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: asked.append("emptied"))
    config = EngineConfig.from_kwargs(device="cuda:1", page_size=16, gpu_memory_utilization=0.5,
                                      max_num_seqs=64)  # 64 x 8192 tokens: no cap below
    page_bytes = 2 * 30 * 16 * 3 * 64 * 2  # 360 KiB per 16-token page in bfloat16
    assert default_num_pages(smollm2, config, torch.bfloat16) == (
        (5 * 2**30 - 512 * 2**20) // page_bytes) == 13107
    assert asked == ["emptied", torch.device("cuda:1")]  # the engine's own GPU, not device 0
    assert default_num_pages(smollm2, config, torch.float32) == 13107 // 2  # 4-byte KV
    tiny = dict(config.__dict__, gpu_memory_utilization=0.01)  # less than the headroom
    with pytest.warns(UserWarning, match=r"10.0 GiB of free GPU memory hold 16 pages"
                                         r", less than one 8192-token context"):
        assert default_num_pages(smollm2, EngineConfig.from_kwargs(**tiny),
                                 torch.bfloat16) == 16
    # no more than every slot at the longest context needs: 4 x 8192 / 16
    few = dict(config.__dict__, max_num_seqs=4)
    assert default_num_pages(smollm2, EngineConfig.from_kwargs(**few), torch.bfloat16) == 2048
    cpu = EngineConfig.from_kwargs(device="cpu")
    assert default_num_pages(smollm2, cpu, torch.float32) == 1024


def test_evicted_prefix_pages_are_counted_in_the_trace(tiny_model):
    """One-at-a-time requests with different 32-token prompts in a 6-page pool: each leaves
    two cached prompt pages, and the next ones must evict them to fit."""
    engine = Engine(tiny_model, policy="single", num_pages=6, page_size=16,
                    check_invariants=True)
    for i in range(3):
        engine.add_request([10 + i] * 32, SamplingParams(max_tokens=20, temperature=0.0,
                                                         ignore_eos=True))
    engine.run()
    evicted = [rec.pages_evicted for rec in engine.trace]
    assert sum(evicted) == engine.pool.num_evicted > 0
    from minicb.benchmark import metrics
    assert metrics.summarize(engine.trace, metrics.request_records(engine))["evicted_pages"] == \
        sum(evicted)


def test_a_loaded_model_keeps_its_dtype(tiny_llama_dir):
    """An engine given a model loaded in bfloat16 builds a bfloat16 KV cache under
    dtype='auto' (a float32 cache failed every request); an explicit other dtype is refused."""
    import torch

    from minicb.model.loader import load_model
    pair = load_model(tiny_llama_dir, dtype=torch.bfloat16)
    engine = Engine(pair, num_pages=16)
    assert engine.pool.kv_caches[0][0].dtype == torch.bfloat16
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0,
                                                           ignore_eos=True))
    engine.run()
    assert len(engine.requests[rid].output_token_ids) == 3
    with pytest.raises(ValueError, match="dtype='float32' but the model passed in is torch.bf"):
        Engine(pair, dtype="float32")


def test_a_loaded_model_on_another_device_is_refused(tiny_llama_dir):
    """A passed model on a device other than the engine's raises ValueError naming both, and with
    device auto naming the model's device."""
    from minicb.model.loader import load_model
    model, info = load_model(tiny_llama_dir, prepack=False)
    model.to("meta")  # anywhere but the engine's device
    with pytest.raises(ValueError, match="device='cpu' but the model passed in is on meta"):
        Engine((model, info), device="cpu")
    with pytest.raises(ValueError, match="'meta'"):  # "auto" takes the model's device: not this
        Engine((model, info))


def test_a_loaded_model_without_its_info_is_refused_by_name(tiny_llama_dir):
    """Engine(model) with the module alone, not the (model, info) pair: a ValueError saying
    what to pass, not its repr taken for a path."""
    from minicb.model.loader import load_model
    model, _ = load_model(tiny_llama_dir, prepack=False)
    with pytest.raises(ValueError, match=r"pass the pair load_model\(...\) returned"):
        Engine(model)


def test_device_auto_is_the_cpu_here_and_follows_a_loaded_model(tiny_llama_dir, monkeypatch):
    """device auto resolves to cuda when CUDA is available, except for int8 (CPU only); an engine
    given a loaded model takes that model's device."""
    import torch

    from minicb.config import resolve_device
    from minicb.model.loader import load_model
    assert EngineConfig().device == "auto"
    model, info = load_model(tiny_llama_dir, prepack=False)
    assert Engine((model, info)).config.device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("auto", quantization="int8") == "cpu"  # a CPU-only option
    assert Engine((model, info)).config.device == "cpu"  # where the model passed in lies


def test_engine_config_limits_are_where_the_messages_say():
    """The boundary of each rule: equal passes where the rule says >=, zero where it says
    >= 0; one step past is refused naming the rule. And "auto" dtype is bfloat16 on CUDA."""
    import torch

    from minicb.config import torch_dtype
    EngineConfig(policy="pd", chunk_size=16, max_num_seqs=16)  # chunk_size >= max_num_seqs
    EngineConfig(policy="dynamic", batch_timeout=0)  # dynamic batching that never waits
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=0.0)
    with pytest.raises(ValueError, match=r"chunk_size \(16\) must be >= min_chunk \(32\)"):
        EngineConfig(policy="pd", chunk_size=16, min_chunk=32)
    assert torch_dtype("auto", "cpu") == torch.float32
    assert torch_dtype("auto", "cuda") == torch_dtype("auto", "cuda:1") == torch.bfloat16
    assert torch_dtype("float16", "cuda") == torch.float16


def test_a_scheduler_instance_meets_the_rules_of_the_policy_it_names():
    """policy=PDScheduler() gets the cross-field checks policy="pd" gets (a budget below
    max_num_seqs wedges chunked and pd: decodes cannot all advance)."""
    from minicb.scheduler import ChunkedScheduler, PDScheduler
    for policy in (PDScheduler(), ChunkedScheduler()):
        with pytest.raises(ValueError, match=rf"max_num_batched_tokens \(4\) must be >= "
                                             rf"max_num_seqs \(8\) under policy '{policy.name}'"):
            EngineConfig(policy=policy, max_num_batched_tokens=4, max_num_seqs=8)
    with pytest.raises(ValueError, match=r"chunk_size \(4\) must be >= max_num_seqs"):
        EngineConfig(policy=PDScheduler(), chunk_size=4, max_num_seqs=8)
    EngineConfig(policy=PDScheduler(), max_num_batched_tokens=8, max_num_seqs=8, chunk_size=8)


def test_an_object_that_is_not_a_scheduler_is_refused_when_the_engine_is_built(tiny_model):
    """A policy object that is not a `Scheduler` is refused before anything is loaded, the
    message naming what it lacks, so no request is ever queued on it and lost."""

    class OnlySchedule:
        def schedule(self, ctx):
            return ctx.batch

    with pytest.raises(SchedulerError, match="OnlySchedule is not a Scheduler .it lacks "
                                             "release, whole_prompts, holds_finished_slots"):
        Engine(tiny_model, policy=OnlySchedule(), num_pages=16)
    with pytest.raises(ValueError, match="policy must be one of"):
        Engine(tiny_model, policy=42, num_pages=16)


def test_a_prompt_that_is_not_valid_text_is_refused_naming_the_prompt(word_model):
    """A lone surrogate cannot be encoded: a ValueError naming the prompt, not the
    tokenizer's TypeError, and nothing is queued."""
    llm = LLM(word_model, num_pages=16)
    with pytest.raises(ValueError, match="prompt 0: prompt is not valid text .surrogates not "
                                         "allowed at character 3"):
        llm.generate(["abc\ud800def"], GREEDY)
    with pytest.raises(ValueError, match="prompt is not valid text"):
        llm.engine.add_request("w3 \udfff", GREEDY)
    assert not llm.engine.requests


def test_an_arrival_time_is_bounded_to_a_day_ahead(tiny_model):
    """`arrival_time` at most MAX_ARRIVAL_DELAY (a day) past the engine's clock: no
    OverflowError from a sleep of 1e300 seconds, no run() that sleeps for days."""
    from minicb.engine import MAX_ARRIVAL_DELAY
    engine = Engine(tiny_model, num_pages=16)
    for late in (1e300, 1e6, MAX_ARRIVAL_DELAY + 60):
        with pytest.raises(ValueError, match="arrival_time must be .* at most 86400 past"):
            engine.add_request([1, 2], GREEDY, arrival_time=late)
    assert not engine.requests
    engine.add_request([1, 2], GREEDY, arrival_time=MAX_ARRIVAL_DELAY / 2)
    assert engine.stats()["num_waiting"] == 1


def test_a_pool_larger_than_memory_is_refused_before_anything_is_allocated(tiny_model,
                                                                         monkeypatch):
    """num_pages is checked against the memory it needs (K/V and bookkeeping) before any of it
    is allocated: a billion pages is a ValueError at once, not the OOM killer."""
    import minicb.kv_cache
    from minicb.benchmark.sim import make_sim_engine

    def never(*args, **kwargs):
        raise AssertionError("the pool was built")

    monkeypatch.setattr(minicb.kv_cache.PagePool, "__init__", never)
    with pytest.raises(ValueError, match="num_pages=1000000000 .* need .* GiB of host memory"):
        Engine(tiny_model, num_pages=10**9)
    with pytest.raises(ValueError, match="num_pages=1000000000"):  # no K/V: bookkeeping only
        make_sim_engine(num_pages=10**9)
    with pytest.raises(ValueError, match="num_swap_pages=1000000000"):
        Engine(tiny_model, num_pages=16, preemption_mode="swap", num_swap_pages=10**9)


class Malformed(PDScheduler):
    """Schedules as pd, then adds one bad item to the batch."""

    def __init__(self, item):
        super().__init__()
        self.item = item

    def schedule(self, ctx):
        super().schedule(ctx)
        ctx.batch.items.append(self.item(ctx) if callable(self.item) else self.item)
        return ctx.batch


@pytest.mark.parametrize("item", [
    "garbage", None, (), lambda ctx: (ctx.running[0],), lambda ctx: (ctx.running[0], 1, 2),
    lambda ctx: (ctx.running[0], "1"), lambda ctx: (ctx.running[0], 1.0), (None, 1),
    lambda ctx: (ctx.running[0].request_id, 1)])
def test_a_malformed_batch_item_is_a_scheduler_error_and_loses_nothing(tiny_model, item):
    """A batch item that is not a (request, positive int) pair raises SchedulerError before the
    forward, and the request stays running with nothing computed and the invariants intact."""
    engine = Engine(tiny_model, policy=Malformed(item), num_pages=16, check_invariants=True)
    engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(SchedulerError):
        engine.step()
    engine.check_invariants()
    assert engine.running and engine.running[0].num_computed_tokens == 0


def test_idle_members_count_toward_max_num_seqs_in_the_message(tiny_model):
    """Idle batch members count toward max_num_seqs, and the SchedulerError names how many members
    are idle."""
    class IdleExtra(PDScheduler):
        def schedule(self, ctx):
            super().schedule(ctx)
            ctx.batch.idle.append(ctx.running[0])
            return ctx.batch

    engine = Engine(tiny_model, policy=IdleExtra(), max_num_seqs=2, num_pages=16)
    for prompt in ([1, 2], [3, 4]):
        engine.add_request(prompt, GREEDY)
    with pytest.raises(SchedulerError, match=r"3 members \(1 of them idle\) exceed "
                                             r"max_num_seqs=2"):
        engine.step()


def _params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                             **kw})


def test_a_request_may_fill_the_models_context_exactly():
    """prompt + max_tokens equal to the model's context is accepted and runs; one token more is
    refused with a clear error."""
    e = make_sim_engine(policy="pd", max_position_embeddings=16, check_invariants=True)
    with pytest.raises(ValueError, match="exceeds the model's context of 16"):
        e.add_request([1] * 8, _params(9))
    assert not e.requests and not e.has_unfinished()
    rid = e.add_request([1] * 8, _params(8))
    out = e.run()[0]
    assert out.request_id == rid and len(out.token_ids) == 8 and out.finish_reason == "length"


def test_a_generated_id_skips_ids_the_caller_took():
    """A generated request id ("req-<n>") skips ids the caller already took."""
    e = make_sim_engine(policy="pd", check_invariants=True)
    e.add_request([1] * 4, _params(2), request_id="req-0")
    auto = e.add_request([2] * 4, _params(2))
    assert auto != "req-0" and set(e.requests) == {"req-0", auto}
    e.run()
    assert all(r.finish_reason == "length" for r in e.requests.values())


def test_cancelling_a_finished_request_changes_nothing():
    """Cancelling a finished request changes nothing: not its finish reason or time, nor the next
    step's record."""
    e = make_sim_engine(policy="pd", check_invariants=True)
    done = e.add_request([1] * 4, _params(2), deadline=100.0)
    e.run()
    before = (e.requests[done].finish_reason, e.requests[done].metrics.finish_step,
              e.requests[done].metrics.finish_time)
    e.cancel(done)
    other = e.add_request([2] * 4, _params(2))
    e.run()
    r = e.requests[done]
    assert (r.finish_reason, r.metrics.finish_step, r.metrics.finish_time) == before
    assert before[0] == "length"
    assert all(done not in rec.finished for rec in e.trace if rec.step > before[1])
    assert e.requests[other].finish_reason == "length"


def test_a_prompt_token_id_equal_to_the_vocabulary_size_is_refused():
    """A prompt token id equal to the vocabulary size is refused up front; the engine stays
    usable."""
    e = make_sim_engine(policy="pd", vocab=128, check_invariants=True)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 128\), got \[128\]"):
        e.add_request([1, 128], _params(2))
    assert not e.requests and not e.has_unfinished()
    e.add_request([1, 127], _params(2))
    assert e.run()[0].finish_reason == "length"


def test_a_negative_arrival_time_is_refused():
    """A negative arrival_time is refused."""
    e = make_sim_engine(policy="pd", check_invariants=True)
    with pytest.raises(ValueError, match="arrival_time must be a finite number >= 0"):
        e.add_request([1] * 4, _params(2), arrival_time=-1.0)
    assert not e.requests and not e.has_unfinished()


def test_a_steps_waiting_count_leaves_out_requests_not_yet_arrived():
    """StepRecord.num_waiting counts only requests that have arrived."""
    e = make_sim_engine(policy="pd", max_num_seqs=1, check_invariants=True)
    e.add_request([1] * 4, _params(3), request_id="now")
    e.add_request([2] * 4, _params(2), request_id="later", arrival_step=50)
    e.add_request([3] * 4, _params(2), request_id="queued")
    record = e.step()
    assert record.num_waiting == 1  # "queued" only


def test_an_idle_engine_does_not_skip_steps_past_a_timed_arrival():
    """An idle engine jumps its step counter to the next arrival step only when every pending
    request arrives by step: a request arriving by time may come first."""
    e = make_sim_engine(policy="pd", check_invariants=True)
    e.add_request([1] * 4, _params(2), request_id="by_step", arrival_step=50)
    e.add_request([2] * 4, _params(2), request_id="by_time", arrival_time=0.5)
    e.run()
    by_time, by_step = e.requests["by_time"].metrics, e.requests["by_step"].metrics
    assert by_time.first_scheduled_step == 1 and by_time.first_scheduled_time == 0.5
    assert by_time.finish_step < 50
    assert by_step.arrival_step == by_step.first_scheduled_step == 50


def test_a_timed_arrival_counts_from_the_step_it_joined():
    """A request arriving by arrival_time counts from the step it joined: served at once it waited
    0 steps and has its first token in its first step, as a request added between steps."""
    from minicb.benchmark import metrics
    engine = make_sim_engine(policy="pd")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request([5] * 8, params, request_id="now")
    engine.add_request([5] * 8, params, request_id="later", arrival_time=0.02)
    engine.run()
    for r in metrics.request_records(engine):
        assert r.arrival_step == r.first_scheduled_step, r
    summary = metrics.summarize(engine.trace, metrics.request_records(engine))
    assert summary["queue_steps"]["p99"] == 0 and summary["ttft_steps"]["p99"] == 1
