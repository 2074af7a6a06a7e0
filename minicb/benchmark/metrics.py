"""Metrics (chapters 05-06): every number of the benchmark contract, computed from plain data.

Inputs are `engine.trace` (one `StepRecord` per step) and `request_records(engine)` (one
`RequestRecord` per request; the client makes them from HTTP responses too): ids, counts and
timestamps, no engine needed.

Per request (seconds, and the same in steps where it makes sense):
    queue   first_scheduled - arrival
    TTFT    first token seen - arrival: the token's computation when the response streams; the
            release when it returns whole (a static batch, chapter 02: its user sees no token
            before the batch ends, so its TTFT is its E2E)
    ITL     gaps between consecutive deliveries of tokens (pooled over requests): tokens that
            arrive together (guesses kept in one step, chapter 08) make one gap, as a client
            that times each streamed chunk sees
    max ITL one request's worst gap (its longest stall); percentiles over requests
    TPOT    (finish - first token) / (output tokens - 1); undefined for one-token outputs
            (ITL and TPOT time the engine producing tokens, whether or not they stream)
    E2E     released - arrival: until the response reaches its user, which is the finish
            except under static batching, whose batch returns whole when its slowest member
            ends (chapter 02); records without a release time fall back to the finish

Memory pressure: preemptions, the computed tokens they threw away (discarded_tokens, the lost
work), how many of those were computed again (recomputed_tokens: the rest came back from the
prefix index), evicted_pages, cached prefix pages given up to make room (reuse lost), the pages
copied out to host memory and back under preemption_mode="swap" (swapped_out_pages,
swapped_in_pages), and rejected requests (reject_when_full: turned away at arrival, counted
among the requests that missed the SLO).

Percentiles are numpy's default definition (linear interpolation between the two nearest
ranks, `np.percentile(..., method="linear")`), over completed requests only: cancelled and
failed requests are counted, never averaged in (the oldest queue age, `max_queue_age`, counts
every request, so a long wait that ended in a cancel still shows there). Throughput divides
by the run's span, from the first arrival to the last finish: requests/s counts completed
requests, output tokens/s counts every token produced (a cancelled request's too). Goodput
counts completed requests that meet every SLO given, per second of the same span.

The PD pair, around one long prompt L (chapter 05):
    dec@P    decode tokens produced by OTHER requests while L's prefill is unfinished: the
             window runs from L's arrival step to the step its last prefill chunk ran
    short_P  from L's arrival until every short request alive with it (arrived before the
             window ended, not finished before L arrived) has finished; in steps and seconds.
             Finished, as the seed says (完成生成), not released: under static batching a
             response returns at its batch's end, and E2E, not short_P, shows that wait
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minicb.config import is_finite_number

PERCENTILES = (50, 95, 99)
PERCENTILE_METHOD = "numpy linear interpolation (np.percentile, method='linear')"
SLO_KEYS = ("ttft", "itl", "tpot", "e2e")
COMPLETED = ("stop", "length")


@dataclass
class RequestRecord:
    """A request as metrics see it: ids, lengths, timestamps."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    arrival_time: float | None
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    token_times: list[float]
    arrival_step: int | None
    first_scheduled_step: int | None
    first_token_step: int | None
    finish_step: int | None
    token_steps: list[int]
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # discarded K/V computed again (the rest came back cached)
    priority: int = 0
    released_time: float | None = None  # the response reached the user (E2E ends here)
    released_step: int | None = None
    tenant: str | None = None
    # the response reached its user all at once, at the release (a static batch, chapter 02):
    # its first token too, so TTFT ends there
    returned_whole: bool = False
    error: str | None = None  # why a failed request failed, in the server's words (client)
    num_discarded_tokens: int = 0  # computed K/V its preemptions threw away (lost work)


def request_records(engine: Any) -> list[RequestRecord]:
    """Every request of `engine` as plain data: its counts and `Request.metrics`."""
    return [RequestRecord(
        r.request_id, r.num_prompt_tokens, len(r.output_token_ids), r.finish_reason,
        num_cached_tokens=r.num_cached_tokens, num_preemptions=r.num_preemptions,
        num_recomputed_tokens=r.num_recomputed_tokens, priority=r.priority, tenant=r.tenant,
        returned_whole=r.returned_whole, num_discarded_tokens=r.num_discarded_tokens,
        **dataclasses.asdict(r.metrics)) for r in engine.requests.values()]


# ------------------------------------------------------------------------------ basics
def percentiles(values: Iterable[float], ps: Sequence[int] = PERCENTILES) -> dict[str, Any]:
    """{"p50": .., "p95": .., "p99": ..} with numpy linear interpolation; None when empty
    (chapter 05)."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return {f"p{p}": None for p in ps}
    return {f"p{p}": float(np.percentile(arr, p, method="linear")) for p in ps}


def is_completed(record: Any) -> bool:
    """Finished normally (stop or length), not cancelled, failed or unfinished (chapter 05)."""
    return record.finish_reason in COMPLETED


def queue_time(r: Any) -> float | None:
    """Seconds from arrival to first being scheduled (chapter 05)."""
    if r.arrival_time is None or r.first_scheduled_time is None:
        return None
    return r.first_scheduled_time - r.arrival_time


def first_token_seen(r: Any) -> tuple[float | None, int | None]:
    """(seconds, step) at which the user saw the first token: when it was computed, except for
    a response returned whole (a static batch, chapter 02), seen at its release."""
    if getattr(r, "returned_whole", False):
        return released(r)
    return r.first_token_time, r.first_token_step


def ttft(r: Any) -> float | None:
    """Time to first token, seconds from arrival until the user saw it (chapter 05)."""
    seen = first_token_seen(r)[0]
    if r.arrival_time is None or seen is None:
        return None
    return seen - r.arrival_time


def released(r: Any) -> tuple[float | None, int | None]:
    """(seconds, step) at which the response reached its user: the release when recorded,
    else the finish (chapter 02)."""
    time, step = r.released_time, r.released_step
    return (r.finish_time if time is None else time, r.finish_step if step is None else step)


def e2e(r: Any) -> float | None:
    """End-to-end latency, seconds from arrival until the response reached its user
    (chapter 05)."""
    end = released(r)[0]
    if r.arrival_time is None or end is None:
        return None
    return end - r.arrival_time


def tpot(r: Any) -> float | None:
    """Time per output token after the first: (finish - first token) / (n - 1); None for
    n < 2 (chapter 05)."""
    if r.num_output_tokens < 2 or r.first_token_time is None or r.finish_time is None:
        return None
    return (r.finish_time - r.first_token_time) / (r.num_output_tokens - 1)


def itls(r: Any) -> list[float]:
    """Gaps between consecutive deliveries of one request's tokens: tokens stamped with the
    same time (kept guesses, chapter 08) arrived together and make one gap (chapter 05)."""
    t = r.token_times
    return [b - a for a, b in zip(t, t[1:]) if b != a]


def max_itl(r: Any) -> float | None:
    """One request's worst gap between two tokens: the longest its user saw the output stall;
    None for fewer than two tokens (chapter 05). Pooled ITL percentiles hide a stall that only a
    few requests suffer once (a long prefill freezing every running chat for one window is a
    handful of gaps among hundreds); the percentiles of this per-request worst gap do not."""
    gaps = itls(r)
    return max(gaps) if gaps else None


def steps_between(start: int | None, end: int | None) -> int | None:
    """Steps from `start` to `end`, both counted: served in its arrival step = 1 (chapter 05)."""
    if start is None or end is None:
        return None
    return end - start + 1


def meets_slo(r: Any, slo: dict[str, float] | None) -> bool:
    """True if a completed request meets every SLO given (`ttft`, `itl`, `tpot`, `e2e`,
    seconds; `itl` bounds the request's worst gap, `max_itl`). A one-token output has no TPOT
    and no gap and passes those two (chapter 06)."""
    if not is_completed(r):
        return False
    for key, limit in (slo or {}).items():
        if limit is None:
            continue
        value = {"ttft": ttft, "itl": max_itl, "tpot": tpot, "e2e": e2e}[key](r)
        if value is None and key in ("itl", "tpot"):
            continue
        if value is None or value > limit:
            return False
    return True


def check_slo(slo: dict[str, float] | None, label: str = "slo[{key!r}]") -> dict[str, float]:
    """Validate an SLO dict: keys among ttft/itl/tpot/e2e, values positive seconds or None
    (chapter 06). `label` names a bad value in the message (the CLI's: "--slo-{key}")."""
    slo = dict(slo or {})
    for key, value in slo.items():
        if key not in SLO_KEYS:
            raise ValueError(f"slo keys must be among {SLO_KEYS}, got {key!r}")
        if value is not None and (not is_finite_number(value) or value <= 0):
            raise ValueError(f"{label.format(key=key)} must be a positive number of seconds, "
                             f"got {value!r}")
    return {k: float(v) for k, v in slo.items() if v is not None}


def sustainable_load(attainment_by_rate: dict[float, float | None],
                     target: float = 0.99) -> float | None:
    """The contract's Sustainable Load (chapter 06): the highest offered rate at which at least
    `target` of the requests met the SLO, every lower rate meeting it too (a rate that passes
    by luck above one that fails does not count). `attainment_by_rate`: rate -> the
    `slo_attainment` of a run at that rate, with the TTFT, ITL and E2E limits the contract
    names. None when the lowest rate already fails."""
    if not is_finite_number(target) or not 0 < target <= 1:
        raise ValueError(f"target must be a fraction in (0, 1], got {target!r}")
    best = None
    for rate in sorted(attainment_by_rate):
        attained = attainment_by_rate[rate]
        if attained is None or attained < target:
            break
        best = rate
    return best


def observed_arrivals(times: Sequence[float]) -> dict[str, float | None]:
    """What a list of arrival times delivers (chapter 06; a generated workload declares it as
    `observed`): the rate (arrivals after the first over the span from first to last; None
    under two distinct times), the burstiness (1 / CV^2 of the gaps; None under three
    arrivals) and the span in seconds."""
    span = max(times) - min(times)
    gaps = np.diff(sorted(times)) if len(times) > 2 else np.array([])
    cv2 = float(gaps.var() / gaps.mean() ** 2) if gaps.size and gaps.mean() > 0 else None
    return {"rate_rps": (len(times) - 1) / span if span > 0 else None,
            "burstiness": 1 / cv2 if cv2 else None, "arrival_span_s": span}


def run_span(records: Sequence[Any]) -> float:
    """Seconds from the first arrival to the last finish (0 if nothing finished) (chapter 05)."""
    arrivals = [r.arrival_time for r in records if r.arrival_time is not None]
    finishes = [r.finish_time for r in records if r.finish_time is not None]
    if not arrivals or not finishes:
        return 0.0
    return max(0.0, max(finishes) - min(arrivals))


# ------------------------------------------------------------------------------ trace helpers
def dead_slot_steps(trace: Sequence[Any]) -> int:
    """Member-steps spent idle: a static batch's finished members still holding their slot
    (chapter 02; R1's ~170 dead steps in the chapter's example)."""
    return sum(1 for rec in trace for m in rec.members if m.kind == "idle")


def batch_sizes(trace: Sequence[Any]) -> list[int]:
    """Members that advanced at least one token, per step (chapters 02-03)."""
    return [sum(1 for m in rec.members if m.num_tokens > 0) for rec in trace]


def steps_that_ran(trace: Sequence[Any]) -> list[Any]:
    """The steps that ran the model: not the empty ones of dynamic batching waiting on the
    clock (chapter 06)."""
    return [rec for rec in trace if any(m.num_tokens > 0 for m in rec.members)]


def speculation(trace: Sequence[Any]) -> dict[str, Any]:
    """Speculative decoding (chapter 08): tokens guessed, guesses the model kept, and the share
    kept (None when nothing was guessed)."""
    guessed = kept = 0
    for rec in trace:
        for drafted, accepted in getattr(rec, "speculated", {}).values():
            guessed, kept = guessed + drafted, kept + accepted
    return {"draft_tokens": guessed, "accepted_draft_tokens": kept,
            "draft_acceptance_rate": kept / guessed if guessed else None}


def tokens_per_step(trace: Sequence[Any]) -> list[tuple[int, int]]:
    """(prefill tokens, decode tokens) per step: the token budget picture (chapters 04-05)."""
    return [(rec.num_prefill_tokens, rec.num_decode_tokens) for rec in trace]


def token_mix(trace: Sequence[Any]) -> dict[str, Any]:
    """What the steps that ran the model actually processed (chapters 05-06; the contract:
    the kinds and counts of tokens per iteration must be measured): prefill tokens, decode
    tokens (decode positions, kept and rejected guesses included) and decode rows (one per
    decode member and step), steps that mixed prefill and decode (count and share of steps),
    the share of decode tokens computed in such a step, and mean tokens per step. Shares are
    None when there is nothing to divide."""
    ran = steps_that_ran(trace)
    prefill = sum(rec.num_prefill_tokens for rec in ran)
    decode = sum(rec.num_decode_tokens for rec in ran)
    mixed = [rec for rec in ran if rec.num_prefill_tokens and rec.num_decode_tokens]
    return {"prefill_tokens": prefill, "decode_tokens": decode,
            "decode_rows": sum(1 for rec in ran for m in rec.members if m.kind == "decode"),
            "mixed_steps": len(mixed),
            "mixed_step_share": len(mixed) / len(ran) if ran else None,
            "decode_share_in_mixed_steps": (sum(rec.num_decode_tokens for rec in mixed) / decode
                                            if decode else None),
            "mean_tokens_per_step": (prefill + decode) / len(ran) if ran else None}


def resource_use(trace: Sequence[Any], num_pages: int,
                 max_num_batched_tokens: int) -> dict[str, float | None]:
    """How full the engine ran (chapter 06; the contract: watch more than device utilisation):
    the KV pool's share in use by running requests after each step that ran the model (mean
    and peak; cached pages kept for reuse not counted) and the token budget's mean share."""
    ran = steps_that_ran(trace)
    if not ran:
        return {"kv_pool_use_mean": None, "kv_pool_use_peak": None, "token_budget_use_mean": None}
    return {"kv_pool_use_mean": float(np.mean([r.pages_used for r in ran])) / num_pages,
            "kv_pool_use_peak": max(r.pages_used for r in ran) / num_pages,
            "token_budget_use_mean": float(np.mean([r.num_tokens for r in ran]))
            / max_num_batched_tokens}


def host_time_fraction(trace: Sequence[Any]) -> float | None:
    """1 - sum(t_forward) / sum(step durations): the share of step time spent outside the
    model (chapter 06)."""
    total = sum(rec.duration for rec in trace)
    if total <= 0:
        return None
    return 1.0 - sum(rec.t_forward for rec in trace) / total


def decode_tokens_per_s(trace: Sequence[Any]) -> float | None:
    """Decode speed: decode tokens / seconds, over the steps that ran only decode rows (so a
    prefill chunk sharing the step does not count against it). None if there are none
    (chapter 05)."""
    steps = [rec for rec in trace if rec.members and rec.num_prefill_tokens == 0
             and rec.num_decode_tokens > 0]
    seconds = sum(rec.duration for rec in steps)
    if not steps or seconds <= 0:
        return None
    return sum(decode_tokens_produced(rec) for rec in steps) / seconds


def decode_tokens_produced(rec: Any) -> int:
    """Output tokens a step's decode members got: one each, plus the guesses kept (chapter 08)."""
    return sum(m.kind == "decode" for m in rec.members) + sum(
        k for _, k in rec.speculated.values())


def max_queue_age(records: Sequence[Any], end_time: float | None = None,
                  end_step: int | None = None) -> tuple[float | None, int | None]:
    """The oldest wait before first being scheduled, in seconds and steps (starvation): for a
    request never scheduled, until it finished (cancelled) or until the end of the run
    (chapter 06). Every request counts, cancelled ones too, so a user who gave up waiting shows
    here though the percentiles leave them out. A preempted request's second wait shows in its
    worst gap between tokens (`max_itl`), not here; `max_preemptions` bounds how often."""
    ages: list[float] = []
    steps: list[int] = []
    def first(*values: Any) -> Any:
        return next((v for v in values if v is not None), None)

    for r in records:
        if r.first_scheduled_time is None and r.first_token_time is not None:
            continue  # scheduled, but nobody saw when (a client's record): its age is unknown
        until = first(r.first_scheduled_time, r.finish_time, end_time)
        if r.arrival_time is not None and until is not None:
            ages.append(until - r.arrival_time)
        until_step = first(r.first_scheduled_step, r.finish_step, end_step)
        if r.arrival_step is not None and until_step is not None:
            steps.append(until_step - r.arrival_step)
    return (max(ages) if ages else None), (max(steps) if steps else None)


# ------------------------------------------------------------------------------ dec@P, short_P
def long_prefill_metrics(trace: Sequence[Any], records: Sequence[Any],
                         long_request_id: str | None) -> dict[str, Any]:
    """dec@P and short_P around the long request (chapter 05; definitions in the module text).

    Returns dec_at_p (tokens), prefill_window_steps/_s, dec_at_p_per_s (dec@P over the
    window's seconds), short_p_steps, short_p_s and the short ids counted. All None when
    `long_request_id` is None; short_p_* None while a counted short request is unfinished."""
    keys = ("dec_at_p", "dec_at_p_per_s", "prefill_window_steps", "prefill_window_s",
            "short_p_steps", "short_p_s")
    out: dict[str, Any] = {k: None for k in keys}
    out["short_request_ids"] = []
    if long_request_id is None:
        return out
    by_id = {r.request_id: r for r in records}
    if long_request_id not in by_id:
        raise ValueError(f"long_request_id {long_request_id!r} is not among the records")
    long = by_id[long_request_id]
    start = long.arrival_step
    if start is None:
        return out
    end = long.first_token_step if long.first_token_step is not None else long.finish_step
    if end is None:  # the prefill never finished (run cut short)
        end = trace[-1].step if trace else start
    window = [rec for rec in trace if start <= rec.step <= end]
    out["dec_at_p"] = sum(1 + rec.speculated.get(m.request_id, (0, 0))[1]
                          for rec in window for m in rec.members
                          if m.kind == "decode" and m.request_id != long_request_id)
    out["prefill_window_steps"] = end - start + 1
    if window and long.arrival_time is not None:
        seconds = window[-1].t_end - long.arrival_time
        out["prefill_window_s"] = seconds
        out["dec_at_p_per_s"] = out["dec_at_p"] / seconds if seconds > 0 else None
    shorts = [r for r in records if r.request_id != long_request_id
              and r.arrival_step is not None and r.arrival_step <= end
              and (r.finish_step is None or r.finish_step >= start)]
    out["short_request_ids"] = [r.request_id for r in shorts]
    if not shorts:
        out["short_p_steps"] = out["short_p_s"] = 0
        return out
    if any(r.finish_step is None for r in shorts):
        return out
    out["short_p_steps"] = max(r.finish_step for r in shorts) - start + 1
    if long.arrival_time is not None and all(r.finish_time is not None for r in shorts):
        out["short_p_s"] = max(r.finish_time for r in shorts) - long.arrival_time
    return out


# ------------------------------------------------------------------------------ per class
PROMPT_BUCKETS = (0, 128, 512, 2048)  # chapter 06's prompt-length buckets, by lower bound


def prompt_bucket(num_prompt_tokens: int) -> str:
    """The prompt-length class of a request: "0-127", "128-511", "512-2047" or "2048+"."""
    low = max(b for b in PROMPT_BUCKETS if b <= num_prompt_tokens)
    bigger = [b for b in PROMPT_BUCKETS if b > low]
    return f"{low}-{bigger[0] - 1}" if bigger else f"{low}+"


CLASSES = {"prompt_tokens": lambda r: prompt_bucket(r.num_prompt_tokens),
           "tenant": lambda r: "(none)" if r.tenant is None else str(r.tenant),
           "priority": lambda r: str(r.priority)}


def by_class(records: Sequence[Any], slo: dict[str, float] | None = None
             ) -> dict[str, dict[str, dict[str, Any]]]:
    """The contract's fairness per class (chapter 06: FCFS is fair to arrival order, not to
    prompt length, tenant or priority class): for each grouping in `CLASSES` that has more than
    one class among `records`, each class's requests, completed requests, TTFT p50/p99, queue
    p99 and E2E p99 (over its completed requests, as in `summarize`) and, with an SLO, the share
    of its not-cancelled requests that met it."""
    slo = check_slo(slo)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for grouping, key in CLASSES.items():
        classes: dict[str, list[Any]] = {}
        for r in records:
            classes.setdefault(key(r), []).append(r)
        if len(classes) < 2:
            continue
        rows = {}
        for name, mine in sorted(classes.items(), key=lambda kv: _class_order(kv[0])):
            done = [r for r in mine if is_completed(r)]
            ttfts = percentiles((v for v in map(ttft, done) if v is not None), (50, 99))
            not_cancelled = [r for r in mine if r.finish_reason != "cancelled"]
            rows[name] = {
                "requests": len(mine), "completed": len(done),
                "ttft_p50_s": ttfts["p50"], "ttft_p99_s": ttfts["p99"],
                "queue_p99_s": percentiles((v for v in map(queue_time, done) if v is not None),
                                           (99,))["p99"],
                "e2e_p99_s": percentiles((v for v in map(e2e, done) if v is not None),
                                         (99,))["p99"],
                "slo_attainment": (sum(1 for r in done if meets_slo(r, slo))
                                   / len(not_cancelled) if slo and not_cancelled else None)}
        out[grouping] = rows
    return out


def worst_class(classes: dict[str, dict[str, dict[str, Any]]]) -> tuple[str, float] | None:
    """The class that met the SLO least often across `by_class`'s groupings, as
    ("prompt_tokens=2048+", 0.41) (chapter 06: the sweep's class-fairness limit); None without
    an SLO or when every grouping holds one class. Ties go to the first in `by_class` order."""
    found = [(f"{grouping}={name}", row["slo_attainment"])
             for grouping, rows in classes.items() for name, row in rows.items()
             if row["slo_attainment"] is not None]
    return min(found, key=lambda item: item[1]) if found else None


def _class_order(name: str) -> tuple[int, float, str]:
    """Classes in a readable order: numbers (buckets, priorities) by value, then names."""
    for text in (name, name.split("-")[0].rstrip("+")):  # "-1", "128-511", "2048+"
        try:
            return (0, float(text), name)
        except ValueError:
            pass
    return (1, 0.0, name)


# ------------------------------------------------------------------------------ summary
def summarize(trace: Sequence[Any], records: Sequence[Any], slo: dict[str, float] | None = None,
              long_request_id: str | None = None) -> dict[str, Any]:
    """Every metric of the results schema from a trace and its request records (chapters
    05-06). `slo`: {"ttft": s, "itl": s, "tpot": s, "e2e": s}, any subset; goodput counts completed
    requests meeting all of them, per second of the run's span."""
    slo = check_slo(slo)
    records = list(records)
    done = [r for r in records if is_completed(r)]
    span = run_span(records)
    output_tokens = sum(r.num_output_tokens for r in records)
    # the contract's token throughput counts the input too (vLLM's "total token throughput"):
    # the prompts that were served, i.e. that got their first token
    prompt_tokens = sum(r.num_prompt_tokens for r in records if r.first_token_time is not None)
    end_time = trace[-1].t_end if trace else None
    end_step = trace[-1].step if trace else None
    age_s, age_steps = max_queue_age(records, end_time, end_step)
    met = [r for r in done if meets_slo(r, slo)]
    not_cancelled = [r for r in records if r.finish_reason != "cancelled"]
    sizes = [b for b in batch_sizes(trace) if b]  # one per step that ran the model

    def per_s(count: float) -> float | None:
        return count / span if span > 0 else None

    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(done),
        "cancelled": sum(1 for r in records if r.finish_reason == "cancelled"),
        "errors": sum(1 for r in records if r.finish_reason == "error"),
        "deadline_missed": sum(1 for r in records if r.finish_reason == "deadline"),
        "rejected": sum(1 for r in records if r.finish_reason == "rejected"),
        "unfinished": sum(1 for r in records if r.finish_reason is None),
        # steps that ran the model: not the empty ones of dynamic batching waiting on the clock
        "num_steps": len(sizes),
        "duration_s": span,
        "output_tokens": output_tokens,
        "output_tokens_per_s": per_s(output_tokens),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_per_s": per_s(prompt_tokens),
        "total_tokens_per_s": per_s(prompt_tokens + output_tokens),
        "requests_per_s": per_s(len(done)),
        "output_tokens_per_step": output_tokens / len(sizes) if sizes else None,
        "decode_tokens_per_s": decode_tokens_per_s(trace),
        **token_mix(trace),
        **speculation(trace),
        "host_time_fraction": host_time_fraction(trace),
        "ttft_s": percentiles(v for v in map(ttft, done) if v is not None),
        "itl_s": percentiles(g for r in done for g in itls(r)),
        "max_itl_s": percentiles(v for v in map(max_itl, done) if v is not None),
        "tpot_s": percentiles(v for v in map(tpot, done) if v is not None),
        "e2e_s": percentiles(v for v in map(e2e, done) if v is not None),
        "queue_s": percentiles(v for v in map(queue_time, done) if v is not None),
        "ttft_steps": percentiles(v for v in (steps_between(r.arrival_step,
                                                            first_token_seen(r)[1])
                                              for r in done) if v is not None),
        "e2e_steps": percentiles(v for v in (steps_between(r.arrival_step, released(r)[1])
                                             for r in done) if v is not None),
        "queue_steps": percentiles(r.first_scheduled_step - r.arrival_step for r in done
                                   if r.first_scheduled_step is not None
                                   and r.arrival_step is not None),
        "slo": slo,
        "slo_met": len(met),
        "slo_attainment": len(met) / len(not_cancelled) if not_cancelled else None,
        "goodput_rps": per_s(len(met)),
        "preemptions": sum(r.num_preemptions for r in records),
        # cached prefix pages given up for new work: prefix reuse lost to memory pressure
        "evicted_pages": sum(rec.pages_evicted for rec in trace),
        "discarded_tokens": sum(r.num_discarded_tokens for r in records),
        "recomputed_tokens": sum(r.num_recomputed_tokens for r in records),
        "swapped_out_pages": sum(rec.pages_swapped_out for rec in trace),
        "swapped_in_pages": sum(rec.pages_swapped_in for rec in trace),
        "max_queue_age_s": age_s,
        "max_queue_age_steps": age_steps,
        "dead_slot_steps": dead_slot_steps(trace),
        "mean_batch_size": float(np.mean(sizes)) if sizes else None,
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in records),
        "by_class": by_class(records, slo),
        "percentile_method": PERCENTILE_METHOD,
    }
    summary.update(long_prefill_metrics(trace, records, long_request_id))
    return summary


def per_request(records: Sequence[Any]) -> list[dict[str, Any]]:
    """One row per request (id, status, lengths, queue/TTFT/TPOT/E2E in seconds and steps):
    the table a chapter shows before it shows percentiles (chapter 05)."""
    rows = []
    for r in records:
        rows.append({
            "request_id": r.request_id, "finish_reason": r.finish_reason,
            "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
            "queue_s": queue_time(r), "ttft_s": ttft(r), "tpot_s": tpot(r), "e2e_s": e2e(r),
            "arrival_step": r.arrival_step,
            "ttft_steps": steps_between(r.arrival_step, first_token_seen(r)[1]),
            "e2e_steps": steps_between(r.arrival_step, released(r)[1]),
            "preemptions": r.num_preemptions,
        })
    return rows


# ------------------------------------------------------------------------------ tables
TABLE_COLUMNS = (
    ("output_tokens_per_s", "out tok/s", "{:.1f}"),
    ("requests_per_s", "req/s", "{:.2f}"),
    ("ttft_s.p50", "TTFT p50", "{:.3f}"),
    ("ttft_s.p99", "TTFT p99", "{:.3f}"),
    ("tpot_s.p50", "TPOT p50", "{:.4f}"),
    ("itl_s.p99", "ITL p99", "{:.4f}"),
    ("max_itl_s.p99", "max ITL p99", "{:.3f}"),
    ("e2e_s.p50", "E2E p50", "{:.3f}"),
    ("e2e_s.p99", "E2E p99", "{:.3f}"),
    ("queue_s.p99", "queue p99", "{:.3f}"),
    ("goodput_rps", "goodput", "{:.2f}"),
    ("num_steps", "steps", "{}"),
    ("preemptions", "preempt", "{}"),
)

# the contract's p50/p95/p99 of every latency, one row per policy (bench prints it under
# TABLE_COLUMNS' table)
LATENCY_COLUMNS = tuple(
    (f"{key}.p{p}", f"{title} p{p}", fmt) for key, title, fmt in (
        ("queue_s", "queue", "{:.3f}"), ("ttft_s", "TTFT", "{:.3f}"),
        ("tpot_s", "TPOT", "{:.4f}"), ("itl_s", "ITL", "{:.4f}"), ("e2e_s", "E2E", "{:.3f}"))
    for p in PERCENTILES)


def lookup(summary: dict[str, Any], dotted: str) -> Any:
    """summary["ttft_s"]["p50"] as lookup(summary, "ttft_s.p50"); None if missing (chapter 05)."""
    value: Any = summary
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def format_table(results: dict[str, dict[str, Any]],
                 columns: Sequence[tuple[str, str, str]] = TABLE_COLUMNS) -> str:
    """A plain-text table, one row per policy (or run), for terminals and notebooks (chapter 05)."""
    header = ["policy"] + [title for _, title, _ in columns]
    rows = [header]
    for name, summary in results.items():
        row = [name]
        for key, _, fmt in columns:
            value = lookup(summary, key)
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
