"""Checks for the exercise notebooks (chapters 01-08): one function per exercise.

`check.<exercise>(your_function_or_class)` runs your code and minicb's reference side by side
on named cases: hand-made edge cases, random ones from a fixed seed and, when a teacher grades
with `--hidden-seed`, hidden ones drawn from `HIDDEN_SEED`. Every case runs. When all pass it
prints one line starting with a tick; otherwise it raises `CheckFailed` (an `AssertionError`)
saying how many passed, then, in plain words, the first failed case's input, what was expected
and what came back, and where it can, which rule was broken, and one line for each other
failure. `RESULTS[exercise]` keeps the cases of the last run; the grader scores an exercise by
the share that passed (`case_points`).

Scheduler exercises run your `Scheduler` for real: `Engine(tiny_model,
policy=YourScheduler(), check_invariants=True)` on small workloads, compared step by step
with minicb's own scheduler for the same policy. The engine refuses impossible batches
(`SchedulerError`) and reports broken books (`InvariantError`); both come back as a
`CheckFailed` that names the workload and the step.

The references are minicb's own code: `PagePool`, `prompt_page_hashes`, the schedulers in
`minicb.scheduler`, `minicb.benchmark.metrics` and `minicb.model.quant.quantize_rows`, and a
few of this module's functions. None of them is accepted as an answer (`_references`). This
module depends on the core and nothing in the core depends on it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import numbers
import operator
import random
import signal
import sysconfig
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minicb.benchmark import metrics
from minicb.benchmark.metrics import RequestRecord
from minicb.kv_cache import PagePool, page_hash, prompt_page_hashes
from minicb.model.quant import quantize_rows
from minicb.request import SamplingParams, Status
from minicb.scheduler import POLICY_CLASSES, POLICY_FLAGS, Scheduler, schedule_prefill_chunks
from minicb.trace import StepRecord


class CheckFailed(AssertionError):
    """Your code disagrees with the reference; the message explains the first difference."""


class ReferenceRefused(CheckFailed):
    """Your answer is minicb's own code (or this module's): the check stops at once."""


def _fail(exercise: str, message: str) -> None:
    raise CheckFailed(f"[{exercise}] {message}")


def _pages(n: int) -> str:
    return f"{n} page{'' if n == 1 else 's'}"


def _call(exercise: str, what: str, fn: Callable, *args: Any) -> Any:
    """Run the learner's code, with minicb's own version of the exercise refusing to run
    (`_references`); an exception it raises becomes a CheckFailed naming the call (the grader
    shows only the message). The exception stays chained below it (`from exc`), so its
    traceback still shows in the notebook. An untouched stub's NotImplementedError passes as it
    is: it says all there is to say."""
    try:
        with _refusing_the_reference(exercise, _references(exercise)):
            return fn(*args)
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as exc:
        raise CheckFailed(f"[{exercise}] {what} raised {type(exc).__name__}: {exc}"
                          f"{_line_of(exc)}") from exc


_LIBRARIES = (str(Path(__file__).resolve().parents[1]), sysconfig.get_paths()["stdlib"],
              sysconfig.get_paths()["purelib"])


def _line_of(exc: BaseException) -> str:
    """Where the learner's code raised: its deepest frame outside minicb and the libraries."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_LIBRARIES)]
    return f" (at `{frames[-1].line}`)" if frames and frames[-1].line else ""


def _as_int(value: Any) -> Any:
    """A numpy integer scalar where an int is asked for counts as that int."""
    if isinstance(value, (int, float)):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _as_list(value: Any) -> Any:
    """A tensor, array or tuple of integers where a list of ints is asked for, as that list."""
    if hasattr(value, "tolist") and not isinstance(value, list):
        value = value.tolist()
    return [_as_int(v) for v in value] if isinstance(value, (list, tuple)) else value


@functools.cache  # asked before every call of the learner's code
def _references(exercise: str) -> tuple[Callable, ...]:
    """minicb's own version of what a function exercise asks for, and this module's: the check
    compares the learner's answer with them, so one of them, renamed, wrapped in a lambda or
    a class that merely calls it, would pass against itself. (Schedulers refuse theirs around
    the whole run, `_check_scheduler`.)"""
    from minicb.attention import AttentionMetadata, build_metadata, cpu_kernel, torch_ref
    from minicb.kv_cache import PrefixIndex
    from minicb.speculative import NgramIndex, verify
    if exercise == "best_setting":
        from minicb.benchmark import sweep  # only here: sweep imports the whole benchmark
        return (sweep.best_setting, sweep.requirement_failures, sweep.ranked)
    if exercise == "swap_break_even":
        from minicb.benchmark import sim
        return (sim.swap_break_even, sim.recompute_seconds, _break_even_variant)
    engine_runs = [_finish_steps_real] + [c.schedule for c in POLICY_CLASSES.values()]
    return tuple({
        "page_pool": [PagePool.allocate, PagePool.share, PagePool.release],
        "prefix_hashes": [prompt_page_hashes],
        "match_prefix": [PagePool.match_prefix, PrefixIndex.lookup, _reference_match],
        "quantize_int8": [quantize_rows],
        "static_batch": [_reference_static_batch],
        "static_finish_steps": engine_runs,
        "continuous_finish_steps": engine_runs,
        "next_chunk": [_reference_next_chunk, schedule_prefill_chunks],
        "dec_at_p": [metrics.long_prefill_metrics, metrics.summarize],
        "short_p": [metrics.long_prefill_metrics, metrics.summarize],
        "latencies": [metrics.queue_time, metrics.ttft, metrics.tpot, metrics.e2e,
                      metrics.released, metrics.first_token_seen, metrics.per_request,
                      metrics.summarize],
        "goodput": [metrics.summarize, metrics.meets_slo, metrics.run_span, _reference_goodput,
                    _num_meeting],
        "per_tenant": [metrics.summarize, metrics.by_class, _reference_per_tenant],
        "slot_mapping": [AttentionMetadata.slot_mapping.func, build_metadata,
                         _reference_metadata],
        "paged_attention": [torch_ref.attend, torch_ref.attend_decodes,
                            torch_ref.attend_prefills, cpu_kernel.attend,
                            cpu_kernel.attend_decodes, _attention_variant],
        "prompt_lookup": [NgramIndex.propose, _lookup_variant],
        "verify_greedy": [verify, _verify_variant],
    }.get(exercise, []))


def _refuse_the_reference(exercise: str, fn: Any, reference: Callable) -> None:
    """The exercise asks for your own code: minicb's function itself (or one wrapped with
    functools.wraps) would pass every comparison with itself."""
    if fn is reference or getattr(fn, "__wrapped__", None) is reference:
        raise ReferenceRefused(f"[{exercise}] that is minicb's own `{reference.__name__}`: "
                               "write your own version (the check compares it with minicb's)")


@dataclass
class CaseResult:
    """One named case of a check: its group ("edge" for the hand-made ones, "random" for the
    public random ones, "hidden" for those drawn from the grader's hidden seed), whether your
    code got it right, and if not, the first line of why."""

    name: str
    group: str
    passed: bool
    message: str = ""


# `python -m minicb grade --hidden-seed N` sets this in each check cell it runs: every check
# then adds random cases drawn from that seed. None (a learner's own run): public cases only.
HIDDEN_SEED: int | None = None
RESULTS: dict[str, _Cases] = {}  # the last run of each check, by exercise
MAX_OTHER_FAILURES = 12  # lines listing the failed cases after the first, in a message
STOP_AT_FIRST = False  # True: a check raises its first failed case's explanation at once


def hidden_rng(exercise: str) -> random.Random | None:
    """The random source of an exercise's hidden cases, None without a hidden seed."""
    return None if HIDDEN_SEED is None else random.Random(f"{HIDDEN_SEED}:{exercise}")


class _Cases:
    """The named cases of one run of a check. Each case runs on its own: a failure is noted
    and the next case runs, so the check says how many of its cases your code gets right.
    `done` prints the mark when every case passed, and otherwise raises a CheckFailed giving
    the first failed case in full and one line for each other one. An untouched stub fails
    every case with its NotImplementedError, which `done` raises as it is."""

    def __init__(self, exercise: str, total: int) -> None:
        self.exercise = exercise
        self.total = total
        self.results: list[CaseResult] = []
        self.first: BaseException | None = None
        self.stub: NotImplementedError | None = None
        self.refused = False  # the answer was minicb's own code: nothing counts
        RESULTS[exercise] = self

    @contextlib.contextmanager
    def case(self, name: str, group: str = "edge"):
        """Run one case: a CheckFailed (or any error) inside it fails only this case."""
        try:
            yield
        except NotImplementedError as exc:
            self.stub = self.stub or exc
            self._failed(name, group, exc, f"{type(exc).__name__}: {exc}")
        except ReferenceRefused:
            self.refused = True  # no case counts
            raise
        except CheckFailed as exc:
            self._failed(name, group, exc, str(exc).removeprefix(f"[{self.exercise}] "))
            if STOP_AT_FIRST:
                raise
        except Exception as exc:  # the check tripped over an odd answer: this case failed
            self._failed(name, group, exc, f"checking it raised {type(exc).__name__}: {exc}")
        else:
            self.results.append(CaseResult(name, group, True))

    def summary(self, max_points: float = 1.0, weights: dict[str, float] | None = None
                ) -> dict[str, Any]:
        """Plain data for the grader: the number of cases, whether the answer was refused,
        each case run as [name, group, passed, the first line of why it failed], and the
        points it earned out of `max_points` (`case_points`)."""
        data = {"total": self.total, "refused": self.refused,
                "cases": [[r.name, r.group, r.passed, (r.message.splitlines() or [""])[0]]
                          for r in self.results]}
        return {**data, "points": case_points(data, max_points, weights)}

    @property
    def explaining(self) -> bool:
        """Whether a failure now is the first: only its explanation is shown in full, so a
        costly hint (one that runs the learner's code again) is worked out for it alone."""
        return self.first is None

    def _failed(self, name: str, group: str, exc: BaseException, message: str) -> None:
        self.first = self.first or exc
        self.results.append(CaseResult(name, group, False, message))

    def done(self, what: str) -> None:
        """Print the mark, or raise what failed (see the class)."""
        failed = [r for r in self.results if not r.passed]
        if not failed:
            print(f"✓ {self.exercise}: {what}")
            return
        if self.stub is not None and len(failed) == len(self.results):
            raise self.stub
        first, others = failed[0], failed[1:]
        lines = [f"[{self.exercise}] {len(self.results) - len(failed)} of {len(self.results)} "
                 f"cases passed. The first that failed, {first.name}: {first.message}"]
        if others:
            lines.append(f"Also failed ({len(others)}):")
        alike: dict[str, list[str]] = {}  # one line per distinct reason, naming its cases
        for r in others:
            alike.setdefault((r.message.splitlines() or [""])[0], []).append(r.name)
        for reason, names in list(alike.items())[:MAX_OTHER_FAILURES]:
            who = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            lines.append(f"  - {who}: {_short_text(reason, 150)}")
        if len(alike) > MAX_OTHER_FAILURES:
            lines.append(f"  - ... and {len(alike) - MAX_OTHER_FAILURES} more reasons")
        raise CheckFailed("\n".join(lines)) from (
            self.first.__cause__ if isinstance(self.first, CheckFailed) else self.first)


def case_points(summary: dict[str, Any], max_points: float,
                weights: dict[str, float] | None = None) -> float:
    """An exercise's points from its check's cases (`_Cases.summary`): `max_points` times the
    weight of the cases passed over the weight of all of them. A case weighs 1 unless
    `weights` names it or its group ("edge", "random", "hidden"); a case the check never ran
    (it was stopped) weighs 1 and failed. An answer the check refused scores 0."""
    if summary.get("refused") or not summary.get("total"):
        return 0.0
    weights = weights or {}
    ran = [(weights.get(name, weights.get(group, 1.0)), passed)
           for name, group, passed, *_ in summary["cases"]]
    available = sum(w for w, _ in ran) + max(summary["total"] - len(ran), 0)
    earned = sum(w for w, passed in ran if passed)
    return round(max_points * earned / available, 4) if available else 0.0


def score(check: Callable[[Any], None], answer: Any, points: float = 1.0,
          weights: dict[str, float] | None = None) -> float:
    """Run `check` (one of this module's) on `answer` and return the points it earns, printing
    the mark or what failed: an nbgrader test cell's last line, whose value nbgrader takes as
    the cell's partial credit (`python -m minicb nbgrader-course`)."""
    name = check.__name__
    RESULTS.pop(name, None)
    try:
        check(answer)
    except (CheckFailed, NotImplementedError) as exc:
        print(f"✗ {type(exc).__name__}: {exc}")
    except Exception as exc:  # a check that stops on an odd answer: no points, no traceback
        print(f"✗ the check stopped: {type(exc).__name__}: {exc}")
    cases = RESULTS.get(name)
    return cases.summary(points, weights)["points"] if cases is not None else 0.0


def _short_text(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _named(exercise: str, edge: Sequence[Any], draw: Callable[[random.Random], Any],
           seed: int, count: int, hidden: int, what: str = "case") -> list[tuple[str, str, Any]]:
    """(name, group, case) of a check's cases: the hand-made `edge` ones, `count` public random
    ones drawn from `seed`, and `hidden` more drawn from the hidden seed, if any."""
    rng, secret = random.Random(seed), hidden_rng(exercise)
    named = [(f"edge {what} {i}", "edge", c) for i, c in enumerate(edge)]
    named += [(f"random {what} {i}", "random", draw(rng)) for i in range(count)]
    if secret is not None:
        named += [(f"hidden {what} {i}", "hidden", draw(secret)) for i in range(hidden)]
    return named


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _hex(h: Any) -> str:
    return h.hex()[:8] + "…" if isinstance(h, bytes) else repr(h)


def _hexes(hashes: Any) -> str:
    if isinstance(hashes, list):
        return "[" + ", ".join(_hex(h) for h in hashes) + "]"
    return _short(hashes)


# ============================================================================ a tiny model
# one layer: a scheduler check runs the model every step, and its answers are noise anyway
TINY_CONFIG = dict(vocab=256, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128,
                   max_positions=2048)
_TINY: dict[int, tuple[Any, Any]] = {}
_TINY_DIRS: list[tempfile.TemporaryDirectory] = []


def tiny_checkpoint(path: str | Path | None = None, seed: int = 0) -> Path:
    """Write a tiny random Llama checkpoint (config.json + model.safetensors, no tokenizer,
    vocabulary of 256 token ids) into `path` (a new temporary folder if None) and return it.
    It loads like any Hugging Face checkpoint: `Engine(str(path))`. About 0.2 MB; its
    answers are noise, but they are deterministic, which is all a scheduler needs."""
    from safetensors.torch import save_file

    if path is None:
        folder = tempfile.TemporaryDirectory(prefix="minicb-tiny-")
        _TINY_DIRS.append(folder)  # removed when the process exits
        path = folder.name
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = TINY_CONFIG
    head_dim = c["hidden"] // c["heads"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    def norm() -> torch.Tensor:
        return torch.rand(c["hidden"], generator=gen) + 0.5

    tensors = {"model.embed_tokens.weight": normal(c["vocab"], c["hidden"]),
               "model.norm.weight": norm(), "lm_head.weight": normal(c["vocab"], c["hidden"])}
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": normal(c["heads"] * head_dim, c["hidden"]),
            p + "self_attn.k_proj.weight": normal(c["kv_heads"] * head_dim, c["hidden"]),
            p + "self_attn.v_proj.weight": normal(c["kv_heads"] * head_dim, c["hidden"]),
            p + "self_attn.o_proj.weight": normal(c["hidden"], c["heads"] * head_dim),
            p + "mlp.gate_proj.weight": normal(c["intermediate"], c["hidden"]),
            p + "mlp.up_proj.weight": normal(c["intermediate"], c["hidden"]),
            p + "mlp.down_proj.weight": normal(c["hidden"], c["intermediate"]),
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
        })
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": c["vocab"], "hidden_size": c["hidden"],
              "intermediate_size": c["intermediate"], "num_hidden_layers": c["layers"],
              "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"],
              "max_position_embeddings": c["max_positions"], "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    return path


def tiny_model(seed: int = 0) -> tuple[Any, Any]:
    """The tiny checkpoint loaded once per process as a `(model, info)` pair, which `Engine`
    accepts in place of a name: `Engine(check.tiny_model(), policy=...)`."""
    if seed not in _TINY:
        from minicb.model.loader import load_model
        # on the CPU even where a GPU is visible: a grade must not depend on the machine
        _TINY[seed] = load_model(str(tiny_checkpoint(seed=seed)), device="cpu")
    return _TINY[seed]


class _OneThread:
    """Tiny models gain nothing from threads; on a shared CPU, spinning threads cost 10x."""

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.before)


# ============================================================================ 01 paged KV
def _num_free(pool: Any) -> int:
    value = pool.num_free
    return value() if callable(value) else value


def _holders(tables: dict[str, list[int]], page: int) -> list[str]:
    return [rid for rid, table in tables.items() for p in table if p == page]


def page_pool(cls: type) -> None:
    """Exercise 1.1: a page pool with a free list and reference counts.

    `cls(num_pages)` must give an object with `ref_count` (a list, one count per page),
    `num_free`, and `allocate(n) -> list[int]`, `share(pages)`, `release(pages)` behaving like
    `minicb.kv_cache.PagePool` without a prefix cache: allocate is all-or-nothing (MemoryError
    and nothing taken if fewer than n pages are free) and hands out pages with ref count 1;
    share adds one reference per page (ValueError for a free page); release drops one per page
    and frees a page whose count reaches 0 (ValueError if it was already 0)."""
    name = "page_pool"
    hidden = hidden_rng(name)
    seeds = [(f"random sequence {s}", "random", s) for s in range(40)]
    seeds += [(f"hidden sequence {k}", "hidden", hidden.randrange(10**9)) for k in range(10)
              if hidden]
    cases = _Cases(name, len(seeds))
    for label, group, seed in seeds:
        with cases.case(label, group):
            _page_pool_sequence(cls, seed, name)
    cases.done(f"edge cases and {len(seeds)} random sequences of allocate/share/release agree "
               "with minicb's PagePool")


def _page_pool_sequence(cls: type, seed: int, name: str) -> None:
    """One random life of a pool, run on the learner's class and on minicb's PagePool in lock
    step (the learner's page ids are mapped onto the reference's as they are handed out)."""
    rng = random.Random(seed)
    num_pages = [4, 6, 8, 12][seed % 4]
    mine = _call(name, f"{getattr(cls, '__name__', 'cls')}({num_pages})", cls, num_pages)
    ref = PagePool(num_pages, 1, enable_prefix_caching=False)
    to_ref: dict[int, int] = {}  # learner page id -> reference page id
    tables: dict[str, list[int]] = {}  # request -> the learner's page ids, in order
    history: list[str] = []
    counter = iter(range(10_000))

    def where() -> str:  # after the reason: a gradebook shows a failure's first line only
        recent = "\n    ".join(history[-6:])
        return (f"\n  (a pool of {num_pages} pages, random sequence {seed}; the last "
                f"operations:\n    {recent})")

    def fail(text: str) -> None:
        _fail(name, text + where())

    def call(what: str, fn: Callable, *args: Any) -> Any:
        try:
            return _call(name, what, fn, *args)
        except ReferenceRefused:
            raise
        except CheckFailed as exc:
            raise CheckFailed(f"{exc}{where()}") from exc.__cause__ or exc  # theirs, not ours

    def verify() -> None:
        counts = list(mine.ref_count)
        if len(counts) != num_pages:
            fail(f"ref_count has {len(counts)} entries, expected one per page "
                 f"({num_pages}).")
        for p in range(num_pages):
            who = _holders(tables, p)
            want = ref.ref_count[to_ref[p]] if who else 0
            if counts[p] != want:
                held = f"held by {', '.join(map(repr, who))}" if who else "held by no request"
                verdict = ("a reference was forgotten: each page table that holds a page "
                           "counts once" if counts[p] < want else
                           "a reference was not dropped (or was counted twice)")
                fail(f"page {p} is {held}, so its ref count should be {want} "
                     f"(as in minicb's PagePool), but yours is {counts[p]}: {verdict}.")
        if _num_free(mine) != ref.num_free:
            fail(f"num_free should be {ref.num_free} (the pages with ref count "
                 f"0) but yours is {_num_free(mine)}.")
        free_list = getattr(mine, "free", None)
        if isinstance(free_list, Iterable) and not callable(free_list):  # if it is a list
            for p in map(_as_int, list(free_list)):
                if isinstance(p, int) and _holders(tables, p):
                    fail(f"page {p} is on your free list but "
                         f"{', '.join(map(repr, _holders(tables, p)))} still holds it "
                         f"(its ref count should be {ref.ref_count[to_ref[p]]}).")

    def pool_state() -> tuple[list, Any]:
        return list(mine.ref_count), _num_free(mine)

    def change_since(before: tuple[list, Any]) -> str:
        after = pool_state()
        return (f"(ref counts {before[0]} -> {after[0]}, num_free {before[1]} -> "
                f"{after[1]})")

    def allocate(n: int, purpose: str) -> list[int] | None:
        should_fail = n > ref.num_free
        before = pool_state()
        try:
            got = theirs("allocate", n)
        except MemoryError:
            history.append(f"allocate({n}) {purpose} -> MemoryError")
            if not should_fail:
                fail(f"allocate({n}) with {ref.num_free} free pages must "
                     f"succeed, but yours raised MemoryError.")
            if pool_state() != before:  # checked here: verify() would blame a later release
                fail(f"allocate({n}) raised MemoryError, rightly ("
                     f"{ref.num_free} free), but it changed the pool first "
                     f"{change_since(before)}. allocate must be all or nothing: when it "
                     "cannot give all the pages it must give none and change nothing.")
            verify()
            return None
        except (NotImplementedError, ReferenceRefused):
            raise
        except Exception as exc:
            history.append(f"allocate({n}) {purpose} -> {type(exc).__name__}")
            if should_fail:
                fail(f"allocate({n}) with only {ref.num_free} free pages must "
                     f"raise MemoryError, but yours raised {type(exc).__name__}: {exc}.")
            raise CheckFailed(f"[{name}] allocate({n}) with {ref.num_free} free pages raised "
                              f"{type(exc).__name__}: {exc}{_line_of(exc)}{where()}") from exc
        history.append(f"allocate({n}) {purpose} -> {_short(got)}")
        if should_fail:
            fail(f"allocate({n}) with only {ref.num_free} free pages must raise "
                 f"MemoryError and take nothing (all or nothing), but yours returned "
                 f"{_short(got)}.")
        got = [_as_int(p) for p in got]  # numpy integers are page ids too
        if len(got) != n or len(set(got)) != n:
            fail(f"allocate({n}) must return {n} different pages; yours "
                 f"returned {_short(got)}.")
        for p in got:
            if not isinstance(p, int) or not 0 <= p < num_pages:
                fail(f"allocate({n}) returned {p!r}, not a page id in "
                     f"0..{num_pages - 1}.")
            if _holders(tables, p):
                fail(f"allocate({n}) handed out page {p}, which "
                     f"{', '.join(map(repr, _holders(tables, p)))} still holds: only "
                     f"pages with ref count 0 may be allocated.")
        for p, q in zip(got, ref.allocate(n)):
            to_ref[p] = q
        return got

    def theirs(method: str, *args: Any) -> Any:  # the learner's method, minicb's refusing
        with _refusing_the_reference(name, _references(name)):
            return getattr(mine, method)(*args)

    def expect_value_error(call: Callable[[], Any], text: str, rule: str) -> None:
        before = pool_state()
        try:
            call()
        except ValueError:
            history.append(f"{text} -> ValueError")
            if pool_state() != before:  # here: verify() would blame a forgotten reference
                fail(f"{text} raised ValueError, rightly, but changed the pool "
                     f"first {change_since(before)}: check before you change anything, "
                     "so that a refused call leaves the pool as it was.")
            return
        except (NotImplementedError, ReferenceRefused):
            raise
        except Exception as exc:
            fail(f"{text} must raise ValueError ({rule}), but yours raised "
                 f"{type(exc).__name__}: {exc}.")
        history.append(text)
        fail(f"{text} must raise ValueError ({rule}), but yours did not.")

    def release(rid: str) -> None:
        pages = tables.pop(rid)
        history.append(f"release({pages}) as request {rid!r} finished")
        call(f"release({pages})", mine.release, pages)
        ref.release([to_ref[p] for p in pages])
        verify()

    # edge cases first
    got = allocate(0, "(nothing)")
    if got != []:
        fail(f"allocate(0) must return [], yours returned {_short(got)}.")
    verify()
    expect_value_error(lambda: theirs("release", [0]), "release([0]) of a free page",
                       "a page cannot be released more often than it was taken")
    verify()
    expect_value_error(lambda: theirs("share", [0]), "share([0]) of a free page",
                       "only a page that some request holds can be shared")
    verify()
    for _ in range(60):
        op = rng.random()
        live = list(tables)
        if op < 0.35 or not live:  # a new request
            rid = f"r{next(counter)}"
            n = rng.randint(1, 4) if rng.random() < 0.85 else num_pages + 1
            got = allocate(n, f"for new request {rid!r}")
            if got is not None:
                tables[rid] = got
        elif op < 0.55:  # a prefix hit: a new request shares an existing one's first pages
            donor = rng.choice(live)
            if not tables[donor]:
                continue
            k = rng.randint(1, len(tables[donor]))
            pages = tables[donor][:k]
            rid = f"r{next(counter)}"
            history.append(f"share({pages}) for new request {rid!r} (a prefix hit on "
                           f"the first {_pages(k)} of request {donor!r})")
            call(f"share({pages})", mine.share, pages)
            ref.share([to_ref[p] for p in pages])
            tables[rid] = list(pages)
        elif op < 0.75:  # a request grows by one page
            rid = rng.choice(live)
            got = allocate(1, f"to grow request {rid!r}")
            if got is not None:
                tables[rid].extend(got)
        else:  # a request finishes
            release(rng.choice(live))
            continue
        verify()
    # a refusal part-way through a list must change nothing either, whichever end a loop
    # starts from (checked last, so that the sequence above names any other mistake first)
    if all(_holders(tables, p) for p in range(num_pages)) and tables:
        release(next(iter(tables)))  # make a page free
    if not tables:
        got = allocate(1, "for request 'a'")
        tables["a"] = got or []
    once = next((p for p in range(num_pages) if len(_holders(tables, p)) == 1), None)
    free = next((p for p in range(num_pages) if not _holders(tables, p)), None)
    if once is not None and free is not None:
        for pages in ([once, free], [free, once]):
            expect_value_error(lambda pages=pages: theirs("release", pages),
                               f"release({pages}) (page {free} is free)",
                               "a page cannot be released more often than it was taken")
            verify()
            expect_value_error(lambda pages=pages: theirs("share", pages),
                               f"share({pages}) (page {free} is free)",
                               "only a page that some request holds can be shared")
            verify()
        expect_value_error(lambda: theirs("release", [once, once]),
                           f"release([{once}, {once}]) (page {once} is held once)",
                           "a page listed twice loses two references, and it has one")
        verify()
    for rid in list(tables):  # finally everyone finishes: the pool must be whole again
        release(rid)
    if any(mine.ref_count):
        fail(f"every request finished, yet pages "
             f"{[p for p in range(num_pages) if mine.ref_count[p]]} still have "
             f"references: they leaked.")
    tables["full"] = allocate(num_pages, "(the whole pool)") or []
    verify()
    if allocate(0, "(nothing, with no page free)") != []:
        fail("allocate(0) must return [] even when no page is free.")
    release("full")


def _prompts(rng: random.Random, n: int, page_size: int) -> list[list[int]]:
    """Prompts that share leading pages with one another, as chat requests behind a common
    system prompt do."""
    base = [rng.randrange(3, 250) for _ in range(page_size * 4)]
    out = []
    for _ in range(n):
        keep = rng.randint(0, len(base))
        tail = [rng.randrange(3, 250) for _ in range(rng.randint(0, page_size * 3))]
        prompt = base[:keep] + tail
        out.append(prompt or [rng.randrange(3, 250)])
    return out


def prefix_hashes(fn: Callable[[list[int], int], list[bytes]]) -> None:
    """Exercise 1.2: `fn(token_ids, page_size)` returns the chained hash of every full page,
    `page_hash(previous, page_tokens)` with previous None for the first page, like
    `minicb.kv_cache.prompt_page_hashes`."""
    name = "prefix_hashes"
    _refuse_the_reference(name, fn, prompt_page_hashes)
    edge: list[tuple[list[int], int]] = [
        ([], 4), ([7, 8, 9], 4), ([7, 8, 9, 10], 4), ([7, 8, 9, 10, 11], 4),
        (list(range(10, 22)), 4), (list(range(10, 20)), 4), ([5, 6, 7], 1),
        ([9, 9, 9, 9, 9, 9, 9, 9], 4),
    ]

    def draw(rng: random.Random) -> tuple[list[int], int]:
        page_size = rng.choice([1, 2, 4, 8, 16])
        return _prompts(rng, 1, page_size)[0], page_size

    named = _named(name, edge, draw, 12, 40, 20, "prompt")
    cases = _Cases(name, len(named))
    for label, group, (tokens, page_size) in named:
        with cases.case(label, group):
            _prefix_hashes_case(fn, name, tokens, page_size)
    cases.done(f"{len(named)} prompts hash exactly like minicb's prompt_page_hashes")


def _prefix_hashes_case(fn: Callable, name: str, tokens: list[int], page_size: int) -> None:
    want = prompt_page_hashes(tokens, page_size)
    got = _call(name, f"fn({_short(tokens, 90)}, {page_size})", fn, list(tokens), page_size)
    if got == want:
        return
    shown = f"token_ids={_short(tokens, 90)}, page_size={page_size}"
    full = len(tokens) // page_size
    if not isinstance(got, list):
        _fail(name, f"fn({shown}) must return a list of bytes, yours returned "
                    f"{type(got).__name__}: {_short(got)}.")
    if len(got) != len(want):
        why = ""
        if len(got) == math.ceil(len(tokens) / page_size):
            why = (f" The last {len(tokens) % page_size} tokens are a partial page: only "
                   "full pages get a hash, because only full pages can be shared.")
        elif len(got) < len(want):
            why = " A page that is exactly full counts too."
        _fail(name, f"fn({shown}) returned {len(got)} hashes; expected {full} ("
                    f"{len(tokens)} tokens fill {_pages(full)} of "
                    f"{page_size}).{why}")
    unchained = [page_hash(None, tokens[i * page_size:(i + 1) * page_size])
                 for i in range(full)]
    first_bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    why = ""
    if got == unchained:
        why = (" Your hashes are computed page by page on their own. Each page's hash must "
               "also take the previous page's hash (the chain), so that equal hashes mean "
               "equal prefixes, not just equal pages.")
    elif first_bad == 0:
        why = " The first page has no previous page: page_hash(None, first_page_tokens)."
    _fail(name, f"fn({shown}): hash of page {first_bad} differs. Expected "
                f"{_hexes(want)}, got {_hexes(got)}.{why}")


def _reference_match(cached: dict[bytes, int], tokens: list[int], page_size: int) -> list[int]:
    pool = PagePool(1, page_size)  # bookkeeping only; match_prefix reads the index
    pool.prefix.page_of = dict(cached)
    return pool.match_prefix(tokens)


def match_prefix(fn: Callable[[dict[bytes, int], list[int], int], list[int]]) -> None:
    """Exercise 1.3: `fn(cached, token_ids, page_size)` returns the cached pages of the longest
    run of leading full pages of `token_ids` whose chained hashes are keys of `cached` (hash ->
    page id), capped so that at least one prompt token is left to compute, like
    `PagePool.match_prefix`."""
    name = "match_prefix"
    ps = 4
    a = list(range(10, 22))  # three full pages
    ha = prompt_page_hashes(a, ps)
    cases: list[tuple[str, dict[bytes, int], list[int], int]] = [
        ("nothing cached", {}, a + [1], ps),
        ("all three pages cached, one more token", dict(zip(ha, [7, 3, 5])), a + [1], ps),
        ("the whole prompt (exactly three pages) cached", dict(zip(ha, [7, 3, 5])), a, ps),
        ("pages 0 and 2 cached but not page 1", {ha[0]: 7, ha[2]: 5}, a + [1], ps),
        ("only page 1 cached", {ha[1]: 3}, a + [1], ps),
        ("a prompt shorter than one page", dict(zip(ha, [7, 3, 5])), a[:3], ps),
        ("a one-page prompt, cached", dict(zip(ha, [7, 3, 5])), a[:4], ps),
        ("same tokens in page 1, different page 0", dict(zip(ha, [7, 3, 5])),
         [0, 0, 0, 0] + a[4:] + [1], ps),
    ]

    def draw(rng: random.Random) -> tuple[dict[bytes, int], list[int], int]:
        page_size = rng.choice([1, 2, 4, 8])
        earlier = _prompts(rng, 4, page_size)
        cached: dict[bytes, int] = {}
        for prompt in earlier:
            for h in prompt_page_hashes(prompt, page_size):
                cached.setdefault(h, len(cached) * 3 % 97)
        query = _prompts(rng, 1, page_size)[0] if rng.random() < 0.4 else \
            list(rng.choice(earlier))[:rng.randint(1, 64)] or [5]
        return cached, query, page_size

    named = [(label, "edge", case) for label, *case in cases]
    named += _named(name, [], draw, 13, 60, 30)
    checked = _Cases(name, len(named))
    for label, group, (cached, tokens, page_size) in named:
        with checked.case(label, group):
            _match_prefix_case(fn, name, label, cached, tokens, page_size)
    checked.done(f"{len(named)} lookups agree with PagePool.match_prefix")


def _match_prefix_case(fn: Callable, name: str, label: str, cached: dict[bytes, int],
                       tokens: list[int], page_size: int) -> None:
    want = _reference_match(cached, tokens, page_size)
    got = _call(name, f"{label}: fn(cached, {_short(tokens, 90)}, {page_size})", fn,
                dict(cached), list(tokens), page_size)
    if list(got) == want if isinstance(got, (list, tuple)) else False:
        return
    shown = (f"{label}: token_ids={_short(tokens, 90)} ({len(tokens)} tokens), "
             f"page_size={page_size}, {len(cached)} cached pages")
    usable = (len(tokens) - 1) // page_size
    why = ""
    if isinstance(got, (list, tuple)) and len(got) > len(want):
        if len(got) * page_size >= len(tokens):
            why = (" Your hit covers the whole prompt, leaving no token to compute; but one "
                   "token must still run through the model to give the logits of the first "
                   f"output token. Cap the hit at (len - 1) // page_size = {usable} pages.")
        else:
            why = (" A hit is a run of *leading* pages: stop at the first page whose hash "
                   "is not cached (a later page's hash names a different prefix).")
    elif isinstance(got, (list, tuple)) and len(got) < len(want):
        why = " Every leading full page whose chained hash is cached should be reused."
    _fail(name, f"{shown}: expected pages {want}, got {_short(got)}.{why}")


def quantize_int8(fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Exercise 1.4: `fn(weight)` quantizes a float [out, in] weight to int8 with one scale per
    output row, scale = max |row| / 127 and q = round(weight / scale), like
    `minicb.model.quant.quantize_rows` (what `Int8Linear` stores)."""
    name = "quantize_int8"
    _refuse_the_reference(name, fn, quantize_rows)
    gen = torch.Generator().manual_seed(14)
    sizes = torch.tensor([1e-3, 1e-1, 1, 10, 1e3, 1e5])[:, None]
    spread = torch.randn(6, 32, generator=gen) * sizes
    one_spike = torch.full((3, 16), 1e-3)
    one_spike[1, 5] = 40.0
    zero_row = torch.randn(4, 24, generator=gen)
    zero_row[2] = 0.0
    cases = [("rows of very different sizes", spread), ("one large weight in row 1", one_spike),
             ("row 2 all zeros", zero_row), ("a single row", torch.randn(1, 7, generator=gen))]
    cases += [(f"random [{o}, {i}]", torch.randn(o, i, generator=gen) * 0.05)
              for o, i in ((64, 48), (96, 64), (5, 80))]
    named = [(label, "random" if label.startswith("random") else "edge", w) for label, w in cases]
    if (secret := hidden_rng(name)) is not None:
        hidden_gen = torch.Generator().manual_seed(secret.randrange(2**31))
        for k in range(6):
            o, i, size = secret.randint(1, 96), secret.randint(1, 96), secret.choice(
                [1e-3, 0.05, 1.0, 30.0])
            named.append((f"hidden weight {k} [{o}, {i}]", "hidden",
                          torch.randn(o, i, generator=hidden_gen) * size))
    checked = _Cases(name, len(named))
    for label, group, weight in named:
        with checked.case(label, group):
            _quantize_case(fn, name, label, weight)
    checked.done(f"{len(named)} weights quantized like Int8Linear: one byte a weight, error at "
                 "most half a step per row")


def _quantize_case(fn: Callable, name: str, label: str, weight: torch.Tensor) -> None:
    shown = f"{label} (shape {list(weight.shape)})"
    given = weight.clone()
    out = _call(name, f"fn(weight) for {shown}", fn, given)
    if not torch.equal(given, weight):
        _fail(name, f"{shown}: your function changed the weight it was given (an in-place "
                    "operation such as div_ or round_?); the caller still needs the float "
                    "weight: compute q in a new tensor.")
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        _fail(name, f"{shown}: return a pair (q, scale), got {_short(out)}.")
    q, scale = out
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        _fail(name, f"{shown}: q must be a torch.int8 tensor (1 byte a weight, the point of "
                    f"the exercise), got {getattr(q, 'dtype', type(q).__name__)}. Convert "
                    "with .to(torch.int8) after rounding.")
    if q.shape != weight.shape:
        _fail(name, f"{shown}: q has shape {list(q.shape)}, expected {list(weight.shape)}.")
    if isinstance(scale, torch.Tensor) and scale.dim() == 2 and scale.shape[1] == 1:
        _fail(name, f"{shown}: scale has shape {list(scale.shape)}, expected "
                    f"[{weight.shape[0]}]: one number per row, in a 1-D tensor (amax(dim=1) "
                    "without keepdim, or .squeeze(1)). A [out, 1] scale broadcasts wrong "
                    "in q * scale[:, None].")
    if isinstance(scale, torch.Tensor) and scale.dtype in (torch.float16, torch.bfloat16):
        _fail(name, f"{shown}: scale is {scale.dtype}; keep it in float32 (or float64): "
                    f"{str(scale.dtype).replace('torch.', '')} keeps only "
                    f"{8 if scale.dtype == torch.bfloat16 else 11} significant bits, so "
                    "every weight would be off by the scale's rounding too. (minicb's "
                    "Int8Linear converts its scale to bfloat16 afterwards, for its kernel, "
                    "and pays that: the exercise measures the weights' rounding alone.)")
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(-1)
    rows = weight.shape[0]
    if scale.numel() != rows:
        per = " (one per column: use the max over dim=1, along each row)" \
            if scale.numel() == weight.shape[1] else ""
        _fail(name, f"{shown}: expected {rows} scales (one per output row), got "
                    f"{scale.numel()}{per}.")
    if not torch.isfinite(scale).all() or (scale <= 0).any():
        _fail(name, f"{shown}: scales {_short(scale.tolist())} must be finite and > 0; an "
                    "all-zero row gives max 0: put a tiny floor under the scale "
                    "(e.g. .clamp(min=1e-12)) so nothing divides by zero.")
    want_q, want_scale = quantize_rows(weight)
    nonzero = weight.abs().amax(dim=1) > 0
    if not torch.allclose(scale[nonzero], want_scale[nonzero], rtol=1e-5, atol=0):
        if torch.allclose(scale, scale[:1].expand_as(scale)) and rows > 1:
            why = (" All your rows share one scale: the largest weight of the whole matrix "
                   "sets it, and rows of small weights round to a few levels or to 0. Use "
                   "one scale per row.")
        else:
            ratio = float((scale[nonzero] / want_scale[nonzero]).median())
            why = (f" Yours are about {ratio:.3g}x that: the row's largest |weight| must map "
                   "to exactly 127 (int8 holds -128..127; 127 keeps it symmetric).")
        _fail(name, f"{shown}: expected scales max|row| / 127 = "
                    f"{_short([round(x, 6) for x in want_scale.tolist()], 120)}, got "
                    f"{_short([round(x, 6) for x in scale.tolist()], 120)}.{why}")
    if int(q.int().abs().max()) > 127:  # abs() of an int8 -128 is -128 again
        _fail(name, f"{shown}: q holds {int(q.int().min())}; keep it in [-127, 127].")
    off = (q.float() - want_q.float()).abs()
    if off.max() > 1 or (off > 0).float().mean() > 0.01:
        r, c = divmod(int(off.argmax()), weight.shape[1])
        _fail(name, f"{shown}: q[{r}, {c}] = {int(q[r, c])}, expected "
                    f"round({float(weight[r, c]):.6g} / {float(want_scale[r]):.6g}) = "
                    f"{int(want_q[r, c])}. Round to the nearest level (torch.round), do not "
                    "truncate.")


# ============================================================================ 02 static
def _reference_static_batch(queue: Sequence[tuple[str, int]], max_num_seqs: int,
                            free_pages: int, page_size: int) -> list[str]:
    batch = []
    for rid, prompt_len in queue[:max_num_seqs]:
        need = -(-prompt_len // page_size)
        if need > free_pages:
            break
        free_pages -= need
        batch.append(rid)
    return batch


def static_batch(fn: Callable[[list[tuple[str, int]], int, int, int], list[str]]) -> None:
    """Exercise 2.1: `fn(queue, max_num_seqs, free_pages, page_size)` forms a static batch:
    the ids of the requests at the front of `queue` (a list of (request_id, prompt_len)), in
    order, at most `max_num_seqs`, each taking ceil(prompt_len / page_size) pages, stopping at
    the first request whose pages do not fit (first come, first served: nobody jumps ahead)."""
    name = "static_batch"
    q = [("r0", 20), ("r1", 40), ("r2", 5), ("r3", 16), ("r4", 33)]
    edge = [([], 4, 10, 16), (q, 3, 100, 16), (q, 8, 100, 16), (q, 4, 3, 16),
            (q, 4, 1, 16), (q, 4, 0, 16), (q, 4, 4, 16), ([("r0", 16)], 1, 1, 16),
            ([("r0", 17)], 1, 1, 16)]

    def draw(rng: random.Random) -> tuple[list[tuple[str, int]], int, int, int]:
        queue = [(f"r{i}", rng.randint(1, 70)) for i in range(rng.randint(0, 8))]
        return queue, rng.randint(1, 6), rng.randint(0, 16), rng.choice([4, 8, 16])

    named = _named(name, edge, draw, 21, 150, 50, "queue")
    cases = _Cases(name, len(named))
    for label, group, case in named:
        with cases.case(label, group):
            _static_batch_case(fn, name, *case)
    cases.done(f"{len(named)} queues form the same batch as minicb's static policy")


def _static_batch_case(fn: Callable, name: str, queue: list[tuple[str, int]],
                       max_num_seqs: int, free_pages: int, page_size: int) -> None:
    want = _reference_static_batch(queue, max_num_seqs, free_pages, page_size)
    got = _call(name, f"fn({queue}, {max_num_seqs}, {free_pages}, {page_size})", fn,
                list(queue), max_num_seqs, free_pages, page_size)
    if isinstance(got, (list, tuple)) and list(got) == want:
        return
    shown = (f"queue={queue}, max_num_seqs={max_num_seqs}, free_pages={free_pages}, "
             f"page_size={page_size}")
    need = {rid: -(-n // page_size) for rid, n in queue}
    why = ""
    if isinstance(got, (list, tuple)):
        got = list(got)
        pages = sum(need.get(rid, 0) for rid in got)
        order = [rid for rid, _ in queue]
        stop = next((rid for rid, _ in queue[len(want):len(want) + 1]), None)
        if len(got) > max_num_seqs:
            why = f" Your batch has {len(got)} members; the limit is {max_num_seqs}."
        elif pages > free_pages:
            why = f" Your batch needs {pages} pages but only {free_pages} are free."
        elif len(want) == max_num_seqs and any(rid not in want for rid in got):
            why = (f" The batch is full at max_num_seqs={max_num_seqs} with the first "
                   f"{max_num_seqs} requests in the queue: first come, first served, later "
                   "requests must not jump ahead.")
        elif stop is not None and stop not in got and any(
                order.index(r) > order.index(stop) for r in got if r in order):
            left = free_pages - sum(need[rid] for rid in want)
            why = (f" {stop!r} does not fit ({_pages(need[stop])} needed, {left} left after "
                   f"{want}), so the batch stops there: first come, first served, later "
                   "requests must not jump ahead.")
        elif got != sorted(got, key=lambda r: order.index(r) if r in order else -1):
            why = " Keep the queue's order."
        elif len(got) < len(want):
            nxt = want[len(got)]
            why = (f" {nxt!r} still fits ({_pages(need[nxt])} needed, "
                   f"{free_pages - pages} left).")
    _fail(name, f"{shown}: expected {want}, got {_short(got)}.{why}")


# ---------------------------------------------------------------- finish steps, from a real run
GREEDY_EXACT = dict(temperature=0.0, ignore_eos=True)


def _engine(policy: Any, **options: Any) -> Any:
    from minicb.engine import Engine

    options.setdefault("num_pages", 512)
    options.setdefault("page_size", 16)
    options.setdefault("check_invariants", True)
    return Engine(tiny_model(), policy=policy, **options)


def _finish_steps_real(policy: str, max_tokens: Sequence[int], arrival_steps: Sequence[int],
                       max_num_seqs: int) -> list[int]:
    """Run the real engine on the tiny model and read each request's finish step."""
    engine = _engine(policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                     chunk_size=2048, check_invariants=False)  # minicb's own: no need
    for i, (n, a) in enumerate(zip(max_tokens, arrival_steps)):
        engine.add_request([3 + i % 200, 10, 11, 12], SamplingParams(max_tokens=n,
                                                                     **GREEDY_EXACT),
                           request_id=f"R{i + 1}", arrival_step=a)
    with _OneThread():
        engine.run()
    return [engine.requests[f"R{i + 1}"].metrics.finish_step for i in range(len(max_tokens))]


FINISH_EDGE_CASES = [([30, 200, 80, 60], [1, 1, 1, 31], 3),  # the chapter's R1..R4
                     ([1], [1], 1), ([5, 1, 3], [1, 1, 1], 1), ([4, 4], [1, 9], 2),
                     ([6, 2, 9, 3, 5], [1, 2, 2, 4, 20], 2),
                     ([5, 5, 5], [9, 1, 1], 1), ([3, 6, 2, 4], [4, 1, 4, 1], 2),  # not in order
                     ([3, 3, 3, 3], [1, 1, 2, 4], 2),  # one arrives as the batch forms
                     ([10, 3, 3], [1, 5, 2], 1)]  # both wait for R1's slot: R3 came first


def _finish_case(rng: random.Random) -> tuple[list[int], list[int], int]:
    """A random finish-steps case: half of them listed in arrival order, half as they came."""
    n = rng.randint(2, 7)
    arrivals = [rng.randint(1, 25) for _ in range(n)]
    if rng.random() < 0.5:
        arrivals.sort()
    return [rng.randint(1, 18) for _ in range(n)], arrivals, rng.randint(1, 4)


def _check_finish_steps(fn: Callable, policy: str, name: str, rule: str) -> None:
    named = _named(name, FINISH_EDGE_CASES, _finish_case, 22 if policy == "static" else 33,
                   8, 6, "workload")
    cases = _Cases(name, len(named))
    for label, group, (max_tokens, arrivals, max_num_seqs) in named:
        with cases.case(label, group):
            _finish_steps_case(fn, policy, name, rule, max_tokens, arrivals, max_num_seqs)
    cases.done(f"{len(named)} workloads (the chapter's R1..R4 among them) finish at the same "
               f"steps as the real engine under policy {policy!r}")


def _finish_steps_case(fn: Callable, policy: str, name: str, rule: str, max_tokens: list[int],
                       arrivals: list[int], max_num_seqs: int) -> None:
    want = _finish_steps_real(policy, max_tokens, arrivals, max_num_seqs)
    shown = (f"max_tokens={max_tokens}, arrival_steps={arrivals}, "
             f"max_num_seqs={max_num_seqs}")
    got = _call(name, f"fn({shown})", fn, list(max_tokens), list(arrivals), max_num_seqs)
    if isinstance(got, (list, tuple)) and list(got) == want:
        return
    detail = ""
    if isinstance(got, (list, tuple)) and len(got) == len(want):
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        detail = (f" First difference: request {i + 1} (max_tokens={max_tokens[i]}, "
                  f"arrives at step {arrivals[i]}) finished at step {want[i]} in the real "
                  f"engine; you said {got[i]}.")
    order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i))
    if order != list(range(len(arrivals))) and RESULTS[name].explaining:  # the order, the bug?
        ordered = _call(name, "fn(the same requests listed in arrival order)", fn,
                        [max_tokens[i] for i in order], sorted(arrivals), max_num_seqs)
        if isinstance(ordered, (list, tuple)) and len(ordered) == len(want) and \
                all(ordered[k] == want[i] for k, i in enumerate(order)):
            detail += (" Here the list is not in arrival order, and yours gets these requests "
                       "right once they are listed in arrival order: requests queue by "
                       "arrival_step (ties in list order), whatever their place in the "
                       "list; sort the indices by (arrival_steps[i], i).")
    _fail(name, f"{shown}: the real engine (policy {policy!r}) finished the requests at "
                f"steps {want}; yours says {_short(got)}.{detail} Remember: {rule}")


STEP_RULES = ("a request admitted at step s produces its first token at step s (its prefill "
              "step) and one more token each step after, so with max_tokens=m it finishes at "
              "step s + m - 1; its slot is free again from the next step.")


def static_finish_steps(fn: Callable[[list[int], list[int], int], list[int]]) -> None:
    """Exercise 2.2: `fn(max_tokens, arrival_steps, max_num_seqs)` predicts the step at which
    each request finishes under static batching; checked against the real engine."""
    return _check_finish_steps(
        fn, "static", "static_finish_steps",
        STEP_RULES + " Under static batching a batch forms only when the previous one has "
        "ended (all its members finished); it takes up to max_num_seqs waiting requests in "
        "arrival order, and requests arriving later wait for the next batch.")


def continuous_finish_steps(fn: Callable[[list[int], list[int], int], list[int]]) -> None:
    """Exercise 3.1: `fn(max_tokens, arrival_steps, max_num_seqs)` predicts the step at which
    each request finishes under continuous batching; checked against the real engine."""
    return _check_finish_steps(
        fn, "continuous", "continuous_finish_steps",
        STEP_RULES + " Under continuous batching every step first reclaims (a request that "
        "finished at step k left at the end of step k) and then admits waiting requests, in "
        "arrival order (ties in list order), into the free slots.")


# ============================================================================ schedulers, for real
@dataclass
class CheckWorkload:
    """A small scheduler workload: (request_id, prompt_len, max_tokens, arrival_step) rows and
    the engine options it runs under."""

    name: str
    about: str
    requests: list[tuple[str, int, int, int]]
    options: dict[str, Any] = field(default_factory=dict)
    shared_prefix: int = 0  # every prompt starts with the same tokens: prefix-cache hits

    def prompt(self, index: int, length: int) -> list[int]:
        """Deterministic token ids (3..249, inside the tiny vocabulary) for request `index`."""
        rng, common = random.Random(1000 + index), random.Random(999)
        prefix = [common.randrange(3, 250) for _ in range(min(self.shared_prefix, length))]
        return prefix + [rng.randrange(3, 250) for _ in range(length - len(prefix))]


def _describe(members: Sequence[Any]) -> str:
    shown = [f"{m.request_id} {m.kind}" + (f" {m.num_tokens}" if m.kind == "prefill" else "")
             for m in members if m.kind != "idle"]
    tokens = sum(m.num_tokens for m in members)
    return ("[" + ", ".join(shown) + f"] ({tokens} tokens)") if shown else "nothing"


def _make_instance(policy: Any) -> Any:
    if isinstance(policy, str):
        return policy
    if isinstance(policy, type):
        return policy()
    try:
        return type(policy)()
    except TypeError:
        return copy.deepcopy(policy)


class _Returns(Scheduler):
    """Wraps a learner's scheduler: same name and the same attributes the engine reads
    (`Scheduler`'s docstring), but a `schedule` that returns something other than the
    context's batch is reported in plain words."""

    def __init__(self, inner: Any, exercise: str, where: str) -> None:
        self.inner = inner
        self.exercise = exercise
        self.where = where
        self.name = getattr(inner, "name", "learner")
        for flag in POLICY_FLAGS:
            setattr(self, flag, getattr(inner, flag, False))

    def schedule(self, ctx: Any) -> Any:
        out = _call(self.exercise, f"{self.where}: at step {ctx.step}, schedule(ctx)",
                    self.inner.schedule, ctx)
        if out is not ctx.batch:
            _fail(self.exercise, f"{self.where}: at step {ctx.step}, schedule(ctx) returned "
                                 f"{_short(out, 60)}; it must return ctx.batch (the batch that "
                                 "ctx.schedule(...) fills).")
        # the engine refuses both below, with a message that does not name the cause
        for req, n in ctx.batch.items:
            if req.status is not Status.RUNNING and any(req is p for p in ctx.batch.preempted):
                _fail(self.exercise, f"{self.where}, step {ctx.step}: {req.request_id!r} was "
                                     "preempted earlier in this step (an earlier decode needed "
                                     "its pages) and then scheduled. Skip a request that is not "
                                     "running any more: `if req.status is not Status.RUNNING: "
                                     "continue` before reserving for it (self.schedule_decodes "
                                     "does that).")
            if not isinstance(n, int) and isinstance(_as_int(n), int):
                _fail(self.exercise, f"{self.where}, step {ctx.step}: ctx.schedule("
                                     f"{req.request_id!r}, {n!r}) needs a Python int, which the "
                                     "engine checks: convert the token count with int(...).")
        return out

    def release(self, req: Any) -> list[Any]:
        return self.inner.release(req) if hasattr(self.inner, "release") else [req]


@dataclass
class _Run:
    trace: list[StepRecord]
    engine: Any
    skipped: list[tuple[int, list[str], list[Any]]] = field(default_factory=list)


def _stalled(engine: Any, record: StepRecord, policy: str | None) -> str:
    """Why a step scheduled nothing while requests wait or run (minicb's never does)."""
    budget = engine.config.max_num_batched_tokens
    head = f"at step {record.step} your scheduler scheduled nothing"
    if not engine.running:
        front = engine.waiting[0]
        if policy == "continuous" and front.num_tokens > budget:
            return (f"{head}: {front.request_id!r} ({front.num_tokens} tokens) waits at the "
                    f"front of the queue and nothing runs. A prompt longer than the budget "
                    f"({budget}) must still run when it is alone: apply the budget only to a "
                    "prompt that would join others in the step (if prefill_tokens and "
                    "prefill_tokens + req.num_tokens > budget: break).")
        return (f"{head} while {[r.request_id for r in engine.waiting][:5]} waited and nothing "
                "ran: admit from the front of ctx.waiting (ctx.admit, then ctx.schedule).")
    running = [r.request_id for r in engine.running]
    if engine.pool.num_available == 0 and not record.preempted:
        return (f"{head} and preempted nobody while {running} ran and no page was free: a "
                "decode that cannot get its page must preempt (ctx.reserve_or_preempt(req, 1), "
                "as self.schedule_decodes does; ctx.reserve only says no), else nothing can "
                "ever run again.")
    never = [r.request_id for r in engine.running if r.metrics.first_scheduled_step is None]
    if never:
        return (f"{head}: {never} were admitted (ctx.admit) but never scheduled. admit only "
                "gives a request its slot and pages; ctx.schedule(req, n) puts it in the step.")
    prefilling = [r.request_id for r in engine.running if r.is_prefill]
    if prefilling:
        return (f"{head}: {prefilling} are running but still in prefill and got no chunk. "
                "Running prompts continue (self.prefilling(ctx)) before new ones are admitted.")
    return f"{head} while {running} ran: every running decode gets its token."


def _run(policy: Any, wl: CheckWorkload, exercise: str, max_steps: int = 2000,
         learner: bool = True, compared_with: str | None = None) -> _Run:
    """Run `wl` in a real engine on the tiny model with `policy`; for a learner's scheduler,
    turn the engine's refusals into CheckFailed naming the workload and the step, stop at
    the first step that scheduled nothing while work was there, and note every step in
    which a running decode was left out. `compared_with`: the policy it must match."""
    from minicb.engine import InvariantError, SchedulerError

    where = f"workload {wl.name!r} ({wl.about})"
    instance = _make_instance(policy)
    if learner:
        instance = _Returns(instance, exercise, where)
    options = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "chunk_size": 64, **wl.options}
    engine = _engine(instance, **options, check_invariants=learner)  # minicb's own: no need
    for i, (rid, prompt_len, max_tokens, arrival) in enumerate(wl.requests):
        engine.add_request(wl.prompt(i, prompt_len),
                           SamplingParams(max_tokens=max_tokens, **GREEDY_EXACT),
                           request_id=rid, arrival_step=arrival)
    run = _Run(engine.trace, engine)
    with _OneThread():
        while engine.has_unfinished():
            if len(engine.trace) >= max_steps:
                waiting = [r.request_id for r in engine.waiting]
                _fail(exercise, f"{where}: your scheduler had not finished after {max_steps} "
                                f"steps (minicb's needs far fewer). Still waiting: {waiting}; "
                                f"running: {[r.request_id for r in engine.running]}. Does "
                                "schedule() admit waiting requests and advance running ones?")
            ready = [r.request_id for r in engine.running if not r.is_prefill]
            try:
                record = engine.step()
            except SchedulerError as exc:
                why = ""
                if "exceed max_num_batched_tokens" in str(exc) and \
                        compared_with in POLICY_CLASSES and \
                        POLICY_CLASSES[compared_with].whole_prompts and \
                        not instance.whole_prompts:
                    why = (" The engine lets one prompt exceed the budget only under a "
                           "whole-prompt policy, which it knows by the class attribute "
                           "`whole_prompts = True` (yours is missing; minicb's "
                           f"{compared_with!r} scheduler has it).")
                _fail(exercise, f"{where}: the engine refused the batch your scheduler "
                                f"returned: {exc}{why}")
            except InvariantError as exc:
                if "left running decodes out" not in str(exc):
                    _fail(exercise, f"{where}: the engine's invariant check failed: {exc}")
                record = engine.trace[-1]
            if learner and not any(m.kind != "idle" for m in record.members) and \
                    (engine.waiting or engine.running):
                _fail(exercise, f"{where}: {_stalled(engine, record, compared_with)}")
            if learner:
                ran = {m.request_id for m in record.members}
                left = [rid for rid in ready if rid not in ran and rid not in record.preempted]
                if left:
                    run.skipped.append((record.step, left, list(record.members)))
    return run


_REFERENCE: dict[tuple[str, str], list[StepRecord]] = {}  # (policy, the workload's repr)


def _reference(policy: str, wl: CheckWorkload) -> list[StepRecord]:
    key = (policy, repr(wl))
    if key not in _REFERENCE:
        _REFERENCE[key] = _run(POLICY_CLASSES[policy], wl, "reference", learner=False).trace
    return _REFERENCE[key]


def _signature(record: StepRecord) -> list[tuple[str, str, int]]:
    return sorted((m.request_id, m.kind, m.num_tokens) for m in record.members)


def _tokens(record: StepRecord) -> int:
    return sum(m.num_tokens for m in record.members)


def _compare(ref: list[StepRecord], mine: list[StepRecord], wl: CheckWorkload, policy: str,
             exercise: str, rules: str) -> None:
    for a, b in zip(ref, mine):
        if _signature(a) != _signature(b) or a.step != b.step or a.preempted != b.preempted:
            waiting = f" Waiting after that step (yours): {b.waiting}." if b.waiting else ""
            extra = ""
            if a.preempted != b.preempted:
                extra = f" minicb preempted {a.preempted}; yours preempted {b.preempted}."
            chunks = {m.request_id: m.num_tokens for m in a.members if m.kind == "prefill"}
            one = [m.request_id for m in b.members if m.kind == "prefill" and m.num_tokens == 1
                   and chunks.get(m.request_id, 1) > 1]
            if one and _tokens(b) < _tokens(a):  # a prompt being prefilled, taken for a decode
                extra += (f" Yours gave {one[0]!r}, whose prompt was not yet done, a single "
                          "token: was it in your decode loop? Decodes are the running requests "
                          "whose prompt is done: loop over self.decoding(ctx), not ctx.running.")
            _fail(exercise, f"workload {wl.name!r} ({wl.about}), step {a.step}: minicb's "
                            f"{policy} scheduler ran {_describe(a.members)}; yours ran "
                            f"{_describe(b.members)}.{extra}{waiting} {rules}")
    if len(ref) != len(mine):
        _fail(exercise, f"workload {wl.name!r} ({wl.about}): minicb's {policy} scheduler "
                        f"finished in {len(ref)} steps, yours in {len(mine)}. {rules}")


TRIPPED = "_minicb_check_tripped"  # set in the module of a minicb function the learner ran


def _tripwire_code(name: str) -> Any:
    """The code of a function that notes `name` in its module and raises. It replaces the
    code of minicb's own function in place, so every reference to it trips: an alias, a
    subclass that does not override, a call through the class or a copied function."""
    namespace: dict[str, Any] = {}
    exec(f"def tripwire(*args, **kwargs):\n"
         f"    globals().setdefault({TRIPPED!r}, set()).add({name!r})\n"
         f"    raise RuntimeError('minicb check: your scheduler ran minicb\\'s own {name}')\n",
         namespace)
    return namespace["tripwire"].__code__


_SCHEDULER_EXERCISES = ("continuous_scheduler", "chunked_scheduler", "pd_scheduler")


@contextlib.contextmanager
def _refusing_the_reference(exercise: str, functions: Sequence[Callable]):
    """While the learner's code runs, minicb's own versions refuse to run: the check
    compares yours with minicb's, so minicb's would pass against itself."""
    saved = {fn: fn.__code__ for fn in functions if fn.__closure__ is None}
    if not saved:  # nothing to refuse (or already refused around the whole run)
        yield
        return
    for fn in saved:
        own = "check." if fn.__module__ == __name__ else ""  # this module's: say so
        fn.__code__ = _tripwire_code(own + fn.__qualname__)

    def tripped() -> list[str]:
        return sorted(set().union(*(fn.__globals__.pop(TRIPPED, set()) for fn in saved)))

    used: list[str] = []
    try:
        yield
    except Exception:
        used = tripped()
        if not used:
            raise
    finally:
        for fn, code in saved.items():
            fn.__code__ = code
    used = used or tripped()
    if used and exercise in _SCHEDULER_EXERCISES:
        raise ReferenceRefused(
            f"[{exercise}] your scheduler ran minicb's own {', '.join(used)}: write the policy "
            "yourself (the check compares it step by step with minicb's, which would pass "
            "against itself). The shared building blocks of `Scheduler` (schedule_decodes, "
            "decoding, prefilling) are yours to use.")
    if used:
        raise ReferenceRefused(
            f"[{exercise}] your code ran minicb's own {', '.join(used)}: write your own version "
            "(the check compares it with minicb's, which would pass against itself).")


def _check_scheduler(cls: Any, policy: str, exercise: str, workloads: list[CheckWorkload],
                     rules: str, decodes_first: bool, also_refused: Sequence[Callable] = ()
                     ) -> None:
    if isinstance(cls, type) and not issubclass(cls, Scheduler) or \
            not isinstance(cls, type) and not hasattr(cls, "schedule"):
        _fail(exercise, f"expected a Scheduler subclass (class MyScheduler(Scheduler): ...), "
                        f"got {_short(cls, 60)}.")
    named = [(wl.name, "edge", wl) for wl in workloads]
    if (secret := hidden_rng(exercise)) is not None:
        named += [(f"hidden workload {k}", "hidden", _random_workload(secret, f"hidden-{k}"))
                  for k in range(3)]
    refs = [_reference(policy, wl) for _, _, wl in named]  # before minicb's own are refused
    refused = [c.schedule for c in POLICY_CLASSES.values()] + list(also_refused)
    cases = _Cases(exercise, len(named))
    try:
        with _refusing_the_reference(exercise, refused):
            for (label, group, wl), ref in zip(named, refs):
                with cases.case(label, group):
                    _run_beside_the_reference(cls, policy, exercise, wl, ref, rules,
                                              decodes_first)
    except ReferenceRefused:
        cases.refused = True
        raise
    steps = sum(len(ref) for ref in refs)
    cases.done(f"{len(named)} workloads ({steps} steps) ran in the real engine with invariant "
               f"checks on, step for step like minicb's {policy!r} scheduler")


def _random_workload(rng: random.Random, name: str) -> CheckWorkload:
    """A random small workload: a few requests arriving over ten steps, a random budget and
    chunk size, sometimes a shared prefix, sometimes so few pages that decodes preempt."""
    requests = [(f"h{i}", rng.randint(4, 80), rng.randint(1, 16), rng.randint(1, 10))
                for i in range(rng.randint(2, 6))]
    options: dict[str, Any] = {"max_num_seqs": rng.randint(2, 5),
                               "max_num_batched_tokens": rng.choice([16, 32, 64]),
                               "chunk_size": rng.choice([8, 16, 32]),
                               "min_chunk": rng.choice([1, 1, 4, 8])}
    if rng.random() < 0.4:  # each request fits alone, not all together: preemption
        largest = max(-(-(n + m) // 16) for _, n, m, _ in requests)
        options["num_pages"] = largest + rng.randint(1, 3)
    about = (f"{len(requests)} random requests (prompt_len, max_tokens, arrival_step): "
             f"{[r[1:] for r in requests]}, options {options}")
    return CheckWorkload(name, about, requests, options,
                         shared_prefix=rng.choice([0, 0, 32]))


def _run_beside_the_reference(cls: Any, policy: str, exercise: str, wl: CheckWorkload,
                              ref: list[StepRecord], rules: str, decodes_first: bool) -> None:
    mine = _run(cls, wl, exercise, max_steps=3 * len(ref) + 50, compared_with=policy)
    if decodes_first and mine.skipped:
        step, left, members = mine.skipped[0]
        prefills = [m for m in members if m.kind == "prefill"]
        ran = _describe(members)
        what = (f"only prefill chunks: {ran}" if prefills and len(prefills) == len(members)
                else ran)
        _fail(exercise, f"decodes were left waiting at step {step} of workload {wl.name!r} "
                        f"({wl.about}): {', '.join(left)} had already produced tokens and "
                        f"were still running, but your scheduler ran {what}. Every running "
                        "decode gets its one token first; only what is left of the budget "
                        "goes to prefill.")
    _compare(ref, mine.trace, wl, policy, exercise, rules)


CONTINUOUS_WORKLOADS = [
    CheckWorkload("r1-r4", "three requests at step 1, a fourth at step 7, three slots",
             [("R1", 8, 6, 1), ("R2", 8, 20, 1), ("R3", 8, 12, 1), ("R4", 8, 8, 7)],
             {"max_num_seqs": 3, "max_num_batched_tokens": 256}),
    CheckWorkload("budget", "six 24-token prompts at once under a 64-token budget",
             [(f"q{i}", 24, 5, 1) for i in range(6)],
             {"max_num_seqs": 8, "max_num_batched_tokens": 64}),
    CheckWorkload("long-alone", "a 100-token prompt, longer than the 64-token budget, arrives "
             "while a request decodes, with a short one right behind it",
             [("a", 10, 12, 1), ("long", 100, 4, 3), ("b", 10, 6, 3), ("c", 30, 4, 3)],
             {"max_num_seqs": 4, "max_num_batched_tokens": 64}),
    CheckWorkload("slots", "seven requests trickling into two slots",
             [(f"s{i}", 6 + 3 * i, 3 + (5 * i) % 7, 1 + 2 * i) for i in range(7)],
             {"max_num_seqs": 2, "max_num_batched_tokens": 128}),
    CheckWorkload("pages", "too few pages: decodes must preempt the newest request",
             [(f"p{i}", 30, 24, 1) for i in range(4)],
             {"max_num_seqs": 4, "max_num_batched_tokens": 256, "num_pages": 8}),
    CheckWorkload("queue-order", "a 50-, a 30- and a 10-token prompt at once under a 64-token "
             "budget: the 30-token one does not fit beside the first, and the 10-token one "
             "must not jump past it",
             [("a", 50, 4, 1), ("b", 30, 4, 1), ("c", 10, 4, 1)],
             {"max_num_seqs": 4, "max_num_batched_tokens": 64}),
    CheckWorkload("late-pages", "six pages: two requests decode when a third arrives at step "
             "4; the decodes need the free pages first",
             [("p0", 30, 12, 1), ("p1", 30, 12, 1), ("p2", 14, 6, 4), ("p3", 14, 6, 6)],
             {"max_num_seqs": 4, "max_num_batched_tokens": 256, "num_pages": 6}),
    CheckWorkload("decodes-beside-prompts", "three requests decode when a 30- and a 32-token "
             "prompt arrive at step 3 under a 64-token budget: only prompt tokens count against "
             "this policy's budget (decodes are not subtracted, unlike chapter 05's pd), so "
             "both prompts join in step 3",
             [("d0", 8, 10, 1), ("d1", 8, 10, 1), ("d2", 8, 10, 1), ("x", 30, 3, 3),
              ("y", 32, 3, 3)],
             {"max_num_seqs": 8, "max_num_batched_tokens": 64}),
    CheckWorkload("exact-fit", "two 32-token prompts fill a 64-token budget exactly: both join "
             "(a prompt fits when the step's prefill tokens stay <= the budget)",
             [("a", 32, 3, 1), ("b", 32, 3, 1)], {"max_num_batched_tokens": 64}),
    CheckWorkload("prefix-hit", "a second request shares the first's 48-token prefix: its "
             "three cached pages are reused, so ctx.admit returns only the 2 tokens left to "
             "compute, and that is what gets scheduled",
             [("first", 51, 4, 1), ("second", 50, 4, 4)], {"max_num_batched_tokens": 256},
             shared_prefix=48),
]
CONTINUOUS_RULES = (
    "Continuous batching, as minicb does it: first every running decode gets one token "
    "(self.schedule_decodes(ctx) does exactly that, preempting when pages run out); then, unless "
    "something was preempted this step, admit requests from the front of the waiting queue, "
    "whole prompts, while they fit: stop at the first one that would push the step's prefill "
    "tokens over max_num_batched_tokens (a prompt longer than the whole budget may still run, "
    "alone, when no other prompt is in the step) or that ctx.admit refuses (returns 0).")


def continuous_scheduler(cls: Any) -> None:
    """Exercise 3.2: a continuous-batching `Scheduler` subclass, run for real on ten small
    workloads and compared step by step with minicb's ContinuousScheduler."""
    return _check_scheduler(cls, "continuous", "continuous_scheduler", CONTINUOUS_WORKLOADS,
                            CONTINUOUS_RULES, decodes_first=True)


LONG_PREFILL = [("short-0", 8, 16, 1), ("short-1", 8, 14, 1), ("short-2", 8, 12, 1),
                ("long", 100, 4, 3)]
CHUNKED_WORKLOADS = [
    CheckWorkload("long-prefill", "three short requests decode; a 100-token prompt arrives at "
             "step 3; budget 32, chunk_size 32", LONG_PREFILL,
             {"max_num_seqs": 4, "max_num_batched_tokens": 32, "chunk_size": 32}),
    CheckWorkload("two-long", "two long prompts and a short one; chunk_size 16, budget 40",
             [("long-a", 70, 3, 1), ("long-b", 50, 3, 1), ("short", 6, 8, 2)],
             {"max_num_seqs": 4, "max_num_batched_tokens": 40, "chunk_size": 16}),
    CheckWorkload("r1-r4", "the R1..R4 example with 20-token prompts; budget 32, chunk_size 16",
             [("R1", 20, 6, 1), ("R2", 20, 20, 1), ("R3", 20, 12, 1), ("R4", 20, 8, 7)],
             {"max_num_seqs": 3, "max_num_batched_tokens": 32, "chunk_size": 16}),
    CheckWorkload("busy-budget", "two 60-token prompts are being chunked when a 30-token one "
             "arrives; budget 40, chunk_size 16: the running prompts' chunks come out of the "
             "budget first, the newcomer gets what is left",
             [("a", 60, 3, 1), ("b", 60, 3, 1), ("c", 30, 3, 2)],
             {"max_num_seqs": 4, "max_num_batched_tokens": 40, "chunk_size": 16}),
    CheckWorkload("prefix-hit", "a second request shares the first's 48-token prefix: ctx.admit "
             "returns only the 2 tokens left after the cached pages; schedule what it returns",
             [("first", 51, 4, 1), ("second", 50, 4, 6)],
             {"max_num_seqs": 4, "max_num_batched_tokens": 32, "chunk_size": 16},
             shared_prefix=48),
]
CHUNKED_RULES = (
    "Prefill-first chunked prefill, as minicb does it: spend the budget "
    "(max_num_batched_tokens) on prefill chunks of at most chunk_size tokens, first for the "
    "running requests still in prefill (oldest first), then by admitting requests from the "
    "front of the waiting queue with ctx.admit(req, min(chunk_size, budget)); stop admitting "
    "when the budget is spent or ctx.admit returns 0. Only if no prefill chunk was scheduled "
    "do the running decodes get their token (self.schedule_decodes(ctx)).")


def chunked_scheduler(cls: Any) -> None:
    """Exercise 4.2: a prefill-first chunked-prefill `Scheduler` subclass, run for real and
    compared step by step with minicb's ChunkedScheduler."""
    return _check_scheduler(cls, "chunked", "chunked_scheduler", CHUNKED_WORKLOADS,
                            CHUNKED_RULES, decodes_first=False,
                            also_refused=[schedule_prefill_chunks])


PD_WORKLOADS = [
    CHUNKED_WORKLOADS[0],
    CheckWorkload("min-chunk", "six 6-token prompts and a 60-token one under a 12-token budget "
             "with min_chunk=8: a chunk waits while the decodes leave too little budget",
             [(f"short-{i}", 6, 6 + i, 1) for i in range(6)] + [("long", 60, 3, 2)],
             {"max_num_seqs": 8, "max_num_batched_tokens": 12, "chunk_size": 16,
              "min_chunk": 8}),
    CheckWorkload("r1-r4", "the R1..R4 example with 20-token prompts; budget 32, chunk_size 16",
             CHUNKED_WORKLOADS[2].requests,
             {"max_num_seqs": 3, "max_num_batched_tokens": 32, "chunk_size": 16}),
    CheckWorkload("pages", "too few pages: decodes must preempt the newest request",
             [(f"p{i}", 30, 24, 1) for i in range(4)],
             {"max_num_seqs": 4, "max_num_batched_tokens": 48, "chunk_size": 32,
              "num_pages": 8}),
    CheckWorkload("pages-mid-prefill", "a prompt is being chunked when the decodes need the "
             "last pages: the decodes take them first",
             [("r0", 34, 16, 7), ("r1", 5, 21, 5), ("r2", 52, 15, 4)],
             {"max_num_seqs": 4, "max_num_batched_tokens": 16, "chunk_size": 32,
              "num_pages": 5}),
]
PD_RULES = (
    "PD interleaving, as in the chapter's pseudo-code: budget = max_num_batched_tokens; every "
    "running decode gets one token first (ctx.reserve_or_preempt(req, 1), then "
    "ctx.schedule(req, 1), budget -= 1); what is left of the budget goes to prefill chunks "
    "(schedule_prefill_chunks(ctx, budget, min_chunk=ctx.config.min_chunk)).")


def pd_scheduler(cls: Any) -> None:
    """Exercise 5.1: the PD-interleaving `Scheduler` subclass from the chapter's pseudo-code,
    run for real (invariant checks on) and compared step by step with minicb's PDScheduler.
    A scheduler that serves prefill before decodes is caught at the first step where a
    running decode was left waiting."""
    return _check_scheduler(cls, "pd", "pd_scheduler", PD_WORKLOADS, PD_RULES,
                            decodes_first=True)


# ============================================================================ 04 chunks
def _reference_next_chunk(remaining: int, chunk_size: int, budget: int,
                          min_chunk: int = 1) -> int:
    """minicb's rule (scheduler.schedule_prefill_chunks): the chunk is as large as the
    prompt's remaining tokens, chunk_size and the budget allow; one smaller than min_chunk
    waits for a later step, unless it finishes the prompt."""
    n = min(remaining, chunk_size, max(budget, 0))
    return 0 if n < min(min_chunk, remaining) else n


def next_chunk(fn: Callable[..., int]) -> None:
    """Exercise 4.1: `fn(remaining, chunk_size, budget, min_chunk=1)` is the size of the next
    prefill chunk of a prompt with `remaining` tokens left, or 0 when it must wait."""
    name = "next_chunk"
    edge = [(100, 32, 64, 1), (100, 32, 20, 1), (10, 32, 64, 1), (100, 32, 0, 1),
            (1, 32, 1, 1), (100, 32, 5, 8), (3, 32, 5, 8), (8, 32, 8, 8), (7, 32, 5, 8),
            (100, 4, 64, 8), (9, 16, 9, 16), (40, 16, 40, 1)]

    def draw(rng: random.Random) -> tuple[int, int, int, int]:
        chunk = rng.choice([1, 4, 8, 16, 32])
        return rng.randint(1, 80), chunk, rng.randint(0, 70), rng.choice([1, 1, 2, 4, 8, 16])

    named = _named(name, edge, draw, 41, 400, 100)
    cases = _Cases(name, len(named))
    for label, group, case in named:
        with cases.case(label, group):
            _next_chunk_case(fn, name, *case)
    cases.done(f"{len(named)} cases agree with minicb's chunking rule")


def _next_chunk_case(fn: Callable, name: str, remaining: int, chunk_size: int, budget: int,
                     min_chunk: int) -> None:
    want = _reference_next_chunk(remaining, chunk_size, budget, min_chunk)
    shown = (f"remaining={remaining}, chunk_size={chunk_size}, budget={budget}, "
             f"min_chunk={min_chunk}")
    got = _as_int(_call(name, f"next_chunk({shown})", fn, remaining, chunk_size, budget,
                        min_chunk))  # a numpy integer (np.min) is an int here
    if got == want and isinstance(got, int):
        return
    why = ""
    if isinstance(got, int):
        if got > budget:
            why = " The chunk must fit in the step's token budget."
        elif got > chunk_size:
            why = " A chunk is at most chunk_size tokens."
        elif got > remaining:
            why = " The prompt has only `remaining` tokens left."
        elif want == 0:
            why = (f" Only {min(remaining, chunk_size, budget)} tokens would fit, fewer than "
                   f"min_chunk={min_chunk}, and they would not finish the prompt: the chunk "
                   "waits for a later step (0).")
        elif got == 0 and remaining < min_chunk:
            why = (f" The last {remaining} tokens of a prompt may run even though that is "
                   "less than min_chunk: nothing bigger will ever come.")
        elif got < want:
            why = " Take as much as the budget, chunk_size and the prompt allow."
    _fail(name, f"next_chunk({shown}): expected {want}, got {_short(got)}.{why}")


# ============================================================================ 05 dec@P, short_P
_PD_TRACES: list[tuple[str, list[StepRecord], list[RequestRecord], str]] = []


def pd_traces() -> list[tuple[str, list[StepRecord], list[RequestRecord], str]]:
    """(label, trace, request records, long request id) from real runs on the tiny model:
    the long-prefill workload under four policies, and a few edge cases. Made once. A variant
    is (workload, policy, steps to stop after or None, step after which 'long' is cancelled
    or None)."""
    if _PD_TRACES:
        return _PD_TRACES
    base = CHUNKED_WORKLOADS[0]
    variants = [
        (base, "pd", None, None), (base, "chunked", None, None),
        (base, "continuous", None, None),
        (replace(base, options={**base.options, "max_num_seqs": 2}), "static", None, None),
        (replace(base, name="long-first", about="the long prompt arrives before the shorts",
                 requests=[("long", 90, 3, 1), ("short-0", 8, 10, 2), ("short-1", 8, 6, 4)]),
         "pd", None, None),
        (replace(base, name="late-short", about="one short request arrives during the long "
                 "prefill, one finished before it began",
                 requests=[("early", 8, 2, 1), ("short-0", 8, 20, 1), ("long", 120, 3, 4),
                           ("late", 8, 5, 5)]), "pd", None, None),
        # short_P's boundaries: the request that decides the answer sits on or just past one
        (replace(base, name="alive-edges", about="one short request finishes the step the "
                 "long one arrives, one arrives the step its prefill ends and finishes last of "
                 "those alive with it, one arrives a step later and finishes later still",
                 requests=[("edge-finish", 8, 3, 1), ("short-0", 8, 6, 1), ("long", 90, 3, 3),
                           ("edge-arrive", 8, 12, 5), ("after", 8, 14, 6)]), "pd", None, None),
        (replace(base, name="finish-edge", about="the only short request alive with the long "
                 "one finishes the step it arrives; another finished before",
                 requests=[("early", 8, 1, 1), ("edge-finish", 8, 3, 1), ("long", 90, 3, 3)]),
         "pd", None, None),
        (replace(base, name="none-alive", about="one request finished before the long one "
                 "arrived, one arrives after its prefill",
                 requests=[("early", 8, 2, 1), ("long", 90, 3, 4), ("after", 8, 10, 9)]),
         "pd", None, None),
        (replace(base, name="alone", about="the long prompt alone",
                 requests=[("long", 70, 3, 2)]), "chunked", None, None),
        (base, "pd", 4, None),  # cut short: the long prefill never finishes
        (base, "chunked", 8, None),
        # the window ends at the long request's finish_step: one arriving after it is not alive
        (replace(base, name="cancelled", about="the long request is cancelled mid-prefill; one "
                 "short request decodes through it, one arrives after it and finishes last",
                 requests=[("short-0", 8, 8, 1), ("long", 100, 3, 3), ("after", 8, 12, 6)]),
         "pd", None, 4),
    ]
    _PD_TRACES.extend(_pd_trace(*variant) for variant in variants)
    return _PD_TRACES


def _pd_trace(wl: CheckWorkload, policy: str, cut: int | None, cancel: int | None
              ) -> tuple[str, list[StepRecord], list[RequestRecord], str]:
    """One of `pd_traces`: the workload run under `policy`, stopped after `cut` steps and with
    'long' cancelled after step `cancel` where those are given."""
    engine = _run(POLICY_CLASSES[policy], wl, "reference", learner=False).engine \
        if cut is None and cancel is None else None
    if engine is None:
        options = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "chunk_size": 64,
                   **wl.options}
        engine = _engine(policy, check_invariants=False, **options)
        for i, (rid, n, m, a) in enumerate(wl.requests):
            engine.add_request(wl.prompt(i, n), SamplingParams(max_tokens=m, **GREEDY_EXACT),
                               request_id=rid, arrival_step=a)
        with _OneThread():
            if cancel:
                engine.run(max_steps=cancel)
                engine.cancel("long")
            engine.run(max_steps=cut)
    label = f"{wl.name} under {policy!r}" + (f", stopped after {cut} steps" if cut else "") \
        + (f", 'long' cancelled after step {cancel}" if cancel else "")
    return label, list(engine.trace), metrics.request_records(engine), "long"


def _random_pd_trace(rng: random.Random, name: str
                     ) -> tuple[str, list[StepRecord], list[RequestRecord], str]:
    """A random long-prefill trace: short requests around one long prompt, under a random
    policy and budget, sometimes stopped early or with the long one cancelled."""
    shorts = [(f"short-{i}", rng.randint(4, 12), rng.randint(1, 20), rng.randint(1, 8))
              for i in range(rng.randint(1, 5))]
    long = ("long", rng.randint(40, 150), rng.randint(1, 4), rng.randint(1, 6))
    requests = sorted(shorts + [long], key=lambda r: r[3])
    wl = CheckWorkload(name, "random requests around a long prompt", requests,
                       {"max_num_seqs": rng.randint(2, 6),
                        "max_num_batched_tokens": rng.choice([16, 32, 48]),
                        "chunk_size": rng.choice([16, 32])})
    ending = rng.random()
    cut = rng.randint(2, 10) if ending < 0.15 else None
    cancel = long[3] + rng.randint(0, 3) if 0.15 <= ending < 0.3 else None
    return _pd_trace(wl, rng.choice(["pd", "pd", "chunked", "continuous"]), cut, cancel)


def _check_long_metric(fn: Callable, key: str, name: str, rule: str,
                       explain: Callable[..., str] | None = None) -> None:
    named = [(entry[0], "edge", entry) for entry in pd_traces()]
    if (secret := hidden_rng(name)) is not None:
        named += [(f"hidden trace {k}", "hidden", _random_pd_trace(secret, f"hidden-{k}"))
                  for k in range(4)]
    cases = _Cases(name, len(named))
    for label, group, entry in named:
        with cases.case(label, group):
            _long_metric_case(fn, key, name, rule, explain, *entry)
    cases.done(f"{len(named)} traces (pd, chunked, continuous, static and edge cases) agree "
               "with minicb.benchmark.metrics")


def _long_metric_case(fn: Callable, key: str, name: str, rule: str,
                      explain: Callable[..., str] | None, label: str, trace: list[StepRecord],
                      records: list[RequestRecord], long_id: str) -> None:
    want = metrics.long_prefill_metrics(trace, records, long_id)[key]
    got = _call(name, f"fn(trace of {label}, records, {long_id!r})", fn, list(trace),
                list(records), long_id)
    if got == want and (got is None) == (want is None):
        return
    long = next(r for r in records if r.request_id == long_id)
    ended = f"its prefill finished at step {long.first_token_step}" \
        if long.first_token_step is not None else \
        f"it ended ({long.finish_reason}) at step {long.finish_step} before its first token" \
        if long.finish_step is not None else "its prefill never finished"
    facts = (f"the long request arrived at step {long.arrival_step}, {ended}, the trace has "
             f"{len(trace)} steps")
    more = explain(trace, records, long) if explain else ""
    _fail(name, f"trace of {label} ({facts}): expected {want!r}, got {_short(got)}.{more} "
                f"{rule}")


def dec_at_p(fn: Callable[[list[StepRecord], list[RequestRecord], str], int]) -> None:
    """Exercise 5.2: `fn(trace, records, long_id)` is dec@P: decode tokens produced by the
    other requests while the long prompt's prefill is unfinished (from its arrival step to
    the step its first token came out, both included; without one, to its finish_step if it
    ended, else to the end of the trace)."""
    return _check_long_metric(
        fn, "dec_at_p", "dec_at_p",
        "dec@P counts the members of kind 'decode' of every other request in the steps from the "
        "long request's arrival_step to its first_token_step, both included (without one: to "
        "its finish_step if it ended, cancelled or failed, else to the last step of the trace).")


def _who_is_alive(trace: list[StepRecord], records: list[RequestRecord],
                  long: RequestRecord) -> str:
    """Which other requests count as alive with the long one, and why the rest do not."""
    end = next((s for s in (long.first_token_step, long.finish_step) if s is not None),
               trace[-1].step)
    counted, left_out = [], []
    for r in records:
        if r is long:
            continue
        if r.arrival_step > end:
            left_out.append(f"{r.request_id} (arrived at step {r.arrival_step}, after the "
                            f"window ended at step {end})")
        elif r.finish_step is not None and r.finish_step < long.arrival_step:
            left_out.append(f"{r.request_id} (finished at step {r.finish_step}, before the "
                            f"long one arrived)")
        else:
            counted.append(f"{r.request_id} (arrived at step {r.arrival_step}, finished at "
                           f"{r.finish_step})")
    return (f" Alive with the long one: {', '.join(counted[:6]) or 'none'}; not: "
            f"{', '.join(left_out[:6]) or 'none'}. Both bounds include their step.")


def short_p(fn: Callable[[list[StepRecord], list[RequestRecord], str], int | None]) -> None:
    """Exercise 5.3: `fn(trace, records, long_id)` is short_P in steps: from the long request's
    arrival until every short request alive with it has finished."""
    return _check_long_metric(
        fn, "short_p_steps", "short_p",
        "short_P (steps) = last finish_step among the short requests - the long request's "
        "arrival_step + 1. The short requests are the other requests alive with the long one: "
        "they arrived no later than the end of its prefill window (its first_token_step; without "
        "one its finish_step, else the last step) and had not finished before it arrived. 0 if "
        "there are none; None if one of them has not finished.", explain=_who_is_alive)


# ============================================================================ 06 latency, goodput
def _records(seed: int, n: int = 12) -> list[RequestRecord]:
    """Random request records with consistent timestamps (seconds), some cancelled, some
    failed, some with a single output token. As the engine's: every one released, at its
    finish unless a static batch held it (`returned_whole`)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        arrival = round(rng.uniform(0, 5), 3)
        first_scheduled = arrival + round(rng.expovariate(4), 3)
        kind = rng.random()
        if kind < 0.1:  # cancelled while waiting
            out.append(RequestRecord(f"r{i}", rng.randint(4, 64), 0, "cancelled", arrival, None,
                                     None, arrival + 1.0, [], 1, None, None, 5, [],
                                     released_time=arrival + 1.0))
            continue
        n_out = 1 if kind < 0.25 else rng.randint(2, 30)
        t = first_scheduled + round(rng.uniform(0.01, 0.8), 3)
        times = [t]
        for _ in range(n_out - 1):
            t += round(rng.uniform(0.005, 0.12), 4)
            times.append(t)
        reason = "error" if kind > 0.95 else ("cancelled" if kind > 0.9 else
                                              rng.choice(["stop", "length"]))
        record = RequestRecord(f"r{i}", rng.randint(4, 64), n_out, reason, arrival,
                               first_scheduled, times[0], times[-1], times, 1, 1, 1, 2,
                               list(range(1, n_out + 1)), released_time=times[-1])
        if reason in metrics.COMPLETED and rng.random() < 0.3:  # returned whole by a static
            held = rng.random() < 0.7  # batch: held for a slower member, or the slowest itself
            record = replace(record, returned_whole=True, released_time=times[-1] + (
                round(rng.uniform(0.1, 2), 3) if held else 0.0))
        out.append(record)
    return out


LATENCY_KEYS = ("queue", "ttft", "tpot", "e2e")


def _close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return isinstance(a, numbers.Real) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _float32(got: Any, want: Any) -> str:
    """The note for a value right only to float32's precision: the type is the bug."""
    if isinstance(got, numbers.Real) and isinstance(want, numbers.Real) and \
            math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7):
        return (" That differs only from about the 7th digit on: computed in float32 (a torch "
                "tensor's default)? Use Python floats or float64.")
    return ""


def latencies(fn: Callable[[RequestRecord], dict[str, float | None]]) -> None:
    """Exercise 6.1: `fn(record)` returns {"queue", "ttft", "tpot", "e2e"} in seconds for one
    request record, None where a value is undefined, like minicb.benchmark.metrics."""
    name = "latencies"
    refs = {"queue": metrics.queue_time, "ttft": metrics.ttft, "tpot": metrics.tpot,
            "e2e": metrics.e2e}
    meaning = {"queue": "first_scheduled_time - arrival_time",
               "ttft": "first_token_time - arrival_time; for a response returned whole "
                       "(returned_whole), released_time - arrival_time",
               "tpot": "(finish_time - first_token_time) / (num_output_tokens - 1), None for "
                       "fewer than 2 tokens",
               "e2e": "released_time - arrival_time, where a released_time of None means the "
                      "finish_time"}
    named = [(f"random record {rec.request_id} of set {seed}", "random", rec)
             for seed in range(8) for rec in _records(seed)]
    if (secret := hidden_rng(name)) is not None:
        named += [(f"hidden record {rec.request_id} of set {k}", "hidden", rec) for k in range(3)
                  for rec in _records(secret.randrange(10**9))]
    cases = _Cases(name, len(named))
    for label, group, rec in named:
        with cases.case(label, group):
            _latencies_case(fn, name, refs, meaning, rec)
    cases.done(f"{len(named)} request records give the same queue time, TTFT, TPOT and E2E as "
               "minicb.benchmark.metrics")


def _latencies_case(fn: Callable, name: str, refs: dict[str, Callable],
                    meaning: dict[str, str], rec: RequestRecord) -> None:
    shown = (f"arrival_time={rec.arrival_time}, first_scheduled_time="
             f"{rec.first_scheduled_time}, first_token_time={rec.first_token_time}, "
             f"finish_time={rec.finish_time}, released_time={rec.released_time}, "
             f"returned_whole={rec.returned_whole}, "
             f"num_output_tokens={rec.num_output_tokens}")
    got = _call(name, f"fn(record {rec.request_id}: {shown})", fn, rec)
    if not isinstance(got, dict):
        _fail(name, f"fn(record) must return a dict with keys {LATENCY_KEYS}; yours "
                    f"returned {_short(got)}.")
    for key in LATENCY_KEYS:
        want = refs[key](rec)
        if key not in got:
            _fail(name, f"the dict has no key {key!r} (keys: {sorted(got)}).")
        if not _close(got[key], want):
            _fail(name, f"record {rec.request_id} ({shown}): {key} should be {want!r} "
                        f"({meaning[key]}), yours is {got[key]!r}.{_float32(got[key], want)}")


def _num_meeting(records: Sequence[RequestRecord], slo: dict[str, float]) -> int:
    return sum(1 for r in records if metrics.meets_slo(r, slo))


def _reference_goodput(records: Sequence[RequestRecord], slo: dict[str, float]) -> float | None:
    span = metrics.run_span(records)
    return _num_meeting(records, slo) / span if span > 0 else None


def goodput(fn: Callable[[list[RequestRecord], dict[str, float]], float | None]) -> None:
    """Exercise 6.2: `fn(records, slo)` is goodput in requests per second: completed requests
    (finish_reason 'stop' or 'length') meeting every SLO in `slo` ({"ttft": s, "tpot": s,
    "e2e": s}, any subset; a value must be <= its limit; a one-token request has no TPOT and
    passes that one), divided by the run's span (first arrival to last finish); None if the
    span is 0."""
    name = "goodput"
    cases: list[tuple[str, list[RequestRecord], dict[str, float]]] = []
    one = _records(3)
    cases.append(("no SLO at all", one, {}))
    cases.append(("an SLO nobody meets", one, {"ttft": 1e-6}))
    cases.append(("no records", [], {"ttft": 1.0}))
    exact = [r for r in one if metrics.is_completed(r)][0]
    cases.append(("a request exactly at its TTFT limit", [exact],
                  {"ttft": metrics.ttft(exact)}))
    ones = [r for seed in range(6) for r in _records(seed) if r.num_output_tokens == 1][:3]
    cases.append(("one-token requests under a TPOT limit", ones, {"tpot": 0.001}))
    cancelled = [r for seed in range(6) for r in _records(seed)
                 if r.finish_reason == "cancelled" and r.num_output_tokens > 0][:1]
    cases.append(("a cancelled request that was fast", cancelled + one, {"ttft": 100.0}))
    at_once = RequestRecord("z0", 8, 0, "cancelled", 2.5, None, None, 2.5, [], 1, None, None,
                            1, [])
    cases.append(("a span of 0 (one request, cancelled the moment it arrived)", [at_once],
                  {"ttft": 1.0}))

    def draw(rng: random.Random) -> tuple[list[RequestRecord], dict[str, float]]:
        records = _records(rng.randrange(100, 10**9), rng.randint(1, 20))
        slo = {k: rng.choice([0.05, 0.1, 0.3, 0.5, 1.0, 2.0]) for k in ("ttft", "tpot", "e2e")
               if rng.random() < 0.6}  # the exercise's keys; the library also has "itl"
        return records, slo

    named = [(label, "edge", (records, slo)) for label, records, slo in cases]
    named += _named(name, [], draw, 62, 40, 20)
    checked = _Cases(name, len(named))
    for label, group, (records, slo) in named:
        with checked.case(label, group):
            _goodput_case(fn, name, label, records, slo)
    checked.done(f"{len(named)} sets of records give the same goodput as "
                 "minicb.benchmark.metrics")


def _goodput_case(fn: Callable, name: str, label: str, records: list[RequestRecord],
                  slo: dict[str, float]) -> None:
    want = _reference_goodput(records, slo)
    got = _call(name, f"{label}: fn({len(records)} records, slo={slo})", fn,
                list(records), dict(slo))
    if _close(got, want):
        return
    met = [r.request_id for r in records if metrics.meets_slo(r, slo)]
    span = metrics.run_span(records)
    why = _float32(got, want)
    if isinstance(got, numbers.Real) and span and not why:
        # the count that each known mistake gives; a hint only where one explains yours,
        # the specific ones first (counting everything also counts the cancelled)
        mistakes = [
            (" Cancelled and failed requests never count, however fast they were.",
             _num_meeting([replace(r, finish_reason="stop") for r in records], slo)),
            (" TTFT and E2E end when the user got the response: a response returned whole "
             "reached its user at released_time (use your latencies).",
             _num_meeting([replace(r, returned_whole=False, released_time=None)
                           for r in records], slo)),
            (" It looks like you counted every request, not only those meeting the SLO.",
             len(records))]
        why = next((hint for hint, n in mistakes
                    if n != len(met) and math.isclose(got * span, n)), "")
    _fail(name, f"{label}: {len(records)} records, slo={slo}: expected {want!r} "
                f"({len(met)} requests meet the SLO: {met[:8]}{'...' if len(met) > 8 else ''}"
                f"; span {span:.3f} s from first arrival to last finish), got "
                f"{_short(got)}.{why}")


def _reference_per_tenant(records: Sequence[RequestRecord]) -> dict[Any, dict[str, Any]]:
    out: dict[Any, dict[str, Any]] = {}
    for tenant in dict.fromkeys(r.tenant for r in records):
        mine = [r for r in records if r.tenant == tenant]
        ttfts = [metrics.ttft(r) for r in mine if metrics.is_completed(r)]
        ttfts = [t for t in ttfts if t is not None]
        spread = metrics.percentiles(ttfts, (50, 99))
        out[tenant] = {"requests": len(mine),
                       "completed": sum(1 for r in mine if metrics.is_completed(r)),
                       "ttft_p50": spread["p50"], "ttft_p99": spread["p99"],
                       "output_tokens": sum(r.num_output_tokens for r in mine)}
    return out


def per_tenant(fn: Callable[[list[RequestRecord]], dict[Any, dict[str, Any]]]) -> None:
    """Exercise 6.3: `fn(records)` is {tenant: {"requests", "completed", "ttft_p50",
    "ttft_p99", "output_tokens"}}: every tenant that sent a request (None is a tenant too),
    its request count, how many completed, the p50 and p99 of its completed requests' TTFTs
    (numpy's linear interpolation; None without any) and the output tokens of all its
    requests."""
    name = "per_tenant"

    def draw(rng: random.Random) -> list[RequestRecord]:
        tenants = rng.choice([["a"], ["a", "b"], ["a", "b", None], ["chat", "batch", "eval"]])
        return [replace(r, tenant=rng.choice(tenants))
                for r in _records(rng.randrange(200, 10**9), rng.randint(1, 16))]

    named = [("no records", "edge", [])] + _named(name, [], draw, 63, 30, 15)
    cases = _Cases(name, len(named))
    for label, group, records in named:
        with cases.case(label, group):
            _per_tenant_case(fn, name, label, records)
    cases.done(f"{len(named)} sets of records give the same per-tenant table as "
               "minicb.benchmark.metrics")


def _per_tenant_case(fn: Callable, name: str, label: str, records: list[RequestRecord]
                     ) -> None:
    want = _reference_per_tenant(records)
    got = _call(name, f"{label}: fn({len(records)} records)", fn, list(records))
    if not isinstance(got, dict):
        _fail(name, f"{label}: fn(records) must return a dict of tenants; yours returned "
                    f"{_short(got)}.")
    if set(got) != set(want):
        _fail(name, f"{label}: the tenants are {sorted(want, key=str)}, yours are "
                    f"{sorted(got, key=str)} (None is a tenant too: requests sent "
                    f"without one).")
    for tenant, row in want.items():
        mine = got[tenant]
        if not isinstance(mine, dict) or set(mine) != set(row):
            _fail(name, f"{label}: tenant {tenant!r} needs the keys {sorted(row)}, yours "
                        f"has {_short(mine)}.")
        for key, value in row.items():
            if not _close(mine[key], value):
                why = _float32(mine[key], value)
                if key.startswith("ttft") and value is not None and not why:
                    every = [metrics.ttft(r) for r in records if r.tenant == tenant
                             and metrics.ttft(r) is not None]
                    everything = metrics.percentiles(every, (50, 99))[f"p{key[6:]}"]
                    done = sorted(metrics.ttft(r) for r in records if r.tenant == tenant
                                  and metrics.is_completed(r) and metrics.ttft(r) is not None)
                    q = int(key[6:])
                    ranks = [float(np.percentile(done, q, method=m))
                             for m in ("lower", "higher", "nearest", "midpoint")]
                    ranks.append(done[min(int(q / 100 * len(done)), len(done) - 1)])
                    if _close(mine[key], everything):
                        why = (" Only completed requests count: a cancelled or failed "
                               "request's first token says nothing of how it was served.")
                    elif any(_close(mine[key], v) for v in ranks):
                        why = (" That is a percentile without interpolation (one of the "
                               "values, or a rank rounded): numpy.percentile's default "
                               f"interpolates linearly between the two values around "
                               f"the {q}th percentile: np.percentile(ttfts, {q}).")
                _fail(name, f"{label}: tenant {tenant!r}: {key} should be {value!r}, yours "
                            f"is {_short(mine[key])}.{why}")


def _sweep_rows(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """Rows as `python -m minicb sweep` writes them (the keys the exercise reads), with ties,
    unknown queue ages, errors, unhonoured cancellations and differing tokens mixed in."""
    return [{"max_num_batched_tokens": rng.choice([64, 128, 256, 512, 1024]),
             "max_num_seqs": rng.choice([4, 8, 16, 32]), "chunk_size": rng.choice([64, 512]),
             "preemption": rng.choice(["newest", "priority"]),
             "goodput_rps": rng.choice([0.0, 2.5, 4.0, 7.5, 7.5, 9.0, 12.0]),
             "output_tokens_per_s": float(rng.randint(100, 3000)),
             "max_queue_age_s": rng.choice([None, 0.25, 0.5, 1.0, 1.5, 3.0]),
             "errors": rng.choice([0, 0, 0, 0, 0, 1, 3]),
             "cancellations_honoured": rng.random() > 0.12,
             "same_tokens": rng.choice([True, True, None, None, False])} for _ in range(count)]


def _setting(row: dict[str, Any]) -> str:
    return " ".join(f"{k}={row.get(k)}" for k in ("max_num_batched_tokens", "max_num_seqs",
                                                  "chunk_size", "preemption"))


def _why_it_fails(row: dict[str, Any], max_queue_age: float | None) -> str:
    from minicb.benchmark import sweep
    age = row["max_queue_age_s"]
    reasons = {"fairness": f"its oldest request waited {age} s, over the limit of "
                           f"{max_queue_age} s" if age is not None else
                           "its queue age is unknown (None), so it cannot be shown to be within "
                           f"the limit of {max_queue_age} s",
               "errors": f"errors={row['errors']}: requests failed under it",
               "cancellation": "cancellations_honoured is False",
               "quality": "same_tokens is False: its greedy tokens differ from each request's "
                          "served alone"}
    return "; ".join(reasons[n] for n in sweep.requirement_failures(row, max_queue_age))


def best_setting(fn: Callable[[list[dict[str, Any]], float | None], dict[str, Any] | None]
                 ) -> None:
    """Exercise 6.4: `fn(rows, max_queue_age)` picks the contract's setting from a sweep's rows:
    among the rows meeting every requirement (errors 0, cancellations_honoured True, same_tokens
    not False (None: not checked), and with a `max_queue_age` a known max_queue_age_s at most
    that), the one with the highest goodput_rps, ties to the most output_tokens_per_s (then
    the first); the row itself, or None when no row qualifies."""
    name = "best_setting"
    cases: list[tuple[str, list[dict[str, Any]], float | None]] = [("no rows", [], None)]
    base = _sweep_rows(random.Random(1), 1)[0] | {"errors": 0, "cancellations_honoured": True,
                                                  "same_tokens": True, "max_queue_age_s": 0.2}
    cases.append(("a faster row over the fairness limit, a slower one exactly at it",
                  [base | {"goodput_rps": 9.0, "max_queue_age_s": 0.6},
                   base | {"goodput_rps": 5.0, "max_queue_age_s": 0.5}], 0.5))
    cases.append(("quality not checked (simulated: same_tokens None) and checked",
                  [base | {"goodput_rps": 9.0, "same_tokens": None},
                   base | {"goodput_rps": 5.0}], None))
    cases.append(("two rows tie on goodput", [base | {"output_tokens_per_s": 900.0},
                                             base | {"output_tokens_per_s": 1200.0}], None))
    cases.append(("two rows equal on goodput and tokens/s",
                  [base | {"output_tokens_per_s": 900.0}, base | {"output_tokens_per_s": 900.0}],
                  None))
    cases.append(("an unknown queue age and no fairness limit",
                  [base | {"goodput_rps": 9.0, "max_queue_age_s": None},
                   base | {"goodput_rps": 5.0}], None))
    cases.append(("an unknown queue age under a limit",
                  [base | {"goodput_rps": 9.0, "max_queue_age_s": None},
                   base | {"goodput_rps": 5.0}], 1.0))
    cases.append(("every row fails a requirement",
                  [base | {"errors": 2}, base | {"cancellations_honoured": False},
                   base | {"same_tokens": False}], None))
    for _, rows, _ in cases:  # the hand-made rows: one setting each, so messages tell them apart
        for j, row in enumerate(rows):
            row["max_num_seqs"] = 8 * (j + 1)

    def draw(rng: random.Random) -> tuple[list[dict[str, Any]], float | None]:
        return _sweep_rows(rng, rng.randint(1, 12)), rng.choice([None, None, 0.5, 1.0, 2.0])

    named = [(label, "edge", (rows, limit)) for label, rows, limit in cases]
    named += _named(name, [], draw, 64, 60, 30, "sweep")
    checked = _Cases(name, len(named))
    for label, group, (rows, limit) in named:
        with checked.case(label, group):
            _best_setting_case(fn, name, label, rows, limit)
    checked.done(f"{len(named)} sweeps give the same setting as `python -m minicb sweep`")


def _best_setting_case(fn: Callable, name: str, label: str, rows: list[dict[str, Any]],
                       limit: float | None) -> None:
    from minicb.benchmark import sweep
    want = sweep.best_setting(rows, limit)
    got = _call(name, f"{label}: fn({len(rows)} rows, max_queue_age={limit})", fn,
                copy.deepcopy(rows), limit)
    if got == want:
        return
    where = f"{label} (max_queue_age={limit}; {len(rows)} rows)"
    if got is not None and got not in rows:
        _fail(name, f"{where}: return one of the rows (the dict itself) or None; yours "
                    f"returned {_short(got)}.")
    if got is not None and sweep.requirement_failures(got, limit):
        _fail(name, f"{where}: you picked {_setting(got)}, which fails a requirement: "
                    f"{_why_it_fails(got, limit)}.")
    if want is None:
        _fail(name, f"{where}: no row meets every requirement, so the answer is None; yours "
                    f"is {_setting(got)}.")
    if got is None:
        hint = ""
        if want["same_tokens"] is None:
            hint = (" same_tokens None means the quality was not checked (the simulator "
                    "makes no tokens): it does not fail the requirement.")
        elif limit is not None and want["max_queue_age_s"] == limit:
            hint = " A queue age equal to the limit is within it."
        _fail(name, f"{where}: {_setting(want)} meets every requirement, yet yours returned "
                    f"None.{hint}")
    hint = ""
    if (got["goodput_rps"], got["output_tokens_per_s"]) == \
            (want["goodput_rps"], want["output_tokens_per_s"]):
        hint = " Among rows equal on both, the first in the list."
    elif got["goodput_rps"] == want["goodput_rps"]:
        hint = " Ties on goodput go to the most output_tokens_per_s."
    elif want["same_tokens"] is None:
        hint = " same_tokens None (not checked) does not fail the quality requirement."
    elif limit is not None and want["max_queue_age_s"] == limit:
        hint = " A queue age equal to the limit is within it."
    _fail(name, f"{where}: expected {_setting(want)} (goodput {want['goodput_rps']}, "
                f"{want['output_tokens_per_s']} tokens/s), yours picked {_setting(got)} "
                f"(goodput {got['goodput_rps']}, {got['output_tokens_per_s']} tokens/s).{hint}")


def _break_even_variant(cost: Any, n: int, cached: int, page_size: int, chunk_size: int,
                        mistake: str | None = None) -> float:
    """The break-even copy cost of exercise 6.5, and the mistakes its hints name."""
    seconds, start = 0.0, 0 if mistake == "from zero" else cached
    step = n if mistake == "one chunk" else chunk_size
    while start < n:
        end = min(start + step, n)
        at = start if mistake == "chunk start" else end
        seconds += (cost.b * (end - start) + (0.0 if mistake == "no d" else cost.d * at)
                    + cost.e * (end - start) * at + (cost.a if mistake == "with a" else 0.0))
        start = end
    pages = max(1, n // page_size) if mistake == "floor" else math.ceil(n / page_size)
    shared = 0 if mistake == "no sharing" else cached // page_size
    copies = {"one way": pages, "uncached": 2 * math.ceil((n - cached) / page_size)}.get(
        mistake, 2 * pages - shared)
    return seconds / copies if copies else math.inf


_BREAK_EVEN_HINTS = {
    "one way": " Swap copies pages twice: out to host memory when the request is preempted, "
               "back in when it is admitted again.",
    "floor": " The last page counts even when it is not full: ceil(num_computed / page_size) "
             "pages hold the tokens.",
    "no sharing": " Coming back, the victim shares its prompt pages still in the prefix index, "
                  "as a recompute does: those num_cached // page_size pages are not copied "
                  "back in.",
    "uncached": " Every page is copied out: when the request is preempted nobody knows which "
                "of its pages will still be cached when it returns.",
    "from zero": " The first num_cached tokens are in prompt pages still in the prefix index: "
                 "recompute starts after them, at context num_cached.",
    "one chunk": " Recompute is a prefill like any other: chunks of at most chunk_size, each "
                 "with its own L and end.",
    "chunk start": " A chunk's context is where it ends: its last token attends to `end` tokens "
                   "(d*end and e*L*end).",
    "with a": " No a: the recomputed chunks ride in steps that run anyway, for the other "
              "requests or the victim's own next token.",
    "no d": " Each chunk also reads its K/V, d*end.",
}


def swap_break_even(fn: Callable[[Any, int, int, int, int], float]) -> None:
    """Exercise 6.5: `fn(cost, num_computed, num_cached, page_size, chunk_size)` is the copy
    cost per page (seconds) at which swapping a preempted request costs what recomputing it
    does, like `minicb.benchmark.sim.swap_break_even`: recompute prefills tokens
    num_cached..num_computed again in chunks of at most chunk_size, a chunk of L tokens ending at
    context `end` costing
    b*L + d*end + e*L*end; swap copies ceil(num_computed / page_size) pages out and all but the
    num_cached // page_size still cached back in."""
    from minicb.benchmark.sim import PRESETS, CostModel
    name = "swap_break_even"
    # coefficients far apart, so that each mistake changes the answer
    costs = [CostModel(a=2.0e-2, b=1.0e-3, c=1.2e-3, d=9.0e-6, e=1.1e-6, name="cpu-like"),
             PRESETS["h100-like"], CostModel(b=1.0, name="b only"),
             CostModel(a=0.5, b=3.0, d=0.25, e=0.125, name="round numbers")]
    victims = [(1, 0, 16, 512), (16, 0, 16, 512), (17, 0, 16, 512), (223, 176, 16, 512),
               (100, 0, 16, 32), (100, 32, 16, 32), (96, 96, 16, 512), (40, 16, 8, 7),
               (5, 0, 16, 1)]

    def draw(rng: random.Random) -> tuple[Any, int, int, int, int]:
        n = rng.randint(1, 600)
        page_size = rng.choice([4, 8, 16, 32])
        cached = rng.randint(0, n // page_size) * page_size if rng.random() < 0.7 else 0
        return (CostModel(**{k: rng.choice([0.0, rng.uniform(1e-7, 1e-2)])
                             for k in ("a", "b", "c", "d", "e")}, name="random"),
                n, min(cached, n), page_size, rng.randint(1, 300))

    named = _named(name, [(cost, *victim) for victim in victims for cost in costs], draw, 65,
                   40, 20, "victim")
    cases = [case for _, _, case in named]
    checked = _Cases(name, len(named))
    for index, (label, group, case) in enumerate(named):
        with checked.case(label, group):
            _break_even_case(fn, name, cases[:index], *case)
    checked.done(f"{len(named)} victims give the same break-even copy cost as "
                 "minicb.benchmark.sim.swap_break_even")


def _break_even_case(fn: Callable, name: str, earlier: list[tuple], cost: Any, n: int,
                     cached: int, page_size: int, chunk_size: int) -> None:
    want = _break_even_variant(cost, n, cached, page_size, chunk_size)
    shown = (f"cost={cost.name!r} (a={cost.a}, b={cost.b}, d={cost.d}, e={cost.e}), "
             f"num_computed={n}, num_cached={cached}, page_size={page_size}, "
             f"chunk_size={chunk_size}")
    got = _call(name, f"fn({shown})", fn, cost, n, cached, page_size, chunk_size)
    if hasattr(got, "item") and not isinstance(got, numbers.Real):
        got = got.item()
    if not isinstance(got, numbers.Real) or isinstance(got, bool):
        _fail(name, f"fn({shown}) must return seconds per page as a number; yours returned "
                    f"{_short(got)}.")
    if _close(float(got), want):
        return
    # a mistake explains the failure if it gives this answer and every earlier one right
    why = next((hint for mistake, hint in _BREAK_EVEN_HINTS.items()
                if _close(float(got), _break_even_variant(cost, n, cached, page_size,
                                                         chunk_size, mistake))
                and all(_close(_break_even_variant(*case, mistake), _break_even_variant(*case))
                        for case in earlier)), "")
    if not why and want and any(_close(float(got), want * scale) for scale in (1e3, 1e6)):
        why = " That is the answer in ms or µs: return seconds."
    _fail(name, f"{shown}: expected {want!r} s per page, got {got!r}."
                f"{why or _float32(float(got), want)}")


# ============================================================================ paged attention (07)
def _reference_metadata(page_table: list[int], num_computed: int, num_new: int,
                        page_size: int) -> Any:
    from minicb.attention import build_metadata
    return build_metadata([list(page_table)], [num_computed], [num_new], page_size)


SLOT_EDGE_CASES = 6  # the first of `_slot_cases`: the same for every seed


def _slot_cases(seed: int) -> list[tuple[list[int], int, int, int]]:
    """(page_table, num_computed, num_new, page_size): pages in any order, a chunk starting
    mid-page, one decode token, a fresh prompt, page size 1."""
    rng = random.Random(seed)
    cases = [([3], 0, 4, 4), ([5, 2], 3, 1, 4), ([7, 1, 4], 2, 9, 4), ([9, 0], 16, 1, 16),
             ([2, 8, 5], 0, 3, 1), ([6, 3], 5, 3, 4)]
    for _ in range(30):
        page_size = rng.choice([1, 2, 4, 16])
        num_computed, num_new = rng.randint(0, 40), rng.randint(1, 40)
        needed = -(-(num_computed + num_new) // page_size)
        pages = rng.sample(range(max(64, 2 * needed)), needed)
        cases.append((pages, num_computed, num_new, page_size))
    return cases


def slot_mapping(fn: Callable[[list[int], int, int, int], list[int]]) -> None:
    """Exercise 7.1: `fn(page_table, num_computed, num_new, page_size)` returns the cache slot
    of each of the step's new tokens (positions num_computed .. num_computed + num_new - 1):
    page_table[pos // page_size] * page_size + pos % page_size, like
    `AttentionMetadata.slot_mapping`."""
    name = "slot_mapping"
    named = [(f"{'edge' if i < SLOT_EDGE_CASES else 'random'} case {i}",
              "edge" if i < SLOT_EDGE_CASES else "random", case)
             for i, case in enumerate(_slot_cases(71))]
    if (secret := hidden_rng(name)) is not None:
        named += [(f"hidden case {i}", "hidden", case) for i, case in
                  enumerate(_slot_cases(secret.randrange(10**9))[SLOT_EDGE_CASES:][:15])]
    cases = _Cases(name, len(named))
    for label, group, case in named:
        with cases.case(label, group):
            _slot_mapping_case(fn, name, *case)
    cases.done(f"{len(named)} page tables map their new tokens to the same slots as minicb's "
               "AttentionMetadata")


def _slot_mapping_case(fn: Callable, name: str, table: list[int], num_computed: int,
                       num_new: int, page_size: int) -> None:
    want = _reference_metadata(table, num_computed, num_new, page_size).slot_mapping.tolist()
    shown = (f"page_table={table}, num_computed={num_computed}, num_new={num_new}, "
             f"page_size={page_size}")
    got = _as_list(_call(name, f"fn({shown})", fn, list(table), num_computed, num_new,
                         page_size))
    if got == want:
        return
    why = ""
    positions = list(range(num_computed, num_computed + num_new))
    if got == positions:
        why = (" Those are the positions: a token's slot is where its page lies, "
               "page_table[pos // page_size] * page_size + pos % page_size.")
    elif isinstance(got, list) and got == _reference_metadata(
            table, 0, num_new, page_size).slot_mapping.tolist():
        why = (" Those are the slots of positions 0.. : the new tokens come after the "
               f"{num_computed} already in the cache.")
    elif isinstance(got, list) and len(got) != num_new:
        why = f" One slot per new token: {num_new} of them."
    elif got == [table[pos // page_size] + pos % page_size for pos in positions]:
        why = (" A page number counts pages, not slots: the page's first slot is "
               "page_table[pos // page_size] * page_size.")
    _fail(name, f"{shown}: expected {want}, got {_short(got)}.{why}")


def _attention_variant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       page_table: list[int], num_computed: int, scale: float,
                       causal: bool | str = True, heads: str = "grouped", paged: bool = True,
                       new_in_context: bool = True) -> torch.Tensor:
    """Attention of one member over its pages, and the mistakes the hints name: no causal
    mask, or the mask of `is_causal=True` (aligned top-left: row i sees positions 0 .. i),
    query head h on kv head h % num_kv_heads, pages read in order 0, 1, ... instead of
    through the table, the step's own tokens left out of the context."""
    num_new, num_heads, _ = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    length = num_computed + (num_new if new_in_context else 0)
    pos = torch.arange(length)
    pages = torch.tensor(page_table)[pos // page_size] if paged else pos // page_size
    slots = pages * page_size + pos % page_size
    k = k_cache.reshape(-1, num_kv_heads, k_cache.shape[-1])[slots]
    v = v_cache.reshape(-1, num_kv_heads, v_cache.shape[-1])[slots]
    group = num_heads // num_kv_heads
    kv_of_head = torch.arange(num_heads) // group if heads == "grouped" else \
        torch.arange(num_heads) % num_kv_heads
    k, v = k[:, kv_of_head], v[:, kv_of_head]  # [length, heads, D]
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) * scale
    if causal:
        row_pos = torch.arange(num_new) + (0 if causal == "top-left" else num_computed)
        scores = scores.masked_fill(pos[None, None, :] > row_pos[None, :, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.double()).to(q.dtype)


def _attention_cases(seed: int) -> list[tuple[str, int, int, int, int, int, int]]:
    """(label, num_computed, num_new, page_size, num_heads, num_kv_heads, head_dim)."""
    rng = random.Random(seed)
    cases = [("a fresh 5-token prompt", 0, 5, 4, 2, 2, 8),
             ("one decode token after 9", 9, 1, 4, 4, 1, 8),
             ("a chunk that starts mid-page", 6, 7, 4, 4, 2, 16),
             ("grouped-query attention, 4 query heads per kv head", 3, 6, 16, 8, 2, 16),
             ("one token alone", 0, 1, 16, 2, 1, 8)]
    for i in range(16):
        kv = rng.choice([1, 2])
        cases.append((f"random case {i}", rng.randint(0, 40), rng.choice([1, rng.randint(1, 24)]),
                      rng.choice([2, 4, 16]), kv * rng.choice([1, 2, 4]), kv,
                      rng.choice([8, 16])))
    return cases


def paged_attention(fn: Callable[..., torch.Tensor]) -> None:
    """Exercise 7.2: `fn(q, k_cache, v_cache, page_table, num_computed, scale)` is one member's
    attention over the paged cache (its context, this step's tokens included, already stored):
    q [num_new, num_heads, head_dim] for positions num_computed ..; row i attends causally to
    positions 0 .. num_computed + i; query head h reads kv head h // (num_heads //
    num_kv_heads). Compared with minicb's torch backend (`attention.torch_ref.attend`)."""
    name = "paged_attention"
    named = [(case[0], "random" if case[0].startswith("random") else "edge", case, 72)
             for case in _attention_cases(72)]
    if (secret := hidden_rng(name)) is not None:
        seed = secret.randrange(10**9)
        named += [(f"hidden {case[0]}", "hidden", case, seed)
                  for case in _attention_cases(seed) if case[0].startswith("random")][:8]
    cases = _Cases(name, len(named))
    generators: dict[int, torch.Generator] = {}
    for label, group, case, seed in named:
        gen = generators.setdefault(seed, torch.Generator().manual_seed(seed))
        with cases.case(label, group):
            _paged_attention_case(fn, name, gen, *case)
    cases.done(f"{len(named)} members (decode rows, fresh prompts, chunks starting mid-page, "
               "grouped-query heads, pages in any order) match minicb's torch attention")


def _paged_attention_case(fn: Callable, name: str, gen: torch.Generator, label: str,
                          num_computed: int, num_new: int, page_size: int, heads: int,
                          kv_heads: int, head_dim: int) -> None:
    from minicb.attention import torch_ref

    needed = -(-(num_computed + num_new) // page_size)  # pages the context fills
    pool = 2 * needed + 3
    table = torch.randperm(pool, generator=gen)[:needed].tolist()
    k_cache = torch.randn(pool, page_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool, page_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(num_new, heads, head_dim, generator=gen)
    scale = head_dim ** -0.5 * (0.6 if label.endswith(("1", "4", "7")) else 1.0)
    meta = _reference_metadata(table, num_computed, num_new, page_size)
    want = torch_ref.attend(q, k_cache, v_cache, meta, scale)
    shown = (f"{label} (num_computed={num_computed}, num_new={num_new}, page_size="
             f"{page_size}, {heads} query heads, {kv_heads} kv heads, page_table={table})")
    got = _call(name, f"fn(q, k_cache, v_cache, ...) for {shown}", fn, q.clone(),
                k_cache.clone(), v_cache.clone(), list(table), num_computed, scale)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        _fail(name, f"{shown}: return a tensor shaped {list(want.shape)} "
                    f"[num_new, num_heads, head_dim], got "
                    f"{list(got.shape) if isinstance(got, torch.Tensor) else _short(got)}.")
    if torch.allclose(got.float(), want, rtol=1e-4, atol=1e-5):
        return
    why = ""
    for mistake, hint in (
            (dict(causal=False), "each row must not see the positions after its own: row i "
                                 "attends to positions 0 .. num_computed + i (mask the rest "
                                 "with -inf before the softmax)"),
            (dict(causal="top-left"), "row i attends to positions 0 .. num_computed + i; "
                                      "SDPA's is_causal=True aligns its mask top-left, so "
                                      "with num_computed > 0 row i sees only 0 .. i: build "
                                      "the mask yourself"),
            (dict(heads="modulo"), "query head h shares kv head h // (num_heads // "
                                   "num_kv_heads) (heads are grouped, not interleaved)"),
            (dict(paged=False), "look each position's page up in page_table (your code "
                                "reads pages 0, 1, 2, ... in order)"),
            (dict(new_in_context=False), "this step's tokens are in the cache already, and "
                                         "each row attends to itself too"),
            (dict(scale=1.0), "multiply the scores by scale before the softmax")):
        options = dict(mistake)
        variant_scale = options.pop("scale", scale)
        wrong = _attention_variant(q, k_cache, v_cache, table, num_computed, variant_scale,
                                   **options)
        if torch.allclose(got.float(), wrong.float(), rtol=1e-4, atol=1e-5):
            why = f" It looks like you missed this: {hint}."
            break
    if not why and not torch.isfinite(got).all():
        why = " Your output holds NaN or inf: a row whose scores are all -inf?"
    worst = (got.float() - want).abs().max().item()
    _fail(name, f"{shown}: your output differs from minicb's by up to {worst:.3g}.{why}")


# ============================================================================ speculation (08)
def _lookup_variant(token_ids: list[int], k: int, n_max: int, n_min: int,
                    pick: str = "rule", include_last: bool = False, uncapped: bool = False,
                    shorter: bool = True) -> list[int]:
    """Prompt lookup and the mistakes the hints name: always the latest (or the earliest)
    occurrence, or the latest of those with k tokens after it; the last n tokens matching
    themselves (with n capped at len - 1 or not); no shorter n tried."""
    ids = list(token_ids)
    sizes = range(min(n_max, len(ids) - (0 if uncapped else 1)), n_min - 1, -1)
    for n in sizes if shorter else list(sizes)[:1]:
        tail = ids[-n:]
        limit = len(ids) - n + (1 if include_last else 0)  # starts whose window ends in ids[:-1]
        hits = [i for i in range(limit) if ids[i:i + n] == tail]
        if hits:
            latest, earliest = hits[-1], hits[0]
            roomy = [i for i in hits if i + n + k <= len(ids)]
            start = {"latest": latest, "earliest": earliest,
                     "latest roomy": roomy[-1] if roomy else earliest}.get(
                pick, latest if latest + n + k <= len(ids) else earliest)
            return ids[start + n:start + n + k]
    return []


class _OutOfTime(BaseException):
    """Raised by `_answers_within`'s alarm; a BaseException, so the learner's code cannot
    swallow it with `except Exception`."""


def _quiet_answer(fn: Callable[..., Any], case: tuple) -> Any:
    """The learner's answer on one case, or None where their function raises (for naming a
    mistake from all their answers, after one has failed)."""
    ids, *rest = case
    try:
        return _as_list(fn(list(ids), *rest))
    except Exception:
        return None


def _answers_within(fn: Callable[..., Any], cases: list[tuple], seconds: float
                    ) -> list[Any] | None:
    """The learner's answers on every case, or None if they take longer than `seconds` (a
    function that loops forever on a case after the failing one must not turn the failure
    message into the grader's timeout). Needs SIGALRM, so only in the main thread."""
    if threading.current_thread() is not threading.main_thread() or \
            not hasattr(signal, "setitimer"):
        return None

    def out_of_time(*_: Any) -> None:
        raise _OutOfTime

    previous = signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return [_quiet_answer(fn, case) for case in cases]
    except _OutOfTime:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def prompt_lookup(fn: Callable[[list[int], int, int, int], list[int]]) -> None:
    """Exercise 8.1: `fn(token_ids, k, n_max, n_min)` guesses up to k next tokens by prompt
    lookup, like `minicb.speculative.NgramIndex.propose`."""
    from minicb.speculative import NgramIndex

    name = "prompt_lookup"
    _refuse_the_reference(name, fn, NgramIndex.propose)
    edge = [([5, 6, 7, 8, 5, 6], 2, 2, 1), ([1, 2, 3, 1, 2, 3, 1, 2], 3, 3, 2),
            ([4, 4, 4, 4], 3, 3, 2), ([9], 4, 4, 2), ([9, 9], 2, 2, 1), ([1, 2, 3, 4], 2, 4, 2),
            ([7, 1, 2, 9, 9, 1, 2, 8, 1, 2], 2, 3, 2), ([3, 5, 3, 5, 3, 5, 3], 4, 4, 2)]

    def draw(rng: random.Random) -> tuple[list[int], int, int, int]:
        ids = [rng.randint(1, rng.choice([3, 6, 20])) for _ in range(rng.randint(1, 30))]
        n_max = rng.randint(1, 4)
        return ids, rng.randint(1, 5), n_max, rng.randint(1, n_max)

    named = _named(name, edge, draw, 81, 60, 30, "sequence")
    cases = [case for _, _, case in named]
    checked = _Cases(name, len(named))
    for index, (label, group, _) in enumerate(named):
        with checked.case(label, group):
            _prompt_lookup_case(fn, name, cases, index)
    checked.done(f"{len(named)} token sequences give the same guesses as minicb's prompt lookup")


def _prompt_lookup_case(fn: Callable, name: str, cases: list[tuple], index: int) -> None:
    ids, k, n_max, n_min = cases[index]
    want = _lookup_variant(ids, k, n_max, n_min)
    shown = f"token_ids={ids}, k={k}, n_max={n_max}, n_min={n_min}"
    got = _as_list(_call(name, f"fn({shown})", fn, list(ids), k, n_max, n_min))
    if got == want:
        return
    mistakes = (
            (dict(pick="earliest"), "take the latest earlier occurrence, if k tokens follow "
                                    "it (the freshest context predicts best)"),
            (dict(pick="latest"), "when fewer than k tokens follow the latest occurrence "
                                  "(in a run like 4 4 4 4 it overlaps the end), take the "
                                  "earliest instead"),
            (dict(pick="latest roomy"), "look only at the latest occurrence: if fewer than "
                                        "k tokens follow it, take the earliest, not the "
                                        "latest of those that have k tokens after them"),
            (dict(include_last=True), "the last n tokens always match themselves: count "
                                      "only occurrences that end before the last token"),
            (dict(include_last=True, uncapped=True),
             "the last n tokens always match themselves: count only occurrences that end "
             "before the last token (so n is at most len(token_ids) - 1)"),
            (dict(shorter=False), "when the last n_max tokens occur nowhere earlier, try "
                                  "n_max - 1, ..., down to n_min"))
    # a mistake explains the failure if it gives the learner's answers on every case (some
    # mistakes agree on a case; the rest of the answers tell them apart), else if it gives
    # this answer and every earlier one right
    answers = _answers_within(fn, cases, seconds=5.0) if RESULTS[name].explaining else None
    explains = [hint for mistake, hint in mistakes if answers is not None
                and all(_lookup_variant(*case, **mistake) == answer
                        for case, answer in zip(cases, answers))] or [
        hint for mistake, hint in mistakes
        if got == _lookup_variant(ids, k, n_max, n_min, **mistake) and all(
            _lookup_variant(*case, **mistake) == _lookup_variant(*case)
            for case in cases[:index])]
    why = f" It looks like you missed this: {explains[0]}." if explains else ""
    _fail(name, f"{shown}: expected {want}, got {_short(got)}.{why}")


def _verify_variant(draft: list[int], target: list[int], mistake: str | None = None
                    ) -> list[int]:
    """Greedy verification, and the mistakes the hints name."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target[accepted]:
        accepted += 1
    if mistake == "no own token":
        return target[:accepted]
    if mistake == "no stop":
        return [d for d, t in zip(draft, target) if d == t] + [target[len(draft)]]
    if mistake == "last row":
        return target[:accepted] + [target[-1]]
    if mistake == "the guess":
        return draft[:accepted + 1] if accepted < len(draft) else target[:accepted + 1]
    return target[:accepted + 1]


def verify_greedy(fn: Callable[[list[int], list[int]], list[int]]) -> None:
    """Exercise 8.2: `fn(draft, target)` keeps the guesses a greedy request keeps: `target[j]`
    is the model's argmax after the request's last token and the first j guesses
    (len(draft) + 1 of them); returns the longest prefix of `draft` equal to `target`, then the
    model's own token after it, like `minicb.speculative.verify` for a greedy request."""
    name = "verify_greedy"
    # the mismatch in the middle comes early: there every mistake below answers differently
    edge = [([], [5]), ([5], [5, 7]), ([1, 2, 3], [1, 9, 3, 4]), ([5], [6, 7]),
            ([1, 2, 3], [1, 2, 3, 4]), ([1, 2, 3], [9, 2, 3, 4])]

    def draw(rng: random.Random) -> tuple[list[int], list[int]]:
        draft = [rng.randint(1, 4) for _ in range(rng.randint(0, 5))]
        return draft, [rng.randint(1, 4) for _ in range(len(draft) + 1)]

    named = _named(name, edge, draw, 82, 40, 20, "draft")
    cases = [case for _, _, case in named]
    checked = _Cases(name, len(named))
    for index, (label, group, _) in enumerate(named):
        with checked.case(label, group):
            _verify_case(fn, name, cases, index)
    checked.done(f"{len(named)} drafts keep the same tokens as minicb's greedy verification")


_VERIFY_HINTS = {
    "no own token": " Every step also yields the model's own token after the kept guesses "
                    "(target[accepted]): a step never yields fewer than one token.",
    "no stop": " Stop at the first guess the model disagrees with: the rows after it assumed a "
               "token the request will not have.",
    "last row": " The model's own token is its prediction after the last kept guess, "
                "target[accepted], not the last row's.",
    "the guess": " At the first disagreement the request takes the model's token, "
                 "target[accepted], not the rejected guess."}


def _verify_case(fn: Callable, name: str, cases: list[tuple], index: int) -> None:
    draft, target = cases[index]
    want = _verify_variant(draft, target)
    shown = f"draft={draft}, target={target}"
    got = _as_list(_call(name, f"fn({shown})", fn, list(draft), list(target)))
    if got == want:
        return
    # a mistake explains the failure if it gives this answer and every earlier one right
    why = next((hint for mistake, hint in _VERIFY_HINTS.items()
                if got == _verify_variant(draft, target, mistake) and all(
                    _verify_variant(*case, mistake) == _verify_variant(*case)
                    for case in cases[:index])), "")
    _fail(name, f"{shown}: expected {want}, got {_short(got)}.{why}")
