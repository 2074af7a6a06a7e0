"""The official `openai` Python client against `minicb serve` (chapter 08): every call a user of
OpenAI's API would make works, or is refused the way OpenAI refuses it.

The server runs the tiny Llama with a word-level tokenizer ("w3 w17 ...") and a chat template,
on loopback; answers are compared with `LLM.generate` on the same model."""

from __future__ import annotations

import httpx
import openai
import pytest

from minicb import LLM, Engine, SamplingParams
from minicb.serving.server import ServerThread, create_app

PROMPT = " ".join(f"w{i}" for i in range(10, 50))  # 40 tokens: two full pages of 16


@pytest.fixture(scope="module")
def server(word_model):
    """A running server and an OpenAI client for it, with the API key "secret"."""
    engine = Engine(word_model, policy="pd", num_pages=128, check_invariants=True)
    app = create_app(engine, "tiny", api_key="secret")
    with ServerThread(app) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0,
                           timeout=30) as client:
            yield client, url, app.state.worker


def greedy_text(word_model, prompt: str, max_tokens: int) -> str:
    llm = LLM(word_model, policy="continuous", num_pages=64)
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True), use_tqdm=False)[0]
    return out.text


def test_completions_and_chat_answer_as_llm_generate(server, word_model):
    """A completion is LLM.generate's text; a chat applies the template and answers too."""
    client, _, _ = server
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == greedy_text(word_model, PROMPT, 5)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "w5"},
                                                              {"type": "text", "text": "w6"}]}],
        max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 3 and chat.choices[0].message.content


def test_a_stream_delivers_every_token_then_the_usage(server, word_model):
    """Streamed, the pieces add up to the whole answer; the last chunk carries the usage."""
    client, _, _ = server
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy_text(word_model, PROMPT, 6)
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w7 w8"}], max_completion_tokens=4,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas)


def test_n_choices_share_the_prompts_pages(server):
    """n=2 gives two choices (equal under greedy sampling); the second reuses the first's
    full prompt pages through the prefix cache, which /metrics counts."""
    client, url, worker = server
    before = worker.stats.value("prefix_cache_hits")
    prompt = " ".join(f"w{i}" for i in range(100, 140))  # not sent before: no cached pages
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                    n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text
    assert out.usage.completion_tokens == 8
    assert worker.stats.value("prefix_cache_hits") - before == 32  # two pages of 16


def test_logprobs_in_both_formats(server):
    """Completions: a logprob per token and the top ones; chat: the same in chat's shape."""
    client, _, _ = server
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text.replace(" ", "") or lp.text_offset[0] == 0
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w5"}], max_completion_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_a_penalty_changes_the_text(server):
    """A strong frequency penalty keeps greedy decoding from repeating itself."""
    client, _, _ = server
    args = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**args).choices[0].text
    penalised = client.completions.create(**args, frequency_penalty=2.0).choices[0].text
    assert plain != penalised
    assert len(set(penalised.split())) >= len(set(plain.split()))


@pytest.mark.parametrize("field, value", [("logit_bias", {"5": 10}),
                                          ("response_format", {"type": "json_object"}),
                                          ("tools", [{"type": "function",
                                                      "function": {"name": "f"}}])])
def test_an_unimplemented_field_is_refused_by_name(server, field, value):
    """OpenAI's fields minicb does not implement get a 400 naming them, never a silent 200."""
    client, _, _ = server
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}],
                                       max_completion_tokens=2, **{field: value})
    assert caught.value.body["param"] == field


def test_models_list_and_retrieve(server):
    """`models.retrieve` finds the served model; another name is a 404."""
    client, _, _ = server
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_the_api_key_is_required(server):
    """With --api-key, a wrong key is a 401 in OpenAI's error shape; /health stays open."""
    _, url, _ = server
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as other:
        with pytest.raises(openai.AuthenticationError) as caught:
            other.models.list()
    assert caught.value.body["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").json() == {"status": "ok"}
