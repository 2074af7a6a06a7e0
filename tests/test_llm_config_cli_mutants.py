"""Planted-bug tests from a mutation review of minicb/llm.py (the `LLM` API: generate, stream,
chat, the incremental detokenizer), minicb/config.py (EngineConfig, its validation, devices,
$MINICB_CACHE) and minicb/__main__.py (the `python -m minicb` dispatch and demo): each test fails
on the bug its docstring names and passes on the real code.

LLM tests run on the tiny Llama (no tokenizer) or on test_serve's word-level tokenizer where text
matters; the detokenizer's are fed small fake tokenizers whose decode is written out, so each
case is exact."""

from __future__ import annotations

import dataclasses
import io

import pytest

import minicb
import minicb.config
from minicb import LLM, EngineConfig, SamplingParams
from minicb.__main__ import DEMO_QUESTIONS, main
from minicb.benchmark.sim import SIM_TOKEN, make_sim_engine
from minicb.config import cache_root, cpuinfo, resolve_device
from minicb.llm import IncrementalDecoder, is_conversation

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
HI = [{"role": "user", "content": "w5 w6"}]


@pytest.fixture
def llm(tiny_model):
    return LLM(tiny_model, num_pages=64, check_invariants=True)


def empty(llm) -> bool:
    """Nothing queued, running or allocated."""
    return not llm.engine.has_unfinished() and llm.engine.pool.num_used == 0


class FakeBar:
    """Stands in for tqdm.auto.tqdm: records what generate does with its bar."""
    made: list[FakeBar] = []

    def __init__(self, total, **_):
        self.total, self.n, self.closed = total, 0, False
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


# ------------------------------------------------------------------------------ LLM
def test_generate_and_stream_of_no_prompts_return_nothing(llm):
    """Planted: `_add_all` read `prompts[0]` of an empty list (the `and prompts` dropped), so
    generate([]) raised IndexError instead of returning []."""
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    assert list(llm.stream([], GREEDY)) == []


def test_a_bad_prompt_is_named_by_its_index(llm):
    """Planted: the refusal named prompt i + 1 (one-based) where every other index is 0-based."""
    with pytest.raises(ValueError, match=r"^prompt 1: prompt is empty"):
        llm.generate([[1, 2], []], GREEDY, use_tqdm=False)
    assert empty(llm) and not llm.engine.requests


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_generate_cancels_every_prompt_and_closes_its_bar(llm, bars, monkeypatch,
                                                                         error):
    """Planted: generate caught Exception, not BaseException (Ctrl-C left its requests running
    and their pages held); it cancelled only the first prompt; its `finally` did not close the
    progress bar."""
    real_step, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:  # both prompts are running by now
            raise error("stop")
        return real_step()
    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(error):
        llm.generate([[1, 2, 3], [4, 5]], GREEDY)
    assert empty(llm)
    assert [(b.total, b.closed) for b in bars] == [(2, True)]


def test_generate_counts_each_finished_prompt_once_and_closes_its_bar(llm, bars):
    """Planted: the bar was never closed after a normal run."""
    llm.generate([[1, 2, 3], [4, 5]], GREEDY)
    assert [(b.total, b.n, b.closed) for b in bars] == [(2, 2, True)]


def test_stream_ignores_requests_it_did_not_add(llm):
    """Planted: stream skipped only requests unknown to the engine, not those it did not add, so
    a request queued beside it (llm.engine.add_request) raised KeyError in the stream."""
    other = llm.engine.add_request([7, 8, 9], GREEDY)
    got: dict[str, list[int]] = {}
    for rid, new, _ in llm.stream([[1, 2, 3]], GREEDY):
        got.setdefault(rid, []).extend(new)
    assert other not in got and [len(v) for v in got.values()] == [6]


def test_stream_sends_every_token_once_when_a_step_adds_several():
    """Planted: stream advanced its count of sent tokens by one per step (`+= 1`), or sent only
    the last token; with speculative decoding a step adds several, so tokens repeated or went
    missing. The simulated model answers SIM_TOKEN, so a prompt of them keeps every guess."""
    llm = LLM.__new__(LLM)  # an LLM over the simulated engine (LLM() loads a real model)
    llm.engine = make_sim_engine(policy="pd", num_speculative_tokens=3, check_invariants=True)
    llm.tokenizer, llm._stops = llm.engine.tokenizer, {}
    news = [new for _, new, _ in llm.stream([[SIM_TOKEN] * 8], GREEDY)]
    assert any(len(new) > 1 for new in news), "no step added several tokens"
    assert [t for new in news for t in new] == [SIM_TOKEN] * 6


def test_is_conversation_needs_a_non_empty_list_or_tuple_of_messages():
    """Planted: an empty list counted as a conversation (`bool(messages)` dropped); a tuple of
    messages did not (only `list` accepted)."""
    assert not is_conversation([]) and not is_conversation(())
    assert is_conversation(tuple(HI)) and is_conversation(HI)


def test_chat_checks_every_conversation_before_queuing_any(word_model):
    """Planted: chat checked only the first conversation, so a later empty one was templated
    and run; chat([]) indexed messages[0] (IndexError). It is now a ValueError (test_llm_api)."""
    llm = LLM(word_model, num_pages=64)
    with pytest.raises(ValueError, match=r"a conversation must be a non-empty list.*got \[\]"):
        llm.chat([HI, []], GREEDY, use_tqdm=False)
    assert not llm.engine.requests


def test_chat_without_a_template_says_so_and_passes_use_tqdm_on(word_model, bars):
    """Planted: the check for a tokenizer without a chat template was dropped (transformers'
    own error, not ours); chat did not pass `use_tqdm` on to generate (a bar always drew)."""
    llm = LLM(word_model, num_pages=64)
    assert len(llm.chat(HI, GREEDY, use_tqdm=False)[0].token_ids) == 6 and bars == []
    saved, llm.tokenizer.chat_template = llm.tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match="this checkpoint has no chat template"):
            llm.chat(HI, GREEDY, use_tqdm=False)
    finally:
        llm.tokenizer.chat_template = saved


# ------------------------------------------------------------------------------ IncrementalDecoder
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
    """Planted: `read_offset > len(token_ids)` for `>=`: a read with no new tokens moved the
    window's start up to the end, so the next token decoded without its leading space."""
    dec = IncrementalDecoder(WordTokenizer())
    assert dec.step([3]) == "w3"
    assert dec.step([3]) == ""
    assert dec.step([3, 4]) == " w4" and dec.text == "w3 w4"


def test_a_window_that_rewrites_its_prefix_adds_only_what_is_new():
    """Planted: where a window's decode rewrote its prefix, the delta was the whole window (text
    sent twice), or the window was sliced as if it had not (text lost)."""
    tok = CleanupTokenizer()
    dec = IncrementalDecoder(tok)
    # " ." cleans up to ".": the space already sent stays, nothing is sent twice
    assert [dec.step([1]), dec.step([1, 2])] == [" ", ""]
    assert dec.text == " "
    dec = IncrementalDecoder(tok)
    ids = [0, 1, 2]
    text = "".join(dec.step(ids[:i]) for i in range(1, 4))
    assert text == tok.decode(ids) == " '."


# ------------------------------------------------------------------------------ EngineConfig
def test_engine_config_defaults():
    """Planted: max_num_seqs 8 (not 16), trace_snapshots False, gpu_memory_utilization 0.5,
    prompt_lookup_max 3: defaults the README quotes (trace_snapshots: the step-through
    pictures need them)."""
    c = EngineConfig()
    assert (c.policy, c.page_size, c.max_num_seqs, c.max_num_batched_tokens, c.chunk_size,
            c.trace_snapshots, c.gpu_memory_utilization, c.prompt_lookup_max,
            c.prompt_lookup_min) == ("pd", 16, 16, 256, 256, True, 0.9, 4, 2)


@pytest.mark.parametrize("options", [
    dict(max_preemptions=0), dict(gpu_memory_utilization=1.0),
    dict(prompt_lookup_min=3, prompt_lookup_max=3), dict(batch_timeout=0)])
def test_engine_config_accepts_its_limits(options):
    """Planted: max_preemptions 0 refused (`< 1`), gpu_memory_utilization 1.0 refused (`< 1.0`),
    prompt_lookup_min == prompt_lookup_max refused (`>=`)."""
    EngineConfig(**options)


@pytest.mark.parametrize("options, message", [
    (dict(min_chunk=0), r"min_chunk must be a positive integer"),
    (dict(priority_aging_steps=4, preemption="deadline"), r"needs preemption='priority'"),
    (dict(batch_timeout_in_seconds=1), r"batch_timeout_in_seconds must be True or False"),
    (dict(num_speculative_tokens=True), r"num_speculative_tokens must be an integer"),
    (dict(prompt_lookup_min=0), r"^prompt_lookup_min must be a positive integer"),
    (dict(quantization="int8", device="cuda:0"), r"quantization='int8' is a CPU option"),
    (dict(device="meta"), r"minicb runs on those"),
    (dict(device=None), r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got None"),
])
def test_engine_config_refuses_with_the_field_named(options, message):
    """Planted: min_chunk left out of the positive-integer check; priority aging allowed with
    any preemption but "newest"; batch_timeout_in_seconds left out of the bool check;
    num_speculative_tokens=True taken as 1; prompt_lookup_min's error named prompt_lookup_max;
    int8 with "cuda:0" allowed (only "cuda" refused); only "mps" refused as a device type; a
    device torch.device() rejects with TypeError not turned into a ValueError."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_from_kwargs_names_the_unknown_and_the_known_options():
    """Planted: the message left out the known names; a name let through unchecked (TypeError
    from the dataclass instead)."""
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['seed'\]; known: "
                                         r"\[.*'max_num_seqs'.*\]"):
        EngineConfig.from_kwargs(seed=1)


def test_resolve_device_checks_a_named_device():
    """Planted: resolve_device returned a named device unchecked (load_model and bench then
    failed later, in torch)."""
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="minicb runs on those"):
        resolve_device("meta")


def test_an_empty_minicb_cache_is_the_default(monkeypatch, tmp_path):
    """Planted: `os.environ.get("MINICB_CACHE", default)`: MINICB_CACHE= (set, empty) made the
    cache the current directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MINICB_CACHE", "")
    assert cache_root() == tmp_path / ".cache" / "minicb"
    monkeypatch.setenv("MINICB_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"


def test_cpuinfo_takes_any_name_and_the_whole_value(monkeypatch):
    """Planted: only the first name was looked for (ARM's "Features" missed where x86 has
    "flags"); the value was cut at a second colon."""
    lines = "processor\t: 0\nFeatures\t: fp asimd\nmodel name\t: Chip: rev 2\n"
    monkeypatch.setattr(minicb.config, "open", lambda _: io.StringIO(lines), raising=False)
    assert cpuinfo("flags", "Features") == "fp asimd"
    assert cpuinfo("model name") == "Chip: rev 2"


# ------------------------------------------------------------------------------ python -m minicb
@pytest.mark.parametrize("word", ["help", "-h", "--help"])
def test_every_help_word_prints_usage_to_stdout_without_an_error(word, capsys):
    """Planted: `help` left out of the help words (usage on stderr, exit 2); "unknown command
    '--help'" printed above the usage."""
    assert main([word]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m minicb {demo,") and "unknown command" not in out


def test_main_reads_sys_argv_without_the_program_name(monkeypatch, capsys):
    """Planted: main() read sys.argv whole, so the program's path was taken as the command."""
    monkeypatch.setattr("sys.argv", ["minicb", "--help"])
    assert main() == 0 and "usage:" in capsys.readouterr().out


def test_demo_defaults_greedy_pd_and_no_progress_bar(word_model, monkeypatch, capsys):
    """Planted: demo's --max-tokens default 64 (not 48), temperature left at its default (not
    greedy), --policy default "continuous", chat called without use_tqdm=False (a bar over the
    answers), answers printed unstripped. Runs the whole demo on the tiny Llama with a
    word-level chat template; its answers padded with the spaces and newlines a real model
    starts and ends them with."""
    made: list[LLM] = []

    def tiny_llm(model, **options):
        llm = LLM(word_model, **options)
        chat = llm.chat
        llm.chat = lambda *a, **kw: [dataclasses.replace(o, text=f"\n {o.text} \n")
                                     for o in chat(*a, **kw)]
        made.append(llm)
        return llm
    monkeypatch.setattr(minicb, "LLM", tiny_llm)
    assert main(["demo"]) == 0
    out, err = capsys.readouterr()
    assert "generate" not in err  # tqdm's bar
    engine = made[0].engine
    assert engine.config.policy == "pd"
    assert {(r.params.max_tokens, r.params.temperature) for r in engine.requests.values()} == \
        {(48, 0.0)}
    assert out.count(">>> ") == 4
    assert all(f"{q}\nw" in out for q in DEMO_QUESTIONS)  # the answer's first word, stripped
