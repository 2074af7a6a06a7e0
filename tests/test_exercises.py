"""Exercises, solutions and the autograder (exercises for chapters 01-08).

Fast tests: the generated notebooks match their sources; the generator's stubs; every exercise
pairs a stub, a check cell and a `minicb.course.check` function; the reference solutions pass their
checks in-process; planted bugs are caught with a message that names the problem.
Slow tests execute notebooks: every solution grades 100% in under a minute, every untouched
exercise notebook grades 0 with a NotImplementedError message per exercise, and the grader
survives tampering, endless loops and bad paths.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from minicb import kv_cache
from minicb.course import check, exercises, grade
from minicb.course.exercises import ROOT, MarkerError, cell_tags, generate, solution_code, stub_code
from minicb.model import quant

SOURCES = sorted((ROOT / "exercises" / "source").glob("*.ipynb"))
NAMES = [p.name for p in SOURCES]
EXPECTED = ["01_paged_kv.ipynb", "02_static_batching.ipynb", "03_continuous_batching.ipynb",
            "04_chunked_prefill.ipynb", "05_pd_interleaving.ipynb", "06_benchmarking.ipynb",
            "07_paged_attention.ipynb", "08_speculative_decoding.ipynb"]


def tagged(nb, prefix: str) -> dict[str, int]:
    """{name: cell index} of cells tagged `prefix:<name>`."""
    return {t.split(":", 1)[1]: i for i, c in enumerate(nb.cells) for t in cell_tags(c)
            if t.startswith(prefix + ":")}


# ------------------------------------------------------------------------------ generation
def test_every_chapter_01_to_06_has_an_exercise_notebook():
    assert NAMES == EXPECTED


def test_generated_notebooks_match_their_sources():
    assert exercises.stale() == [], "run `python -m minicb.course.exercises build` and commit"
    assert exercises.main(["check"]) == 0


def test_links_out_of_the_source_folder_are_rewritten_for_the_generated_notebooks():
    text = "See [ch 01](../../chapters/01_x.ipynb#top), [next](02_y.ipynb), [web](https://a.b/c)."
    assert exercises.relink(text) == ("See [ch 01](../chapters/01_x.ipynb#top), "
                                      "[next](02_y.ipynb), [web](https://a.b/c).")


def test_check_mode_fails_on_a_stale_or_orphan_notebook(tmp_path, capsys):
    for folder in ("exercises", "solutions"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    assert exercises.main(["check", "--root", str(tmp_path)]) == 0
    path = tmp_path / "solutions" / EXPECTED[0]
    path.write_text(path.read_text().replace("MyPagePool", "YourPagePool"))
    (tmp_path / "exercises" / "99_orphan.ipynb").write_text("{}")
    assert exercises.main(["check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"solutions/{EXPECTED[0]}" in err and "99_orphan.ipynb (no source)" in err
    assert exercises.main(["build", "--root", str(tmp_path)]) == 0
    assert exercises.stale(tmp_path) == ["exercises/99_orphan.ipynb (no source)"]


def test_reset_puts_a_fresh_stub_in_place_and_keeps_the_learners_work(tmp_path, capsys):
    """`make reset NB=...`: a learner starting over gets the generated stub back, and the
    notebook they had is kept under exercises/.backup/ (not graded by `exercises/*.ipynb`)."""
    shutil.copytree(ROOT / "exercises", tmp_path / "exercises")
    name = EXPECTED[1]
    mine = tmp_path / "exercises" / name
    fresh = mine.read_text()
    mine.write_text(fresh.replace("NotImplementedError", "my own attempt"))
    assert exercises.main(["reset", f"exercises/{name}", "--root", str(tmp_path)]) == 0
    assert mine.read_text() == fresh
    backups = list((tmp_path / "exercises" / ".backup").glob("*.ipynb"))
    assert len(backups) == 1 and "my own attempt" in backups[0].read_text()
    assert "yours is kept as exercises/.backup/" in capsys.readouterr().out
    assert exercises.main(["reset", name, "--root", str(tmp_path)]) == 0  # twice in a second
    assert len(list((tmp_path / "exercises" / ".backup").glob("*.ipynb"))) == 2
    assert exercises.main(["reset", "exercises/99_nope.ipynb", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no exercise notebook named '99_nope.ipynb'" in err and EXPECTED[0] in err
    for wrong in (["reset"], ["build", f"exercises/{name}"]):  # which notebook? / none wanted
        with pytest.raises(SystemExit):
            exercises.main(wrong)


def test_generation_is_deterministic_and_keeps_cell_ids():
    for src in SOURCES:
        nb = nbformat.read(src, as_version=4)
        ex1, sol1 = generate(nb, src.name)
        ex2, sol2 = generate(nbformat.read(src, as_version=4), src.name)
        assert exercises.render(ex1) == exercises.render(ex2)
        assert exercises.render(sol1) == exercises.render(sol2)
        ids = [c["id"] for c in nb.cells]
        assert [c["id"] for c in ex1.cells] == ids == [c["id"] for c in sol1.cells]
        assert len(set(ids)) == len(ids)


def test_stub_replaces_the_solution_with_hint_and_error():
    source = "\n".join([
        "class Pool:",
        "    def allocate(self, n):",
        "        ### BEGIN SOLUTION",
        "        # HINT: take n pages",
        "        #       from the free list.",
        "        pages = self.free[:n]",
        "        return pages",
        "        ### END SOLUTION",
        "",
        "def helper():",
        "    ### BEGIN SOLUTION",
        "    return 1",
        "    ### END SOLUTION",
    ])
    stub = stub_code(source, "page_pool")
    assert "pages = self.free" not in stub and "return 1" not in stub
    assert "        # HINT: take n pages\n        #       from the free list.\n" in stub
    assert ('        raise NotImplementedError("write Pool.allocate (exercise page_pool): '
            'see the HINT above")') in stub
    assert ('    raise NotImplementedError("write helper (exercise page_pool): replace this '
            'line with your code")') in stub
    compile(stub, "stub", "exec")
    solution = solution_code(source)
    assert "BEGIN" not in solution and "END SOLUTION" not in solution
    assert "        return pages" in solution and "# HINT: take n pages" in solution


@pytest.mark.parametrize("bad", [
    "### BEGIN SOLUTION\nx = 1",
    "x = 1\n### END SOLUTION",
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n### END SOLUTION",
])
def test_unbalanced_markers_are_refused(bad):
    with pytest.raises(MarkerError):
        stub_code(bad)


def test_notebook_structure():
    """Every exercise has a stub cell, a check cell after it and a check function; the
    exercise notebooks hold no solution and no output; check cells are the same in all three."""
    for src in SOURCES:
        source = nbformat.read(src, as_version=4)
        ex = nbformat.read(ROOT / "exercises" / src.name, as_version=4)
        sol = nbformat.read(ROOT / "solutions" / src.name, as_version=4)
        stubs, checks = tagged(source, "exercise"), tagged(source, "check")
        assert 2 <= len(checks) <= 5, src.name  # 5: chapter 06 is the longest
        assert list(stubs) == list(checks), f"{src.name}: each exercise needs stub + check"
        for name, index in checks.items():
            assert stubs[name] < index
            assert callable(getattr(check, name, None)), f"minicb.course.check.{name} missing"
            assert f"check.{name}(" in source.cells[index].source
            assert ex.cells[index].source == sol.cells[index].source \
                == source.cells[index].source
            assert "### BEGIN SOLUTION" in source.cells[stubs[name]].source
            assert f"(exercise {name})" in ex.cells[stubs[name]].source
        assert source.cells[0].cell_type == "markdown"
        chapter = re.search(r"\(\.\./\.\./chapters/(\d\d_\w+)\.ipynb\)", source.cells[0].source)
        assert chapter and chapter.group(1)[:2] == src.name[:2], "intro links its chapter"
        assert "Summary" in source.cells[-1].source
        for nb in (ex, sol):
            text = exercises.render(nb)
            assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
            assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


# ------------------------------------------------------------------------------ solutions
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


def test_every_check_is_covered_here():
    names = {n for src in SOURCES for n in tagged(nbformat.read(src, as_version=4), "check")}
    assert names == set(SOLUTION_OBJECTS)


@pytest.mark.parametrize("exercise", sorted(SOLUTION_OBJECTS))
def test_reference_solution_passes_its_check(exercise, capsys):
    notebook, obj = SOLUTION_OBJECTS[exercise]
    assert getattr(check, exercise)(solution(notebook)[obj]) is True
    assert capsys.readouterr().out.startswith(f"✓ {exercise}: ")


# ------------------------------------------------------------------------------ planted bugs
def caught(exercise: str, learner) -> str:
    with pytest.raises(check.CheckFailed) as info:
        getattr(check, exercise)(learner)
    assert isinstance(info.value, AssertionError)
    message = str(info.value)
    assert message.startswith(f"[{exercise}] ")
    return message


def test_pd_scheduler_serving_prefill_before_decodes_is_caught():
    from minicb.request import Status
    from minicb.scheduler import Scheduler, schedule_prefill_chunks

    class PrefillFirst(Scheduler):
        name = "my-pd"

        def schedule(self, ctx):
            budget = schedule_prefill_chunks(ctx, ctx.config.max_num_batched_tokens)
            for req in self.decoding(ctx):
                if budget > 0 and req.status is Status.RUNNING and \
                        ctx.reserve_or_preempt(req, 1):
                    ctx.schedule(req, 1)
                    budget -= 1
            return ctx.batch

    message = caught("pd_scheduler", PrefillFirst)
    assert "decodes were left waiting at step 3" in message
    assert "short-0, short-1, short-2" in message and "long prefill 32" in message

    class NamedPD(PrefillFirst):  # the engine's own pd invariant fires first: same message
        name = "pd"

    assert "decodes were left waiting at step 3" in caught("pd_scheduler", NamedPD)


def test_a_prompt_in_the_decode_loop_is_named():
    """Found by a learner review: looping over ctx.running for decodes gives a half-prefilled
    prompt one token; the message says so instead of only showing the two steps."""
    from minicb.request import Status
    from minicb.scheduler import Scheduler, schedule_prefill_chunks

    class RunningAsDecodes(Scheduler):
        name = "my-pd"

        def schedule(self, ctx):
            budget = ctx.config.max_num_batched_tokens
            for req in list(ctx.running):
                if req.status is Status.RUNNING and ctx.reserve_or_preempt(req, 1):
                    ctx.schedule(req, 1)
                    budget -= 1
            schedule_prefill_chunks(ctx, budget, min_chunk=ctx.config.min_chunk)
            return ctx.batch

    message = caught("pd_scheduler", RunningAsDecodes)
    assert "long prefill 1] (4 tokens)" in message
    assert "Yours gave 'long', whose prompt was not yet done, a single token" in message
    assert "self.decoding(ctx)" in message


def test_page_pool_that_forgets_a_ref_count_is_caught():
    """The reason comes first: a gradebook's feedback keeps a failure's first line, which was
    a header ("pool of 4 pages (random sequence 0); the last operations:")."""
    base = solution("01_paged_kv.ipynb")["MyPagePool"]

    class ShareForgets(base):
        def share(self, pages):
            for page in pages:
                if self.ref_count[page] == 0:
                    raise ValueError("free")

    class ReleaseFreesAll(base):
        def release(self, pages):
            if any(self.ref_count[page] <= 0 for page in pages):
                raise ValueError("free")
            for page in pages:
                self.ref_count[page] = 0
                self.free.append(page)

    for bug in (ShareForgets, ReleaseFreesAll):
        message = caught("page_pool", bug)
        first, *rest = message.splitlines()  # a gradebook's feedback shows the first only
        assert re.search(r"ref count should be [2-9]", first), message
        assert "a reference was forgotten" in first
        assert "share(" in "\n".join(rest)  # the operations that led there are listed

    class NotAllOrNothing(base):
        def allocate(self, n):
            pages = self.free[:n]
            del self.free[:n]
            for page in pages:
                self.ref_count[page] = 1
            return pages

    assert "must raise MemoryError and take nothing" in caught("page_pool", NotAllOrNothing)

    class RefusesTooLate(base):  # found by an audit: blamed on "a reference was forgotten"
        def release(self, pages):
            for page in pages:
                self.ref_count[page] -= 1
                if self.ref_count[page] < 0:
                    raise ValueError("free")
                if self.ref_count[page] == 0:
                    self.free.append(page)

    message = caught("page_pool", RefusesTooLate)
    assert "release([0]) of a free page raised ValueError, rightly, but changed the pool first" \
        in message and "ref counts [0, 0, 0, 0] -> [-1, 0, 0, 0]" in message, message


def test_unchained_hash_and_uncapped_prefix_hit_are_caught():
    from minicb.kv_cache import page_hash

    def unchained(tokens, page_size):
        return [page_hash(None, tokens[i:i + page_size])
                for i in range(0, len(tokens) - page_size + 1, page_size)]

    assert "the chain" in caught("prefix_hashes", unchained)

    hashes = solution("01_paged_kv.ipynb")["my_prompt_page_hashes"]

    def uncapped(cached, tokens, page_size):
        pages = []
        for h in hashes(tokens, page_size):
            if h not in cached:
                break
            pages.append(cached[h])
        return pages

    message = caught("match_prefix", uncapped)
    assert "whole prompt" in message and "Cap the hit" in message


def test_quantization_bugs_are_caught():
    import torch

    def one_scale(weight):  # the whole matrix shares the largest weight's scale
        scale = (weight.abs().max() / 127).expand(weight.shape[0])
        return torch.round(weight / scale[:, None]).to(torch.int8), scale

    def divides_by_zero(weight):
        scale = weight.abs().amax(dim=1) / 127
        return torch.round(weight / scale[:, None]).to(torch.int8), scale

    def truncates(weight):
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
        return (weight / scale[:, None]).to(torch.int8), scale

    def keeps_floats(weight):
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
        return torch.round(weight / scale[:, None]), scale

    assert "one scale per row" in caught("quantize_int8", one_scale)
    assert "floor under the scale" in caught("quantize_int8", divides_by_zero)
    assert "do not truncate" in caught("quantize_int8", truncates)
    assert "torch.int8" in caught("quantize_int8", keeps_floats)

    def column_of_scales(weight):  # keepdim: passes the numbers, breaks q * scale[:, None]
        scale = (weight.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        return torch.round(weight / scale).to(torch.int8), scale

    def half_scales(weight):  # as Int8Linear stores them, but the check wants float32
        q, scale = solution("01_paged_kv.ipynb")["my_quantize_int8"](weight)
        return q, scale.to(torch.bfloat16)

    def float16_scales(weight):
        q, scale = solution("01_paged_kv.ipynb")["my_quantize_int8"](weight)
        return q, scale.half()

    assert "(shape [6, 32]): scale has shape [6, 1], expected [6]" in caught(
        "quantize_int8", column_of_scales)
    assert "keep it in float32" in caught("quantize_int8", half_scales)
    message = caught("quantize_int8", float16_scales)
    assert "keep it in float32" in message and "11 significant bits" in message


def test_a_refused_release_part_way_through_a_list_is_caught():
    """Exercise 1.1: a refused call changes nothing, also when the bad page comes after a good
    one in the list (the check's release([held, free]))."""
    pool_class = solution("01_paged_kv.ipynb")["MyPagePool"]

    class HalfwayRelease(pool_class):
        def release(self, pages):
            for page in pages:
                if self.ref_count[page] <= 0:
                    raise ValueError(f"page {page}")
                self.ref_count[page] -= 1
                if self.ref_count[page] == 0:
                    self.free.append(page)

    class HalfwayShare(pool_class):
        def share(self, pages):
            for page in pages:
                if self.ref_count[page] == 0:
                    raise ValueError(f"page {page}")
                self.ref_count[page] += 1

    class BackwardsRelease(pool_class):  # refuses before changing only if the bad page is last
        def release(self, pages):
            for page in reversed(pages):
                if self.ref_count[page] <= 0:
                    raise ValueError(f"page {page}")
                self.ref_count[page] -= 1
                if self.ref_count[page] == 0:
                    self.free.append(page)

    class CountsEachPageOnce(pool_class):  # checks first, but a page listed twice goes to -1
        def release(self, pages):
            if any(self.ref_count[page] <= 0 for page in pages):
                raise ValueError("free")
            for page in pages:
                self.ref_count[page] -= 1
                if self.ref_count[page] == 0:
                    self.free.append(page)

    assert "a page listed twice loses two references" in caught("page_pool", CountsEachPageOnce)
    for cls, call in ((HalfwayRelease, "release(["), (HalfwayShare, "share(["),
                      (BackwardsRelease, "release([")):
        message = caught("page_pool", cls)
        assert "changed the pool first" in message and re.search(
            re.escape(call) + r"\d+, \d+\]\) \(page \d+ is free\)", message), message


def test_batching_bugs_are_caught():
    def jumps_ahead(queue, max_num_seqs, free_pages, page_size):
        batch = []
        for rid, n in queue:
            need = -(-n // page_size)
            if len(batch) < max_num_seqs and need <= free_pages:
                free_pages -= need
                batch.append(rid)
        return batch

    message = caught("static_batch", jumps_ahead)
    # the first mismatch: r0 takes 2 of 3 free pages, r1 needs 3 (a review: say what is left)
    assert "'r1' does not fit (3 pages needed, 1 left after ['r0'])" in message
    assert "must not jump ahead" in message

    def shortest_first(queue, max_num_seqs, free_pages, page_size):
        return jumps_ahead(sorted(queue, key=lambda q: q[1]), max_num_seqs, free_pages,
                           page_size)

    # full at max_num_seqs, not short of pages: the message must not say a request "does not fit"
    message = caught("static_batch", shortest_first)
    assert "The batch is full at max_num_seqs=3" in message and "does not fit" not in message

    def ignores_min_chunk(remaining, chunk_size, budget, min_chunk=1):
        return min(remaining, chunk_size, budget)

    assert "min_chunk=8" in caught("next_chunk", ignores_min_chunk)

    continuous = solution("03_continuous_batching.ipynb")["continuous_finish_steps"]
    message = caught("static_finish_steps", continuous)
    assert "[30, 200, 80, 260]" in message and "request 4" in message


def test_scheduler_bugs_meet_the_engine_rules():
    from minicb.scheduler import Scheduler

    mine = solution("03_continuous_batching.ipynb")["MyContinuousScheduler"]

    class Renamed(mine):  # the engine goes by attributes, not by names
        name = "mine"

    assert check.continuous_scheduler(Renamed)

    class NotWhole(mine):  # budget enforced: the long prompt is refused by the engine
        whole_prompts = False

    message = caught("continuous_scheduler", NotWhole)
    assert "the engine refused the batch" in message and "max_num_batched_tokens" in message
    assert "`whole_prompts = True` (yours is missing" in message

    class Unreserved(Scheduler):
        def schedule(self, ctx):
            for req in list(ctx.running):
                ctx.schedule(req, 1)
            if ctx.waiting:
                req = ctx.waiting[0]
                n = ctx.admit(req, req.num_tokens)
                if n:
                    ctx.schedule(req, n)
            return ctx.batch

    assert "reserve them first" in caught("continuous_scheduler", Unreserved)

    class ReturnsNothing(solution("05_pd_interleaving.ipynb")["MyPDScheduler"]):
        def schedule(self, ctx):
            super().schedule(ctx)

    assert "it must return ctx.batch" in caught("pd_scheduler", ReturnsNothing)

    class DecodesRideAlong(Scheduler):  # PD written out by hand: not prefill-first
        def schedule(self, ctx):
            budget = ctx.config.max_num_batched_tokens - self.schedule_decodes(ctx)
            for req in self.prefilling(ctx):
                n = min(req.num_remaining, ctx.config.chunk_size, budget)
                if n and ctx.reserve(req, n):
                    ctx.schedule(req, n)
                    budget -= n
            while ctx.waiting and budget > 0:
                req = ctx.waiting[0]
                n = ctx.admit(req, min(ctx.config.chunk_size, budget))
                if not n:
                    break
                ctx.schedule(req, n)
                budget -= n
            return ctx.batch

    message = caught("chunked_scheduler", DecodesRideAlong)
    assert "step 3: minicb's chunked scheduler ran [long prefill 32]" in message


def test_metric_bugs_are_caught():
    goodput = solution("06_benchmarking.ipynb")["goodput"]
    latencies = solution("06_benchmarking.ipynb")["latencies"]

    def counts_cancelled(records, slo):
        done = [r for r in records if r.finish_reason != "cancelled" or True]
        span = goodput(records, {})  # only for the None case
        if span is None:
            return None
        first = min(r.arrival_time for r in records)
        last = max(r.finish_time for r in records if r.finish_time is not None)
        ok = [r for r in done if all((latencies(r)[k] is None and k == "tpot")
                                     or (latencies(r)[k] is not None and latencies(r)[k] <= v)
                                     for k, v in slo.items())]
        return len(ok) / (last - first)

    assert "Cancelled and failed requests never count" in caught("goodput", counts_cancelled)

    def e2e_to_the_finish(record):  # ignores a static batch's hold: E2E ends at the release
        out = latencies(record)
        if out["e2e"] is not None and record.finish_time is not None:
            out["e2e"] = record.finish_time - record.arrival_time
        return out

    assert "released_time" in caught("latencies", e2e_to_the_finish)

    def ttft_at_the_computation(record):  # a static batch's user sees no token before release
        out = latencies(record)
        if out["ttft"] is not None:
            out["ttft"] = record.first_token_time - record.arrival_time
        return out

    assert "returned_whole" in caught("latencies", ttft_at_the_computation)

    per_tenant = solution("06_benchmarking.ipynb")["per_tenant"]

    def every_first_token(records):  # cancelled and failed requests' TTFTs counted too
        out = per_tenant(records)
        for tenant, row in out.items():
            ttfts = [latencies(r)["ttft"] for r in records if r.tenant == tenant]
            ttfts = [t for t in ttfts if t is not None]
            if ttfts:
                row["ttft_p50"] = float(np.percentile(ttfts, 50))
                row["ttft_p99"] = float(np.percentile(ttfts, 99))
        return out

    assert "Only completed requests count" in caught("per_tenant", every_first_token)
    assert "None is a tenant too" in caught(
        "per_tenant", lambda records: {t: row for t, row in per_tenant(records).items()
                                       if t is not None})

    def window_from_first_chunk(trace, records, long_id):
        long = next(r for r in records if r.request_id == long_id)
        end = long.first_token_step or trace[-1].step
        return sum(1 for rec in trace if (long.first_scheduled_step or 0) <= rec.step <= end
                   for m in rec.members if m.kind == "decode" and m.request_id != long_id)

    assert "arrival_step" in caught("dec_at_p", window_from_first_chunk)


def short_p_selecting(alive):
    """short_P computed over the other requests for which `alive(r, long, window_end)`."""
    def fn(trace, records, long_id):
        long = next(r for r in records if r.request_id == long_id)
        end = next((s for s in (long.first_token_step, long.finish_step) if s is not None),
                   trace[-1].step)
        shorts = [r for r in records if r is not long and alive(r, long, end)]
        if not shorts:
            return 0
        if any(r.finish_step is None for r in shorts):
            return None
        return max(r.finish_step for r in shorts) - long.arrival_step + 1
    return fn


def test_short_p_is_tested_on_both_bounds_of_alive():
    def not_done_before(r, long):
        return r.finish_step is None or r.finish_step >= long.arrival_step

    def every_other(trace, records, lid):  # the reviewer's: no alive test at all
        long = next(r for r in records if r.request_id == lid)
        f = [r.finish_step for r in records if r.request_id != lid]
        return 0 if not f else None if None in f else max(f) - long.arrival_step + 1

    wrong = {
        "after the window ended": short_p_selecting(
            lambda r, long, end: not_done_before(r, long)),  # no arrival bound
        "before the long one arrived": short_p_selecting(
            lambda r, long, end: r.arrival_step <= end),  # finished before it: counted
        "finished at 3": short_p_selecting(  # strict >: finishing on its arrival step
            lambda r, long, end: r.arrival_step <= end and (
                r.finish_step is None or r.finish_step > long.arrival_step)),
        "arrived at step 5, finished at 17": short_p_selecting(  # strict <: arriving at its end
            lambda r, long, end: r.arrival_step < end and not_done_before(r, long)),
    }
    for named, fn in [*wrong.items(), ("after the window ended", every_other)]:
        message = caught("short_p", fn)
        assert "Alive with the long one" in message and named in message, (named, message)
    # the edge traces put their requests where their labels say: on or just past a bound
    traces = {label.split(" ")[0]: {r.request_id: r for r in records}
              for label, _, records, _ in check.pd_traces()}
    edges, none = traces["alive-edges"], traces["none-alive"]
    assert edges["edge-finish"].finish_step == edges["long"].arrival_step
    assert edges["edge-arrive"].arrival_step == edges["long"].first_token_step
    assert edges["after"].arrival_step == edges["long"].first_token_step + 1
    assert edges["after"].finish_step > edges["edge-arrive"].finish_step > \
        edges["short-0"].finish_step
    assert traces["finish-edge"]["edge-finish"].finish_step == \
        traces["finish-edge"]["long"].arrival_step
    assert none["early"].finish_step < none["long"].arrival_step < none["after"].arrival_step
    cancelled = traces["cancelled"]
    assert cancelled["long"].first_token_step is None and cancelled["long"].finish_reason == \
        "cancelled" and cancelled["long"].finish_step < cancelled["after"].arrival_step
    assert cancelled["after"].finish_step > cancelled["short-0"].finish_step


def test_a_cancelled_long_requests_window_ends_at_its_finish_step():
    def window_end(with_finish_step):  # a learner review: the solutions ended it at the trace's
        def end(trace, long):
            steps = (long.first_token_step, long.finish_step) if with_finish_step \
                else (long.first_token_step,)
            return next((s for s in steps if s is not None), trace[-1].step)
        return end

    def short_p(end):
        def fn(trace, records, long_id):
            long = next(r for r in records if r.request_id == long_id)
            shorts = [r for r in records if r is not long and r.arrival_step <= end(trace, long)
                      and (r.finish_step is None or r.finish_step >= long.arrival_step)]
            if any(r.finish_step is None for r in shorts):
                return None
            return max((r.finish_step - long.arrival_step + 1 for r in shorts), default=0)
        return fn

    def dec_at_p(end):
        def fn(trace, records, long_id):
            long = next(r for r in records if r.request_id == long_id)
            return sum(m.kind == "decode" and m.request_id != long_id for rec in trace
                       if long.arrival_step <= rec.step <= end(trace, long) for m in rec.members)
        return fn

    for name, fn in ("short_p", short_p), ("dec_at_p", dec_at_p):
        assert getattr(check, name)(fn(window_end(True)))
        message = caught(name, fn(window_end(False)))
        assert "trace of cancelled under 'pd'" in message
        assert "it ended (cancelled) at step 4 before its first token" in message
        if name == "short_p":
            assert "after (arrived at step 6, after the window ended at step 4)" in message


def test_chunked_scheduler_budget_bugs_are_caught():
    from minicb.scheduler import Scheduler

    next_chunk = solution("04_chunked_prefill.ipynb")["next_chunk"]

    def chunked(running_first=True, admit_all=False, charge_running=True):
        class Chunked(Scheduler):
            name = "my-chunked"

            def schedule(self, ctx):
                budget, size = ctx.config.max_num_batched_tokens, ctx.config.chunk_size

                def running():
                    nonlocal budget
                    for req in self.prefilling(ctx):
                        if req.request_id in ctx.scheduled_ids:
                            continue
                        n = next_chunk(req.num_remaining, size, budget)
                        if n and ctx.reserve(req, n):
                            ctx.schedule(req, n)
                            budget -= n if charge_running else 0

                if running_first:
                    running()
                while ctx.waiting and budget > 0:
                    req = ctx.waiting[0]
                    n = ctx.admit(req, size if admit_all else min(size, budget))
                    if not n:
                        break
                    ctx.schedule(req, n)
                    budget -= n
                if not running_first:
                    running()
                if not ctx.batch.items:
                    self.schedule_decodes(ctx)
                return ctx.batch
        return Chunked

    assert check.chunked_scheduler(chunked())  # the helper itself is right
    assert "busy-budget" in caught("chunked_scheduler", chunked(charge_running=False))
    assert "busy-budget" in caught("chunked_scheduler", chunked(admit_all=True))
    message = caught("chunked_scheduler", chunked(running_first=False))
    assert "busy-budget" in message and "[c prefill 16, a prefill 16, b prefill 8]" in message


def continuous_like(decodes_first=True, stop_at_misfit=True, alone=True, preempting=True,
                    schedules=True, decodes_count=False, off_by_one=False):
    """Exercise 3.2's scheduler, with one of its rules broken on demand."""
    from minicb.scheduler import Scheduler

    class Continuous(Scheduler):
        name = "continuous"
        whole_prompts = True

        def decodes(self, ctx):
            if preempting:
                self.schedule_decodes(ctx)
            else:
                for req in self.decoding(ctx):
                    if ctx.reserve(req, 1):
                        ctx.schedule(req, 1)

        def schedule(self, ctx):
            if decodes_first:
                self.decodes(ctx)
            budget = ctx.config.max_num_batched_tokens
            budget -= len(ctx.batch.items) if decodes_count else 0
            tokens = 0
            for req in list(ctx.waiting):
                if ctx.batch.preempted:
                    break
                total = tokens + req.num_tokens
                if (tokens or not alone) and (total >= budget if off_by_one else total > budget):
                    if stop_at_misfit:
                        break
                    continue
                n = ctx.admit(req, req.num_tokens)
                if not n:
                    break
                if schedules:
                    ctx.schedule(req, n)
                tokens += n
            if not decodes_first:
                self.decodes(ctx)
            return ctx.batch
    return Continuous


def test_continuous_scheduler_queue_order_and_decodes_first_are_checked():
    assert check.continuous_scheduler(continuous_like())  # the helper itself is right
    message = caught("continuous_scheduler", continuous_like(stop_at_misfit=False))
    assert "'queue-order'" in message and "[a prefill 50, c prefill 10]" in message
    message = caught("continuous_scheduler", continuous_like(decodes_first=False))
    assert "'late-pages'" in message and "yours preempted ['p1']" in message
    # pd's rule (chapter 05) carried back: decodes subtracted from the budget (a learner review)
    message = caught("continuous_scheduler", continuous_like(decodes_count=True))
    assert "'decodes-beside-prompts'" in message and "[d0 decode, d1 decode, d2 decode, x " \
        "prefill 30] (33 tokens)" in message
    # off by one: a prompt that fills the budget exactly left for the next step (a learner review)
    message = caught("continuous_scheduler", continuous_like(off_by_one=True))
    assert "'exact-fit'" in message and "yours ran [a prefill 32] (32 tokens)" in message


def test_finish_steps_of_requests_listed_out_of_arrival_order():
    def unsorted(policy):  # the reference solutions, without their sort
        def fn(max_tokens, arrivals, max_num_seqs):
            queue, finish, running, step = list(range(len(max_tokens))), [0] * len(max_tokens), \
                [], 0
            while queue:
                step += 1
                if policy == "continuous" or all(finish[i] < step for i in running):
                    running = [i for i in running if finish[i] >= step]
                    while queue and len(running) < max_num_seqs and arrivals[queue[0]] <= step:
                        i = queue.pop(0)
                        finish[i] = step + max_tokens[i] - 1
                        running.append(i)
            return finish
        return fn

    for policy in ("static", "continuous"):
        notebook, name = SOLUTION_OBJECTS[f"{policy}_finish_steps"]
        for case in ([30, 200, 80, 60], [1, 1, 1, 31], 3), ([4, 2, 6], [1, 2, 2], 2):
            assert unsorted(policy)(*case) == solution(notebook)[name](*case)  # sorted: right
        message = caught(f"{policy}_finish_steps", unsorted(policy))
        assert "arrival_steps=[9, 1, 1]" in message and "[15, 5, 10]" in message
        assert "sort the indices by (arrival_steps[i], i)" in message


def test_finish_steps_admitting_the_arrived_in_list_order_are_caught():
    def scanning(policy):  # a learner review: takes whoever has arrived, in list order
        def fn(max_tokens, arrivals, max_num_seqs):
            finish, running, step = [None] * len(max_tokens), [], 0
            while None in finish:
                step += 1
                if policy == "continuous" or all(finish[i] < step for i in running):
                    running = [i for i in running if finish[i] >= step]
                    for i, a in enumerate(arrivals):
                        if finish[i] is None and a <= step and len(running) < max_num_seqs:
                            finish[i] = step + max_tokens[i] - 1
                            running.append(i)
            return finish
        return fn

    for policy in ("static", "continuous"):  # the engine: R3 came at step 2, before R2
        assert check._finish_steps_real(policy, [10, 3, 3], [1, 5, 2], 1) == [10, 16, 13]
        message = caught(f"{policy}_finish_steps", scanning(policy))
        assert "arrival_steps=[1, 5, 2]" in message and "yours says [10, 13, 16]" in message
        assert "sort the indices by (arrival_steps[i], i)" in message


def test_scheduler_stalls_and_refusals_name_their_cause():
    message = caught("continuous_scheduler", continuous_like(alone=False))
    assert "'long' (100 tokens) waits" in message
    assert "must still run when it is alone" in message
    message = caught("continuous_scheduler", continuous_like(preempting=False))
    assert "no page was free" in message and "must preempt" in message
    message = caught("continuous_scheduler", continuous_like(schedules=False))
    assert "admitted (ctx.admit) but never scheduled" in message  # not "got no chunk"

    from minicb.request import Status
    from minicb.scheduler import Scheduler, schedule_prefill_chunks

    def pd(status_check=True, preempting=True):
        class PD(Scheduler):
            name = "my-pd"

            def schedule(self, ctx):
                budget = ctx.config.max_num_batched_tokens
                for req in self.decoding(ctx):
                    if status_check and req.status is not Status.RUNNING:
                        continue
                    if (ctx.reserve_or_preempt if preempting else ctx.reserve)(req, 1):
                        ctx.schedule(req, 1)
                        budget -= 1
                schedule_prefill_chunks(ctx, budget, min_chunk=ctx.config.min_chunk)
                return ctx.batch
        return PD

    message = caught("pd_scheduler", pd(status_check=False))
    assert "'p3' was preempted earlier in this step" in message
    assert "req.status is not Status.RUNNING" in message
    assert "must preempt" in caught("pd_scheduler", pd(preempting=False))


def test_page_pool_allocate_is_all_or_nothing_and_raises_memory_error():
    base = solution("01_paged_kv.ipynb")["MyPagePool"]

    class OneByOne(base):  # takes pages until it runs out, then raises
        def allocate(self, n):
            pages = []
            for _ in range(n):
                if not self.free:
                    raise MemoryError
                pages.append(self.free.pop(0))
                self.ref_count[pages[-1]] = 1
            return pages

    class Runtime(base):
        def allocate(self, n):
            if n > len(self.free):
                raise RuntimeError("out of pages")
            return super().allocate(n)

    message = caught("page_pool", OneByOne)
    assert "allocate must be all or nothing" in message and "not dropped" not in message
    message = caught("page_pool", Runtime)
    assert "must raise MemoryError, but yours raised RuntimeError: out of pages" in message


def test_an_error_in_the_learners_code_names_the_input():
    dec_at_p = solution("05_pd_interleaving.ipynb")["dec_at_p"]

    def unfinished_is_none(trace, records, long_id):  # no window end when the prefill is cut
        long = next(r for r in records if r.request_id == long_id)
        if long.first_token_step is None:
            return sum(1 for rec in trace if rec.step <= long.first_token_step)
        return dec_at_p(trace, records, long_id)

    with pytest.raises(check.CheckFailed) as info:
        check.dec_at_p(unfinished_is_none)
    message = str(info.value)
    assert "stopped after 4 steps" in message and "raised TypeError" in message
    assert "rec.step <= long.first_token_step" in message  # the learner's line
    assert isinstance(info.value.__cause__, TypeError)  # its traceback is kept

    latencies = solution("06_benchmarking.ipynb")["latencies"]

    def no_none(r):
        return {**latencies(r), "queue": r.first_scheduled_time - r.arrival_time}

    message = caught("latencies", no_none)
    assert "first_scheduled_time=None" in message and "raised TypeError" in message

    class BadShare(solution("01_paged_kv.ipynb")["MyPagePool"]):
        def share(self, pages):
            super().share(pages)
            return self.shared[0]  # no such attribute

    message = caught("page_pool", BadShare)
    assert "share([" in message and "raised AttributeError" in message.splitlines()[0]

    class Stub(solution("01_paged_kv.ipynb")["MyPagePool"]):  # untouched: the stub's own error
        def allocate(self, n):
            raise NotImplementedError("write MyPagePool.allocate")

    with pytest.raises(NotImplementedError, match="write MyPagePool.allocate"):
        check.page_pool(Stub)


def tenant_ttfts(latencies, records, tenant):
    """The TTFTs of one tenant's completed requests, by the learner-style `latencies`."""
    ttfts = [latencies(r)["ttft"] for r in records
             if r.tenant == tenant and r.finish_reason in ("stop", "length")]
    return [t for t in ttfts if t is not None]


def test_numpy_integers_pass_and_float32_is_named():
    import torch

    reference = solution("04_chunked_prefill.ipynb")["next_chunk"]
    assert check.next_chunk(lambda *args: np.int64(reference(*args)))

    class NumpyIds(solution("01_paged_kv.ipynb")["MyPagePool"]):
        def allocate(self, n):
            return list(np.array(super().allocate(n), dtype=np.int64))

    class CountOnly:  # `free` is a count here, not a list
        def __init__(self, n):
            self.ref_count, self.pages, self.free = [0] * n, list(range(n)), n

        @property
        def num_free(self):
            return self.free

        def allocate(self, n):
            if n > self.free:
                raise MemoryError
            got, self.pages, self.free = self.pages[:n], self.pages[n:], self.free - n
            for p in got:
                self.ref_count[p] = 1
            return got

        def share(self, pages):
            if any(self.ref_count[p] == 0 for p in pages):
                raise ValueError
            for p in pages:
                self.ref_count[p] += 1

        def release(self, pages):
            if any(self.ref_count[p] < pages.count(p) for p in pages):
                raise ValueError
            for p in pages:
                self.ref_count[p] -= 1
                if self.ref_count[p] == 0:
                    self.pages.append(p)
                    self.free += 1

    assert check.page_pool(NumpyIds) and check.page_pool(CountOnly)

    class NumpyChunks(solution("04_chunked_prefill.ipynb")["MyChunkedScheduler"]):
        def schedule(self, ctx):
            super().schedule(ctx)
            ctx.batch.items = [(r, np.int64(n)) for r, n in ctx.batch.items]
            return ctx.batch

    assert "needs a Python int" in caught("chunked_scheduler", NumpyChunks)

    latencies = solution("06_benchmarking.ipynb")["latencies"]
    per_tenant = solution("06_benchmarking.ipynb")["per_tenant"]

    def in_float32(record):
        return {k: None if v is None else float(np.float32(v))
                for k, v in latencies(record).items()}

    def torch_quantile(records):
        out = per_tenant(records)
        for tenant, row in out.items():
            ttfts = tenant_ttfts(latencies, records, tenant)
            if ttfts:
                q = torch.quantile(torch.tensor(ttfts), torch.tensor([0.5, 0.99]))
                row["ttft_p50"], row["ttft_p99"] = q.tolist()
        return out

    assert "computed in float32" in caught("latencies", in_float32)
    assert "computed in float32" in caught("per_tenant", torch_quantile)


def test_goodput_and_per_tenant_hints_fire_only_for_their_cause():
    goodput = solution("06_benchmarking.ipynb")["goodput"]
    latencies = solution("06_benchmarking.ipynb")["latencies"]

    def ends_at_the_finish(records, slo):  # TTFT and E2E without the release of a static batch
        def unreleased(r):
            out = dict(latencies(r))
            if r.first_token_time is not None:
                out["ttft"] = r.first_token_time - r.arrival_time
                out["e2e"] = r.finish_time - r.arrival_time
            return out

        span = goodput(records, {})
        if span is None:
            return None
        span = max(r.finish_time for r in records if r.finish_time is not None) - \
            min(r.arrival_time for r in records)
        return sum(1 for r in records if r.finish_reason in ("stop", "length") and all(
            (unreleased(r)[k] is None and k == "tpot") or
            (unreleased(r)[k] is not None and unreleased(r)[k] <= v) for k, v in slo.items())
        ) / span

    message = caught("goodput", ends_at_the_finish)
    assert "released_time" in message and "counted every request" not in message

    def zero_when_no_span(records, slo):
        got = goodput(records, slo)
        return 0.0 if got is None and records else got

    assert "a span of 0" in caught("goodput", zero_when_no_span)

    per_tenant = solution("06_benchmarking.ipynb")["per_tenant"]

    def nearest(records):
        out = per_tenant(records)
        for tenant, row in out.items():
            ttfts = tenant_ttfts(latencies, records, tenant)
            if ttfts:
                row["ttft_p50"] = float(np.percentile(ttfts, 50, method="nearest"))
        return out

    assert "without interpolation" in caught("per_tenant", nearest)


# ------------------------------------------------------------------------------ notebooks
@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_solution_notebook_grades_full_marks_in_under_a_minute(name):
    t0 = time.perf_counter()
    report = grade.grade_notebook(ROOT / "solutions" / name)
    elapsed = time.perf_counter() - t0
    assert report.exercises and report.score == report.max_score, grade.format_report(report)
    assert report.notes == []
    assert elapsed < 60, f"{name} took {elapsed:.0f} s"


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_untouched_exercise_notebook_grades_zero_with_a_message_each(name, capsys):
    assert grade.main([str(ROOT / "exercises" / name), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    source = nbformat.read(ROOT / "exercises" / "source" / name, as_version=4)
    assert [e["name"] for e in data["exercises"]] == list(tagged(source, "check"))
    assert data["score"] == 0 and data["max_score"] >= len(data["exercises"]) >= 2
    for e in data["exercises"]:
        assert not e["passed"] and e["points"] == 0
        assert e["message"].startswith("NotImplementedError: write "), e
        assert f"(exercise {e['name']})" in e["message"]
        assert e["attempted"] is False  # a gradebook tells "not attempted" from "wrong"
    assert not any("raised" in note for note in data["notes"])  # the setup cell ran


@pytest.mark.slow
def test_a_broken_setup_cell_is_named_and_costs_only_what_needs_it(tmp_path, capsys):
    """Found by a teacher's review: a typo in the first cell (`import numpyy`) used to zero
    every exercise with "'NoneType' object has no attribute '__dict__'", because the fresh
    minicb.course.check the grader loads was not in sys.modules for its dataclasses. Now an exercise
    that needs nothing from that cell still scores, and a note names the cell that broke."""
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    setup = next(c for c in nb.cells if c.cell_type == "code")
    setup.source = "import numpyy\n" + setup.source
    path = tmp_path / EXPECTED[0]
    nbformat.write(nb, path)
    assert grade.main([str(path), "--json", "--timeout", "60"]) == 0
    data = json.loads(capsys.readouterr().out)
    results = {e["name"]: e for e in data["exercises"]}
    assert results["page_pool"]["passed"]
    assert not any("NoneType" in e["message"] for e in data["exercises"])
    assert all(e["attempted"] for e in data["exercises"])
    assert any("('import numpyy') raised ModuleNotFoundError" in note for note in data["notes"])


@pytest.mark.slow
def test_grader_restores_checks_and_survives_endless_loops(tmp_path, capsys):
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    checks = tagged(nb, "check")
    nb.cells[checks["page_pool"]].source = "print('trust me')"  # edited: restored, still passes
    stubs = tagged(nb, "exercise")
    nb.cells[stubs["match_prefix"]].source = (
        "def my_match_prefix(cached, token_ids, page_size):\n    while True:\n        pass")
    del nb.cells[checks["prefix_hashes"]]
    assert grade.source_for(tmp_path / EXPECTED[0]) == ROOT / "exercises" / "source" / EXPECTED[0]
    path = tmp_path / "alice.ipynb"  # a renamed submission: name its source
    nbformat.write(nb, path)
    source = ROOT / "exercises" / "source" / EXPECTED[0]
    # a timeout of a few seconds can interrupt the import cell on a loaded machine
    assert grade.main([str(path), "--timeout", "15", "--source", str(source)]) == 0
    out = capsys.readouterr().out
    assert "✓ page_pool" in out and "✓ quantize_int8" in out and "total: 3/4" in out
    assert "check cell of 'page_pool' was edited: restored from the source" in out
    assert "✓ prefix_hashes" in out and "check cell of 'prefix_hashes' was not found: put " \
        "back after the exercise's own cell" in out  # deleted: it earns nothing by that
    assert "KeyboardInterrupt" in out and "longer than 15 s" in out
    assert grade.main([str(tmp_path / "missing.ipynb")]) == 2


@pytest.mark.slow
def test_a_cell_that_swallows_the_interrupt_is_killed_and_the_rest_still_graded(tmp_path,
                                                                              capsys):
    """Found by review: a cell catching KeyboardInterrupt in a loop was interrupted every
    `timeout` seconds forever. Now its kernel is killed one timeout after the interrupt and the
    notebook runs again in a fresh kernel with that cell raising TimeoutError: the exercises
    before it and after it keep their points (those after it scored 0 before). The learner's
    notebook also names a kernel this machine lacks: the grader runs its own."""
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    nb.metadata["kernelspec"] = {"name": "some-env-of-mine", "display_name": "mine",
                                 "language": "python"}
    stubs = tagged(nb, "exercise")
    nb.cells[stubs["match_prefix"]].source = (
        "import time\nwhile True:\n    try:\n        time.sleep(60)\n"
        "    except BaseException:\n        print('not stopping')")
    path = tmp_path / EXPECTED[0]
    nbformat.write(nb, path)
    t0 = time.monotonic()
    # 3 s was too tight on a loaded machine: the cell importing torch timed out in one CI run
    assert grade.main([str(path), "--timeout", "15"]) == 0
    assert time.monotonic() - t0 < 120
    out = capsys.readouterr().out
    assert "✓ page_pool" in out and "✓ prefix_hashes" in out and "✓ quantize_int8" in out
    assert "total: 3/4" in out and "TimeoutError" in out
    assert "('import time') ignored the interrupt at 15 s and its kernel was killed; the " \
           "notebook was run again in a fresh kernel" in out
    assert "execution stopped" not in out
    assert "reported no error but did not run to its end" not in out


def test_malformed_tags_and_batches_do_not_stop_the_grader(tmp_path, capsys):
    """A hand-edited notebook may hold `"tags": null`; a notebook that cannot be graded is
    reported and the others still are; --json gives a list whenever several were asked, with
    an entry saying why for each notebook that could not be graded (they were left out)."""
    assert exercises.cell_tags({"metadata": {"tags": None}}) == []
    assert exercises.cell_tags({"metadata": None}) == []
    assert exercises.cell_tags({"metadata": {"tags": ["check", 3]}}) == ["check"]
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    assert grade.main(["--json", str(bad), str(tmp_path / "missing.ipynb")]) == 2
    data = json.loads(capsys.readouterr().out)
    assert [e["notebook"] for e in data] == [str(bad), str(tmp_path / "missing.ipynb")]
    assert all(set(e) == {"notebook", "error"} and "cannot read" in e["error"] for e in data)
    assert grade.main(["--json", str(bad)]) == 2  # one notebook: the object itself
    assert json.loads(capsys.readouterr().out)["error"].startswith(f"cannot read {bad}")


def test_the_gradebook_has_a_row_per_notebook_and_a_column_per_exercise():
    """Submissions of two exercise sets share one sheet: a column for every exercise, blank
    where a notebook has none, the first line of each failure; a notebook that could not be
    graded keeps its row (with why), in the order the notebooks were given."""
    R, E = grade.GradeReport, grade.ExerciseResult
    failed = E("static_finish_steps", 0, 1, False, "CheckFailed: R2 finishes at 9\nmore")
    alice = R("alice.ipynb", [E("static_batch", 1, 1, True), failed], seconds=12.34,
              source="02_static_batching")
    bob = R("bob.ipynb", [E("page_pool", 1, 1, True), E("quantize_int8", 0.5, 1, False, ""),
                          E("match_prefix", 0, 1, False, "NotImplementedError: write it",
                            attempted=False)],
            source="01_paged_kv", notes=["kernel died"])
    rows = grade.gradebook([alice, bob], {"carol.ipynb": "cannot read carol.ipynb"},
                           order=["carol.ipynb", "bob.ipynb", "alice.ipynb"])
    assert [r["notebook"] for r in rows] == ["carol.ipynb", "bob.ipynb", "alice.ipynb"]
    assert list(rows[0]) == ["notebook", "source", "score", "max_score", "page_pool",
                             "quantize_int8", "match_prefix", "static_batch",
                             "static_finish_steps", "seconds", "error", "not_attempted",
                             "feedback", "notes"]  # exercises in the sources' order
    carol, bob_row, alice_row = rows
    assert carol["error"] == "cannot read carol.ipynb" and carol["score"] == ""
    assert (bob_row["score"], bob_row["max_score"], bob_row["quantize_int8"]) == (1.5, 3, 0.5)
    assert bob_row["not_attempted"] == "match_prefix" and alice_row["not_attempted"] == ""
    assert bob_row["static_batch"] == "" and bob_row["notes"] == "kernel died"
    assert (alice_row["score"], alice_row["page_pool"], alice_row["seconds"]) == (1, "", 12.3)
    assert alice_row["feedback"] == "static_finish_steps: CheckFailed: R2 finishes at 9"
    assert [r["notebook"] for r in grade.gradebook([alice, bob])] == ["alice.ipynb", "bob.ipynb"]


@pytest.mark.slow
def test_a_class_is_graded_two_at_a_time_into_a_gradebook(tmp_path, capfd):
    """`--jobs 2 --csv` on a folder of submissions (one folder per student, Jupyter's
    checkpoint copies left out): each notebook graded in its own process, reports printed in
    name order, a spreadsheet with every submission, the unreadable one included. The kernels
    talk over Unix sockets: no warning per kernel that TCP is unencrypted."""
    folder = tmp_path / "submissions"
    for student, source in [("alice", "solutions"), ("bob", "exercises")]:
        (folder / student).mkdir(parents=True)
        shutil.copy(ROOT / source / EXPECTED[student == "bob"], folder / student)
    (folder / "carol").mkdir()
    (folder / "carol" / EXPECTED[0]).write_text("{not json")
    (folder / "alice" / ".ipynb_checkpoints").mkdir()
    (folder / "alice" / ".ipynb_checkpoints" / "old-checkpoint.ipynb").write_text("{not json")
    paths = [str(folder / s / EXPECTED[s == "bob"]) for s in ("alice", "bob", "carol")]
    book = tmp_path / "gradebook.csv"
    assert grade.main([str(folder), "--jobs", "2", "--csv", str(book), "--timeout", "60"]) == 2
    out, err = capfd.readouterr()
    assert out.index("alice") < out.index("bob") and "total: 4/4" in out
    assert "without encryption" not in err and "gradebook: " in err
    with open(book, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    assert [r["notebook"] for r in rows] == paths
    alice, bob, carol = rows
    assert (alice["source"], alice["score"], alice["page_pool"]) == ("01_paged_kv", "4", "1")
    assert alice["static_batch"] == "" and bob["page_pool"] == ""
    assert bob["source"] == Path(EXPECTED[1]).stem and bob["score"] == "0"
    assert bob["static_batch"] == "0" and "static_batch: NotImplementedError" in bob["feedback"]
    assert carol["score"] == "" and carol["error"].startswith("cannot read")
    with pytest.raises(SystemExit):
        grade.main([paths[0], "--jobs", "0"])
    with pytest.raises(SystemExit):
        grade.main([paths[0], "--csv", paths[1]])  # would overwrite a notebook
    with pytest.raises(SystemExit):
        grade.main([str((tmp_path / "empty").mkdir() or tmp_path / "empty")])  # no notebook


def test_each_notebook_is_graded_once_and_the_gradebook_is_safe_in_a_spreadsheet(tmp_path):
    """A folder and a file in it, or `a.ipynb` and `./a.ipynb`, name one notebook: graded once.
    The CSV starts with a byte-order mark (a spreadsheet on Windows then reads UTF-8), and a
    cell that would run as a formula (a file named `=HYPERLINK(...)`) is written as text."""
    folder = tmp_path / "class"
    (folder / "a").mkdir(parents=True)
    for name in ("a/x.ipynb", "b.ipynb"):
        (folder / name).write_text("{}")
    found = grade.notebooks_in([folder / "a" / "x.ipynb", folder, folder / "a" / ".." / "b.ipynb"])
    assert found == [folder / "a" / "x.ipynb", folder / "b.ipynb"]
    book = tmp_path / "book.csv"
    rows = grade.gradebook([grade.GradeReport("=HYPERLINK(\"http://x\").ipynb", source="é")],
                           {"-bad.ipynb": "+cannot read"})
    grade.write_gradebook(book, rows)
    raw = book.read_bytes()
    assert raw.startswith(b"\xef\xbb\xbf")
    with open(book, newline="", encoding="utf-8-sig") as f:
        first, second = csv.DictReader(f)
    assert first["notebook"] == "'=HYPERLINK(\"http://x\").ipynb" and first["source"] == "é"
    assert second["notebook"] == "'-bad.ipynb" and second["error"] == "'+cannot read"
    with pytest.raises(SystemExit):  # checked before grading, so no run is lost
        grade.main([str(folder), "--csv", str(tmp_path / "no-such-folder" / "book.csv")])


def test_kernels_use_unix_sockets_unless_the_path_is_too_long(tmp_path):
    short = grade.kernel_config(tmp_path)
    assert short.KernelManager.transport == "ipc"
    assert short.KernelManager.ip == str(tmp_path / "kernel")
    long_path = tmp_path / ("x" * 100)  # a socket path past ~107 bytes cannot be bound
    assert "transport" not in grade.kernel_config(long_path).KernelManager


def test_a_kernel_that_ran_no_cell_is_not_a_score_of_zero(tmp_path, monkeypatch, capsys):
    """A kernel that never started (a socket it could not bind, a broken environment) is an
    error row, not zeros for a student."""
    path = tmp_path / EXPECTED[1]
    shutil.copy(ROOT / "solutions" / EXPECTED[1], path)
    monkeypatch.setattr(grade, "execute",
                        lambda nb, workdir, timeout: ["execution stopped: ZMQError: too long"])
    with pytest.raises(grade.GradeError, match="its kernel ran no cell .*ZMQError"):
        grade.grade_notebook(path)
    assert grade.main([str(path), "--json"]) == 2
    entry = json.loads(capsys.readouterr().out)  # an error entry, not a list without it
    assert entry["notebook"] == str(path) and "ran no cell" in entry["error"]


def test_an_interrupted_run_stops_and_keeps_what_was_graded(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the second of three notebooks runs: the first keeps its score, the others
    are rows saying they were not graded, the exit status is 130, nothing more is graded."""
    for i in range(3):
        shutil.copy(ROOT / "solutions" / EXPECTED[1], tmp_path / f"s{i}.ipynb")
    calls = []
    fake = fake_execute({})

    def execute(nb, workdir, timeout):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return fake(nb, workdir, timeout)

    monkeypatch.setattr(grade, "execute", execute)
    book = tmp_path / "book.csv"
    assert grade.main([str(tmp_path), "--csv", str(book), "--source",
                       str(ROOT / "exercises" / "source" / EXPECTED[1])]) == 130
    assert len(calls) == 2
    with open(book, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    assert [(r["score"], r["error"]) for r in rows] == [
        ("2", ""), ("", "not graded: the run was interrupted (Ctrl-C)"),
        ("", "not graded: the run was interrupted (Ctrl-C)")]


@pytest.mark.slow
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_stops_a_real_grading_run_at_once(tmp_path, jobs):
    """A teacher's Ctrl-C reaches the grader, its workers and their kernels (one process
    group). nbclient takes SIGINT to shut its kernel down; the grader then stops instead of
    scoring that notebook 0 and going on, and with --jobs stops its workers."""
    import signal
    import subprocess
    import sys

    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    started = tmp_path / "started"
    nb.cells.insert(1, nbformat.v4.new_code_cell(
        f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(60)"))
    for i in range(3):
        nbformat.write(nb, tmp_path / f"s{i}.ipynb")
    book = tmp_path / "book.csv"
    run = subprocess.Popen(
        [sys.executable, "-m", "minicb", "grade", *(str(tmp_path / f"s{i}.ipynb")
                                                   for i in range(3)),
         "--jobs", jobs, "--csv", str(book), "--source",
         str(ROOT / "exercises" / "source" / EXPECTED[0])],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    os.killpg(run.pid, signal.SIGINT)
    t0 = time.monotonic()
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err.decode()[-2000:]
    assert time.monotonic() - t0 < 30  # not after the 60 s cells, nor the other notebooks
    with open(book, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and all(r["error"].startswith("not graded: the run was interrupted")
                                  for r in rows)


def test_minicbs_own_function_is_not_an_answer():
    assert "minicb's own" in caught("prefix_hashes", kv_cache.prompt_page_hashes)
    assert "minicb's own" in caught("quantize_int8", quant.quantize_rows)


def _minicbs_own_behind_a_lambda():
    """A wrong 'answer' per function exercise: minicb's own version, called from a lambda or a
    subclass (handing over the function itself was refused before; a wrapper passed)."""
    from minicb import SamplingParams
    from minicb.attention import build_metadata, torch_ref
    from minicb.benchmark import metrics
    from minicb.speculative import NgramIndex, verify

    class InheritedPool(kv_cache.PagePool):
        def __init__(self, num_pages):
            super().__init__(num_pages, 16)

    def greedy_verify(draft, target):
        logits = torch.full((len(target), max(target + draft) + 1), -1.0)
        logits[torch.arange(len(target)), torch.tensor(target)] = 1.0
        return verify(logits, draft, SamplingParams(temperature=0.0), None)

    def long_metric(key):
        return lambda t, r, long_id: metrics.long_prefill_metrics(t, r, long_id)[key]

    return {
        "page_pool": InheritedPool,
        "prefix_hashes": lambda tokens, ps: kv_cache.prompt_page_hashes(tokens, ps),
        "quantize_int8": lambda w: quant.quantize_rows(w),
        "dec_at_p": long_metric("dec_at_p"),
        "short_p": long_metric("short_p_steps"),
        "latencies": lambda r: {"queue": metrics.queue_time(r), "ttft": metrics.ttft(r),
                                "tpot": metrics.tpot(r), "e2e": metrics.e2e(r)},
        "goodput": lambda records, slo: metrics.summarize([], records, slo=slo)["goodput_rps"],
        "slot_mapping": lambda table, computed, new, ps:
            build_metadata([table], [computed], [new], ps).slot_mapping.tolist(),
        "paged_attention": lambda q, k, v, table, computed, scale: torch_ref.attend(
            q, k, v, build_metadata([table], [computed], [q.shape[0]], k.shape[1]), scale),
        "prompt_lookup": lambda ids, k, n_max, n_min: NgramIndex(n_max, n_min).propose(ids, k),
        "verify_greedy": greedy_verify,
    }


@pytest.mark.parametrize("exercise", ["page_pool", "prefix_hashes", "quantize_int8", "dec_at_p",
                                      "short_p", "latencies", "goodput", "slot_mapping",
                                      "paged_attention", "prompt_lookup", "verify_greedy"])
def test_minicbs_own_version_behind_a_wrapper_is_not_an_answer(exercise):
    message = caught(exercise, _minicbs_own_behind_a_lambda()[exercise])
    assert "your code ran minicb's own" in message, message


def test_minicbs_building_blocks_of_6_1_and_6_2_are_not_an_answer():
    """Found by an audit: goodput from `metrics.meets_slo` over `metrics.run_span`, and TTFT and
    E2E from `metrics.first_token_seen` and `metrics.released`, passed: those helpers are the
    whole of exercises 6.2 and 6.1."""
    from minicb.benchmark import metrics

    def goodput(records, slo):
        span = metrics.run_span(records)
        return sum(metrics.meets_slo(r, slo) for r in records) / span if span > 0 else None

    def latencies(r):
        def since(t):
            return None if t is None or r.arrival_time is None else t - r.arrival_time
        tpot = None
        if r.num_output_tokens >= 2 and r.first_token_time is not None \
                and r.finish_time is not None:
            tpot = (r.finish_time - r.first_token_time) / (r.num_output_tokens - 1)
        return {"queue": since(r.first_scheduled_time), "tpot": tpot,
                "ttft": since(metrics.first_token_seen(r)[0]), "e2e": since(metrics.released(r)[0])}

    for exercise, answer in (("goodput", goodput), ("latencies", latencies)):
        message = caught(exercise, answer)
        assert "your code ran minicb's own" in message, message


def test_minicbs_own_scheduler_is_not_an_answer():
    """minicb's policy, however it is reached (the class itself, a subclass that does not
    override, a call through it, a copied function, an error swallowed), fails the check and
    names what ran; minicb's functions are themselves again afterwards, and the building
    blocks the exercises offer (schedule_decodes; schedule_prefill_chunks in 5.1) still pass."""
    from minicb import scheduler as S

    class Subclass(S.ContinuousScheduler):
        pass

    class Delegates(S.Scheduler):
        def schedule(self, ctx):
            return S.ChunkedScheduler().schedule(ctx)

    class Swallows(S.Scheduler):
        def schedule(self, ctx):
            try:
                return S.PDScheduler.schedule(self, ctx)
            except Exception:
                return ctx.batch

    class UsesTheChunkLoop(S.Scheduler):  # fine in 5.1, not in 4.2 which asks for the loop
        def schedule(self, ctx):
            S.schedule_prefill_chunks(ctx, ctx.config.max_num_batched_tokens)
            if not ctx.batch.items:
                self.schedule_decodes(ctx)
            return ctx.batch

    copied = type("Copied", (S.Scheduler,), {"schedule": S.ContinuousScheduler.schedule})
    cases = [("continuous_scheduler", S.ContinuousScheduler, "ContinuousScheduler.schedule"),
             ("continuous_scheduler", Subclass, "ContinuousScheduler.schedule"),
             ("continuous_scheduler", copied, "ContinuousScheduler.schedule"),
             ("chunked_scheduler", Delegates, "ChunkedScheduler.schedule"),
             ("chunked_scheduler", UsesTheChunkLoop, "schedule_prefill_chunks"),
             ("pd_scheduler", Swallows, "PDScheduler.schedule")]
    for exercise, learner, name in cases:
        assert f"your scheduler ran minicb's own {name}:" in caught(exercise, learner), name
    assert S.ContinuousScheduler.schedule.__code__.co_name == "schedule"
    assert S.schedule_prefill_chunks.__code__.co_name == "schedule_prefill_chunks"
    assert not hasattr(S, check.TRIPPED)
    assert check.pd_scheduler(solution("05_pd_interleaving.ipynb")["MyPDScheduler"])


def untagged(nb):
    """The notebook with every cell tag removed (ids and sources kept)."""
    for cell in nb.cells:
        cell.get("metadata", {}).pop("tags", None)
    return nb


def test_a_notebook_is_identified_by_its_content():
    """A renamed submission still names its source: by its tags and check calls, and with
    every tag stripped and every check cell replaced, by the cells it left as they were."""
    for folder in ("exercises", "solutions"):
        for name in EXPECTED:
            nb = nbformat.read(ROOT / folder / name, as_version=4)
            source = ROOT / "exercises" / "source" / name
            assert grade.source_for(ROOT / "submissions" / "alice.ipynb", nb) == source
            for index in tagged(nb, "check").values():
                nb.cells[index].source = "print('✓ passed')"
            assert grade.identify_source(untagged(nb)) == source, (folder, name)
    chapter = nbformat.read(ROOT / "chapters" / "04_chunked_prefill.ipynb", as_version=4)
    assert grade.identify_source(chapter) is None
    mixed = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "check.next_chunk(next_chunk)\ncheck.latencies(latencies)")])
    assert grade.identify_source(mixed) is None  # two sources tie: refuse to guess


def test_restore_checks_puts_the_sources_check_cells_back():
    """In memory, no kernel: an edited check cell gets the source's text back, an untagged
    one is found by its id, a deleted one is put back after its exercise's cell, and one
    deleted with that cell is reported missing."""
    source = nbformat.read(ROOT / "exercises" / "source" / EXPECTED[0], as_version=4)
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    checks = tagged(source, "check")
    first, second, third, fourth = checks
    nb.cells[checks[first]].source = "print('✓ passed')"
    nb.cells[checks[second]].metadata["tags"] = []
    nb.cells[checks[second]].source = "pass"
    del nb.cells[checks[fourth]], nb.cells[checks[fourth] - 1]  # check and stub
    del nb.cells[checks[third]]
    expected, notes = grade.restore_checks(nb, source)
    assert [name for name, _ in expected] == list(checks)
    restored = {name: nb.cells[i].source for i, name, _ in grade.check_cells(nb)}
    assert restored[first] == source.cells[checks[first]].source
    assert restored[second] == source.cells[checks[second]].source
    assert restored[third] == source.cells[checks[third]].source
    at = {name: i for i, name, _ in grade.check_cells(nb)}
    assert tagged(nb, "exercise")[third] == at[third] - 1
    assert fourth not in restored
    assert f"check cell of {fourth!r} is missing: that exercise scores 0" in notes


def test_a_check_cell_retagged_as_another_exercise_serves_only_that_one():
    """A learner re-tags the first check cell as the second exercise's and deletes the
    second's: that cell is the second exercise's check (restored), and the first exercise's
    check is put back after its own cell. Finding the first by its cell id as well would make
    one cell stand for two exercises (a survivor of the fourth mutation review)."""
    source = nbformat.read(ROOT / "exercises" / "source" / EXPECTED[0], as_version=4)
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    checks = tagged(source, "check")
    first, second, *_ = checks
    nb.cells[checks[first]].metadata["tags"] = [f"check:{second}"]
    del nb.cells[checks[second]]
    _, notes = grade.restore_checks(nb, source)
    restored = {name: i for i, name, _ in grade.check_cells(nb)}
    assert restored[first] != restored[second]
    assert restored[first] == tagged(nb, "exercise")[first] + 1
    assert f"check cell of {first!r} was not found: put back after the exercise's own cell, " \
        "restored from the source" in notes
    assert nb.cells[restored[second]].source == source.cells[checks[second]].source


def test_a_notebook_saved_under_another_exercises_name_is_graded_as_what_it_holds():
    """Exercise 3's work saved as 02_static_batching.ipynb names only exercise 3's checks: it
    is graded as exercise 3. A file that names its own exercises keeps its name's source."""
    source = ROOT / "exercises" / "source"
    for folder in ("exercises", "solutions"):
        nb = nbformat.read(ROOT / folder / EXPECTED[2], as_version=4)
        assert grade.source_for(ROOT / "submissions" / EXPECTED[1], nb) == source / EXPECTED[2]
        own = nbformat.read(ROOT / folder / EXPECTED[1], as_version=4)
        assert grade.source_for(ROOT / "submissions" / EXPECTED[1], own) == source / EXPECTED[1]
        own.cells += nb.cells  # both exercises' cells: its name decides
        assert grade.source_for(ROOT / "submissions" / EXPECTED[1], own) == source / EXPECTED[1]


@pytest.mark.slow
def test_endless_printing_is_capped(tmp_path):
    """A cell that prints 6 MB keeps about MAX_CELL_OUTPUT characters and a note; the cells
    after it run and keep their output."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("for i in range(60_000):\n    print('x' * 99)"),
        nbformat.v4.new_code_cell("print('after')")])
    assert grade.execute(nb, tmp_path, timeout=60) == []
    first = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert grade.MAX_CELL_OUTPUT - 10_000 < len(first) < grade.MAX_CELL_OUTPUT + 200
    assert "output past 1,000,000 characters dropped" in first
    assert [o.get("text") for o in nb.cells[1].outputs] == ["after\n"]


def test_a_notebook_of_unknown_source_is_refused(tmp_path, capsys):
    """No source, no grade: the grader never scores a notebook by its own check cells."""
    nb = nbformat.read(ROOT / "chapters" / "04_chunked_prefill.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("print('✓ passed')",  # a check of its own
                                              metadata={"tags": ["check:homework"]}))
    path = tmp_path / "alice.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(grade.GradeError, match="--source"):
        grade.grade_notebook(path)
    assert grade.main([str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["notebook"] == str(path)
    assert "cannot tell which exercise notebook" in captured.err and "--source" in captured.err
    missing = tmp_path / "nowhere.ipynb"
    with pytest.raises(grade.GradeError, match="cannot read the source"):
        grade.grade_notebook(path, source=missing)


@pytest.mark.slow
def test_a_renamed_tampered_submission_scores_zero(tmp_path, capsys):
    """Check cells replaced by a print in a notebook named alice.ipynb, no --source: the
    source is found from the content, the checks are restored, the stubs score 0."""
    nb = nbformat.read(ROOT / "exercises" / EXPECTED[1], as_version=4)
    checks = tagged(nb, "check")
    for index in checks.values():
        nb.cells[index].source = "print('✓ passed')"
    path = tmp_path / "alice.ipynb"
    nbformat.write(nb, path)
    assert grade.main([str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in data["exercises"]] == list(checks)
    assert data["score"] == 0 and data["max_score"] == len(checks)
    assert all(e["message"].startswith("NotImplementedError: ") for e in data["exercises"])
    assert f"check cells restored from exercises/source/{EXPECTED[1]}" in data["notes"]
    for name in checks:
        assert f"check cell of {name!r} was edited: restored from the source" in data["notes"]


@pytest.mark.slow
def test_a_removed_check_tag_does_not_drop_the_exercise(tmp_path):
    """Untagged check cells are found by their cell id and restored; one that lost its tag,
    its id and its text is put back after its exercise's cell, never left out of the report."""
    nb = untagged(nbformat.read(ROOT / "solutions" / EXPECTED[1], as_version=4))
    source = nbformat.read(ROOT / "exercises" / "source" / EXPECTED[1], as_version=4)
    checks = tagged(source, "check")
    first, second = checks  # static_batch, static_finish_steps
    nb.cells[checks[first]].source = "print('✓ passed')"  # untagged and edited: restored
    nb.cells[checks[second]]["id"] = "mine"  # untagged, new id, new text: cannot be found
    nb.cells[checks[second]].source = "pass"
    path = tmp_path / "carol.ipynb"
    nbformat.write(nb, path)
    report = grade.grade_notebook(path)
    by_name = {e.name: e for e in report.exercises}
    assert list(by_name) == [first, second], grade.format_report(report)
    assert by_name[first].passed and by_name[second].passed
    assert f"check cell of {first!r} had lost its tag: found by its cell id, restored from " \
           "the source" in report.notes
    assert f"check cell of {second!r} was not found: put back after the exercise's own cell, " \
           "restored from the source" in report.notes


@pytest.mark.slow
def test_an_earlier_cell_cannot_patch_the_checks_away(tmp_path):
    """A cell that replaces `check.pd_scheduler` changes nothing (the check cell loads a fresh
    minicb.course.check), and one that silences errors scores 0 (the check never printed its mark);
    the same patches leave a solution notebook at full marks."""
    for folder, full in (("exercises", False), ("solutions", True)):
        nb = nbformat.read(ROOT / folder / EXPECTED[4], as_version=4)
        stubs = tagged(nb, "exercise")
        nb.cells.insert(stubs["dec_at_p"], nbformat.v4.new_code_cell(
            "get_ipython().set_custom_exc((Exception,), lambda *a, **k: None)"))
        nb.cells.insert(stubs["pd_scheduler"], nbformat.v4.new_code_cell(
            'setattr(check, "pd_scheduler", lambda *a, **k: None)\n'
            "import minicb.course.check\nminicb.check.pd_scheduler = check.pd_scheduler"))
        path = tmp_path / EXPECTED[4]
        nbformat.write(nb, path)
        report = grade.grade_notebook(path)
        by_name = {e.name: e for e in report.exercises}
        assert list(by_name) == ["pd_scheduler", "dec_at_p", "short_p"]
        if full:
            assert report.score == report.max_score == 4, grade.format_report(report)
            continue
        assert report.score == 0, grade.format_report(report)
        assert by_name["pd_scheduler"].message.startswith("NotImplementedError: write ")
        for name in ("dec_at_p", "short_p"):
            assert "did not run to its end" in by_name[name].message


def test_static_batch_reference_matches_the_engines_first_batch():
    """The check's reference for exercise 2.1 is what minicb's static policy admits."""
    import random

    from minicb import Engine, SamplingParams
    from minicb.course.check import _reference_static_batch, tiny_model

    rng = random.Random(5)
    for _ in range(12):
        page_size, num_pages = rng.choice([4, 8, 16]), rng.randint(1, 12)
        max_num_seqs = rng.randint(1, 5)
        queue = [(f"r{i}", rng.randint(1, min(60, num_pages * page_size - 1)))
                 for i in range(rng.randint(1, 7))]
        engine = Engine(tiny_model(), policy="static", page_size=page_size, num_pages=num_pages,
                        max_num_seqs=max_num_seqs, enable_prefix_caching=False)
        for i, (rid, n) in enumerate(queue):
            engine.add_request([(7 * i + j) % 200 + 3 for j in range(n)],
                               SamplingParams(max_tokens=1, temperature=0.0), request_id=rid)
        first = engine.step()
        admitted = [m.request_id for m in first.members]
        assert admitted == _reference_static_batch(queue, max_num_seqs, num_pages, page_size)


def test_paged_attention_mistakes_are_named():
    """Each typical mistake fails with its own hint; the hints' variants are built by the
    check itself, so this also proves the variant without a mistake is minicb's attention."""
    from minicb.course.check import _attention_variant

    correct = solution("07_paged_attention.ipynb")["paged_attention"]
    assert check.paged_attention(lambda *a: _attention_variant(*a)) is True
    for mistake, hint in ((dict(causal=False), "must not see the positions after its own"),
                          (dict(causal="top-left"), "SDPA's is_causal=True aligns its mask"),
                          (dict(heads="modulo"), "kv head h // (num_heads // num_kv_heads)"),
                          (dict(paged=False), "look each position's page up in page_table"),
                          (dict(new_in_context=False), "this step's tokens are in the cache")):
        assert hint in caught("paged_attention",
                              lambda *a, m=mistake: _attention_variant(*a, **m))
    assert "by scale" in caught("paged_attention", lambda q, k, v, t, n, s: correct(q, k, v, t,
                                                                                   n, 1.0))

    def sdpa_is_causal(q, k_cache, v_cache, page_table, num_computed, scale):
        num_new, heads, dim = q.shape
        page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        pos = torch.arange(num_computed + num_new)
        slots = torch.tensor(page_table)[pos // page_size] * page_size + pos % page_size
        k = k_cache.reshape(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, 1)
        v = v_cache.reshape(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, 1)
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            scale=scale).transpose(0, 1)

    assert "SDPA's is_causal=True" in caught("paged_attention", sdpa_is_causal)
    assert "[num_new, num_heads, head_dim]" in caught(
        "paged_attention", lambda q, k, v, t, n, s: correct(q, k, v, t, n, s)[-1])


def test_slot_mapping_mistakes_are_named():
    def positions(table, num_computed, num_new, page_size):
        return list(range(num_computed, num_computed + num_new))

    def from_zero(table, num_computed, num_new, page_size):
        return [table[p // page_size] * page_size + p % page_size for p in range(num_new)]

    def numpy_ids(table, num_computed, num_new, page_size):  # numpy integers are fine
        pos = np.arange(num_computed, num_computed + num_new)
        return list(np.asarray(table)[pos // page_size] * page_size + pos % page_size)

    def pages_not_slots(table, num_computed, num_new, page_size):
        return [table[p // page_size] + p % page_size
                for p in range(num_computed, num_computed + num_new)]

    assert "Those are the positions" in caught("slot_mapping", positions)
    assert "counts pages, not slots" in caught("slot_mapping", pages_not_slots)
    assert "come after the" in caught("slot_mapping", from_zero)
    assert check.slot_mapping(numpy_ids) is True


def test_prompt_lookup_and_verification_mistakes_are_named():
    """Each mistake's hint fires on it alone (a variant that also gets every earlier case
    right); the variant without a mistake is minicb's propose_ngram on 3,000 sequences."""
    import random

    from minicb.course.check import _lookup_variant
    from minicb.speculative import propose_ngram

    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randint(1, rng.choice([2, 3, 6])) for _ in range(rng.randint(1, 25))]
        n_max, k = rng.randint(1, 4), rng.randint(1, 5)
        n_min = rng.randint(1, n_max)
        assert _lookup_variant(ids, k, n_max, n_min) == propose_ngram(ids, k, n_max, n_min)
    for mistake, hint in ((dict(pick="earliest"), "take the latest earlier occurrence"),
                          (dict(pick="latest"), "take the earliest instead"),
                          (dict(pick="latest roomy"), "not the latest of those that have k"),
                          (dict(include_last=True), "match themselves"),
                          (dict(include_last=True, uncapped=True), "n is at most len"),
                          (dict(shorter=False), "down to n_min")):
        message = caught("prompt_lookup", lambda *a, m=mistake: _lookup_variant(*a, **m))
        assert hint in message and message.count("It looks like") == 1, (mistake, message)

    def latest_with_room(token_ids, k, n_max, n_min):  # the other reading of the rule
        for n in range(min(n_max, len(token_ids) - 1), n_min - 1, -1):
            hits = [i for i in range(len(token_ids) - n) if token_ids[i:i + n] == token_ids[-n:]]
            if hits:
                roomy = [i for i in hits if i + n + k <= len(token_ids)]
                start = roomy[-1] if roomy else hits[0]
                return token_ids[start + n:start + n + k]
        return []
    assert "not the latest of those that have k" in caught("prompt_lookup", latest_with_room)

    def self_matching(token_ids, k, n_max, n_min):  # a learner's own loop, n capped right
        for n in range(min(n_max, len(token_ids) - 1), n_min - 1, -1):
            hits = [i for i in range(len(token_ids) - n + 1)
                    if token_ids[i:i + n] == token_ids[-n:]]
            if hits:
                start = hits[-1] if hits[-1] + n + k <= len(token_ids) else hits[0]
                return token_ids[start + n:start + n + k]
        return []
    def loops_on_long_inputs(token_ids, k, n_max, n_min):  # wrong first, endless later
        while len(token_ids) > 8:
            pass
        return []
    started = time.perf_counter()
    assert "expected [7, 8], got []" in caught("prompt_lookup", loops_on_long_inputs)
    assert time.perf_counter() - started < 30  # not the grader's timeout

    # its first wrong answer is also what "no shorter n" gives: all its answers tell them apart
    message = caught("prompt_lookup", self_matching)
    assert "match themselves" in message and "down to n_min" not in message
    assert "minicb's own" in caught("prompt_lookup", propose_ngram)

    verify = solution("08_speculative_decoding.ipynb")["verify_greedy"]
    assert "never yields fewer than one token" in caught(
        "verify_greedy", lambda d, t: verify(d, t)[:-1])
    from minicb.course.check import _verify_variant
    assert "Stop at the first guess" in caught(
        "verify_greedy", lambda d, t: _verify_variant(d, t, "no stop"))
    assert "target[accepted], not the last row's" in caught(
        "verify_greedy", lambda d, t: _verify_variant(d, t, "last row"))
    assert "not the rejected guess" in caught(
        "verify_greedy", lambda d, t: _verify_variant(d, t, "the guess"))
    # one too many (it did stop at the first disagreement): no hint rather than a wrong one
    message = caught("verify_greedy", lambda d, t: t[:len(verify(d, t)) + 1])
    assert "Stop at the first guess" not in message and "last row" not in message
    # tensors, arrays and tuples of the right ints are right answers
    assert check.verify_greedy(lambda d, t: torch.tensor(verify(d, t))) is True
    assert check.prompt_lookup(lambda *a: np.array(_lookup_variant(*a), dtype=np.int64)) is True
    slots = solution("07_paged_attention.ipynb")["slot_mapping"]
    assert check.slot_mapping(lambda *a: torch.tensor(slots(*a))) is True


def test_exercise_demos_print_what_their_text_says(capsys):
    """The demos of exercises 07 and 08 run on the solutions (stored without outputs, so nbval
    compares nothing there)."""
    for notebook, cell_id in (("07_paged_attention.ipynb", "ex07-demo-code"),
                              ("08_speculative_decoding.ipynb", "ex08-demo-code")):
        namespace = solution(notebook)
        cell = next(c for c in nbformat.read(ROOT / "solutions" / notebook,
                                             as_version=4).cells if c.get("id") == cell_id)
        exec(compile(cell.source, f"{notebook}:{cell_id}", "exec"), namespace)
    out = capsys.readouterr().out
    difference = float(re.search(r"largest difference from dense attention (\S+)", out)[1])
    assert difference < 1e-5
    assert "30 tokens in 8 steps (22 guesses kept); same answer: True" in out



def fake_execute(outcome: dict[str, str]):
    """A stand-in for `grade.execute` (no kernel): every code cell counts as run. A cell tagged
    `check:<name>` or `exercise:<name>` does what `outcome[tag]` says: "pass" (a check cell's
    default) prints the grader's mark (a restored check cell's last line) or, unrestored,
    "passed"; "silent" ends with no mark and no error (an earlier cell swallowed errors);
    any other value is the error it raises, "Name: message"."""
    def execute(nb, workdir, timeout):
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            cell.execution_count = i + 1
            tag = next((t for t in cell_tags(cell) if t.startswith(("check:", "exercise:"))),
                       "")
            what = outcome.get(tag, "pass" if tag.startswith("check:") else "silent")
            if what == "pass":
                mark = re.search(r"print\('(minicb-grade-check-done:[^']*)'\)\s*$",
                                 cell.source)
                cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=(
                    mark.group(1) if mark else "passed") + "\n")]
            elif what != "silent":
                ename, _, evalue = what.partition(": ")
                cell.outputs = [nbformat.v4.new_output("error", ename=ename, evalue=evalue,
                                                       traceback=[])]
        return []
    return execute


def test_scores_follow_the_check_cells_marks_and_points(tmp_path, monkeypatch):
    """In memory, no kernel: a passing check earns its `points:<n>` (pd_scheduler is worth 2),
    a failing one 0 with its error, and one that ended without printing the grader's mark
    (errors silenced by an earlier cell) 0, even though it raised nothing."""
    name = EXPECTED[4]  # pd_scheduler (2 points), dec_at_p, short_p
    path = tmp_path / name
    shutil.copy(ROOT / "solutions" / name, path)
    monkeypatch.setattr(grade, "execute", fake_execute({
        "check:dec_at_p": "CheckFailed: wrong answer", "check:short_p": "silent"}))
    report = grade.grade_notebook(path)
    got = {e.name: (e.points, e.max_points, e.passed) for e in report.exercises}
    assert got == {"pd_scheduler": (2, 2, True), "dec_at_p": (0, 1, False),
                   "short_p": (0, 1, False)}
    assert (report.score, report.max_score) == (2, 4)
    by_name = {e.name: e for e in report.exercises}
    assert by_name["dec_at_p"].message == "CheckFailed: wrong answer"
    assert "did not run to its end" in by_name["short_p"].message
    assert "total: 2/4" in grade.format_report(report)
    # --no-restore: no mark is asked for, so the silent check passes (proves nothing)
    assert grade.grade_notebook(path, restore=False).score == 3


def test_a_killed_kernel_is_restarted_with_its_cell_raising_at_most_max_restarts_times(
        tmp_path, monkeypatch):
    """In memory, no kernel: each run that ends with a killed kernel is followed by a run in
    which that cell raises TimeoutError; the notes name each killed cell (an exercise's check
    cell by its exercise's name); after MAX_RESTARTS restarts the run is graded as stopped."""
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    stub = tagged(nb, "exercise")["match_prefix"]
    check_cell = tagged(nb, "check")["quantize_int8"]
    runs = []

    def run_kernel(nb, workdir, timeout):
        runs.append([c.source for c in nb.cells])
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran")]
            if i in (stub, check_cell) and not cell.source.startswith("raise TimeoutError"):
                return i, "ignored the interrupt at 9 s and its kernel was killed"
        return None, None

    monkeypatch.setattr(grade, "_run_kernel", run_kernel)
    first_line = nb.cells[stub].source.strip().splitlines()[0]
    notes = grade.execute(nb, tmp_path, 9)
    assert len(runs) == 3 and notes == [
        f"cell {stub + 1} ({first_line[:60]!r}) ignored the interrupt at 9 s and its kernel "
        "was killed; the notebook was run again in a fresh kernel with that cell raising "
        "TimeoutError",
        "the check cell of 'quantize_int8' ignored the interrupt at 9 s and its kernel was "
        "killed; the notebook was run again in a fresh kernel with that cell raising "
        "TimeoutError"]
    assert runs[1][stub].startswith("raise TimeoutError") and runs[1][check_cell] == \
        runs[0][check_cell]
    assert nb.cells[check_cell].source.startswith("raise TimeoutError('minicb grade: this "
                                                  "cell ignored the interrupt at 9 s")
    # no restarts left: the last run is reported as stopped and nothing is replaced
    nb = nbformat.read(ROOT / "solutions" / EXPECTED[0], as_version=4)
    runs.clear()
    monkeypatch.setattr(grade, "MAX_RESTARTS", 0)
    notes = grade.execute(nb, tmp_path, 9)
    assert len(runs) == 1 and notes == [
        f"execution stopped: cell {stub + 1} ({first_line[:60]!r}) ignored the interrupt at 9 "
        "s and its kernel was killed"]
    assert not nb.cells[stub].source.startswith("raise")


def test_a_failed_check_names_the_learners_own_error_only_when_it_caused_it(tmp_path,
                                                                              monkeypatch):
    """A check failing with NameError after the exercise's own cell raised reports that
    earlier error (the name was never defined because of it); a check failing on its own
    (CheckFailed) reports its own message, whatever failed before it."""
    path = tmp_path / EXPECTED[0]  # page_pool, prefix_hashes, match_prefix, quantize_int8
    shutil.copy(ROOT / "solutions" / EXPECTED[0], path)
    monkeypatch.setattr(grade, "execute", fake_execute({
        "exercise:prefix_hashes": "ZeroDivisionError: division by zero",
        "check:prefix_hashes": "NameError: name 'prompt_page_hashes' is not defined",
        "exercise:match_prefix": "TypeError: bad operand",
        "check:match_prefix": "CheckFailed: match_prefix([1, 2]) returned 3, expected 2",
        "check:quantize_int8": "KeyboardInterrupt: "}))
    messages = {e.name: e.message for e in grade.grade_notebook(path, timeout=7).exercises}
    assert messages["page_pool"] == ""
    assert messages["prefix_hashes"] == ("ZeroDivisionError: division by zero  (then the check "
                                         "failed with NameError)")
    assert messages["match_prefix"] == "CheckFailed: match_prefix([1, 2]) returned 3, expected 2"
    assert messages["quantize_int8"].startswith("KeyboardInterrupt: a cell ran longer than 7 s")


def test_json_is_a_list_whenever_several_notebooks_were_asked_for(tmp_path, monkeypatch,
                                                                   capsys):
    path = tmp_path / EXPECTED[1]
    shutil.copy(ROOT / "solutions" / EXPECTED[1], path)
    monkeypatch.setattr(grade, "execute", fake_execute({}))
    assert grade.main(["--json", str(path), str(tmp_path / "missing.ipynb")]) == 2
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data, list) and [d.get("score") for d in data] == [2, None]
    assert data[1]["error"].startswith("cannot read")  # the ungradable one is there, saying why


def test_a_file_holding_its_own_exercises_keeps_its_name_even_when_outweighed():
    """02's stubs and checks plus all of exercise 3's cells: by content alone it looks like
    exercise 3, but it names 02's exercises and is called 02_...: graded as 02."""
    source = ROOT / "exercises" / "source"
    own = nbformat.read(ROOT / "solutions" / EXPECTED[1], as_version=4)
    other = nbformat.read(ROOT / "solutions" / EXPECTED[2], as_version=4)
    keep = set(tagged(own, "check").values()) | set(tagged(own, "exercise").values())
    own.cells = [c for i, c in enumerate(own.cells) if i in keep] + other.cells
    assert grade.identify_source(own) == source / EXPECTED[2]
    assert grade.source_for(ROOT / "submissions" / EXPECTED[1], own) == source / EXPECTED[1]


@pytest.mark.parametrize("bad, message", [
    ("### BEGIN SOLUTION\nanswer = 42\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION",
     "line 3: ### BEGIN SOLUTION inside another solution"),
    ("x = 1\n### END SOLUTION", "line 2: ### END SOLUTION without ### BEGIN SOLUTION"),
    ("x = 1\n### BEGIN SOLUTION\nx = 2", "line 2: ### BEGIN SOLUTION is never closed"),
])
def test_marker_errors_name_the_line_and_the_fault(bad, message):
    """A BEGIN left open before another one would otherwise put `answer = 42` in the stub."""
    with pytest.raises(MarkerError, match=re.escape(message)):
        stub_code(bad, where="cell")


def test_a_written_answer_is_stubbed_and_only_tags_survive_generation():
    """No source has a marked markdown cell yet: the exercise shows the prompt, never the
    answer; teacher-only metadata (a hidden source, nbgrader's) and outputs are dropped."""
    src = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(
            "Why?\n### BEGIN SOLUTION\nBecause the pages are shared.\n### END SOLUTION",
            metadata={"tags": ["answer"], "jupyter": {"source_hidden": True}}),
        nbformat.v4.new_code_cell("x = 1", metadata={"nbgrader": {"grade": True}},
                                  execution_count=3,
                                  outputs=[nbformat.v4.new_output("stream", text="1\n")])])
    ex, sol = generate(src, "t")
    assert ex.cells[0].source == "Why?\n" + exercises.MARKDOWN_STUB
    assert sol.cells[0].source == "Why?\nBecause the pages are shared."
    assert ex.cells[0].metadata == sol.cells[0].metadata == {"tags": ["answer"]}
    assert ex.cells[1].metadata == {} and ex.cells[1].outputs == []
    assert ex.cells[1].execution_count is None


def test_best_setting_mistakes_are_named():
    """Exercise 6.4: the usual slips each get their own message: quality None taken as a
    failure, a queue age at the limit taken as over it, no tie-break, no fairness at all, an
    index instead of the row, and minicb's own function behind a lambda."""
    from minicb.benchmark import sweep
    mine = solution("06_benchmarking.ipynb")["best_setting"]

    def keep(rule):
        def pick(rows, max_queue_age=None):
            fit = [r for r in rows if rule(r, max_queue_age)]
            return max(fit, key=lambda r: (r["goodput_rps"], r["output_tokens_per_s"]),
                       default=None)
        return pick

    def base(r, limit):
        return r["errors"] == 0 and r["cancellations_honoured"] and r["same_tokens"] is not False

    def fair(r, limit):
        return limit is None or (r["max_queue_age_s"] is not None
                                 and r["max_queue_age_s"] <= limit)
    assert "does not fail the quality requirement" in caught("best_setting", keep(
        lambda r, lim: base(r, lim) and fair(r, lim) and r["same_tokens"] is True))
    assert "A queue age equal to the limit is within it" in caught("best_setting", keep(
        lambda r, lim: base(r, lim) and (lim is None or (r["max_queue_age_s"] or 1e9) < lim)))
    assert "its oldest request waited 0.6 s, over the limit of 0.5 s" in caught(
        "best_setting", keep(base))
    assert "Ties on goodput go to the most output_tokens_per_s" in caught(
        "best_setting", lambda rows, lim=None: max(
            [r for r in rows if base(r, lim) and fair(r, lim)],
            key=lambda r: r["goodput_rps"], default=None) if rows else None)

    def last_of_ties(rows, limit=None):  # `>=` in a loop: found by an audit, passed before
        best = None
        for r in rows:
            if base(r, limit) and fair(r, limit) and (best is None or (
                    r["goodput_rps"], r["output_tokens_per_s"]) >= (
                    best["goodput_rps"], best["output_tokens_per_s"])):
                best = r
        return best
    assert "Among rows equal on both, the first in the list" in caught("best_setting",
                                                                        last_of_ties)
    assert "return one of the rows (the dict itself) or None" in caught(
        "best_setting", lambda rows, lim=None: (rows.index(mine(rows, lim))
                                                if mine(rows, lim) is not None else None))
    assert "ran minicb's own best_setting" in caught(
        "best_setting", lambda rows, lim=None: sweep.best_setting(rows, lim))


def test_swap_break_even_mistakes_are_named():
    """Exercise 6.5: each slip the hints name is caught with its hint (planted through the
    check's own variants, and once written out by hand); minicb's own function is refused; a
    non-number is named; a float32 answer gets the float32 note."""
    from minicb.benchmark import sim
    for mistake, hint in check._BREAK_EVEN_HINTS.items():
        def planted(cost, n, cached, page_size, chunk_size, mistake=mistake):
            return check._break_even_variant(cost, n, cached, page_size, chunk_size, mistake)
        assert hint.strip() in caught("swap_break_even", planted), mistake

    mine = solution("06_benchmarking.ipynb")["swap_break_even"]

    def recompute_seconds(cost, n, cached, page_size, chunk_size):  # mine times its copies
        copies = 2 * -(-n // page_size) - cached // page_size
        return mine(cost, n, cached, page_size, chunk_size) * copies

    def out_only(cost, n, cached, page_size, chunk_size):  # written as a learner would
        return recompute_seconds(cost, n, cached, page_size, chunk_size) / -(-n // page_size)
    assert "Swap copies pages twice" in caught("swap_break_even", out_only)

    def floor_pages(cost, n, cached, page_size, chunk_size):  # guarded against n < page_size
        return recompute_seconds(cost, n, cached, page_size, chunk_size) / (
            2 * max(1, n // page_size) - cached // page_size)
    assert "The last page counts even when it is not full" in caught("swap_break_even",
                                                                     floor_pages)

    def every_page_back(cost, n, cached, page_size, chunk_size):
        return recompute_seconds(cost, n, cached, page_size, chunk_size) / (
            2 * -(-n // page_size))
    assert "shares its prompt pages still in the prefix index" in caught("swap_break_even",
                                                                         every_page_back)
    assert "in ms or µs: return seconds" in caught("swap_break_even", lambda *args: mine(
        *args) * 1e6)
    assert "ran minicb's own swap_break_even" in caught(
        "swap_break_even", lambda *args: sim.swap_break_even(*args))
    assert "ran minicb's own recompute_seconds" in caught(
        "swap_break_even", lambda cost, n, cached, page, chunk:
        sim.recompute_seconds(cost, n, cached, chunk) / (2 * -(-n // page)))
    assert "must return seconds per page as a number" in caught(
        "swap_break_even", lambda *args: "0.1 ms")
    assert "computed in float32" in caught("swap_break_even", lambda *args: torch.tensor(
        mine(*args), dtype=torch.float32).item() * (1 + 3e-7))


# --- from the session-14 mutation review (here, not in test_session14_mutants.py, because they
# read solutions/, which the student copy does not have) ---
def _graded(tmp_path, monkeypatch, outcome, stopped=(), setup_error=None):
    """Grade a copy of solutions/01 in memory (fake_execute): `outcome` per
    tag, the run's notes `stopped`, and `setup_error` raised by its first code cell."""
    path = tmp_path / EXPECTED[0]  # page_pool, prefix_hashes, match_prefix, quantize_int8
    shutil.copy(ROOT / "solutions" / EXPECTED[0], path)
    fake = fake_execute(outcome)

    def execute(nb, workdir, timeout):
        fake(nb, workdir, timeout)
        if setup_error:
            first = next(c for c in nb.cells if c.cell_type == "code")
            ename, _, evalue = setup_error.partition(": ")
            first.outputs = [nbformat.v4.new_output("error", ename=ename, evalue=evalue,
                                                    traceback=[])]
        return list(stopped)
    monkeypatch.setattr(grade, "execute", execute)
    return grade.grade_notebook(path)


def test_a_check_cell_cut_off_by_a_stopped_kernel_says_so(tmp_path, monkeypatch):
    """A check cell that was running when its kernel was killed (no error, no mark) was told
    "reported no error but did not run to its end (did an earlier cell change how errors ...
    are handled?)" (the stopped-kernel branch dropped), blaming cells that did nothing."""
    report = _graded(tmp_path, monkeypatch, {"check:match_prefix": "silent"},
                     stopped=["execution stopped: cell 3 ignored the interrupt at 300 s "
                              "and its kernel was killed"])
    message = {e.name: e.message for e in report.exercises}["match_prefix"]
    assert message.startswith("its check cell was still running when the kernel was stopped")


def test_only_an_untouched_stubs_error_is_not_attempted(tmp_path, monkeypatch):
    """attempted=False for any NotImplementedError (the stub's "write " prefix dropped): a
    learner's own code raising NotImplementedError was listed as not attempted."""
    report = _graded(tmp_path, monkeypatch, {
        "check:prefix_hashes": "NotImplementedError: write prompt_page_hashes (exercise "
                               "prefix_hashes)",
        "check:match_prefix": "NotImplementedError: pages of size 0"})
    attempted = {e.name: e.attempted for e in report.exercises}
    assert attempted == {"page_pool": True, "prefix_hashes": False, "match_prefix": True,
                         "quantize_int8": True}


def test_the_setup_note_names_only_a_cell_before_the_first_check(tmp_path, monkeypatch):
    """_first_setup_error scanned every cell (not those before the first check cell): an
    exercise's own error after it was named as the setup cell's. A setup error is named by
    the first line of its message only, and only when an exercise failed (the note came with
    a full score too when the `not all(passed)` condition was dropped)."""
    report = _graded(tmp_path, monkeypatch, {"exercise:match_prefix": "TypeError: bad operand",
                                             "check:match_prefix": "CheckFailed: wrong"})
    assert not any("raised" in note for note in report.notes)
    report = _graded(tmp_path, monkeypatch, {"check:match_prefix": "CheckFailed: wrong"},
                     setup_error="ModuleNotFoundError: No module named 'numpyy'\nsecond line")
    notes = [n for n in report.notes if "raised" in n]
    assert len(notes) == 1 and "raised ModuleNotFoundError: No module named 'numpyy'; the " \
        "cells after it" in notes[0] and "second line" not in notes[0]
    report = _graded(tmp_path, monkeypatch, {}, setup_error="ModuleNotFoundError: numpyy")
    assert report.score == report.max_score
    assert not any("raised" in note for note in report.notes)
