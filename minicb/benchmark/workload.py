"""Workloads (chapters 02-06): who arrives when, with how long a prompt, wanting how many tokens.

The benchmark contract (seed document 002) says a result means nothing without its workload:
arrival process, burstiness, concurrency and length distributions. A `Workload` is a list of
`WorkloadRequest`s plus a `declaration` dict that says exactly how it was made, so every result
file can start with it.

    arrivals      all at once; Poisson at a rate; gamma gaps with a burstiness factor
                  (1 = Poisson, < 1 burstier, > 1 smoother); explicit steps or times
    lengths       fixed, uniform, lognormal, or drawn from a list
    scenarios     seed-r1-r4, long-prefill, mixed-chat, equal-lengths, low-rate, shared-prefix
    traces        replay a recorded trace (JSON Lines or CSV, `load_workload_file`), and write
                  any workload in that format (`save_workload_file`)

Prompts are random token ids from an ordinary-text range of the vocabulary (100..10000 by
default), so no tokenizer is needed and decoding them still gives readable-ish text. Everything
is drawn from `numpy.random.Generator`s seeded by `seed`: same seed, same workload. Lengths and
prompts, arrival times and the cancelled requests each have their own stream, so the same seed
at another rate, burstiness or arrival process is the same requests arriving differently.
"""

from __future__ import annotations

import csv
import gc
import heapq
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from minicb.benchmark.metrics import observed_arrivals
from minicb.config import is_positive_int

DEFAULT_VOCAB_RANGE = (100, 10000)  # ordinary text tokens of the SmolLM2 vocabulary (49152)


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_positive(name: str, value: Any, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    if not ok or math.isnan(value) or math.isinf(value) or value < 0 \
            or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------ requests
@dataclass
class WorkloadRequest:
    """One request of a workload (chapters 05-06). Give `prompt_token_ids`, or only
    `prompt_len` (ids are then drawn deterministically from the request's index). Arrival is
    `arrival_time` (seconds after the run starts), or `arrival_step`, or neither (at once).
    `cancel_after_tokens`: the client cancels once it has received that many tokens.
    `deadline`: seconds after arrival by which the engine must finish it; `tenant`: who sent
    it (chapter 06)."""

    prompt_token_ids: list[int] | None = None
    prompt_len: int | None = None
    max_tokens: int = 16
    arrival_time: float | None = None
    arrival_step: int | None = None
    priority: int = 0
    cancel_after_tokens: int | None = None
    request_id: str | None = None
    deadline: float | None = None
    tenant: str | None = None

    def __post_init__(self) -> None:
        if self.prompt_token_ids is None and self.prompt_len is None:
            raise ValueError("WorkloadRequest needs prompt_token_ids or prompt_len")
        if self.prompt_token_ids is not None:
            ids = list(self.prompt_token_ids)
            if not ids or any(not isinstance(t, (int, np.integer)) or t < 0 for t in ids):
                raise ValueError("prompt_token_ids must be a non-empty list of token ids >= 0")
            self.prompt_token_ids = [int(t) for t in ids]
            if self.prompt_len is not None and self.prompt_len != len(ids):
                raise ValueError(f"prompt_len ({self.prompt_len}) disagrees with "
                                 f"len(prompt_token_ids) ({len(ids)})")
            self.prompt_len = len(ids)
        self.prompt_len = _check_int("prompt_len", self.prompt_len)
        self.max_tokens = _check_int("max_tokens", self.max_tokens)
        if self.arrival_time is not None:
            self.arrival_time = _check_positive("arrival_time", self.arrival_time, True)
        if self.arrival_step is not None:
            self.arrival_step = _check_int("arrival_step", self.arrival_step)
        if self.arrival_time is not None and self.arrival_step is not None:
            raise ValueError("give arrival_time or arrival_step, not both")
        if not isinstance(self.priority, (int, np.integer)):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        self.priority = int(self.priority)  # a numpy integer is not JSON (the client sends it)
        if self.cancel_after_tokens is not None:
            self.cancel_after_tokens = _check_int("cancel_after_tokens",
                                                  self.cancel_after_tokens)
        if self.deadline is not None:
            self.deadline = _check_positive("deadline", self.deadline)

    def token_ids(self, index: int = 0,
                  vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE) -> list[int]:
        """The prompt ids: the given ones, or `prompt_len` ids drawn from a generator seeded by
        the request's index (so a length-only request is still reproducible)."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        rng = np.random.default_rng([index, 0x5EED])
        return rng.integers(vocab_range[0], vocab_range[1], self.prompt_len).tolist()


@dataclass
class Workload:
    """A list of requests plus the declaration of how it was generated (chapters 05-06).
    `recommended`: engine options the scenario is meant for (e.g. max_num_seqs=3 for R1..R4).
    `long_request_id`: the long prompt that dec@P and short_P are measured around, if any."""

    name: str
    requests: list[WorkloadRequest]
    declaration: dict[str, Any] = field(default_factory=dict)
    recommended: dict[str, Any] = field(default_factory=dict)
    long_request_id: str | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)

    def ids(self) -> list[str]:
        return [r.request_id or f"req-{i}" for i, r in enumerate(self.requests)]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "declaration": self.declaration,
                "recommended": self.recommended, "long_request_id": self.long_request_id,
                "requests": [asdict(r) for r in self.requests]}


# ------------------------------------------------------------------------------ arrivals
ARRIVALS = ("all-at-once", "poisson", "gamma", "steps", "times")


def poisson_gaps(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """`n` exponential gaps with mean 1/rate seconds (chapter 06)."""
    return gamma_gaps(n, rate, 1.0, rng)


def gamma_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """`n` gamma gaps with mean 1/rate: shape = burstiness, scale = 1/(rate * burstiness), so
    burstiness 1 is Poisson, < 1 burstier (CV^2 = 1/burstiness), > 1 more regular (chapter 06)."""
    _check_int("num_requests", n, 0)
    rate = _check_positive("rate", rate)
    burstiness = _check_positive("burstiness", burstiness)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, process: str = "all-at-once", rate: float | None = None,
                  burstiness: float = 1.0, rng: np.random.Generator | None = None,
                  times: Sequence[float] | None = None) -> list[float]:
    """Arrival times in seconds for `n` requests (chapter 06). The first request arrives at 0;
    gaps follow the process. `process`: 'all-at-once', 'poisson', 'gamma' or 'times'."""
    _check_int("num_requests", n, 0)
    rng = rng if rng is not None else np.random.default_rng(0)
    if process == "all-at-once":
        return [0.0] * n
    if process in ("poisson", "gamma"):
        if rate is None:
            raise ValueError(f"rate (requests/s) is required for arrival process {process!r}")
        gaps = gamma_gaps(n, rate, 1.0 if process == "poisson" else burstiness, rng)
        return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist() if n else []
    if process == "times":
        if times is None or len(times) != n:
            raise ValueError(f"times must list one arrival time per request ({n}), got "
                             f"{None if times is None else len(times)}")
        out = [_check_positive("times[i]", t, allow_zero=True) for t in times]
        if any(b < a for a, b in zip(out, out[1:])):
            raise ValueError("times must be non-decreasing")
        return out
    raise ValueError(f"arrival process must be one of {ARRIVALS[:3] + ('times',)}, "
                     f"got {process!r}")


# ------------------------------------------------------------------------------ lengths
LENGTH_KINDS = ("fixed", "uniform", "lognormal", "list")


@dataclass(frozen=True)
class Lengths:
    """A length distribution (chapters 05-06).

    fixed(value) | uniform(low, high) (inclusive) | lognormal(median, sigma) clipped to
    [low, high] | list(values) drawn with replacement. Parse CLI text with `Lengths.parse`:
    "128", "fixed:128", "uniform:16:512", "lognormal:128:0.8:8:1024", "list:8,32,200"."""

    kind: str
    value: int | None = None
    low: int | None = None
    high: int | None = None
    median: float | None = None
    sigma: float | None = None
    values: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length kind must be one of {LENGTH_KINDS}, got {self.kind!r}")
        if self.kind == "fixed":
            _check_int("lengths.value", self.value)
        if self.kind in ("uniform", "lognormal"):
            _check_int("lengths.low", self.low)
            _check_int("lengths.high", self.high)
            if self.high < self.low:
                raise ValueError(f"lengths.high ({self.high}) must be >= lengths.low "
                                 f"({self.low})")
        if self.kind == "lognormal":
            _check_positive("lengths.median", self.median)
            _check_positive("lengths.sigma", self.sigma, allow_zero=True)
        if self.kind == "list":
            if not self.values:
                raise ValueError("lengths.values must list at least one length")
            for v in self.values:
                _check_int("lengths.values[i]", v)

    @classmethod
    def fixed(cls, value: int) -> Lengths:
        return cls("fixed", value=value)

    @classmethod
    def uniform(cls, low: int, high: int) -> Lengths:
        return cls("uniform", low=low, high=high)

    @classmethod
    def lognormal(cls, median: float, sigma: float, low: int = 1,
                  high: int = 4096) -> Lengths:
        return cls("lognormal", median=median, sigma=sigma, low=low, high=high)

    @classmethod
    def from_list(cls, values: Sequence[int]) -> Lengths:
        return cls("list", values=tuple(int(v) for v in values))

    @classmethod
    def parse(cls, text: str | int | Lengths) -> Lengths:
        """Read "128", "fixed:128", "uniform:LO:HI", "lognormal:MEDIAN:SIGMA[:LO:HI]",
        "list:A,B,C"."""
        if isinstance(text, Lengths):
            return text
        if isinstance(text, int):
            return cls.fixed(text)
        parts = str(text).strip().split(":")
        try:
            if len(parts) == 1:
                return cls.fixed(int(parts[0]))
            kind, args = parts[0], parts[1:]
            if kind == "fixed" and len(args) == 1:
                return cls.fixed(int(args[0]))
            if kind == "uniform" and len(args) == 2:
                return cls.uniform(int(args[0]), int(args[1]))
            if kind == "lognormal" and len(args) in (2, 4):
                extra = (int(args[2]), int(args[3])) if len(args) == 4 else (1, 4096)
                return cls.lognormal(float(args[0]), float(args[1]), *extra)
            if kind == "list" and len(args) == 1:
                return cls.from_list([int(v) for v in args[0].split(",") if v])
        except ValueError as exc:
            if "must" in str(exc):
                raise
        raise ValueError(f"cannot read length distribution {text!r}: use N, fixed:N, "
                         "uniform:LO:HI, lognormal:MEDIAN:SIGMA[:LO:HI] or list:A,B,C")

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        """`n` lengths drawn with `rng`."""
        _check_int("num_requests", n, 0)
        if self.kind == "fixed":
            return [self.value] * n
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, n).tolist()
        if self.kind == "lognormal":
            raw = rng.lognormal(math.log(self.median), self.sigma, n)
            return np.clip(np.rint(raw), self.low, self.high).astype(int).tolist()
        return rng.choice(np.array(self.values), n).astype(int).tolist()

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for key in ("value", "low", "high", "median", "sigma"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.values:
            out["values"] = list(self.values)
        return out


# ------------------------------------------------------------------------------ generator
def random_prompt(length: int, rng: np.random.Generator,
                  vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE) -> list[int]:
    """`length` token ids drawn uniformly from `vocab_range` (chapters 05-06)."""
    _check_int("prompt length", length)
    lo, hi = vocab_range
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo < hi):
        raise ValueError(f"vocab_range must be (low, high) with 0 <= low < high, got "
                         f"{vocab_range!r}")
    return rng.integers(lo, hi, length).tolist()


def make_workload(num_requests: int = 32, prompt_lengths: Lengths | str | int = "uniform:16:512",
                  output_lengths: Lengths | str | int = "uniform:8:256",
                  arrival: str = "all-at-once", rate: float | None = None,
                  burstiness: float = 1.0, seed: int = 0,
                  vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE,
                  shared_prefix_len: int = 0, name: str = "custom",
                  arrival_steps: Sequence[int] | None = None,
                  arrival_times_s: Sequence[float] | None = None,
                  cancel_fraction: float = 0.0, cancel_after_tokens: int = 1) -> Workload:
    """The general generator behind every scenario (chapters 05-06).

    `arrival`: 'all-at-once', 'poisson' (needs `rate`), 'gamma' (needs `rate`, `burstiness`),
    'steps' (`arrival_steps`, engine steps) or 'times' (`arrival_times_s`, seconds).
    `shared_prefix_len`: every prompt starts with the same that-many tokens (a system prompt,
    the same for every seed, so a run with another seed is the same traffic with other
    questions); the drawn prompt length is the unique part after it. `cancel_fraction` of the
    requests (chosen at random) are cancelled by the client after `cancel_after_tokens`
    tokens."""
    n = _check_int("num_requests", num_requests)
    seed = _check_int("seed", seed, 0)
    _check_int("shared_prefix_len", shared_prefix_len, 0)
    if not 0.0 <= float(cancel_fraction) <= 1.0:
        raise ValueError(f"cancel_fraction must be in [0, 1], got {cancel_fraction!r}")
    prompt_dist = Lengths.parse(prompt_lengths)
    output_dist = Lengths.parse(output_lengths)
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    rng = np.random.default_rng(seed)
    steps: list[int | None] = [None] * n
    if arrival == "steps":
        if arrival_steps is None or len(arrival_steps) != n:
            raise ValueError(f"arrival_steps must list one step per request ({n})")
        steps = [_check_int("arrival_steps[i]", s) for s in arrival_steps]
        times: list[float | None] = [None] * n
    else:  # their own stream: the same seed draws the same requests whatever their arrivals
        # (gamma draws differ in number with its shape, all-at-once draws none)
        times = list(arrival_times(n, arrival, rate, burstiness,
                                   np.random.default_rng([seed, 2]), arrival_times_s))
    prompt_lens = prompt_dist.sample(n, rng)
    output_lens = output_dist.sample(n, rng)
    prefix = random_prompt(shared_prefix_len, np.random.default_rng(0x5157), vocab_range) \
        if shared_prefix_len else []
    cancel = set()
    if cancel_fraction > 0:  # its own stream: the same seed draws the same prompts either way
        count = int(round(cancel_fraction * n))
        cancel = set(np.random.default_rng([seed, 1]).choice(n, count, replace=False).tolist())
    requests = []
    for i in range(n):
        ids = prefix + random_prompt(prompt_lens[i], rng, vocab_range)
        requests.append(WorkloadRequest(
            prompt_token_ids=ids, max_tokens=output_lens[i], arrival_time=times[i],
            arrival_step=steps[i], request_id=f"req-{i}",
            cancel_after_tokens=cancel_after_tokens if i in cancel else None))
    declaration = {
        "workload": name, "num_requests": n, "seed": seed,
        "arrival_process": f"gamma (shape={burstiness})" if arrival == "gamma" else arrival,
        "rate_rps": rate if arrival in ("poisson", "gamma") else None,
        # a short sample's arrivals can come well off the rate asked for: say what was drawn
        **({"observed": observed_arrivals(times)} if times[0] is not None else {}),
        # Poisson gaps are exponential whatever `burstiness` says (arrival_times)
        "burstiness": {"poisson": 1.0, "gamma": burstiness}.get(arrival),
        # a prompt is the shared prefix, then a drawn length of its own
        "prompt_lengths": {**prompt_dist.describe(),
                           **({"after_shared_prefix": shared_prefix_len} if shared_prefix_len
                              else {})},
        "output_lengths": output_dist.describe(), "shared_prefix_len": shared_prefix_len,
        "vocab_range": list(vocab_range),
        "cancel_fraction": cancel_fraction,
        "cancel_after_tokens": cancel_after_tokens if cancel else None,
        "output_lengths_exact": True,  # submit() sets ignore_eos and max_tokens
    }
    return Workload(name, requests, declaration)


# ------------------------------------------------------------------------------ scenarios
def seed_r1_r4(prompt_len: int = 8, r4_output: int = 60, seed: int = 0,
               vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE) -> Workload:
    """The chapter's example (chapters 02-03): R1, R2, R3 need 30, 200 and 80 output tokens
    and start together; R4 arrives at step 31. Meant for max_num_seqs=3. The seed gives R4 no
    length: `r4_output` is the course's choice, 60, the length chapters 02 and 03 use."""
    rng = np.random.default_rng(_check_int("seed", seed, 0))
    _check_int("prompt_len", prompt_len)
    _check_int("r4_output", r4_output)
    spec = [("R1", 30, 1), ("R2", 200, 1), ("R3", 80, 1), ("R4", r4_output, 31)]
    requests = [WorkloadRequest(prompt_token_ids=random_prompt(prompt_len, rng, vocab_range),
                                max_tokens=out, arrival_step=step, request_id=rid)
                for rid, out, step in spec]
    declaration = {"workload": "seed-r1-r4", "num_requests": 4, "seed": seed,
                   "arrival_process": "explicit steps (R1-R3 at step 1, R4 at step 31)",
                   "prompt_lengths": {"kind": "fixed", "value": prompt_len},
                   "output_lengths": {"kind": "list", "values": [30, 200, 80, r4_output]},
                   "output_lengths_exact": True}
    return Workload("seed-r1-r4", requests, declaration, {"max_num_seqs": 3})


def long_prefill(long_prompt_len: int = 2000, num_short: int = 4, short_prompt_len: int = 16,
                 short_output: int = 128, long_output: int = 16, long_arrival_step: int = 5,
                 seed: int = 0,
                 vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE) -> Workload:
    """The chapter's PD example (chapters 04-05): `num_short` short requests start decoding at
    step 1; one `long_prompt_len`-token prompt ('long') arrives at `long_arrival_step` while
    they decode. dec@P and short_P are measured around it."""
    rng = np.random.default_rng(_check_int("seed", seed, 0))
    for name, value in (("long_prompt_len", long_prompt_len), ("num_short", num_short),
                        ("short_prompt_len", short_prompt_len), ("short_output", short_output),
                        ("long_output", long_output), ("long_arrival_step", long_arrival_step)):
        _check_int(name, value)
    requests = [WorkloadRequest(prompt_token_ids=random_prompt(short_prompt_len, rng,
                                                               vocab_range),
                                max_tokens=short_output, arrival_step=1,
                                request_id=f"short-{i}") for i in range(num_short)]
    requests.append(WorkloadRequest(
        prompt_token_ids=random_prompt(long_prompt_len, rng, vocab_range),
        max_tokens=long_output, arrival_step=long_arrival_step, request_id="long"))
    declaration = {"workload": "long-prefill", "num_requests": num_short + 1, "seed": seed,
                   "arrival_process": f"explicit steps ({num_short} short at step 1, the long "
                                      f"prompt at step {long_arrival_step})",
                   "prompt_lengths": {"kind": "list", "values": [short_prompt_len,
                                                                 long_prompt_len]},
                   "output_lengths": {"kind": "list", "values": [short_output, long_output]},
                   "long_prompt_len": long_prompt_len, "output_lengths_exact": True}
    return Workload("long-prefill", requests, declaration,
                    {"max_num_seqs": max(num_short + 1, 2)}, long_request_id="long")


def mixed_chat(num_requests: int = 32, seed: int = 0, rate: float | None = None,
               burstiness: float = 1.0, **kw: Any) -> Workload:
    """The standard mixed workload (chapters 03-06): prompts uniform 16-512 tokens, outputs
    uniform 8-256, all at once (or at `rate` requests/s with gamma `burstiness`)."""
    return _with_arrival("mixed-chat", num_requests, "uniform:16:512", "uniform:8:256", seed,
                         rate, burstiness, **kw)


def equal_lengths(num_requests: int = 32, seed: int = 0, rate: float | None = None,
                  burstiness: float = 1.0, **kw: Any) -> Workload:
    """Every prompt 128 tokens, every output 128 tokens, all at once: the seed's row where
    continuous batching gains little over static batching (chapter 06)."""
    return _with_arrival("equal-lengths", num_requests, "fixed:128", "fixed:128", seed, rate,
                         burstiness, **kw)


def low_rate(num_requests: int = 12, seed: int = 0, rate: float | None = 0.5,
             burstiness: float = 1.0, **kw: Any) -> Workload:
    """Poisson arrivals at a low `rate` (requests/s) so usually only one request runs: the
    seed's row where continuous batching degenerates to one request at a time (chapter 06)."""
    kw.setdefault("prompt_lengths", "uniform:32:128")
    kw.setdefault("output_lengths", "uniform:16:64")
    prompt, output = kw.pop("prompt_lengths"), kw.pop("output_lengths")
    return _with_arrival("low-rate", num_requests, prompt, output, seed, rate, burstiness,
                         **kw)


def shared_prefix(num_requests: int = 32, seed: int = 0, rate: float | None = None,
                  burstiness: float = 1.0, prefix_len: int = 256, **kw: Any) -> Workload:
    """Many requests behind one common system prompt of `prefix_len` tokens, then a unique
    question of 16-64 tokens; outputs 16-64 tokens (chapter 06, prefix caching)."""
    kw.setdefault("prompt_lengths", "uniform:16:64")
    kw.setdefault("output_lengths", "uniform:16:64")
    prompt, output = kw.pop("prompt_lengths"), kw.pop("output_lengths")
    return _with_arrival("shared-prefix", num_requests, prompt, output, seed, rate, burstiness,
                         shared_prefix_len=prefix_len, **kw)


def _with_arrival(name: str, num_requests: int, prompt: Any, output: Any, seed: int,
                  rate: float | None, burstiness: float, **kw: Any) -> Workload:
    kw.setdefault("prompt_lengths", prompt)
    kw.setdefault("output_lengths", output)
    if rate is None and burstiness != 1.0:
        raise ValueError("burstiness needs a rate: give rate (requests/s) too")
    arrival = "all-at-once" if rate is None else ("poisson" if burstiness == 1.0 else "gamma")
    return make_workload(num_requests, arrival=arrival, rate=rate, burstiness=burstiness,
                         seed=seed, name=name, **kw)


SCENARIOS: dict[str, Callable[..., Workload]] = {
    "seed-r1-r4": seed_r1_r4,
    "long-prefill": long_prefill,
    "mixed-chat": mixed_chat,
    "equal-lengths": equal_lengths,
    "low-rate": low_rate,
    "shared-prefix": shared_prefix,
}


def get_workload(name: str, **kwargs: Any) -> Workload:
    """A named scenario with keyword overrides (None values are ignored), chapters 05-06."""
    if name not in SCENARIOS:
        raise ValueError(f"workload must be one of {sorted(SCENARIOS)}, got {name!r}")
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return SCENARIOS[name](**kwargs)


# ------------------------------------------------------------------------------ replayed traces
# One request per line of JSON Lines (or per row of a CSV with these names as its header):
# name -> (kind, WorkloadRequest field). Give arrival_s or arrival_step, prompt_tokens or
# prompt_token_ids, and output_tokens; the rest is optional. long_prefill belongs to the
# workload, not to a request: the one request dec@P and short_P are measured around.
TRACE_FIELDS: dict[str, tuple[str, str | None]] = {
    "request_id": ("str", "request_id"),
    "arrival_s": ("seconds", "arrival_time"),  # seconds from the start of the run
    "arrival_step": ("count", "arrival_step"),  # or the engine step it arrives at (from 1)
    "prompt_tokens": ("count", "prompt_len"),  # a length: ids drawn from the request's index
    "prompt_token_ids": ("ids", "prompt_token_ids"),
    "output_tokens": ("count", "max_tokens"),  # exact: replayed with ignore_eos
    "priority": ("int", "priority"),  # lower is served first under --preemption priority
    "tenant": ("str", "tenant"),  # who sent it, for --preemption fair
    "deadline_s": ("seconds", "deadline"),  # seconds after arrival, for --preemption deadline
    "cancel_after_tokens": ("count", "cancel_after_tokens"),  # the client cancels then
    "long_prefill": ("flag", None),  # true on at most one request: Workload.long_request_id
}
MAX_FIRST_ARRIVAL_S = 86400.0  # a later first arrival is a clock time (epoch), not an offset
FLAG_TEXT = {"true": True, "1": True, "false": False, "0": False}  # a CSV cell


def _trace_value(name: str, value: Any, where: str) -> Any:
    """One field of a trace row, checked (CSV text converted first); ValueError names
    `where` (file and line) and the field."""
    kind = TRACE_FIELDS[name][0]
    if kind == "flag":
        value = FLAG_TEXT.get(value.lower(), value) if isinstance(value, str) else value
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {name} must be true or false, got {value!r}")
        return value
    if isinstance(value, str) and kind != "str":  # a CSV cell
        try:
            value = ([int(v) for v in value.split()] if kind == "ids" else
                     float(value) if kind == "seconds" else int(value))
        except ValueError:
            wanted = "token ids separated by spaces" if kind == "ids" else "a number"
            raise ValueError(f"{where}: {name} must be {wanted}, got {value!r}") from None
    label = f"{where}: {name}"
    if kind == "str":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{label} must be a non-empty string, got {value!r}")
        return value
    if kind == "seconds":
        return _check_positive(label, value, allow_zero=name == "arrival_s")
    if kind == "ids":
        if not isinstance(value, list) or not value:
            raise ValueError(f"{label} must be a non-empty list of token ids, got {value!r}")
        return [_check_int(f"{label}[{i}]", t, 0) for i, t in enumerate(value)]
    if kind == "int":
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"{label} must be an integer, got {value!r}")
        return int(value)
    return _check_int(label, value)


def trace_request(row: dict[str, Any], where: str) -> WorkloadRequest:
    """A WorkloadRequest from one trace row (chapter 06); ValueError names `where` and the
    field at fault: an unknown field, a missing one, or a bad value."""
    unknown = sorted(set(row) - set(TRACE_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {list(TRACE_FIELDS)}")
    given = {k: v for k, v in row.items() if v is not None and v != ""}
    for one_of in (("arrival_s", "arrival_step"), ("prompt_tokens", "prompt_token_ids"),
                   ("output_tokens",)):
        found = [k for k in one_of if k in given]
        if len(found) != 1:
            raise ValueError(f"{where}: give {' or '.join(one_of)}"
                             + (", not both" if found else " (missing)"))
    kwargs = {TRACE_FIELDS[k][1]: _trace_value(k, v, where) for k, v in given.items()
              if TRACE_FIELDS[k][1] is not None}
    return WorkloadRequest(**kwargs)


def _summary(values: Sequence[float]) -> dict[str, Any]:
    return {"kind": "observed", "min": min(values), "p50": float(np.percentile(values, 50)),
            "max": max(values), "mean": float(np.mean(values))}


def load_workload_file(path: str | Path, num_requests: int | None = None) -> Workload:
    """Replay a trace (chapter 06): JSON Lines, one request a line, or CSV with the field names
    as header (`TRACE_FIELDS`). Requests are sorted by arrival (the declaration says when the
    file was not); `num_requests` keeps the first that many. The declaration summarises what
    the file holds: arrivals ("replayed trace", observed mean rate), lengths (min/p50/max)."""
    if num_requests is not None:  # a slice would take -1 as "all but the last"
        _check_int("num_requests", num_requests)
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--workload-file {str(path)!r} is a directory, not a trace file")
    if not path.is_file():
        raise ValueError(f"--workload-file {str(path)!r}: no such file")
    try:  # utf-8-sig: a byte-order mark (Excel writes one) is not part of the first name
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}); a trace must be JSON "
                         "Lines or CSV saved as UTF-8") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    rows: list[tuple[str, dict[str, Any]]] = []
    if path.suffix.lower() == ".csv":
        limit = csv.field_size_limit()  # 131072 by default: ~20k prompt ids in one cell
        csv.field_size_limit(max(limit, len(text) + 1))
        try:
            reader = csv.DictReader(io.StringIO(text))
            for i, row in enumerate(reader, start=2):
                if None in row:
                    raise ValueError(f"{path}, line {i}: more cells than the header has names")
                rows.append((f"{path}, line {i}", row))
        except csv.Error as exc:
            raise ValueError(f"{path}, line {reader.line_num}: not CSV ({exc})") from None
        finally:
            csv.field_size_limit(limit)
    else:
        first = True
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:  # JSONDecodeError, or an integer of 4301+ digits
                hint = "; a CSV trace's name must end in .csv" if first else ""
                raise ValueError(f"{path}, line {i}: not JSON ({getattr(exc, 'msg', exc)})"
                                 f"{hint}") from None
            first = False
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {i}: each line must be a JSON object")
            rows.append((f"{path}, line {i}", row))
    requests = [trace_request(row, where) for where, row in rows]
    if not requests:
        raise ValueError(f"{path}: no requests in the file")
    marked = [requests[i] for i, (where, row) in enumerate(rows)
              if row.get("long_prefill") not in (None, "")
              and _trace_value("long_prefill", row["long_prefill"], where)]
    if len(marked) > 1:
        raise ValueError(f"{path}: long_prefill is true on {len(marked)} requests; dec@P and "
                         "short_P are measured around one")
    if len({r.arrival_step is None for r in requests}) > 1:
        raise ValueError(f"{path}: give every request arrival_s, or every one arrival_step")
    order = sorted(range(len(requests)), key=lambda i: (*_arrival(requests[i]), i))
    was_sorted = order == sorted(order)
    requests = [requests[i] for i in order][:num_requests]
    for i, r in enumerate(requests):
        r.request_id = r.request_id or f"req-{order[i]}"
    if len(set(r.request_id for r in requests)) < len(requests):
        raise ValueError(f"{path}: request_id values must be unique")
    long_request_id = next((r.request_id for r in requests if marked and r is marked[0]), None)
    times = [r.arrival_time for r in requests if r.arrival_time is not None]
    if times and min(times) > MAX_FIRST_ARRIVAL_S:  # the engine would wait until then
        raise ValueError(f"{path}: the first arrival_s is {min(times)}, more than a day; "
                         "arrival_s is seconds after the run starts, not a clock time: "
                         "subtract the first timestamp from every arrival_s")
    observed = observed_arrivals(times) if times else {}
    declaration = {
        "workload": path.stem, "source": f"replayed from {path}", "num_requests": len(requests),
        "arrival_process": "replayed trace" + (" in steps" if not times else "")
                           + ("" if was_sorted else " (sorted by arrival: the file was not)"),
        "rate_rps": observed.get("rate_rps"),
        "burstiness": observed.get("burstiness"),
        "burstiness_note": "observed: 1 / CV^2 of the arrival gaps (1 is Poisson-like, "
                           "smaller is burstier)",
        "arrival_span_s": observed.get("arrival_span_s"),
        "prompt_lengths": _summary([r.prompt_len for r in requests]),
        "output_lengths": _summary([r.max_tokens for r in requests]),
        "priorities": sorted({r.priority for r in requests}),
        "tenants": len({r.tenant for r in requests if r.tenant is not None}),
        "deadlines": sum(r.deadline is not None for r in requests),
        "cancel_fraction": sum(r.cancel_after_tokens is not None for r in requests)
                           / len(requests),
        "output_lengths_exact": True,
        "long_request_id": long_request_id,
    }
    return Workload(path.stem, requests, declaration, long_request_id=long_request_id)


def trace_row(req: WorkloadRequest, index: int = 0,
              long_request_id: str | None = None) -> dict[str, Any]:
    """One request as a trace row (`load_workload_file` reads it back): prompt ids written out,
    so a replay sends the same tokens; optional fields only when set, long_prefill on the
    request whose id is `long_request_id` (chapter 06)."""
    row: dict[str, Any] = {"request_id": req.request_id or f"req-{index}"}
    if req.arrival_step is not None:
        row["arrival_step"] = req.arrival_step
    else:
        row["arrival_s"] = req.arrival_time or 0.0
    row["prompt_token_ids"] = req.token_ids(index)
    row["output_tokens"] = req.max_tokens
    for name, field_name in (("priority", "priority"), ("tenant", "tenant"),
                             ("deadline_s", "deadline"),
                             ("cancel_after_tokens", "cancel_after_tokens")):
        value = getattr(req, field_name)
        if value is not None and not (name == "priority" and value == 0):
            row[name] = value
    if long_request_id is not None and row["request_id"] == long_request_id:
        row["long_prefill"] = True
    return row


def save_workload_file(workload: Workload, path: str | Path) -> Path:
    """Write `workload` as a trace that `load_workload_file` replays (chapter 06): JSON Lines,
    or CSV when `path` ends in .csv (prompt ids separated by spaces). Its long request, if any,
    is marked long_prefill; its `recommended` engine options are not requests, so not kept
    (`replay_flags` gives them as flags)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [trace_row(r, i, workload.long_request_id) for i, r in enumerate(workload.requests)]
    if path.suffix.lower() == ".csv":
        names = [n for n in TRACE_FIELDS if any(n in row for row in rows)]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, names)
            writer.writeheader()
            for row in rows:
                writer.writerow({k: " ".join(map(str, v)) if isinstance(v, list) else v
                                 for k, v in row.items()})
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def replay_flags(workload: Workload) -> str:
    """The command-line flags that give a replay of `workload`'s trace the engine options its
    scenario recommends (e.g. "--max-num-seqs 3"); empty when there are none (chapter 06)."""
    return " ".join(f"--{key.replace('_', '-')} {value}"
                    for key, value in workload.recommended.items())


# ------------------------------------------------------------------------------ driving
def _add(engine: Any, req: WorkloadRequest, index: int, temperature: float) -> str:
    from minicb.request import SamplingParams

    params = SamplingParams(max_tokens=req.max_tokens, temperature=temperature,
                            ignore_eos=True, seed=index if temperature > 0 else None)
    arrival_time = req.arrival_time
    if arrival_time is None and req.arrival_step is None:
        arrival_time = 0.0
    prompt = req.token_ids(index)
    vocab = engine.info.config.vocab_size
    if max(prompt) >= vocab:  # a tiny test checkpoint: fold the ids into its vocabulary
        prompt = [t % vocab for t in prompt]
    return engine.add_request(prompt, params, request_id=req.request_id or f"req-{index}",
                              arrival_step=req.arrival_step, arrival_time=arrival_time,
                              priority=int(req.priority), deadline=req.deadline,
                              tenant=req.tenant)


def submit(engine: Any, workload: Workload, temperature: float = 0.0,
           reset_clock: bool = True) -> list[str]:
    """Add every request to `engine` (chapters 05-06) with ignore_eos=True and max_tokens fixed,
    so output lengths are exact; greedy unless `temperature` > 0. Requests without an arrival
    step or time arrive at time 0; the others wait in the engine until their step or their
    time (engine clock) comes. Prompt ids at or above the model's vocabulary size are folded
    into it (t % vocab_size). Resets the engine clock afterwards, so arrival times count from
    the run's start. Returns the request ids."""
    ids = [_add(engine, req, i, temperature) for i, req in enumerate(workload.requests)]
    if reset_clock:
        engine.t0 += engine.clock()  # the engine clock restarts at 0
    return ids


def _arrival(req: WorkloadRequest) -> tuple[int, float]:
    return req.arrival_step or 0, req.arrival_time or 0.0


class _Feeder:
    """Hands requests to the engine when their arrival comes, like clients would, so the
    engine's pending list stays short however long the workload is."""

    def __init__(self, engine: Any, workload: Workload, temperature: float,
                 max_concurrency: int | None = None) -> None:
        self.engine = engine
        self.temperature = temperature
        order = sorted(range(len(workload.requests)),
                       key=lambda i: (*_arrival(workload.requests[i]), i))
        self.queue = [(i, workload.requests[i]) for i in order]
        self.next = 0
        self.ids: dict[int, str] = {}
        self.max_concurrency = max_concurrency
        self.in_flight: list[str] = []  # sent, response not yet back (only under a cap)
        # a closed loop's free client slots: (time, step) each became free, earliest first
        self.free_slots = [(0.0, 0)] * (max_concurrency or 0)

    def room(self) -> bool:
        """Whether a client may send another request: always in an open loop; in a closed loop
        only while fewer than `max_concurrency` of its requests await their response."""
        if self.max_concurrency is None:
            return True
        still = []
        for rid in self.in_flight:
            m = self.engine.requests[rid].metrics if rid in self.engine.requests else None
            if m is None or m.released_time is not None:  # back (or forgotten): a slot frees
                freed = (m.released_time, m.released_step) if m is not None \
                    else (self.engine.clock(), self.engine.step_count)
                heapq.heappush(self.free_slots, freed)
            else:
                still.append(rid)
        self.in_flight = still
        return bool(self.free_slots)

    def due(self, req: WorkloadRequest) -> bool:
        if req.arrival_step is not None:
            return req.arrival_step <= self.engine.step_count + 1
        return (req.arrival_time or 0.0) <= self.engine.clock()

    def feed(self) -> None:
        """Hand the engine every request due by now; an idle engine also gets the next arrival
        and every request arriving with it (the engine waits for them: a tie fed one loop later
        would queue a step behind its twins on a free engine)."""
        if self.next < len(self.queue) and not self.engine.has_unfinished():
            first = self.queue[self.next][1]
            while self.next < len(self.queue) and _arrival(self.queue[self.next][1]) \
                    == _arrival(first) and self.room():
                self._add_next()
        while self.next < len(self.queue) and self.due(self.queue[self.next][1]) \
                and self.room():
            self._add_next()

    def _add_next(self) -> None:
        i, req = self.queue[self.next]
        if self.max_concurrency is not None:  # held back, it is sent when its slot frees
            free_time, free_step = heapq.heappop(self.free_slots)
            if req.arrival_step is not None:
                req = replace(req, arrival_step=max(req.arrival_step, free_step + 1))
            else:
                req = replace(req, arrival_time=max(req.arrival_time or 0.0, free_time))
        self.ids[i] = _add(self.engine, req, i, self.temperature)
        self.in_flight.append(self.ids[i])
        self.next += 1

    @property
    def exhausted(self) -> bool:
        return self.next >= len(self.queue)


def run_workload(engine: Any, workload: Workload, progress: bool | Any = False,
                 max_steps: int | None = None, temperature: float = 0.0,
                 upfront: bool = False, max_concurrency: int | None = None) -> list[Any]:
    """Run `workload` on `engine` until every request is done (chapters 05-06).

    Requests reach the engine when their arrival step or time comes (engine clock, reset at
    the start), as online clients would send them (an open loop); `upfront=True` adds them
    all at once with `submit` instead (the engine then holds the future ones).
    `max_concurrency=N` closes the loop (vLLM's `bench serve --max-concurrency`): at most N
    requests are unfinished at once, and a request that comes due while N are is sent when
    one finishes, its arrival (and so its queue time, TTFT and E2E) counted from then.
    Requests with `cancel_after_tokens` are cancelled once they have that many tokens.
    `progress`: True for a tqdm bar, or a tqdm-like object with `update(n)`. Returns the
    engine trace."""
    if max_concurrency is not None and (not is_positive_int(max_concurrency) or upfront):
        raise ValueError("max_concurrency must be a positive integer (and needs upfront=False),"
                         f" got {max_concurrency!r}")
    if upfront:
        ids = submit(engine, workload, temperature=temperature)
        feeder = None
    else:
        engine.t0 += engine.clock()  # the engine clock restarts at 0
        feeder = _Feeder(engine, workload, temperature, max_concurrency)
        ids = [r.request_id or f"req-{i}" for i, r in enumerate(workload.requests)]
    cancel_at = {rid: r.cancel_after_tokens for rid, r in zip(ids, workload.requests)
                 if r.cancel_after_tokens is not None}
    bar, own_bar = (None if progress is False or progress is None else progress), False
    if progress is True:
        from tqdm.auto import tqdm
        bar, own_bar = tqdm(total=len(ids), desc=workload.name, unit="req", leave=False), True
    steps = idle = 0
    # A long run keeps many objects alive (the trace, the requests); Python's cyclic garbage
    # collector would rescan them every few hundred allocations. Collect less often while
    # running (a third of a simulated run's time otherwise) and restore the setting after.
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], 50_000), *thresholds[1:])
    try:
        while max_steps is None or steps < max_steps:
            if feeder is not None:
                feeder.feed()
            if not engine.has_unfinished():
                break
            record = engine.step()
            steps += 1
            for rid in record.sampled:
                limit = cancel_at.get(rid)
                req = engine.requests[rid]
                if limit is not None and len(req.output_token_ids) >= limit \
                        and not req.is_finished:
                    engine.cancel(rid)
            if bar is not None and record.finished:
                bar.update(len(record.finished))
            # dynamic batching by seconds waits on the clock: its empty steps are no stall
            idle = 0 if (record.members or record.finished or engine.running
                         or engine.waits_on_clock) else idle + 1
            if idle > engine.stall_limit:
                raise RuntimeError(f"the policy scheduled nothing for {idle} steps while "
                                   f"requests wait: {[r.request_id for r in engine.waiting][:5]}")
    finally:
        gc.set_threshold(*thresholds)
        if own_bar:
            bar.close()
    return engine.trace
