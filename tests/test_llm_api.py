"""The `LLM` API (chapter 00) on the inputs users hand it: stop strings in `SamplingParams`
(as vLLM's, matched by the same `StopMatcher` the server uses), prompts as numpy arrays or torch
tensors, containers that are not lists, and chat's refusals.

Text matters here, so most tests run the tiny Llama with test_serve's word-level tokenizer
("w3 w17 ..."), built again below; every refusal must leave the engine empty."""

from __future__ import annotations

import pytest
from tiny_models import guessable_model

from minicb import LLM, SamplingParams
from minicb.benchmark.sim import SIM_TOKEN, make_sim_engine
from minicb.llm import IncrementalDecoder, is_conversation

GREEDY = dict(temperature=0.0, ignore_eos=True)
HI = [{"role": "user", "content": "w5 w6"}]


@pytest.fixture
def llm(word_model):
    return LLM(word_model, num_pages=64, check_invariants=True)


def empty(llm) -> bool:
    """Nothing queued, running or allocated."""
    return not llm.engine.has_unfinished() and llm.engine.pool.num_used == 0


def tokens_to_reach(llm, token_ids: list[int], end: int) -> int:
    """How many of `token_ids` it takes for their text to be at least `end` characters long."""
    for n in range(1, len(token_ids) + 1):
        if len(llm.tokenizer.decode(token_ids[:n], skip_special_tokens=True)) >= end:
            return n
    raise AssertionError("the text never gets that long")


def once(words: list[str], start: int) -> str:
    """The first of `words[start:]` that is no part of any other word: a stop string that
    matches in one place only."""
    return next(w for w in words[start:] if sum(w in v for v in words) == 1)


# ------------------------------------------------------------------------------ stop strings
def test_sampling_params_stop_is_a_tuple_of_non_empty_strings():
    """stop is stored as a tuple of strings (one string is one stop string, None is none); bytes,
    empty strings, non-strings and sets raise ValueError."""
    assert SamplingParams().stop == ()
    assert SamplingParams(stop="w1").stop == ("w1",)  # one string is one stop string (vLLM)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=("a",)).stop == ("a",)
    assert SamplingParams(stop=None).stop == ()
    for bad in (b"\n", [b"\n"], "", [""], ["a", ""], [3], 3, {"a"}, True):
        with pytest.raises(ValueError, match="stop must be a string or a list of non-empty"):
            SamplingParams(stop=bad)


def test_generate_cuts_the_text_before_the_earliest_stop_string_and_stops_at_once(llm):
    """vLLM: the text ends before the stop string, finish_reason "stop", the token that
    completed it is kept; the request leaves the engine then, not at max_tokens."""
    ref = llm.generate("w5 w6 w7", SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    words = ref.text.split()
    early = once(words, 3)
    late = once(words, words.index(early) + 1)
    cut = ref.text.find(early)  # `late` comes first in the list, `early` in the text
    stop_sp = SamplingParams(max_tokens=12, stop=[late, "nowhere", early], **GREEDY)
    out, other = llm.generate(["w5 w6 w7", "w5 w6 w7"], [stop_sp, SamplingParams(
        max_tokens=12, stop="nowhere", **GREEDY)], use_tqdm=False)
    n = tokens_to_reach(llm, ref.token_ids, cut + len(early))
    assert (out.text, out.finish_reason) == (ref.text[:cut], "stop")
    assert out.token_ids == ref.token_ids[:n] and n < 12, "stopped in the engine at once"
    assert llm.engine.requests[out.request_id].finish_reason == "stop"
    assert (other.text, other.token_ids, other.finish_reason) == (ref.text, ref.token_ids,
                                                                   "length")
    assert empty(llm)


def test_a_stop_string_may_span_tokens(llm):
    """A stop string that spans two tokens ends the text just before it, with finish reason stop,
    and keeps only the tokens needed to reach its end."""
    ref = llm.generate("w5 w6 w7", SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    words = ref.text.split()
    stop = f"{words[2][-1]} {words[3][:2]}"  # the end of one word and the start of the next
    cut = ref.text.find(stop)
    out = llm.generate("w5 w6 w7", SamplingParams(max_tokens=12, stop=stop, **GREEDY),
                       use_tqdm=False)[0]
    assert (out.text, out.finish_reason) == (ref.text[:cut], "stop")
    assert out.token_ids == ref.token_ids[:tokens_to_reach(llm, ref.token_ids, cut + len(stop))]


def test_no_stop_string_before_min_tokens(llm):
    """As vLLM and the server: a stop string ends nothing before `min_tokens` tokens."""
    ref = llm.generate("w5 w6 w7", SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    words = ref.text.split()
    stop = words[1]
    min_tokens = max(i for i, w in enumerate(words) if w == stop) + 2  # after its last one
    out = llm.generate("w5 w6 w7", SamplingParams(max_tokens=12, stop=stop, min_tokens=min_tokens,
                                                  **GREEDY), use_tqdm=False)[0]
    assert (out.text, out.finish_reason, out.token_ids) == (ref.text, "length", ref.token_ids)


@pytest.mark.parametrize("also", [(), ("a stop string longer than the whole output",)])
def test_no_stop_string_before_min_tokens_whatever_else_is_listed(llm, also):
    """A stop string counts only if it ends in text the output made from `min_tokens` on, whatever
    longer stop strings are listed beside it."""
    ref = llm.generate("w5 w6 w7", SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    words = ref.text.split()
    stop = once(words, 0)
    min_tokens = words.index(stop) + 2  # the token after it reaches min_tokens
    out = llm.generate("w5 w6 w7", SamplingParams(max_tokens=12, stop=[stop, *also],
                                                  min_tokens=min_tokens, **GREEDY),
                       use_tqdm=False)[0]
    assert (out.text, out.finish_reason, out.token_ids) == (ref.text, "length", ref.token_ids)


def guessing_llm(word_model, k: int) -> LLM:
    """An `LLM` whose `k` guesses are all right (tiny_models.guessable_model): the simulated
    model, always "w100", with the word tokenizer."""
    model, clock = guessable_model(word_model[1].tokenizer)
    return LLM(model, clock=clock, device="cpu", attention_backend="torch",
               num_speculative_tokens=k, check_invariants=True)


@pytest.mark.parametrize("read", ["generate", "stream"])
def test_a_stop_string_completed_among_kept_guesses_ends_the_tokens_there(word_model, read):
    """Chapter 08: a step with kept guesses brings several tokens; the one that completes a stop
    string ends the output, its ids and timings too, as if no guess had come after it (2 ids for a
    stop string done at the 2nd)."""
    sp = SamplingParams(max_tokens=12, stop="w100 w100", **GREEDY)
    outs = {}
    for k in (0, 3):
        llm = guessing_llm(word_model, k)
        if read == "generate":
            out = llm.generate([100] * 8, sp, use_tqdm=False)[0]
            rid, ids, text = out.request_id, out.token_ids, out.text
        else:
            items = list(llm.stream([100] * 8, sp))
            rid, ids = items[0][0], [t for _, new, _ in items for t in new]
            text = "".join(delta for _, _, delta in items)
        req = llm.engine.requests[rid]
        outs[k] = ids, text, req.finish_reason, len(req.metrics.token_times), \
            len(req.metrics.token_steps)
        assert empty(llm)
    assert outs[3] == outs[0] == ([100, 100], "", "stop", 2, 2)


def test_stop_at_drops_the_tokens_after_and_refuses_a_bad_count(word_model):
    """stop_at(request_id, n) keeps the first n output tokens and their step record, finishes the
    request with stop and frees its pages; n outside 1..len(output), a non-integer n or an unknown
    request_id raises ValueError naming it."""
    llm = guessing_llm(word_model, 3)
    rid = llm.engine.add_request([100] * 8, SamplingParams(max_tokens=12, **GREEDY))
    llm.engine.step(), llm.engine.step()  # 1 token, then 4 more
    req = llm.engine.requests[rid]
    assert len(req.output_token_ids) == 5
    for bad in (0, 6, 2.0, True):
        with pytest.raises(ValueError, match="num_output_tokens must be 1..5"):
            llm.engine.stop_at(rid, bad)
    with pytest.raises(ValueError, match="cannot stop unknown request_id 'nobody'"):
        llm.engine.stop_at("nobody", 1)
    llm.engine.stop_at(rid, 3)
    assert (req.output_token_ids, req.metrics.token_steps, req.finish_reason) == \
        ([100] * 3, [1, 2, 2], "stop")
    assert empty(llm)


def test_a_stop_string_in_the_last_allowed_token_is_a_stop(llm):
    """A stop string completed by the last token max_tokens allows finishes the request with stop,
    not length, in the output and in the engine's request."""
    ref = llm.generate("w5 w6 w7", SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0]
    first, stop = ref.text.split()
    assert stop not in first
    out = llm.generate("w5 w6 w7", SamplingParams(max_tokens=2, stop=[stop], **GREEDY),
                       use_tqdm=False)[0]
    assert (out.text, out.finish_reason, out.token_ids) == (first + " ", "stop", ref.token_ids)
    assert llm.engine.requests[out.request_id].finish_reason == "stop"


def test_stream_holds_back_what_may_begin_a_stop_string_and_stops_there(llm):
    """A stream never yields text that may begin a stop string: its text ends just before the stop
    string, its tokens are those generate keeps, and without stop strings it yields the whole
    text."""
    ref = llm.generate("w5 w6 w7", SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    words = ref.text.split()
    stop = f"{words[2][-1]} {words[3][:2]}"  # its first character ends a word: held back
    cut = ref.text.find(stop)
    items = list(llm.stream("w5 w6 w7", SamplingParams(max_tokens=12, stop=stop, **GREEDY)))
    text = "".join(delta for _, _, delta in items)
    ids = [t for _, new, _ in items for t in new]
    assert text == ref.text[:cut]
    assert ids == ref.token_ids[:tokens_to_reach(llm, ref.token_ids, cut + len(stop))]
    assert llm.engine.requests[items[0][0]].finish_reason == "stop" and empty(llm)
    # without stop strings, the stream's text is the whole output, as before
    plain = list(llm.stream("w5 w6 w7", SamplingParams(max_tokens=12, **GREEDY)))
    assert "".join(delta for _, _, delta in plain) == ref.text


def test_a_stop_string_ends_its_request_whichever_call_steps_the_engine(llm):
    """Two streams read in turn, or a stream paused while generate runs, step each other's requests:
    a stop string reached in another call's step still stops the request at once, not a token later
    or at max_tokens."""
    ref = llm.generate("w5 w6 w7", SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    words = ref.text.split()
    stop = once(words, 3)
    n = tokens_to_reach(llm, ref.token_ids, ref.text.find(stop) + len(stop))
    sp = SamplingParams(max_tokens=12, stop=stop, **GREEDY)
    first, second = llm.stream("w5 w6 w7", sp), llm.stream("w5 w6 w7", sp)
    got: dict[str, list[int]] = {}
    for a, b in zip(first, second):  # each next() runs a step for both requests
        for rid, new, _ in (a, b):
            got.setdefault(rid, []).extend(new)
    for rest in (first, second):
        for rid, new, _ in rest:
            got.setdefault(rid, []).extend(new)
    assert list(got.values()) == [ref.token_ids[:n]] * 2
    paused = llm.stream("w5 w6 w7", sp)
    rid, new, _ = next(paused)
    llm.generate("w9", SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    assert new + [t for _, more, _ in paused for t in more] == ref.token_ids[:n]
    assert llm.engine.requests[rid].finish_reason == "stop" and empty(llm)


def test_chat_honours_stop_strings(llm):
    """chat ends its reply just before the first stop string, with finish reason stop."""
    ref = llm.chat(HI, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    stop = once(ref.text.split(), 4)
    out = llm.chat(HI, SamplingParams(max_tokens=8, stop=stop, **GREEDY), use_tqdm=False)[0]
    assert (out.text, out.finish_reason) == (ref.text[:ref.text.find(stop)], "stop")


def test_stop_strings_without_a_tokenizer_are_refused_and_nothing_is_queued(tiny_model):
    """Stop strings on an LLM with no tokenizer raise ValueError naming the prompt, in generate and
    stream, before any request is queued or any page taken."""
    llm = LLM(tiny_model, num_pages=64)
    with pytest.raises(ValueError, match="prompt 1: stop strings need a tokenizer"):
        llm.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=3), SamplingParams(
            max_tokens=3, stop="x")], use_tqdm=False)
    assert not llm.engine.requests and empty(llm)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        next(llm.stream([5, 6], SamplingParams(max_tokens=3, stop=["x"])))
    assert not llm.engine.requests and empty(llm)


# ------------------------------------------------------------------------------ prompt containers
def test_a_1d_array_or_tensor_is_one_prompt_and_a_2d_one_a_list_of_prompts(tiny_model):
    """numpy arrays and torch tensors of token ids, as `tokenizer(..., return_tensors=...)`
    gives them: a 1-D one is one prompt, not a list of prompts of one int each."""
    import numpy as np
    import torch
    llm = LLM(tiny_model, num_pages=64)
    sp = SamplingParams(max_tokens=4, **GREEDY)
    ref = llm.generate([[5, 6, 7], [8, 9, 10]], sp, use_tqdm=False)
    for one in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), np.array([5, 6, 7], np.int32),
                list(np.array([5, 6, 7]))):
        out = llm.generate(one, sp, use_tqdm=False)
        assert [(o.prompt_token_ids, o.token_ids) for o in out] == [([5, 6, 7], ref[0].token_ids)]
    for two in (np.array([[5, 6, 7], [8, 9, 10]]), torch.tensor([[5, 6, 7], [8, 9, 10]]),
                [np.array([5, 6, 7]), torch.tensor([8, 9, 10])]):
        out = llm.generate(two, sp, use_tqdm=False)
        assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert [t for _, new, _ in llm.stream(torch.tensor([5, 6, 7]), sp) for t in new] == \
        ref[0].token_ids
    for bad, message in ((np.array([1.0, 2.0]), "integer token ids, got dtype float64"),
                         (torch.ones(1, 2, 3, dtype=torch.long), r"1-D .* or 2-D .*shape"),
                         (np.array(5), r"got shape \(\)"),
                         # an empty one is one empty prompt, not no prompt at all ([] back)
                         (np.array([], dtype=np.int64), "prompt is empty"),
                         (torch.tensor([], dtype=torch.long), "prompt is empty")):
        with pytest.raises(ValueError, match=message):
            llm.generate(bad, sp, use_tqdm=False)
    assert empty(llm)


def test_a_dict_or_a_set_of_prompts_is_refused(llm):
    """A dict (which would iterate as its keys, a prompt per key), a set or a frozenset (no order to
    give the outputs in) is refused as prompts, naming its type."""
    for bad, kind in (({"w5 w6": 1}, "dict"), ({"w5 w6", "w7"}, "set"),
                      (frozenset({"w5"}), "frozenset")):
        with pytest.raises(ValueError, match=f"prompts must be a prompt or a list of prompts, "
                                             f"got a {kind}"):
            llm.generate(bad, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.requests and empty(llm)


def test_stop_token_ids_refuse_bytes():
    """b"\\n " iterated as the ids (10, 32): a string's bytes are not its tokens."""
    for bad in (b"\n ", bytearray(b"\n")):
        with pytest.raises(ValueError, match="stop_token_ids must be a list of token ids"):
            SamplingParams(stop_token_ids=bad)
    assert SamplingParams(stop_token_ids=[10, 32]).stop_token_ids == (10, 32)


# ------------------------------------------------------------------------------ chat
def test_chat_of_no_conversation_is_refused(llm):
    """chat([]) returned [] silently; a dict (one message, not in a list) raised KeyError."""
    for bad in ([], (), {"role": "user", "content": "w5"}, None):
        with pytest.raises(ValueError, match="chat.. takes a conversation"):
            llm.chat(bad, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.requests and empty(llm)


def test_a_chat_template_error_is_a_value_error(llm):
    """As the server says it: jinja's UndefinedError, a TypeError from the template, or the
    template's own raise_exception becomes a ValueError saying the chat template cannot be applied,
    and nothing is queued."""
    saved = llm.tokenizer.chat_template
    templates = {"{{ messages[0]['content'].upper() }}": [{"role": "user", "content": 5}],
                 "{{ messages[0]['content'] + 1 }}": HI,
                 "{{ raise_exception('no system role, please') }}": HI}
    try:
        for template, messages in templates.items():
            llm.tokenizer.chat_template = template
            with pytest.raises(ValueError, match="cannot apply the chat template: "):
                llm.chat(messages, use_tqdm=False)
            with pytest.raises(ValueError, match="cannot apply the chat template: "):
                llm.apply_chat_template(messages)
    finally:
        llm.tokenizer.chat_template = saved
    assert not llm.engine.requests and empty(llm)
    llm.tokenizer.chat_template = None  # the fixture's tokenizer is shared: restored below
    try:
        with pytest.raises(ValueError, match="this checkpoint has no chat template"):
            llm.apply_chat_template(HI)
    finally:
        llm.tokenizer.chat_template = saved


def test_text_without_stop_strings_is_read_in_one_decode_per_call(llm):
    """A matcher without stop strings (every stream's) reads a step's tokens in one decode,
    however many: one per token would copy the output so far for each (quadratic on a long
    output read late). With stop strings it reads them one at a time, without copies."""
    from minicb.llm import StopMatcher
    ids = llm.generate("w5 w6 w7", SamplingParams(max_tokens=40, **GREEDY),
                       use_tqdm=False)[0].token_ids
    for stop, calls in (((), 1), (("nowhere",), 40)):
        m = StopMatcher(llm.tokenizer, stop)
        seen = []
        original = m.decoder.step
        m.decoder.step = lambda token_ids, final=False, upto=None, seen=seen, original=original: (
            seen.append((token_ids is ids, upto)), original(token_ids, final, upto))[1]
        assert not m.step(ids, final=True)
        assert len(seen) == calls and all(same for same, _ in seen)  # never a sliced copy
        assert m.text == llm.tokenizer.decode(ids, skip_special_tokens=True)


GREEDY6 = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class FakeBar:
    """Stands in for tqdm.auto.tqdm: records what generate does with its bar."""
    made: list[FakeBar] = []

    def __init__(self, total, disable=False, **_):
        self.total, self.n, self.closed = total, 0, False
        if not disable:  # use_tqdm=False: a bar that shows nothing
            FakeBar.made.append(self)

    def update(self, n):
        self.n += n

    def close(self):
        self.closed = True


@pytest.fixture
def bars(monkeypatch) -> list[FakeBar]:
    FakeBar.made = []
    monkeypatch.setattr("tqdm.auto.tqdm", FakeBar)  # generate imports it when it runs
    return FakeBar.made


def test_generate_and_stream_of_no_prompts_return_nothing(llm):
    """generate([]) returns [] and stream([]) yields nothing."""
    assert llm.generate([], GREEDY6, use_tqdm=False) == []
    assert list(llm.stream([], GREEDY6)) == []


def test_a_bad_prompt_is_named_by_its_index(llm):
    """A refused prompt is named by its 0-based index in the batch."""
    with pytest.raises(ValueError, match=r"^prompt 1: prompt is empty"):
        llm.generate([[1, 2], []], GREEDY6, use_tqdm=False)
    assert empty(llm) and not llm.engine.requests


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_generate_cancels_every_prompt_and_closes_its_bar(llm, bars, monkeypatch,
                                                                         error):
    """An interrupted generate (Ctrl-C included) cancels every prompt it queued and closes its
    progress bar."""
    real_step, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:  # both prompts are running by now
            raise error("stop")
        return real_step()
    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(error):
        llm.generate([[1, 2, 3], [4, 5]], GREEDY6)
    assert empty(llm)
    assert [(b.total, b.closed) for b in bars] == [(2, True)]


def test_generate_counts_each_finished_prompt_once_and_closes_its_bar(llm, bars):
    """generate's progress bar counts each finished prompt once and is closed after the run."""
    llm.generate([[1, 2, 3], [4, 5]], GREEDY6)
    assert [(b.total, b.n, b.closed) for b in bars] == [(2, 2, True)]


def test_stream_ignores_requests_it_did_not_add(llm):
    """A stream yields only its own requests, whatever else the engine runs."""
    other = llm.engine.add_request([7, 8, 9], GREEDY6)
    got: dict[str, list[int]] = {}
    for rid, new, _ in llm.stream([[1, 2, 3]], GREEDY6):
        got.setdefault(rid, []).extend(new)
    assert other not in got and [len(v) for v in got.values()] == [6]


def test_stream_sends_every_token_once_when_a_step_adds_several():
    """A stream sends every token once when a step adds several (kept guesses, chapter 08)."""
    llm = LLM.__new__(LLM)  # an LLM over the simulated engine (LLM() loads a real model)
    llm.engine = make_sim_engine(policy="pd", num_speculative_tokens=3, check_invariants=True)
    llm.tokenizer, llm._stops = llm.engine.tokenizer, {}
    news = [new for _, new, _ in llm.stream([[SIM_TOKEN] * 8], GREEDY6)]
    assert any(len(new) > 1 for new in news), "no step added several tokens"
    assert [t for new in news for t in new] == [SIM_TOKEN] * 6


def test_is_conversation_needs_a_non_empty_list_or_tuple_of_messages():
    """A conversation is a non-empty list or tuple of messages."""
    assert not is_conversation([]) and not is_conversation(())
    assert is_conversation(tuple(HI)) and is_conversation(HI)


def test_chat_checks_every_conversation_before_queuing_any(word_model):
    """chat checks every conversation before queuing any."""
    llm = LLM(word_model, num_pages=64)
    with pytest.raises(ValueError, match=r"a conversation must be a non-empty list.*got \[\]"):
        llm.chat([HI, []], GREEDY6, use_tqdm=False)
    assert not llm.engine.requests


def test_chat_without_a_template_says_so_and_passes_use_tqdm_on(word_model, bars):
    """chat on a checkpoint without a chat template says so; chat passes use_tqdm on to generate."""
    llm = LLM(word_model, num_pages=64)
    assert len(llm.chat(HI, GREEDY6, use_tqdm=False)[0].token_ids) == 6 and bars == []
    saved, llm.tokenizer.chat_template = llm.tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match="this checkpoint has no chat template"):
            llm.chat(HI, GREEDY6, use_tqdm=False)
    finally:
        llm.tokenizer.chat_template = saved


class WordTokenizer:
    """Token i is the word "w<i>", words joined by spaces (a window's first word has none)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


class CleanupTokenizer:
    """Pieces joined, then spaces before punctuation cleaned up as transformers'
    clean_up_tokenization does: a window's decode can rewrite the end of the one before it."""
    pieces = [" '", " ", "."]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids).replace(" .", ".").replace(" ' ", "'")


def test_a_read_with_no_new_tokens_keeps_the_window():
    """A read with no new tokens leaves the decoder's window where it was: the next token keeps its
    leading space."""
    dec = IncrementalDecoder(WordTokenizer())
    assert dec.step([3]) == "w3"
    assert dec.step([3]) == ""
    assert dec.step([3, 4]) == " w4" and dec.text == "w3 w4"


def test_a_window_that_rewrites_its_prefix_adds_only_what_is_new():
    """Where a window's decode rewrites its prefix, the text added is exactly what is new."""
    tok = CleanupTokenizer()
    dec = IncrementalDecoder(tok)
    # " ." cleans up to ".": the space already sent stays, nothing is sent twice
    assert [dec.step([1]), dec.step([1, 2])] == [" ", ""]
    assert dec.text == " "
    dec = IncrementalDecoder(tok)
    ids = [0, 1, 2]
    text = "".join(dec.step(ids[:i]) for i in range(1, 4))
    assert text == tok.decode(ids) == " '."


def test_a_stream_of_two_prompts_sends_both_requests_tokens_another_consumer_produced(llm):
    """A stream of several prompts sends, at its end, every request's tokens produced while
    another stream was being read: here both requests finish in the other stream's steps."""
    short = SamplingParams(max_tokens=3, **GREEDY)
    both = llm.stream([[5, 6], [7, 8]], short)
    other = llm.stream([[9, 10]], SamplingParams(max_tokens=12, **GREEDY))
    got = [next(both), next(both)]  # the first step's token of each
    assert got[0][0] != got[1][0]
    list(other)
    got += list(both)
    per_request: dict[str, list[int]] = {}
    for rid, new, _ in got:
        per_request.setdefault(rid, []).extend(new)
    ref = llm.generate([[5, 6], [7, 8]], short, use_tqdm=False)
    assert list(per_request.values()) == [o.token_ids for o in ref]


def test_bytes_are_neither_a_prompt_nor_params(llm):
    """Bytes are refused as prompts (not read as a list of ids) and as params (not one
    SamplingParams per byte), with a message naming what was given; nothing is left queued."""
    greedy = SamplingParams(max_tokens=12, **GREEDY)
    for call, message in ((lambda: llm.generate(b"\x05\x06", greedy), "prompts must be"),
                          (lambda: llm.generate([[1]], b"x"), "params must be a "
                                                                  "SamplingParams .*, got b'x'")):
        with pytest.raises(ValueError, match=message):
            call()
        assert not llm.engine.requests


def test_an_output_says_whether_it_finished_in_vllms_name(llm):
    """`RequestOutput.finished`, vLLM's name, is true when the output has a finish reason (every
    output `generate` returns) and false without one."""
    import dataclasses

    out = llm.generate("w5 w6", SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    assert out.finished and out.finish_reason == "length"
    assert not dataclasses.replace(out, finish_reason=None).finished
