"""One request's whole state as plain fields, like nano-vllm's `Sequence` (chapter 01):

    WAITING -> RUNNING (prefill chunks, then decode) -> FINISHED
       ^          |                 (stop / length / cancelled / error / deadline / rejected)
       +-- PREEMPTED (pages freed, recomputed later) <-+
       +-- SWAPPED (pages copied to host memory, copied back later) <-+

"cancelled" and "deadline" end it in any state, "rejected" on arrival, "error" in a failed step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from itertools import islice
from typing import Any

from minicb.config import is_finite_number, is_int, is_positive_int


class Status(enum.Enum):
    """Where a request is in its life (chapter 01; PREEMPTED and SWAPPED, chapter 06)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, to be recomputed
    SWAPPED = "swapped"  # back in the waiting queue, its K/V in host memory (chapter 06)
    FINISHED = "finished"


MAX_TOKENS = 2**24  # past any model's context: a larger max_tokens is a mistake, not a wish
MAX_STOP_TOKEN_IDS = 1024  # a longer list is an attack or a bug, not a stop rule
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (vLLM's default max_logprobs is 20 too)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop, in vLLM's names (chapter 00)."""
    # `stop` strings are matched where text is made (`LLM`, the server): the engine is
    # token-level. `logprobs`: how many top tokens' logprobs each output token reports

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def within(low: float, high: float):
            return lambda v: is_finite_number(v) and low <= v <= high

        # repetition_penalty: vLLM takes any > 0, but past these the logits leave float32's range
        for name, ok, what in (
                ("max_tokens", lambda v: is_positive_int(v) and v <= MAX_TOKENS,
                 f"an integer in [1, {MAX_TOKENS}]"),
                ("temperature", lambda v: is_finite_number(v) and v >= 0, "a finite number >= 0"),
                ("top_k", lambda v: is_int(v) and v >= 0, "an integer >= 0 (0 = off)"),
                ("top_p", lambda v: is_finite_number(v) and 0 < v <= 1, "in (0, 1]"),
                ("seed", lambda v: v is None or is_int(v) and -2**63 <= v < 2**64,
                 "an integer in [-2**63, 2**64) or None (torch's generator range)"),
                ("min_tokens", lambda v: is_int(v) and 0 <= v <= self.max_tokens,
                 "in [0, max_tokens]"),
                ("ignore_eos", lambda v: isinstance(v, bool), "True or False"),  # "false" is truthy
                ("presence_penalty", within(-2, 2), "a number in [-2, 2]"),
                ("frequency_penalty", within(-2, 2), "a number in [-2, 2]"),
                ("repetition_penalty", within(0.01, 100), "a number in [0.01, 100]"),
                ("logprobs", lambda v: v is None or is_int(v) and 0 <= v <= MAX_LOGPROBS,
                 f"an integer in [0, {MAX_LOGPROBS}] or None")):
            if not ok(getattr(self, name)):
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r:.40}")
        ids = self.stop_token_ids  # bytes iterate as ints (b"\n " as 10, 32): no token ids
        if isinstance(ids, (int, str, bytes, bytearray)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r} (stop "
                             f"strings go in stop)")
        ids = tuple(islice(ids, MAX_STOP_TOKEN_IDS + 1))  # an endless iterator stops here
        if len(ids) > MAX_STOP_TOKEN_IDS or any(not is_int(t) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} integers >= 0, "
                             f"got {ids!r:.80}")
        stop = () if self.stop is None else self.stop  # one string is one stop string (vLLM)
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings (token ids go "
                             f"in stop_token_ids), got {self.stop!r:.80}")
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def greedy(self) -> bool:
        """Temperature below 1e-5 (as in vLLM: too small to sample from in float32), or top_k 1."""
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """A penalty is set: sampling needs the request's `sampler.TokenCounts`."""
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0, 0, 1)


@dataclass
class RequestMetrics:
    """Engine-clock seconds and step indices of a request's milestones (chapters 00, 02-06)."""

    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    arrival_step: int | None = None
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    token_steps: list[int] = field(default_factory=list)
    # when the response reaches its user: at the finish, except that a static batch returns
    # whole, when its slowest member ends (chapter 02); None while held or unfinished
    released_time: float | None = None
    released_step: int | None = None


@dataclass(eq=False)  # identity: `req in queue` must not compare every field of every request
class Request:
    """All of one request's state (chapter 01; the preemption fields, chapter 06)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    # when the caller asked it to join the waiting queue: at this step, or at this engine-clock
    # time in seconds (None: when added). When it did join: `metrics.arrival_step`/`_time`
    arrives_at_step: int | None = None
    arrives_at_time: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in this request's pages
    num_cached_tokens: int = 0  # prompt tokens served from the prefix index at admission
    page_table: list[int] = field(default_factory=list)  # page ids, in token order
    swapped_pages: list[int] = field(default_factory=list)  # host page ids while SWAPPED
    slot: int | None = None  # batch slot held while running (what the slot pictures draw)
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_discarded_tokens: int = 0  # computed K/V its preemptions threw away (lost work)
    num_recomputed_tokens: int = 0  # of those, tokens computed again (the rest came back cached)
    num_tokens_before_preemption: int = 0  # K/V once reached here: computing below it is redone
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    seq_index: int = 0  # arrival order, set as it joins the queue: "newest" preemption, FCFS ties
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full prompt pages
    deadline: float | None = None  # seconds after arrival by which it must finish (chapter 06)
    tenant: str | None = None  # who sent it, for preemption="fair" (None: one shared tenant)
    num_service_tokens: int = 0  # tokens computed for it the first time: its service (ch. 06)
    returned_whole: bool = False  # its response reached the user all at once, at the release
    ngram_index: Any = None  # speculative decoding's lookup over its tokens (chapter 08)
    token_counts: Any = None  # the penalties' counts (sampler.TokenCounts) while it runs
    output_logprobs: list[dict[int, float]] = field(default_factory=list)  # params.logprobs
    generator: Any = None  # its own random stream when it has a seed (`sampler.make_generator`)

    @cached_property
    def stop_tokens(self) -> frozenset[int]:
        """Its stop_token_ids and, unless ignore_eos, its end-of-sequence tokens (built once)."""
        p = self.params
        return frozenset((*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)))

    def advance(self, num_tokens: int) -> int:
        """`num_tokens` more of its tokens are cached; returns how many were never computed."""
        # the one place a step grows num_computed_tokens
        start = self.num_computed_tokens
        self.num_computed_tokens += num_tokens
        redone = max(0, min(self.num_computed_tokens, self.num_tokens_before_preemption) - start)
        self.num_recomputed_tokens += redone
        self.num_service_tokens += num_tokens - redone
        return num_tokens - redone

    def stop_reason(self) -> str | None:
        """"stop" or "length" once its last token ends it, else None."""
        if not self.output_token_ids or self.is_prefill:
            return None
        if self.output_token_ids[-1] in self.stop_tokens:
            return "stop"
        return "length" if len(self.output_token_ids) >= self.params.max_tokens else None

    @property
    def deadline_time(self) -> float:
        if self.deadline is None or self.metrics.arrival_time is None:
            return float("inf")
        return self.metrics.arrival_time + self.deadline

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` without building the whole list."""
        p = len(self.prompt_token_ids)
        outputs = self.output_token_ids[max(start - p, 0):max(stop - p, 0)]
        return self.prompt_token_ids[start:stop] + outputs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens to run through the model before the next can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while the prompt (or a preempted request's recompute) is not fully in the cache."""
        return not self.output_token_ids or self.num_remaining > 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt, in vLLM's names (chapter 00)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    num_preemptions: int = 0
    # per output token, when SamplingParams.logprobs is set: the top `logprobs` token ids in
    # rank order, then the sampled token if not among them -> the model's raw log-softmax
    # (before bans, penalties, temperature, top-k and top-p: vLLM's default "raw_logprobs")
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
