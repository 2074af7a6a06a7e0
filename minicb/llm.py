"""`LLM`, the vLLM-style façade (chapter 00): build an engine, feed it prompts, collect outputs."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence, Set
from typing import Any

from minicb.config import EngineConfig, is_int
from minicb.engine import Engine
from minicb.request import RequestOutput, SamplingParams

Prompt = str | list[int]


def _is_array(value: object) -> bool:  # a numpy array or a torch tensor
    return hasattr(value, "ndim") and hasattr(value, "tolist")


def array_token_ids(array: Any) -> list:
    """A numpy array or torch tensor of token ids as lists: 1-D one prompt, 2-D one a row."""
    if array.ndim not in (1, 2):
        raise ValueError(f"a prompt array must be 1-D (one prompt's token ids) or 2-D (one "
                         f"prompt a row), got shape {tuple(array.shape)}")
    if not all(is_int(t) for t in array.reshape(-1).tolist()):
        raise ValueError(f"a prompt array must hold integer token ids, got dtype {array.dtype}")
    return array.tolist()


def prompt_list(prompts: object) -> list:
    """`LLM.generate`'s prompts as a list: one prompt, a list of prompts or an array."""
    if _is_array(prompts):  # 1-D: one prompt, an empty one too (refused as such)
        return [array_token_ids(prompts)] if prompts.ndim == 1 else array_token_ids(prompts)
    if isinstance(prompts, (list, tuple)) and prompts and all(
            _is_array(t) and t.ndim == 0 for t in prompts):
        prompts = [t.tolist() for t in prompts]  # list(np.array([1, 2])): numpy's scalars
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and isinstance(prompts[0], int)):
        return [prompts]  # one prompt, as text or as token ids
    if isinstance(prompts, (Mapping, Set)):  # a dict's keys or a set's order: not what was meant
        raise ValueError(f"prompts must be a prompt or a list of prompts, got a "
                         f"{type(prompts).__name__} ({prompts!r:.60}): pass a list")
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise ValueError(f"prompts must be a prompt (a string or a list of token ids) or a "
                         f"list of prompts, got {prompts!r:.80}")
    return [array_token_ids(p) if _is_array(p) else p for p in prompts]


def is_conversation(messages: object) -> bool:
    """A non-empty list of chat messages, each a dict with a `role` and a `content`."""
    return isinstance(messages, (list, tuple)) and bool(messages) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages)


def render_chat(tokenizer: Any, messages: list[dict]) -> str:
    """The prompt text a chat template makes of `messages`, the assistant's turn opened."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class IncrementalDecoder:
    """One request's output text, decoded as its tokens arrive (vLLM's incremental detokenizer)."""
    # from a short window of recent tokens: O(n) in all, not O(n^2); a character split across
    # tokens is held back until it completes or the request ends

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""  # decoded so far
        # special tokens decode to nothing; a window starting on one would strip the next
        # word's leading space, so the window never holds them
        self.special = set(getattr(tokenizer, "all_special_ids", ())) | {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if getattr(t, "special", False)}
        self.ids: list[int] = []  # the output's tokens that are text, special ones dropped
        self.num_seen = 0  # of the output's tokens, those already sorted into `ids`
        # the window starts at `prefix_offset`, `text` covers `ids` up to `read_offset`: both
        # where the text ended with a whole character
        self.prefix_offset = self.read_offset = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def step(self, token_ids: list[int], final: bool = False, upto: int | None = None) -> str:
        """Read the output so far (or its first `upto`); returns the text it adds."""
        end = len(token_ids) if upto is None else upto
        self.ids += [t for t in token_ids[self.num_seen:end] if t not in self.special]
        self.num_seen = max(self.num_seen, end)
        if self.read_offset >= len(self.ids) and not final:
            return ""
        # the window starts before the new tokens: a token decoded differently at the start
        # (a stripped leading space) is so in both decodes
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if window.endswith("\ufffd") and not final:
            return ""  # wait for the rest of the character
        if window.startswith(prefix):
            delta = window[len(prefix):]
        else:  # a window decode that rewrites its prefix (cleaned-up spaces): decode it all
            delta = self._decode(self.ids)[len(self.text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


class StopMatcher:
    """One request's output text cut before the first of its stop strings (vLLM's `stop`)."""
    # looked for one token at a time as the text grows; none counts before `min_tokens`

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        # characters at the end that might still grow into a stop string: not final yet
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # decoded so far, cut before a stop string once one is found
        self.num_tokens = 0  # output tokens read: once stopped, up to the one that completed it
        self.stopped = False

    def step(self, token_ids: list[int], final: bool = False) -> bool:
        """Read the output so far; True once a stop string has ended it."""
        while self.stop and not self.stopped and self.num_tokens < len(token_ids) - 1:
            self.num_tokens += 1
            self._read(token_ids, self.num_tokens, final=False)
        if not self.stopped:  # the last token; or none new, when the end flushes a character
            self.num_tokens = len(token_ids)
            self._read(token_ids, self.num_tokens, final)
        return self.stopped

    def _read(self, token_ids: list[int], upto: int, final: bool) -> None:
        """Read the first `upto` tokens (one more than before) and look for a stop string."""
        searched = len(self.decoder.text)  # stop strings were looked for up to here
        self.decoder.step(token_ids, final=final, upto=upto)
        self.text = self.decoder.text
        if self.stop and upto >= self.min_tokens:
            # a match must end in the new text: one in the text before min_tokens counts not
            hits = [i for i in (self.text.find(s, max(0, searched - len(s) + 1))
                                for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True

    def ready(self, final: bool = False) -> int:
        """Characters of `text` that will not change: all but those that may begin a stop string."""
        return len(self.text) if final or self.stopped else len(self.text) - self.hold


class LLM:
    """`LLM(model, **engine_config)`; the engine stays reachable as `llm.engine`."""

    def __init__(self, model="smollm2-135m", config: EngineConfig | None = None, **options) -> None:
        self.engine = Engine(model, config, **options)
        self.tokenizer = self.engine.tokenizer
        # the stop strings of every request a generate or stream call still reads: any call's
        # step checks them all (two streams read in turn step each other's requests)
        self._stops: dict[str, StopMatcher] = {}

    def _add_all(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        prompts = prompt_list(prompts)
        params = SamplingParams() if params is None else params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif isinstance(params, (dict, str, bytes)) or not hasattr(params, "__iter__"):
            got = "a dict: write SamplingParams(**{...})" if isinstance(params, dict) else \
                f"{params!r:.80}"
            raise ValueError(f"params must be a SamplingParams (or one per prompt), got {got}")
        param_list = list(params)
        if len(param_list) != len(prompts):
            raise ValueError(f"params has {len(param_list)} entries for {len(prompts)} prompts; "
                             "give one SamplingParams or one per prompt")
        # check everything before queuing anything, so bad input leaves nothing behind
        token_lists = []
        for i, (prompt, p) in enumerate(zip(prompts, param_list)):
            try:
                token_lists.append(self.engine.check_request(prompt, p))
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
            if p.stop and self.tokenizer is None:
                raise ValueError(f"prompt {i}: stop strings need a tokenizer, and this checkpoint "
                                 f"has none: use stop_token_ids")
        ids = [self.engine.add_request(t, p) for t, p in zip(token_lists, param_list)]
        self._stops.update((rid, StopMatcher(self.tokenizer, p.stop, p.min_tokens))
                           for rid, p in zip(ids, param_list) if p.stop)
        return ids

    def _step(self) -> Any:
        record = self.engine.step()
        self._match_stops(record.sampled + record.finished)
        return record

    def _match_stops(self, rids: list[str]) -> None:
        for rid in rids:
            m = self._stops.get(rid)
            if m is not None and not m.stopped:
                req = self.engine.requests[rid]
                if m.step(req.output_token_ids, final=req.is_finished):
                    self.engine.stop_at(rid, m.num_tokens)

    def _num_unfinished(self, ids: list[str]) -> int:
        return sum(not self.engine.requests[rid].is_finished for rid in ids)

    def _close(self, ids: list[str]) -> None:
        """Cancel what is left of `ids` (a stalled policy, Ctrl-C, a consumer gone)."""
        for rid in ids:
            self.engine.cancel(rid)
            self._stops.pop(rid, None)

    def _output(self, rid: str) -> RequestOutput:
        self._match_stops([rid])  # in case its last tokens came in a step nobody checked
        out = self.engine.output(rid)
        m = self._stops.get(rid)
        if m is not None and m.stopped:
            out.text = m.text
        return out

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order."""
        from tqdm.auto import tqdm
        ids = self._add_all(prompts, params)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while self._num_unfinished(ids):
                self._step()
                bar.update(len(ids) - self._num_unfinished(ids) - bar.n)
            return [self._output(rid) for rid in ids]
        finally:
            self._close(ids)
            bar.close()

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[tuple[str, list[int], str]]:
        """Yield `(request_id, new_token_ids, text_delta)` as steps produce tokens."""
        ids = self._add_all(prompts, params)
        sent_tokens, sent_text = dict.fromkeys(ids, 0), dict.fromkeys(ids, 0)
        # its text comes through a StopMatcher: the request's own if it has stop strings
        texts = {} if self.tokenizer is None else {
            rid: self._stops.get(rid) or StopMatcher(self.tokenizer) for rid in ids}

        def news(rid: str) -> tuple[str, list[int], str] | None:  # None: nothing not yielded
            req = self.engine.requests[rid]
            delta, m = "", texts.get(rid)
            if m is not None:
                if rid in self._stops:
                    self._match_stops([rid])  # first: a stop string drops the tokens after it
                else:
                    m.step(req.output_token_ids, final=req.is_finished)
                end = max(sent_text[rid], m.ready(final=req.is_finished))
                delta, sent_text[rid] = m.text[sent_text[rid]:end], end
            new = req.output_token_ids[sent_tokens[rid]:]
            sent_tokens[rid] = len(req.output_token_ids)
            return (rid, new, delta) if new or delta else None

        try:
            while self._num_unfinished(ids):
                record = self._step()
                for rid in dict.fromkeys(record.sampled + record.finished):
                    if rid in sent_tokens and (item := news(rid)) is not None:
                        yield item
            # steps another consumer ran (a second stream read in turn, a generate call) may
            # have given these requests tokens, or finished them: those tokens still go out
            for rid in ids:
                if (item := news(rid)) is not None:
                    yield item
        finally:
            self._close(ids)

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (or a list of them)."""
        if isinstance(messages, str):  # llm.chat("hi"): the string, not its first letter
            raise ValueError(f"chat() takes messages, got the string {messages!r}: pass "
                             f"[{{'role': 'user', 'content': {messages!r}}}] or call generate()")
        if not isinstance(messages, (list, tuple)) or not messages:  # [] would return []
            raise ValueError(f"chat() takes a conversation (a non-empty list of {{'role': ..., "
                             f"'content': ...}} messages) or a list of them, got {messages!r:.80}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        for conversation in conversations:
            if not is_conversation(conversation):
                raise ValueError(f"a conversation must be a non-empty list of {{'role': ..., "
                                 f"'content': ...}} messages, got {conversation!r}")
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """The prompt token ids the chat template makes of one conversation, else ValueError."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this checkpoint has no chat template; use generate() with a prompt")
        try:
            text = render_chat(self.tokenizer, messages)
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
            raise ValueError(f"cannot apply the chat template: {exc}") from None
        return self.engine.tokenize(text, add_special_tokens=False)  # the template wrote them
