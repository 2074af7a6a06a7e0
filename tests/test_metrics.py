"""metrics.py on hand-built traces: every number checked against a value computed by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from helpers import approx, rec, step

from minicb.benchmark import metrics
from minicb.course import viz
from minicb.trace import StepRecord


# --------------------------------------------------------------------------- basics
def test_percentiles_linear_interpolation():
    """Percentiles interpolate linearly between ranks (p50, p95, p99 of 1..4 are 2.5, 3.85, 3.97);
    no values give None and one value gives itself."""
    p = metrics.percentiles([1.0, 2.0, 3.0, 4.0])
    # rank = p/100 * (n-1): p50 -> 1.5 -> 2.5; p95 -> 2.85 -> 3.85; p99 -> 2.97 -> 3.97
    assert p == {"p50": approx(2.5), "p95": approx(3.85), "p99": approx(3.97)}
    assert metrics.percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert metrics.percentiles([7.0]) == {"p50": 7.0, "p95": 7.0, "p99": 7.0}


def hand_records():
    a = rec("A", 3, arrival=0.0, sched=0.5, first=1.0, finish=2.5, times=[1.0, 1.5, 2.5],
            a_step=1, s_step=2, f_step=3, fin_step=6, steps=[3, 4, 6])
    b = rec("B", 1, arrival=1.0, sched=1.0, first=2.5, finish=2.5, times=[2.5],
            a_step=2, s_step=2, f_step=6, fin_step=6, steps=[6])
    c = rec("C", 2, reason="cancelled", arrival=0.0, sched=0.1, first=0.2, finish=3.0,
            times=[0.2, 0.3], a_step=1, s_step=1, f_step=1, fin_step=7, steps=[1, 2])
    d = rec("D", 0, reason="error", arrival=0.5, sched=0.6, finish=0.7, a_step=1, s_step=1,
            fin_step=1, preempt=2, recomputed=40)
    return [a, b, c, d]


def test_per_request_latencies_by_hand():
    """Queue time, TTFT, end-to-end time, TPOT and inter-token gaps come from a request's
    timestamps; a one-token output has no TPOT, and a cancelled request is not completed."""
    a, b, c, _ = hand_records()
    assert metrics.queue_time(a) == 0.5
    assert metrics.ttft(a) == 1.0
    assert metrics.e2e(a) == 2.5
    assert metrics.tpot(a) == approx((2.5 - 1.0) / 2)
    assert metrics.itls(a) == [0.5, 1.0]
    assert metrics.tpot(b) is None  # one output token: TPOT undefined
    assert metrics.ttft(b) == 1.5
    assert not metrics.is_completed(c)


def test_summarize_by_hand():
    """The summary counts completed, cancelled and failed requests, divides tokens by the span from
    first arrival to last finish, counts prompt tokens in the token throughput, and takes
    latencies over completed requests only."""
    records = hand_records()
    s = metrics.summarize([], records)
    assert (s["num_requests"], s["completed"], s["cancelled"], s["errors"]) == (4, 2, 1, 1)
    # span: first arrival 0.0 to last finish 3.0 (the cancelled one)
    assert s["duration_s"] == 3.0
    assert s["requests_per_s"] == approx(2 / 3)
    assert s["output_tokens"] == 3 + 1 + 2 + 0
    assert s["output_tokens_per_s"] == approx(6 / 3)
    # token throughput counts the prompts served too (8 tokens each; D never got a token)
    assert s["prompt_tokens"] == 24 and s["prompt_tokens_per_s"] == approx(24 / 3)
    assert s["total_tokens_per_s"] == approx((24 + 6) / 3)
    # latencies over completed requests only (A and B): cancelled C and failed D left out
    assert s["ttft_s"]["p50"] == approx(1.25)
    assert s["e2e_s"]["p50"] == approx((2.5 + 1.5) / 2)
    assert s["queue_s"]["p50"] == approx(0.25)
    assert s["tpot_s"] == {"p50": approx(0.75), "p95": approx(0.75), "p99": approx(0.75)}
    assert s["itl_s"]["p50"] == approx(0.75)  # A's gaps 0.5 and 1.0; B has none
    assert s["max_itl_s"]["p50"] == 1.0  # A's worst gap; B has no gap to count
    assert s["preemptions"] == 2 and s["recomputed_tokens"] == 40
    # oldest wait before first scheduled: A waited 0.5 s; in steps A waited 1
    assert s["max_queue_age_s"] == 0.5 and s["max_queue_age_steps"] == 1
    assert s["ttft_steps"]["p50"] == approx((3 + 5) / 2)  # A: steps 1..3, B: steps 2..6
    assert s["goodput_rps"] == approx(2 / 3)  # no SLO: every completed request counts


def test_goodput_at_slo():
    """Goodput counts completed requests that meet every given SLO (a request with no TPOT meets a
    TPOT SLO), and attainment divides by the requests not cancelled."""
    records = hand_records()
    s = metrics.summarize([], records, slo={"ttft": 1.2})
    assert s["slo_met"] == 1 and s["goodput_rps"] == approx(1 / 3)  # A only (B: 1.5 s)
    s = metrics.summarize([], records, slo={"tpot": 0.5})
    assert s["slo_met"] == 1  # A fails (0.75 s); B has no TPOT and passes that SLO
    s = metrics.summarize([], records, slo={"ttft": 2.0, "tpot": 1.0, "e2e": 2.6})
    assert s["slo_met"] == 2
    assert s["slo_attainment"] == approx(2 / 3)  # over the 3 requests not cancelled
    s = metrics.summarize([], records, slo={"ttft": 0.1, "e2e": 0.2})
    assert s["slo_met"] == 0 and s["goodput_rps"] == 0.0 and s["slo_attainment"] == 0.0


def test_sustainable_load_is_the_highest_rate_met_with_every_lower_one():
    """The sustainable load is the highest rate whose attainment, and every lower rate's, reaches
    the target; none met gives None, and a target outside (0, 1] is refused."""
    assert metrics.sustainable_load({10: 1.0, 12: 0.995, 14: 0.98, 16: 0.9}) == 12
    assert metrics.sustainable_load({16: 0.9, 10: 1.0, 12: 0.99}) == 12  # order of the dict
    assert metrics.sustainable_load({10: 1.0, 12: 0.95, 14: 0.999}) == 10  # 14 passed by luck
    assert metrics.sustainable_load({10: 0.5}) is None
    assert metrics.sustainable_load({10: 1.0, 12: None}) == 10  # nothing completed at 12
    assert metrics.sustainable_load({10: 0.96, 12: 0.9}, target=0.95) == 10
    for bad in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="target"):
            metrics.sustainable_load({10: 1.0}, target=bad)


def test_itl_slo_bounds_each_requests_worst_gap():
    """An ITL SLO bounds each request's largest inter-token gap; a request with no gap meets it."""
    records = hand_records()
    assert metrics.max_itl(records[0]) == 1.0 and metrics.max_itl(records[1]) is None
    assert metrics.summarize([], records, slo={"itl": 0.9})["slo_met"] == 1  # B only: no gap
    assert metrics.summarize([], records, slo={"itl": 1.0})["slo_met"] == 2


def test_one_stall_shows_in_max_itl_but_not_in_pooled_itl():
    """Nine requests with 100 even gaps each; one of them stalls once for 5 s. Pooled over
    ~1,000 gaps the stall is below p99; per request it is the worst gap of 1 in 10."""
    records = []
    for i in range(10):
        times = [0.1 * k for k in range(101)]
        if i == 0:
            times = times[:50] + [t + 5.0 for t in times[50:]]
        records.append(rec(f"r{i}", 101, first=times[0], finish=times[-1], times=times))
    s = metrics.summarize([], records)
    assert s["itl_s"]["p99"] == approx(0.1)
    assert s["max_itl_s"]["p99"] > 4.5 and s["max_itl_s"]["p50"] == approx(0.1)
    assert metrics.summarize([], records, slo={"itl": 1.0})["slo_met"] == 9


@pytest.mark.parametrize("slo, match", [({"latency": 1.0}, "slo keys"),
                                        ({"ttft": -1.0}, "positive"),
                                        ({"tpot": "fast"}, "positive"),
                                        ({"ttft": float("nan")}, "positive"),
                                        ({"e2e": float("inf")}, "positive"),
                                        ({"itl": True}, "positive")])
def test_bad_slo_is_refused(slo, match):
    """An SLO with an unknown key or a value that is not a positive finite number is refused, naming
    the problem."""
    with pytest.raises(ValueError, match=match):
        metrics.summarize([], hand_records(), slo=slo)


def test_empty_run():
    """An empty run summarizes to zero requests with rates, percentiles and dec@P as None."""
    s = metrics.summarize([], [])
    assert s["num_requests"] == 0 and s["requests_per_s"] is None
    assert s["ttft_s"]["p99"] is None and s["dec_at_p"] is None


def test_only_one_token_outputs_have_no_tpot():
    """When every output is one token, TPOT and ITL percentiles are None and a TPOT SLO is met."""
    r = rec("X", 1, arrival=0.0, sched=0.0, first=0.2, finish=0.2, times=[0.2])
    s = metrics.summarize([], [r], slo={"tpot": 1e-6})
    assert s["tpot_s"]["p50"] is None and s["itl_s"]["p50"] is None
    assert s["slo_met"] == 1


# --------------------------------------------------------------------------- dec@P, short_P
def pd_like_trace(interleave: bool):
    """S0 finishes at step 1; S1, S2 decode; L (2 prefill chunks) arrives at step 2; S3 arrives
    at step 5, after L's window. interleave=True is PD (decodes ride along), False is
    prefill-first chunked (decodes wait during L's chunks)."""
    d = "decode"
    steps = [step(1, [("S0", d, 1, 0), ("S1", d, 1, 1), ("S2", d, 1, 2)], 0.0, 1.0)]
    if interleave:
        steps += [step(2, [("S1", d, 1, 1), ("S2", d, 1, 2), ("L", "prefill", 50, 0)], 1.0, 2.0),
                  step(3, [("S1", d, 1, 1), ("S2", d, 1, 2), ("L", "prefill", 50, 0)], 2.0, 3.0),
                  step(4, [("S1", d, 1, 1), ("S2", d, 1, 2), ("L", d, 1, 0)], 3.0, 4.0),
                  step(5, [("S2", d, 1, 2), ("L", d, 1, 0), ("S3", "prefill", 4, 1)], 4.0, 5.0)]
        fin = {"S1": (4, 4.0), "S2": (5, 5.0)}
        first_l = 3
    else:
        steps += [step(2, [("L", "prefill", 50, 0)], 1.0, 2.0),
                  step(3, [("L", "prefill", 50, 0)], 2.0, 3.0),
                  step(4, [("S1", d, 1, 1), ("S2", d, 1, 2), ("L", d, 1, 0)], 3.0, 4.0),
                  step(5, [("S1", d, 1, 1), ("S2", d, 1, 2), ("L", d, 1, 0)], 4.0, 5.0),
                  step(6, [("S2", d, 1, 2), ("S3", "prefill", 4, 1)], 5.0, 6.0)]
        fin = {"S1": (5, 5.0), "S2": (6, 6.0)}
        first_l = 3
    records = [rec("S0", 4, a_step=1, arrival=0.0, sched=0.0, first=0.0, finish=1.0,
                   f_step=1, fin_step=1),
               rec("L", 3, a_step=2, arrival=1.0, sched=1.0, first=3.0, finish=6.0,
                   f_step=first_l, fin_step=6),
               rec("S3", 2, a_step=5, arrival=4.0, sched=4.0, first=5.0, finish=7.0,
                   f_step=5, fin_step=7)]
    for rid, (fs, ft) in fin.items():
        records.append(rec(rid, 9, a_step=1, arrival=0.0, sched=0.0, first=0.5, finish=ft,
                           f_step=1, fin_step=fs))
    return steps, records


def test_dec_at_p_and_short_p_pd():
    """Under interleaving, dec@P counts the decode tokens in the long prompt's prefill window, and
    short_P spans the short requests alive in that window, in steps and seconds."""
    trace, records = pd_like_trace(interleave=True)
    m = metrics.long_prefill_metrics(trace, records, "L")
    assert m["dec_at_p"] == 4  # steps 2 and 3: S1 and S2 decode one token each
    assert m["prefill_window_steps"] == 2 and m["prefill_window_s"] == 2.0
    assert m["dec_at_p_per_s"] == 2.0
    # S0 finished before L arrived; S3 arrived after the window ended: neither counts
    assert sorted(m["short_request_ids"]) == ["S1", "S2"]
    assert m["short_p_steps"] == 5 - 2 + 1 and m["short_p_s"] == 5.0 - 1.0


def test_dec_at_p_counts_kept_guesses():
    """A decode that kept 2 guessed tokens in a step delivered 3 tokens there (chapter 08)."""
    trace, records = pd_like_trace(interleave=True)
    trace[1].speculated = {"S1": (3, 2)}  # step 2, inside L's prefill window
    assert metrics.long_prefill_metrics(trace, records, "L")["dec_at_p"] == 4 + 2


def test_dec_at_p_and_short_p_prefill_first():
    """Under prefill-first no decode runs in the long prompt's prefill window (dec@P is 0), and
    short_P lasts longer; summarize reports the same."""
    trace, records = pd_like_trace(interleave=False)
    m = metrics.long_prefill_metrics(trace, records, "L")
    assert m["dec_at_p"] == 0
    assert m["short_p_steps"] == 6 - 2 + 1 and m["short_p_s"] == 6.0 - 1.0
    s = metrics.summarize(trace, records, long_request_id="L")
    assert s["dec_at_p"] == 0 and s["short_p_steps"] == 5


def test_dec_at_p_unknown_long_id():
    """A long request id not in the records is refused; no long id gives dec@P as None."""
    trace, records = pd_like_trace(True)
    with pytest.raises(ValueError, match="long_request_id"):
        metrics.long_prefill_metrics(trace, records, "nobody")
    assert metrics.long_prefill_metrics(trace, records, None)["dec_at_p"] is None


def test_short_p_unfinished_short_is_none():
    """short_P is None while a short request in the window is unfinished; dec@P is still counted."""
    trace, records = pd_like_trace(True)
    records = [r for r in records if r.request_id != "S2"]
    records.append(rec("S2", 9, reason=None, a_step=1, arrival=0.0, sched=0.0, f_step=1))
    m = metrics.long_prefill_metrics(trace, records, "L")
    assert m["short_p_steps"] is None and m["dec_at_p"] == 4


# --------------------------------------------------------------------------- trace helpers
def test_dead_slots_batch_sizes_host_time_decode_speed():
    """Per-step helpers count idle slots, batch sizes, prefill and decode tokens, host time and
    decode speed from the trace, and the summary leaves out steps that scheduled nothing."""
    trace = [step(1, [("A", "prefill", 10, 0), ("B", "prefill", 6, 1)], 0.0, 1.0, 0.5),
             step(2, [("A", "decode", 1, 0), ("B", "decode", 1, 1)], 1.0, 1.5, 0.25),
             step(3, [("A", "idle", 0, 0), ("B", "decode", 1, 1)], 1.5, 2.0, 0.25)]
    assert metrics.dead_slot_steps(trace) == 1
    assert metrics.batch_sizes(trace) == [2, 2, 1]
    assert metrics.tokens_per_step(trace) == [(16, 0), (0, 2), (0, 1)]
    assert metrics.host_time_fraction(trace) == approx(1 - 1.0 / 2.0)
    assert metrics.decode_tokens_per_s(trace) == approx(3 / 1.0)  # steps 2 and 3 only
    assert metrics.host_time_fraction([]) is None and metrics.decode_tokens_per_s([]) is None
    # dynamic batching waiting on the clock: steps that scheduled nothing ran no model
    waiting = [step(4, [], 2.0, 2.001, 0.0), step(5, [], 2.001, 2.002, 0.0)]
    s = metrics.summarize(trace + waiting, hand_records())
    assert s["num_steps"] == 3 and s["mean_batch_size"] == approx(5 / 3)


def test_queue_age_counts_requests_never_scheduled():
    """The oldest queue age counts requests never scheduled, up to their finish or the run's end; a
    record with no arrival step gives None."""
    waiting = rec("W", 0, reason="cancelled", arrival=1.0, finish=4.5, a_step=2, fin_step=9)
    still = rec("Z", 0, reason=None, arrival=2.0, a_step=3)
    age_s, age_steps = metrics.max_queue_age([waiting, still], end_time=5.0, end_step=10)
    assert age_s == 3.5 and age_steps == 7
    # a client's record: it got tokens, so it was scheduled, but nobody saw when
    seen_by_a_client = rec("C", 3, arrival=0.0, first=0.2, finish=9.0, times=[0.2, 5.0, 9.0],
                           a_step=None)
    assert metrics.max_queue_age([seen_by_a_client]) == (None, None)


def test_format_table_and_lookup():
    """format_table writes a header, a rule and one row per policy; lookup follows a dotted key and
    gives None for a missing one; per_request has one row per request."""
    s = metrics.summarize([], hand_records())
    table = metrics.format_table({"pd": s, "static": s})
    lines = table.splitlines()
    assert lines[0].startswith("policy") and len(lines) == 4
    assert metrics.lookup(s, "ttft_s.p50") == s["ttft_s"]["p50"]
    assert metrics.lookup(s, "nope.p50") is None
    rows = metrics.per_request(hand_records())
    assert rows[0]["request_id"] == "A" and math.isclose(rows[0]["tpot_s"], 0.75)


def test_evicted_pages_are_summed_over_the_steps():
    """The summary's evicted pages are the sum over the steps' evictions (0 for no steps)."""
    trace = [step(i, [(rid, "prefill", 4, i - 1)], i - 1.0, float(i))
             for i, rid in enumerate("ABC", start=1)]
    trace[1].pages_evicted, trace[2].pages_evicted = 2, 1
    assert metrics.summarize(trace, [])["evicted_pages"] == 3
    assert metrics.summarize([], [])["evicted_pages"] == 0


def test_a_response_returned_whole_shows_its_first_token_at_the_release():
    """A static batch returns whole: its user sees no token before the release, so TTFT ends
    there (in seconds and in steps); ITL and TPOT still time the engine producing the tokens,
    and a streamed response is unchanged."""
    times = [1.0, 1.1, 1.2]
    streamed = rec("s", 3, first=1.0, finish=1.2, times=times, arrival=0.5)
    held = replace(streamed, request_id="h", returned_whole=True, released_time=3.0,
                   arrival_step=1, first_token_step=2, finish_step=4, released_step=9)
    assert metrics.ttft(streamed) == approx(0.5) and metrics.ttft(held) == approx(2.5)
    assert metrics.ttft(held) == metrics.e2e(held)
    assert metrics.tpot(held) == metrics.tpot(streamed) and metrics.itls(held) == approx([0.1] * 2)
    in_steps = metrics.steps_between(1, 9)  # arrival step to release step, not to step 2
    assert metrics.per_request([held])[0]["ttft_steps"] == in_steps == 9
    assert metrics.summarize([], [held])["ttft_steps"]["p50"] == in_steps
    assert metrics.meets_slo(streamed, {"ttft": 1.0}) and not metrics.meets_slo(held, {"ttft": 1.0})


# --------------------------------------------------------------------------- step measures
def test_host_time_fraction_is_the_share_outside_the_forward():
    """The host-time fraction is the share of a step's time spent outside the forward."""
    trace = [step(1, [("A", "decode", 1, 0)], 0.0, 1.0, t_forward=0.25)]
    assert metrics.host_time_fraction(trace) == approx(0.75)


def test_decode_speed_skips_mixed_steps_and_counts_kept_guesses_once():
    """Decode speed leaves out steps that also prefill, and a speculative step produces its kept
    guesses plus one token, not every token it scored."""
    mixed = step(1, [("A", "prefill", 8, 0), ("B", "decode", 1, 1)], 0.0, 1.0)
    spec = step(2, [("B", "decode", 4, 1)], 1.0, 1.5)  # last token + 3 guesses, 2 kept
    spec.speculated = {"B": (3, 2)}
    assert metrics.decode_tokens_produced(spec) == 3
    assert metrics.decode_tokens_per_s([mixed, spec]) == approx(3 / 0.5)


def test_dec_at_p_per_s_divides_by_the_windows_seconds_not_steps():
    """dec@P per second divides by the prefill window's seconds, not its steps."""
    trace, records = pd_like_trace(interleave=True)
    trace[2].t_end = 5.0  # step 3 (L's last chunk) takes 3 s
    m = metrics.long_prefill_metrics(trace, records, "L")
    assert m["prefill_window_s"] == 4.0 and m["dec_at_p_per_s"] == approx(4 / 4.0)


def test_short_p_counts_requests_alive_at_the_window_edges():
    """short_P counts a request that finishes in the long prompt's arrival step and one that arrives
    in its last prefill step."""
    trace, records = pd_like_trace(interleave=True)  # L: arrives step 2, last chunk step 3
    records += [rec("E", 1, a_step=1, arrival=0.0, sched=0.0, first=1.5, finish=1.5,
                    f_step=2, fin_step=2),   # finishes in L's arrival step
                rec("F", 2, a_step=3, arrival=2.0, sched=2.0, first=3.0, finish=4.0,
                    f_step=3, fin_step=4)]   # arrives in L's last prefill step
    m = metrics.long_prefill_metrics(trace, records, "L")
    assert sorted(m["short_request_ids"]) == ["E", "F", "S1", "S2"]


def test_queue_and_e2e_steps_in_the_summary():
    """The summary gives queue and end-to-end times in steps, and a response held back ends at its
    release step."""
    records = hand_records()  # A: arrival 1, scheduled 2, finish 6; B: 2, 2, 6
    s = metrics.summarize([], records)
    assert s["queue_steps"]["p50"] == approx(0.5) and s["e2e_steps"]["p50"] == approx(5.5)
    held = replace(records[0], returned_whole=True, released_time=3.0, released_step=9)
    assert metrics.summarize([], [held])["e2e_steps"]["p50"] == 9  # to the release


def test_latency_columns_cover_every_percentile_of_every_latency():
    """The latency columns are p50, p95 and p99 of queue, TTFT, TPOT, ITL and end-to-end time, and
    format_table labels them."""
    keys = [key for key, _, _ in metrics.LATENCY_COLUMNS]
    assert keys == [f"{m}.p{p}" for m in ("queue_s", "ttft_s", "tpot_s", "itl_s", "e2e_s")
                    for p in (50, 95, 99)]
    s = metrics.summarize([], hand_records())
    assert "TTFT p95" in metrics.format_table({"x": s}, metrics.LATENCY_COLUMNS)


def test_token_mix_counts_what_each_step_processed():
    """PD's trace above by hand: steps 2 and 3 mix L's prefill chunks with two decodes, step 5
    mixes S3's prefill with two decodes; 5 steps ran, 1 waited on the clock (no members)."""
    trace, records = pd_like_trace(interleave=True)
    mix = metrics.token_mix(trace + [step(6, [], 5.0, 5.1)])
    assert mix == {"prefill_tokens": 50 + 50 + 4, "decode_tokens": 3 + 2 + 2 + 3 + 2,
                   "decode_rows": 12, "mixed_steps": 3, "mixed_step_share": approx(3 / 5),
                   "decode_share_in_mixed_steps": approx(6 / 12),
                   "mean_tokens_per_step": approx(116 / 5)}
    assert metrics.token_mix(pd_like_trace(interleave=False)[0])["mixed_steps"] == 1  # S3's
    s = metrics.summarize(trace, records)
    assert all(s[key] == value for key, value in mix.items())
    guessing = [step(1, [("A", "decode", 4, 0)], 0.0, 1.0)]  # its token and 3 guesses
    assert metrics.token_mix(guessing)["decode_tokens"] == 4
    assert metrics.token_mix(guessing)["decode_rows"] == 1
    empty = metrics.token_mix([])
    assert empty["prefill_tokens"] == empty["mixed_steps"] == 0
    assert empty["mixed_step_share"] is None and empty["mean_tokens_per_step"] is None


# --------------------------------------------------------------------------- fairness per class
def test_prompt_buckets_have_exact_edges():
    """Prompt lengths fall into 0-127, 128-511, 512-2047 and 2048+, each edge in the bucket it
    opens."""
    assert [metrics.prompt_bucket(n) for n in (0, 127, 128, 511, 512, 2047, 2048, 10**6)] == [
        "0-127", "0-127", "128-511", "128-511", "512-2047", "512-2047", "2048+", "2048+"]


def test_by_class_groups_by_prompt_length_tenant_and_priority():
    """Each grouping with two or more classes, in value order; per class its own requests'
    TTFT p50/p99, queue and E2E p99 over its completed requests, and SLO attainment over its
    not-cancelled ones. A grouping with one class (here nobody has a priority) is left out."""
    def one(rid, prompt, tenant, first, reason="length", priority=0):
        return replace(rec(rid, 4, reason, arrival=0.0, sched=first / 2, first=first,
                           finish=first + 1.0, times=[first, first + 1.0]),
                       num_prompt_tokens=prompt, tenant=tenant, priority=priority)
    records = [one("a1", 10, "a", 0.1), one("a2", 200, "a", 0.3), one("a3", 300, "a", 2.0),
               one("b1", 3000, "b", 0.5), one("b2", 20, "b", 9.0, reason="cancelled"),
               one("n1", 600, None, 0.2)]
    out = metrics.by_class(records, {"ttft": 1.0})
    assert list(out) == ["prompt_tokens", "tenant"]
    assert list(out["prompt_tokens"]) == ["0-127", "128-511", "512-2047", "2048+"]
    assert list(out["tenant"]) == ["(none)", "a", "b"]
    a = out["tenant"]["a"]
    want = metrics.percentiles([0.1, 0.3, 2.0], (50, 99))
    assert (a["requests"], a["completed"]) == (3, 3)
    assert (a["ttft_p50_s"], a["ttft_p99_s"]) == (approx(want["p50"]), approx(want["p99"]))
    assert a["queue_p99_s"] == approx(metrics.percentiles([0.05, 0.15, 1.0], (99,))["p99"])
    assert a["e2e_p99_s"] == approx(metrics.percentiles([1.1, 1.3, 3.0], (99,))["p99"])
    assert a["slo_attainment"] == approx(2 / 3)
    b = out["tenant"]["b"]  # the cancelled request is counted, never averaged in
    assert (b["requests"], b["completed"], b["ttft_p99_s"], b["slo_attainment"]) == (2, 1, 0.5,
                                                                                     1.0)
    assert out["prompt_tokens"]["0-127"]["requests"] == 2
    assert metrics.by_class(records)["tenant"]["a"]["slo_attainment"] is None  # no SLO
    ranked = [replace(r, priority=p) for r, p in zip(records, (2, -1, 0, 10, 2, 0))]
    assert list(metrics.by_class(ranked)["priority"]) == ["-1", "0", "2", "10"]
    assert metrics.by_class(records[:1]) == {}
    assert metrics.summarize([], records)["by_class"] == metrics.by_class(records)


def test_resource_use_counts_steps_that_ran_against_pool_and_budget():
    """Mean and peak of pages held by running requests over steps that ran the model (an idle
    step is not averaged in), and the mean share of the token budget those steps used."""
    trace = [replace(step(1, [("a", "prefill", 12, 0)], 0.0, 1.0), pages_used=2),
             replace(step(2, [], 1.0, 2.0), pages_used=0),  # waiting on the clock: ignored
             replace(step(3, [("a", "decode", 1, 0), ("b", "prefill", 7, 1)], 2.0, 3.0),
                     pages_used=6)]
    assert metrics.resource_use(trace, num_pages=8, max_num_batched_tokens=16) == {
        "kv_pool_use_mean": approx(0.5), "kv_pool_use_peak": approx(0.75),
        "token_budget_use_mean": approx(10 / 16)}
    assert metrics.resource_use(trace[1:2], 8, 16)["kv_pool_use_peak"] is None


def test_tokens_delivered_together_make_one_gap():
    """Tokens stamped with the same time (guesses kept in one step) arrived together: one
    gap, not zero gaps that would pull a speculative run's ITL p50 towards 0."""
    r = rec("A", 5, first=1.0, finish=3.0, times=[1.0, 2.0, 2.0, 2.0, 3.0])
    assert metrics.itls(r) == [1.0, 1.0]
    assert metrics.summarize([], [r])["itl_s"]["p50"] == 1.0


def test_a_request_that_did_not_complete_never_meets_the_slo():
    """Only a completed request can meet an SLO: a cancelled or failed one with fast tokens
    does not."""
    fast = dict(arrival=0.0, sched=0.0, first=0.1, finish=0.2, times=[0.1, 0.2])
    slo = {"ttft": 1.0, "e2e": 1.0}
    assert metrics.meets_slo(rec("ok", 2, **fast), slo)
    for reason in ("cancelled", "error", "deadline", None):
        assert not metrics.meets_slo(rec("x", 2, reason=reason, **fast), slo)
        assert not metrics.meets_slo(rec("x", 2, reason=reason, **fast), None)


def test_a_step_record_built_by_hand_swaps_nothing():
    """A StepRecord built by hand names no swap, and summarize invents none."""
    rec = StepRecord(1, [], [], [], [], 0, 0, 0.0, 0.1)
    assert (rec.pages_swapped_out, rec.pages_swapped_in, rec.swapped) == (0, 0, [])
    seed = viz.seed_example("continuous")
    assert sum(r.pages_swapped_out + r.pages_swapped_in for r in seed) == 0


def test_class_slo_attainment_counts_failed_requests_as_summarize_does():
    """A class's SLO attainment is the share of its not-cancelled requests that met the SLO,
    failed ones counting as missed, as `summarize`'s slo_attainment is: one class alone gives
    summarize's number."""
    ok = rec("ok", 4, arrival=0.0, sched=0.0, first=0.1, finish=0.5, times=[0.1, 0.5])
    failed = replace(rec("bad", 0, "error", arrival=0.0, finish=0.2), tenant="b")
    records = [replace(ok, tenant="a"), replace(ok, request_id="ok2", tenant="b"), failed]
    rows = metrics.by_class(records, {"ttft": 1.0})["tenant"]
    assert rows["a"]["slo_attainment"] == 1.0
    assert rows["b"]["slo_attainment"] == approx(0.5)  # one met, one failed
    alone = [r for r in records if r.tenant == "b"]
    assert metrics.summarize([], alone, {"ttft": 1.0})["slo_attainment"] == approx(0.5)


def test_latency_column_titles_match_their_keys():
    """Each latency column's title names the latency and percentile its key holds."""
    names = {"queue_s": "queue", "ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "ITL",
             "e2e_s": "E2E"}
    for key, title, _ in metrics.LATENCY_COLUMNS:
        latency, p = key.split(".")
        assert title == f"{names[latency]} {p}", key
