"""`LLM`, the vLLM-style façade (chapter 00): build an engine, feed it prompts, collect outputs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from minicb.config import EngineConfig
from minicb.engine import Engine
from minicb.request import RequestOutput, SamplingParams

Prompt = str | list[int]


def is_conversation(messages: object) -> bool:
    """A non-empty list of chat messages, each a dict with a `role` and a `content`: what a
    chat template needs (LLM.chat and the server's /v1/chat/completions check the same)."""
    return isinstance(messages, (list, tuple)) and bool(messages) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages)


class LLM:
    """`LLM(model, **engine_config)`; the engine stays reachable as `llm.engine`."""

    def __init__(self, model="smollm2-135m", config: EngineConfig | None = None,
                 **options) -> None:
        self.engine = Engine(model, config, **options)
        self.tokenizer = self.engine.tokenizer

    def _add_all(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, dict):
            raise ValueError("params must be a SamplingParams (or one per prompt), got a dict: "
                             "write SamplingParams(**{...})")
        param_list = [params] * len(prompts) if isinstance(params, SamplingParams) \
            else list(params)
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
        return [self.engine.add_request(token_ids, p)
                for token_ids, p in zip(token_lists, param_list)]

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order."""
        ids = self._add_all(prompts, params)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        done: set[str] = set()
        try:
            while any(not self.engine.requests[rid].is_finished for rid in ids):
                record = self.engine.step()
                if bar is not None:
                    new = [rid for rid in record.finished if rid in ids and rid not in done]
                    done.update(new)
                    bar.update(len(new))
        except BaseException:  # a stalled policy, Ctrl-C: leave nothing queued or allocated
            for rid in ids:
                self.engine.cancel(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self.engine.output(rid) for rid in ids]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[tuple[str, list[int], str]]:
        """Yield `(request_id, new_token_ids, text_delta)` as each step produces tokens."""
        ids = self._add_all(prompts, params)
        sent_tokens = {rid: 0 for rid in ids}
        sent_text = {rid: "" for rid in ids}
        try:
            while any(not self.engine.requests[rid].is_finished for rid in ids):
                record = self.engine.step()
                for rid in record.sampled:
                    if rid not in sent_tokens:
                        continue
                    req = self.engine.requests[rid]
                    new = req.output_token_ids[sent_tokens[rid]:]
                    sent_tokens[rid] = len(req.output_token_ids)
                    delta = ""
                    if self.tokenizer is not None:
                        text = self.tokenizer.decode(req.output_token_ids,
                                                     skip_special_tokens=True)
                        if not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
                            delta = text[len(sent_text[rid]):]
                            sent_text[rid] = text
                    yield rid, new, delta
        finally:  # a consumer that stops early cancels what it no longer reads
            for rid in ids:
                self.engine.cancel(rid)

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (or a list of them)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this checkpoint has no chat template; use generate() with a prompt")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        for conversation in conversations:
            if not is_conversation(conversation):
                raise ValueError(f"a conversation must be a non-empty list of {{'role': ..., "
                                 f"'content': ...}} messages, got {conversation!r}")
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
