"""The C decode kernel of the CPU backend (chapter 08) against dense attention and the torch
reference: ragged contexts, GQA ratios 1-7, page sizes 4-32, shuffled and shared pages, NaN in
every slot it must not read, and the whole engine's tokens under every policy.

A machine without a C compiler skips these (the engine then keeps the torch reference); one
with a compiler that fails to build the kernel fails them."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cases import HEAD_DIM, assert_close, check_against_dense, make_case

from minicb.attention import build_metadata, cpu_kernel, int_tensor, resolve_backend, torch_ref

if cpu_kernel._compiler() is None:
    pytest.skip("no C compiler: the CPU kernel backend cannot be built here",
                allow_module_level=True)


@pytest.fixture
def broken_compiler(monkeypatch, tmp_path):
    """A compiler that always fails, with nothing built or cached yet."""
    script = tmp_path / "cc"
    script.write_text("#!/bin/sh\necho 'cc: error: no such thing' >&2\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    monkeypatch.setenv("MINICB_CACHE", str(tmp_path / "cache"))
    cpu_kernel._built.cache_clear()
    yield script
    cpu_kernel._built.cache_clear()  # the working compiler's build, from the cache


def test_the_kernel_builds_and_is_cached_readable_by_all():
    """The C kernel builds here into the kernels cache folder with mode 0755 under the umask,
    readable by every user."""
    assert cpu_kernel.unavailable_reason() is None
    path = cpu_kernel.library_path(cpu_kernel._compiler())
    assert path.exists() and path.parent.name == "kernels"
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o755 & ~umask  # not mkstemp's private 0600


def test_a_damaged_cached_library_is_rebuilt(monkeypatch, tmp_path):
    """A cached library that does not load is rebuilt in place into a working shared library,
    leaving no temporary file beside it."""
    monkeypatch.setenv("MINICB_CACHE", str(tmp_path))
    compiler = cpu_kernel._compiler()
    path = cpu_kernel.library_path(compiler)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    library = cpu_kernel._load(compiler)
    assert hasattr(library, "paged_decode_attention")
    assert path.read_bytes()[:4] == b"\x7fELF"
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_a_build_keeps_only_the_newest_builds(monkeypatch, tmp_path):
    """Each change to the source or flags makes a new build; the oldest go, the newest stay."""
    monkeypatch.setenv("MINICB_CACHE", str(tmp_path))
    compiler = cpu_kernel._compiler()
    path = cpu_kernel.library_path(compiler)
    path.parent.mkdir(parents=True)
    old = [path.parent / f"paged_decode-old{i}.so" for i in range(6)]
    for i, stale in enumerate(old):
        stale.write_bytes(b"an older build")
        os.utime(stale, (1_000_000 + i, 1_000_000 + i))  # old0 is the oldest
    cpu_kernel._build(compiler, path)
    kept = {p.name for p in path.parent.iterdir()}
    assert kept == {path.name, *(p.name for p in old[-(cpu_kernel.KEEP_BUILDS - 1):])}


def test_cc_may_carry_a_wrapper_and_a_missing_one_is_named(monkeypatch):
    """CC may name a wrapper and its compiler ("ccache gcc"), and a compiler that does not exist
    raises RuntimeError naming it."""
    monkeypatch.setenv("CC", "ccache gcc")
    assert cpu_kernel._compiler() == ["ccache", "gcc"]
    with pytest.raises(RuntimeError, match="'/no/such/cc' was not found"):
        cpu_kernel.library_path(["/no/such/cc"])


def test_bad_metadata_is_refused_before_the_c_code_reads_it():
    """Where the reference would raise an IndexError, C would read out of bounds: the wrapper
    checks once per step what the kernel trusts."""
    q, k, v, k_cache, v_cache, meta = make_case([(20, 1), (40, 1)], 16, 2)
    bad = build_metadata([[0, 1], [2, k_cache.shape[0]]], [20, 30], [1, 1], 16)  # no such page
    with pytest.raises(ValueError, match="outside the cache's"):
        cpu_kernel.attend(q, k_cache, v_cache, bad, 0.25)
    wide = build_metadata([[0, 1], [2, 3]], [20, 30], [1, 1], 16)
    wide.__dict__["page_tables"] = wide.page_tables.long()  # int64: C reads int32
    with pytest.raises(ValueError, match="contiguous int32"):
        cpu_kernel.attend(q, k_cache, v_cache, wide, 0.25)
    with pytest.raises(ValueError, match="pages of 16 tokens"):
        cpu_kernel.attend(q, k_cache, v_cache, build_metadata([[0, 1, 2], [3, 4, 5]], [20, 22],
                                                              [1, 1], 8), 0.25)
    with pytest.raises(ValueError, match="q has 1 rows"):  # C would read q and write out past
        cpu_kernel.attend(q[:1], k_cache, v_cache, meta, 0.25)  # their ends
    torch_ref.store_kv(k, v, k_cache, v_cache, meta)
    out = cpu_kernel.attend(q, k_cache, v_cache, meta, 0.25)  # still usable
    assert_close(out, torch_ref.attend(q, k_cache, v_cache, meta, 0.25))


@settings(max_examples=40, deadline=None)
@given(decodes=st.lists(st.integers(0, 80), min_size=1, max_size=10),
       chunks=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), max_size=2),
       group=st.integers(1, 5), page_size=st.sampled_from([4, 16]), seed=st.integers(0, 2**16))
def test_any_step_matches_dense_attention(decodes, chunks, group, page_size, seed):
    """Each member's rows equal dense attention over its own K/V: decode rows from the kernel,
    chunks from the reference, in one call."""
    check_against_dense([(c, 1) for c in decodes] + chunks, seed, attend=cpu_kernel.attend,
                        group=group, page_size=page_size)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("page_size", [16, 32])
def test_poisoned_caches_and_strided_queries(group, page_size):
    """The kernel reads only its members' slots (every other slot is NaN), takes q as a view of
    the fused q/k/v product, writes every row, and agrees with the reference."""
    rng = random.Random(page_size + group)
    members = [(2 * page_size + 3, 1), (2 * page_size + 9, 1)]
    members += [(rng.randrange(0, 5 * page_size), 1) for _ in range(5)] + [(page_size + 5, 7)]
    q, k, v, k_cache, v_cache, meta = make_case(members, page_size, group, shared_pages=2)
    assert not q.is_contiguous()
    torch_ref.store_kv(k, v, k_cache, v_cache, meta)
    expected = torch_ref.attend(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    assert not expected.isnan().any(), "the reference read a slot outside a row's context"
    out = cpu_kernel.attend(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    assert not out.isnan().any(), "a row read a slot outside its context, or was not written"
    assert_close(out, expected)


def test_non_power_of_two_group_and_head_dim():
    """Qwen2-0.5B has 7 query heads per kv head; some models have head_dim 80 or 96."""
    q, k, v, k_cache, v_cache, meta = make_case([(20, 1), (3, 1), (40, 1)], 16, 7, head_dim=24)
    torch_ref.store_kv(k, v, k_cache, v_cache, meta)
    expected = torch_ref.attend(q, k_cache, v_cache, meta, 0.2)
    assert_close(cpu_kernel.attend(q, k_cache, v_cache, meta, 0.2), expected)


def test_a_row_does_not_depend_on_its_batch_or_the_thread_count():
    """Each request is one thread's work, in a fixed order (a lone request's kv heads split over
    the threads, each head's arithmetic unchanged): a row's result is the same, bit for bit,
    alone or among others, on one thread or two. (The reference's padded groups can differ in
    the last bits with the company a row keeps.)"""
    members = [(computed, 1) for computed in (5, 70, 33, 128, 1, 64)]
    q, k, v, k_cache, v_cache, meta = make_case(members, 16, 3)
    torch_ref.store_kv(k, v, k_cache, v_cache, meta)
    threads = torch.get_num_threads()
    row = 3
    pages = meta.page_tables[row, :-(-meta.context_lens_list[row] // 16)].tolist()
    alone = build_metadata([pages], [members[row][0]], [1], 16)
    try:
        torch.set_num_threads(1)
        one = cpu_kernel.attend(q, k_cache, v_cache, meta, 0.25)
        alone_one = cpu_kernel.attend(q[row:row + 1], k_cache, v_cache, alone, 0.25)[0]
        torch.set_num_threads(2)
        two = cpu_kernel.attend(q, k_cache, v_cache, meta, 0.25)
        alone_two = cpu_kernel.attend(q[row:row + 1], k_cache, v_cache, alone, 0.25)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(alone_one, one[row]) and torch.equal(alone_two, one[row])


def test_bfloat16_caches_are_read_in_float32(caplog, monkeypatch):
    """A bfloat16 engine: the kernel reads the 16-bit caches, computes in float32 and rounds
    once at the end, so it matches float32 attention over the same values to bf16's precision
    (the reference, which runs bf16 arithmetic, is further off). float16 takes the reference."""
    members = [(20, 1), (70, 1), (3, 1), (9, 5)]
    q, k, v, k_cache, v_cache, meta = make_case(members, 16, 3, dtype=torch.bfloat16)
    torch_ref.store_kv(k, v, k_cache, v_cache, meta)
    out = cpu_kernel.attend(q, k_cache, v_cache, meta, 0.25)
    assert out.dtype == torch.bfloat16 and not out[:3].isnan().any()
    exact = torch_ref.attend(q.float(), k_cache.float(), v_cache.float(), meta, 0.25)
    torch.testing.assert_close(out[:3].float(), exact[:3], rtol=2 ** -8, atol=1e-3)
    half = [t.to(torch.float16) for t in (q, k_cache, v_cache)]
    cpu_kernel._warn_reference.cache_clear()  # said once per process
    with caplog.at_level("WARNING", logger="minicb"):
        assert torch.equal(cpu_kernel.attend(*half, meta, 0.25),
                           torch_ref.attend(*half, meta, 0.25))
    assert "take the torch reference" in caplog.text  # said once, not silently


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_match_the_torch_backend_in_each_dtype(tiny_llama_dir, dtype):
    """In float32 and bfloat16, the engine's greedy tokens with the C kernel equal those with the
    torch backend."""
    from minicb import LLM, SamplingParams
    prompts = [list(range(3, 40)), list(range(50, 57)), list(range(60, 90))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {name: [o.token_ids for o in LLM(str(tiny_llama_dir), attention_backend=name,
                                              dtype=dtype, num_pages=32)
                     .generate(prompts, params, use_tqdm=False)] for name in ("torch", "cpu")}
    assert tokens["cpu"] == tokens["torch"]


def test_auto_picks_the_kernel_on_the_cpu(monkeypatch):
    """auto picks the C kernel on the CPU unless MINICB_ATTENTION says otherwise; the C kernel on
    CUDA, or an unknown backend from the argument or the environment, raises ValueError naming where
    the value came from."""
    monkeypatch.delenv("MINICB_ATTENTION", raising=False)
    assert resolve_backend("auto", "cpu") == "cpu"
    monkeypatch.setenv("MINICB_ATTENTION", "torch")
    assert resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="C kernel for the CPU"):
        resolve_backend("cpu", "cuda")
    monkeypatch.setenv("MINICB_ATTENTION", "bogus")  # the message names where it came from
    with pytest.raises(ValueError, match=r"MINICB_ATTENTION \(environment\) must be .*'bogus'"):
        resolve_backend("auto", "cpu")
    with pytest.raises(ValueError, match="^attention_backend must be"):
        resolve_backend("bogus", "cpu")


def test_without_a_working_compiler_auto_falls_back_and_cpu_is_refused(broken_compiler, caplog,
                                                                        monkeypatch):
    """Without a working compiler, auto falls back to the torch reference with a warning naming the
    compiler's error, an explicit cpu backend raises ValueError with that error, and no partial
    library is cached."""
    monkeypatch.delenv("MINICB_ATTENTION", raising=False)
    with caplog.at_level(logging.WARNING, logger="minicb"):
        assert resolve_backend("auto", "cpu") == "torch"
    assert "no such thing" in caplog.text and "torch reference" in caplog.text
    with pytest.raises(ValueError, match="(?s)could not build paged_decode.c.*no such thing"):
        resolve_backend("cpu", "cpu")
    assert not list((broken_compiler.parent / "cache").rglob("*.so")), "half a build was kept"


@pytest.mark.parametrize("policy", ["single", "static", "continuous", "chunked", "pd"])
def test_engine_tokens_match_the_torch_backend(tiny_llama_dir, policy):
    """The whole engine through the kernel, including a second call whose prompts hit the first
    call's cached prefix pages, under greedy sampling."""
    from minicb import LLM, SamplingParams
    base = list(range(3, 40))
    first, rest = [base + [50, 51]], [base + [60], list(range(70, 75)), list(range(80, 101))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(policy=policy, page_size=16, num_pages=64, max_num_seqs=4, chunk_size=16,
              max_num_batched_tokens=24, check_invariants=True)
    results = {}
    for name in ("torch", "cpu"):
        llm = LLM(str(tiny_llama_dir), attention_backend=name, **kw)
        assert llm.engine.attention_backend == name
        outs = llm.generate(first, params) + llm.generate(rest, params)
        assert outs[1].num_cached_tokens >= 32
        results[name] = [o.token_ids for o in outs]
    assert results["cpu"] == results["torch"]


def test_num_decodes_counts_only_the_decode_rows():
    """AttentionMetadata.num_decodes is the decode rows (one token each), not every member of
    the step."""
    meta = build_metadata([[0], [1], [2]], [4, 7, 0], [1, 1, 5], 16)
    assert (meta.num_decodes, meta.num_members) == (2, 3)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_picks_triton_on_any_cuda_device(monkeypatch, device):
    """'auto' picks Triton on any CUDA device ("cuda" or "cuda:1"), the C kernel ('cpu') is
    refused there, and an empty backend name is no backend."""
    monkeypatch.delenv("MINICB_ATTENTION", raising=False)
    assert resolve_backend("auto", device) == "triton"
    with pytest.raises(ValueError, match="C kernel for the CPU"):
        resolve_backend("cpu", device)
    with pytest.raises(ValueError, match="got ''"):
        resolve_backend("", device)


def test_the_torch_fallback_is_announced_once(monkeypatch, caplog):
    """Without the C kernel, 'auto' on the CPU falls back to torch with one warning per
    process, not one per engine built."""
    from minicb import attention
    monkeypatch.delenv("MINICB_ATTENTION", raising=False)
    attention._warn_once.cache_clear()
    monkeypatch.setattr(cpu_kernel, "unavailable_reason", lambda: "no compiler here")
    with caplog.at_level(logging.WARNING, logger="minicb"):
        assert [attention.resolve_backend("auto", "cpu") for _ in range(3)] == ["torch"] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "no compiler here; using the torch reference for attention"]


# --- what the wrapper refuses before C reads it -------------------------------------------------

def stored_case():
    q, k, v, k_cache, v_cache, meta = make_case([(20, 1), (40, 1)], 16, 2)
    torch_ref.store_kv(k, v, k_cache, v_cache, meta)
    return q, k_cache, v_cache, meta


def test_a_page_table_with_a_negative_or_missing_page_is_refused():
    """A negative page id, or a table narrower than its row's context, is a ValueError before
    C would read out of bounds."""
    q, k_cache, v_cache, meta = stored_case()
    with pytest.raises(ValueError, match="outside the cache's"):
        cpu_kernel.attend(q, k_cache, v_cache, build_metadata([[0, -1], [2, 3]], [20, 30],
                                                              [1, 1], 16), 0.25)
    meta.__dict__["page_tables"] = meta.page_tables[:, :2].contiguous()  # member 1 needs 3
    with pytest.raises(ValueError, match="too short"):
        cpu_kernel.attend(q, k_cache, v_cache, meta, 0.25)


def test_context_lens_that_disagree_or_are_not_int32_are_refused():
    """The lengths C reads must be the list's and int32."""
    q, k_cache, v_cache, meta = stored_case()
    longer = build_metadata(meta.page_table_list, [20, 40], [1, 1], 16)
    longer.__dict__["context_lens"] = int_tensor([21, 48], torch.int32)  # the list says 41
    with pytest.raises(ValueError, match="disagree"):
        cpu_kernel.attend(q, k_cache, v_cache, longer, 0.25)
    wide = build_metadata(meta.page_table_list, [20, 40], [1, 1], 16)
    wide.__dict__["context_lens"] = wide.context_lens.long()
    with pytest.raises(ValueError, match="context_lens as a contiguous int32"):
        cpu_kernel.attend(q, k_cache, v_cache, wide, 0.25)


def test_heads_that_do_not_fit_the_caches_are_refused():
    """Query heads not a multiple of the kv heads, another head_dim, or more rows than the
    metadata's members are a ValueError (C would ignore or overrun them)."""
    q, k_cache, v_cache, meta = stored_case()  # 4 query heads of 16 over 2 kv heads
    with pytest.raises(ValueError, match="heads of"):
        cpu_kernel.attend(torch.randn(2, 5, HEAD_DIM), k_cache, v_cache, meta, 0.25)
    with pytest.raises(ValueError, match="heads of"):
        cpu_kernel.attend(torch.randn(2, 4, HEAD_DIM // 2), k_cache, v_cache, meta, 0.25)
    with pytest.raises(ValueError, match="q has 3 rows"):
        cpu_kernel.attend(torch.randn(3, 4, HEAD_DIM), k_cache, v_cache, meta, 0.25)


def test_non_contiguous_caches_get_the_reference_answer():
    """Caches that are views into a wider pool (strided) are not what C walks: the backend
    returns the reference's answer."""
    q, k_cache, v_cache, meta = stored_case()
    k_pool = torch.zeros(*k_cache.shape[:-1], 2 * HEAD_DIM)
    v_pool = torch.zeros_like(k_pool)
    k_pool[..., :HEAD_DIM], v_pool[..., :HEAD_DIM] = k_cache.nan_to_num(), v_cache.nan_to_num()
    k_view, v_view = k_pool[..., :HEAD_DIM], v_pool[..., :HEAD_DIM]
    assert not k_view.is_contiguous()
    expected = torch_ref.attend(q, k_view.contiguous(), v_view.contiguous(), meta, 0.25)
    assert_close(cpu_kernel.attend(q, k_view, v_view, meta, 0.25), expected)


def test_caches_of_two_dtypes_never_reach_the_kernel(monkeypatch):
    """C reads both caches as one type (float32 keys with bfloat16 values would read past the
    value cache): such caches go to the reference, which refuses them."""
    q, k_cache, v_cache, meta = stored_case()

    def no_library():
        raise AssertionError("the C kernel was called with caches of two dtypes")
    monkeypatch.setattr(cpu_kernel, "library", no_library)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_kernel.attend(q, k_cache, v_cache.bfloat16(), meta, 0.25)
