"""Plain helpers the test modules share (fixtures live in conftest.py): hand-built request and
step records (test_metrics, test_sim, test_serve); the exercise sources, the solution notebooks
run in this process, and a planted bug's check message (test_exercises, test_check,
test_grade)."""

from __future__ import annotations

import types

import nbformat
import pytest

from minicb.benchmark.metrics import RequestRecord
from minicb.course import check
from minicb.course.exercises import ROOT, cell_tags
from minicb.trace import Member, StepRecord


# ------------------------------------------------------------------------------ records
def rec(rid, n, reason="length", arrival=0.0, sched=None, first=None, finish=None,
        times=None, a_step=1, s_step=None, f_step=None, fin_step=None, steps=None,
        preempt=0, recomputed=0, cached=0) -> RequestRecord:
    """A finished request's record: `n` output tokens, 8 prompt tokens, times in seconds."""
    return RequestRecord(rid, 8, n, reason, arrival, sched, first, finish, list(times or []),
                         a_step, s_step, f_step, fin_step, list(steps or []), cached, preempt,
                         recomputed)


def step(i, members, t0, t1, t_forward=0.0, preempted=()) -> StepRecord:
    """Step `i`'s record: `members` as `Member` fields, from `t0` to `t1` seconds."""
    return StepRecord(step=i, members=[Member(*m) for m in members], waiting=[], finished=[],
                      preempted=list(preempted), pages_used=0, pages_cached=0, t_start=t0,
                      t_end=t1, t_forward=t_forward)


def approx(x):
    """Equal to `x` up to float rounding."""
    return pytest.approx(x, rel=1e-9, abs=1e-12)


# ------------------------------------------------------------------------------ exercises
SOURCES = sorted((ROOT / "exercises" / "source").glob("*.ipynb"))


NAMES = [p.name for p in SOURCES]


EXPECTED = ["01_paged_kv.ipynb", "02_static_batching.ipynb", "03_continuous_batching.ipynb",
            "04_chunked_prefill.ipynb", "05_pd_interleaving.ipynb", "06_benchmarking.ipynb",
            "07_paged_attention.ipynb", "08_speculative_decoding.ipynb"]


def tagged(nb, prefix: str) -> dict[str, int]:
    """{name: cell index} of cells tagged `prefix:<name>`."""
    return {t.split(":", 1)[1]: i for i, c in enumerate(nb.cells) for t in cell_tags(c)
            if t.startswith(prefix + ":")}


_NAMESPACES: dict[str, dict] = {}


def solution(notebook: str) -> dict:
    """The namespace of a solution notebook's setup and exercise cells, run in this process
    (no kernel, no demos): the reference answers, to check and to break on purpose."""
    if notebook not in _NAMESPACES:
        nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
        namespace: dict = {"__name__": f"solution_{notebook[:2]}"}
        for cell in nb.cells:
            if cell.get("id") == "setup" or any(t.startswith("exercise:")
                                                for t in cell_tags(cell)):
                code = "\n".join(line for line in cell.source.splitlines()
                                 if not line.startswith("%"))
                exec(compile(code, f"{notebook}:{cell['id']}", "exec"), namespace)
        _NAMESPACES[notebook] = namespace
    return _NAMESPACES[notebook]


SOLUTION_OBJECTS = {
    "page_pool": ("01_paged_kv.ipynb", "MyPagePool"),
    "prefix_hashes": ("01_paged_kv.ipynb", "my_prompt_page_hashes"),
    "match_prefix": ("01_paged_kv.ipynb", "my_match_prefix"),
    "quantize_int8": ("01_paged_kv.ipynb", "my_quantize_int8"),
    "static_batch": ("02_static_batching.ipynb", "form_static_batch"),
    "static_finish_steps": ("02_static_batching.ipynb", "static_finish_steps"),
    "continuous_finish_steps": ("03_continuous_batching.ipynb", "continuous_finish_steps"),
    "continuous_scheduler": ("03_continuous_batching.ipynb", "MyContinuousScheduler"),
    "next_chunk": ("04_chunked_prefill.ipynb", "next_chunk"),
    "chunked_scheduler": ("04_chunked_prefill.ipynb", "MyChunkedScheduler"),
    "pd_scheduler": ("05_pd_interleaving.ipynb", "MyPDScheduler"),
    "dec_at_p": ("05_pd_interleaving.ipynb", "dec_at_p"),
    "short_p": ("05_pd_interleaving.ipynb", "short_p"),
    "latencies": ("06_benchmarking.ipynb", "latencies"),
    "goodput": ("06_benchmarking.ipynb", "goodput"),
    "per_tenant": ("06_benchmarking.ipynb", "per_tenant"),
    "best_setting": ("06_benchmarking.ipynb", "best_setting"),
    "swap_break_even": ("06_benchmarking.ipynb", "swap_break_even"),
    "slot_mapping": ("07_paged_attention.ipynb", "slot_mapping"),
    "paged_attention": ("07_paged_attention.ipynb", "paged_attention"),
    "prompt_lookup": ("08_speculative_decoding.ipynb", "prompt_lookup"),
    "verify_greedy": ("08_speculative_decoding.ipynb", "verify_greedy"),
}


def caught(exercise: str, learner) -> str:
    """The check's explanation of a planted bug's first failed case, in full: the message up
    to its list of the other failed cases (`first_failure`)."""
    with pytest.raises(check.CheckFailed) as info:
        getattr(check, exercise)(learner)
    assert isinstance(info.value, AssertionError)
    message = str(info.value)
    assert message.startswith(f"[{exercise}] ")
    return first_failure(message)


def first_failure(message: str) -> str:
    """A check's message without its list of the other failed cases."""
    return message.split("\nAlso failed (", 1)[0]


def code(source: str = "pass", tags: tuple[str, ...] = (), markdown: bool = False):
    """A cell with `tags` (a markdown cell when `markdown`)."""
    make = nbformat.v4.new_markdown_cell if markdown else nbformat.v4.new_code_cell
    return make(source, metadata={"tags": list(tags)})


def variant(name: str):
    """A copy of one of the check module's own functions (`_attention_variant`, ...), to plant
    the mistakes it knows as a learner's answer: the checks refuse the function itself."""
    fn = getattr(check, name)
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy
