"""The OpenAI request schema the server accepts (chapter 08): one pydantic model per endpoint,
so FastAPI validates every body and `/openapi.json` documents every field.

Three kinds of field:
- OpenAI's fields that minicb implements, with OpenAI's bounds;
- vLLM's extra sampling fields that minicb implements (`top_k`, `min_tokens`, `ignore_eos`,
  `stop_token_ids`, `priority`, `repetition_penalty`, `return_token_ids`) and minicb's own
  `deadline`, accepted by name as vLLM accepts them;
- OpenAI's fields that minicb does not implement (`logit_bias`, `tools`, `response_format`, ...):
  listed, and refused with a 400 naming the field unless left at a value that changes nothing.

A field no one defines is refused with a 400 naming it, as OpenAI does (vLLM would ignore it with
a warning): a misspelt `temprature` must not quietly sample at the default."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
)

from minicb.request import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS

MAX_N = 16  # choices per request: each is a sequence in the engine


def _utf8(text: str) -> str:
    """A JSON string may hold a lone surrogate (`"\\ud800"`), which is no text: no tokenizer
    can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text: a lone surrogate at character "
                         f"{exc.start}") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_utf8)]
TokenId = Annotated[StrictInt, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = Field(
        None, description="a last chunk with the usage, before [DONE]")


class TextPart(BaseModel):
    """One part of a chat message's content (OpenAI's list form): text only."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: StrictStr | None = None

    def as_template_input(self) -> dict[str, str]:
        """The {role, content} a chat template reads; text parts joined by newlines (vLLM)."""
        content = self.content if isinstance(self.content, str) else \
            "\n".join(part.text for part in self.content)
        return {"role": self.role, "content": content}


# OpenAI's fields that minicb does not implement -> the values that ask for nothing (accepted)
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
}
REFUSED = Field(None, description="not implemented by minicb: any value that asks for "
                                  "something is refused (400)")


class Sampling(BaseModel):
    """The fields both endpoints share: sampling, stopping, streaming, scheduling."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: StrictStr | None = Field(None, description="the served name (default: the only one)")
    n: int = Field(1, ge=1, le=MAX_N, description="choices to generate; they share the "
                   "prompt's KV pages through the prefix cache")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, description="default 1; 0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    stop: Text | list[Text] | list[TokenId] | None = Field(
        None, description="stop strings (not in the output), or token ids")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-2**63, lt=2**64)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: StrictStr | None = Field(None, description="the tenant, for --preemption fair")
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, description="vLLM: keep the k likeliest (0, -1: off)")
    min_tokens: int = Field(0, ge=0, description="vLLM: no stop before this many tokens")
    ignore_eos: StrictBool | None = Field(False, description="vLLM: run to max_tokens")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                                 description="vLLM: token ids that end it")
    priority: int = Field(0, description="vLLM: smaller is served first (--preemption "
                          "priority)")
    repetition_penalty: float | None = Field(None, gt=0, description="vLLM: > 1 discourages "
                                             "tokens already in the prompt or output")
    return_token_ids: StrictBool | None = Field(None, description="vLLM: minicb always "
                                                "returns each choice's token_ids")
    # minicb's own
    deadline: float | None = Field(None, gt=0, description="minicb: seconds after arrival by "
                                   "which it must finish (--preemption deadline)")
    # OpenAI's, not implemented
    logit_bias: Any = REFUSED
    store: Any = REFUSED
    metadata: Any = REFUSED
    service_tier: Any = REFUSED

    @field_validator(*(name for name in NOT_IMPLEMENTED), check_fields=False)
    @classmethod
    def _not_implemented(cls, value: Any, info: Any) -> Any:
        if value not in NOT_IMPLEMENTED[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported by minicb (leave it out)")
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: Any) -> Any:
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError("a stop string must not be empty")
        return value


class CompletionRequest(Sampling):
    """POST /v1/completions."""

    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]] = Field(
        description="a text or a list of token ids; a list of one of them is that one")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="the chosen token's logprob and this many likeliest")
    echo: StrictBool | None = Field(False, description="the prompt's text before the output")
    best_of: Any = REFUSED
    suffix: Any = REFUSED

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("one prompt per request (send the others as their own "
                                 "requests, or use n for several choices)")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


class ChatCompletionRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens' newer name")
    logprobs: StrictBool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: Any = REFUSED
    tools: Any = REFUSED
    tool_choice: Any = REFUSED
    parallel_tool_calls: Any = REFUSED
    functions: Any = REFUSED
    function_call: Any = REFUSED
    audio: Any = REFUSED
    modalities: Any = REFUSED
    prediction: Any = REFUSED
    reasoning_effort: Any = REFUSED
    web_search_options: Any = REFUSED
    verbosity: Any = REFUSED


def sampling_params(req: Sampling, chat: bool) -> dict[str, Any]:
    """`SamplingParams` keyword arguments from a validated request (without `stop` strings,
    which need the tokenizer's check, and without max_tokens for a chat that set none)."""
    stop_ids = list(req.stop_token_ids or [])
    if isinstance(req.stop, list) and req.stop and isinstance(req.stop[0], int):
        stop_ids += req.stop  # token ids given as `stop`
    max_tokens = req.max_completion_tokens if chat and req.max_completion_tokens is not None \
        else req.max_tokens
    params: dict[str, Any] = dict(
        max_tokens=max_tokens if max_tokens is not None or chat else 16,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0), seed=req.seed, stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(req.ignore_eos), min_tokens=req.min_tokens)
    # defaults left out: an engine without penalties or logprobs serves them as it is
    for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                      ("repetition_penalty", 1.0)):
        value = getattr(req, name)
        if value is not None and value != off:
            params[name] = value
    num_logprobs = logprobs_wanted(req, chat)
    if num_logprobs is not None:
        params["logprobs"] = num_logprobs
    return params


def logprobs_wanted(req: Sampling, chat: bool) -> int | None:
    """How many likeliest tokens to list beside each chosen one (0: only the chosen one's
    logprob); None: no logprobs."""
    if chat:
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def stop_text(req: Sampling) -> tuple[str, ...]:
    """The stop strings (token ids given as `stop` are not)."""
    if isinstance(req.stop, str):
        return (req.stop,)
    return tuple(s for s in req.stop or () if isinstance(s, str))


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The message and `param` of the first of pydantic's errors, in OpenAI's terms: the
    top-level field it concerns (None for a body that is not a JSON object)."""
    err = errors[0]
    kind = err.get("type")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error')}", None
    field = next((part for part in err.get("loc", ()) if part != "body"), None)
    if not isinstance(field, str):
        return ("the request body must be a JSON object (sent as Content-Type: "
                "application/json)"), None
    # a field of several types fails once per type: our own checks' words say most
    same = [e for e in errors if field in e.get("loc", ())]
    err = next((e for e in same if e.get("type") == "value_error"), err)
    loc = list(err["loc"])[list(err["loc"]).index(field):]
    where = field + "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                            for part in loc[1:] if isinstance(part, int) or part.isidentifier()
                            and part not in TYPE_TAGS)
    if err.get("type") == "extra_forbidden":
        return f"unrecognized request argument: {where}", field
    message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{where}: {message}", field


# what pydantic puts in an error's location for the member of a union that failed
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
