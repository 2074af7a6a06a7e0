"""The Triton kernels (chapter 07) against the torch reference, on fresh random paged caches.

On the CPU the kernels run in Triton's interpreter: TRITON_INTERPRET=1 must be set before
`triton` is first imported, which this module does itself unless something imported triton
earlier (then it skips, saying so; `make test` sets the variable for the whole run).
`MINICB_TEST_DEVICE=cuda` runs the same tests on a GPU with compiled kernels (bench/gpu_check.sh
does that).
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("MINICB_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif not torch.cuda.is_available():
    pytest.skip(f"MINICB_TEST_DEVICE={DEVICE} but torch sees no CUDA device",
                allow_module_level=True)

try:
    import triton  # noqa: F401
except ImportError as exc:  # the triton extra is optional
    pytest.skip(f"triton cannot be imported ({exc}); pip install triton to run the kernel tests",
                allow_module_level=True)

import paged_cases  # noqa: E402
from paged_cases import HEAD_DIM, NUM_KV_HEADS, assert_close, batch  # noqa: E402

from minicb.attention import build_metadata, torch_ref  # noqa: E402
from minicb.attention import triton_ops as tops  # noqa: E402
from minicb.benchmark.launches import count_launches  # noqa: E402

if DEVICE == "cpu" and not tops._interpreted():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
                "on the CPU: run pytest with TRITON_INTERPRET=1 in the environment",
                allow_module_level=True)

pytestmark = pytest.mark.triton


def make_case(*args, **kwargs):
    return paged_cases.make_case(*args, device=DEVICE, **kwargs)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("page_size", [1, 16, 32, 64])
def test_store_and_attend_match_reference(kind, group, page_size):
    """For decode, prefill and mixed batches, every page size and GQA group: store_kv writes the
    caches bit for bit as the torch reference (unwritten slots stay NaN), and attend writes every
    output row and matches the reference without reading past a member's context."""
    members, shared, sharers = batch(kind, page_size, seed=page_size + group)
    q, k, v, k_cache, v_cache, meta = make_case(members, page_size, group, shared, sharers,
                                                seed=group)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_ref.store_kv(k, v, ref_k, ref_v, meta)
    tops.store_kv(k, v, k_cache, v_cache, meta)
    # bit-identical, and slots nobody wrote are still NaN
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0, equal_nan=True)

    scale = HEAD_DIM ** -0.5
    # both read the poisoned caches: neither may touch a slot past a member's context
    expected = torch_ref.attend(q, ref_k, ref_v, meta, scale)
    out = torch.full_like(expected, float("nan"))
    tops.attend(q, k_cache, v_cache, meta, scale, out=out)
    assert not out.isnan().any(), "some output rows were not written"
    assert_close(out, expected)


def test_contexts_longer_than_several_key_blocks():
    """The running softmax rescales its sum across key blocks: contexts of two and three
    blocks (decode and prefill rows), so a kernel that skipped the rescale would be wrong."""
    members = [(300, 1), (200, 40), (0, 290), (5, 1)]
    # float32 here, on the CPU and on CUDA alike: the kernel's float32 key block
    key_block = max(16, tops.FLOAT32_KEY_BLOCK // max(16, triton.next_power_of_2(HEAD_DIM)))
    assert max(c + n for c, n in members) > 2 * key_block
    q, k, v, k_cache, v_cache, meta = make_case(members, 16, 4, seed=3)
    tops.store_kv(k, v, k_cache, v_cache, meta)
    expected = torch_ref.attend(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    out = torch.full_like(expected, float("nan"))
    tops.attend(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5, out=out)
    assert_close(out, expected)


def test_decode_and_prefill_tiles_are_set_apart(monkeypatch):
    """gpu_check.py sweeps the decode tile only; a decode tile it tries must not reach the
    prefill launch ((128, 4, 2) gives a prefill tile 145 KiB of shared memory, more than sm_86
    or sm_89 have). The launch options a GPU would get, read off a stand-in kernel; float32
    keeps its own key block and 8 prefill warps."""
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **options: launches.append(options)

    monkeypatch.setattr(tops, "_paged_attention_kernel", Kernel())
    monkeypatch.setattr(tops, "_interpreted", lambda: False)  # as compiled for a GPU
    monkeypatch.setattr(tops, "_check_device", lambda t: None)
    monkeypatch.setattr(tops, "DECODE_TILES", (128, 8, 3))
    for dtype in (torch.bfloat16, torch.float32):
        q, _, _, k_cache, v_cache, meta = make_case([(20, 1), (0, 30)], 16, 4, dtype=dtype)
        tops.attend(q, k_cache, v_cache, meta, 0.25)
    key_block = max(16, tops.FLOAT32_KEY_BLOCK // max(16, triton.next_power_of_2(HEAD_DIM)))
    got = [(o["BLOCK_N"], o["num_warps"], o["num_stages"], o["DECODE"]) for o in launches]
    assert got == [(128, 8, 3, True), (*tops.PREFILL_TILES, False),
                   (key_block, 8, 3, True), (key_block, 8, tops.PREFILL_TILES[2], False)]


def test_non_power_of_two_group_and_head_dim():
    """Qwen2-0.5B has 7 query heads per kv head; some models have head_dim 80 or 96."""
    members = [(20, 1), (3, 1), (16, 21)]
    q, k, v, k_cache, v_cache, meta = make_case(members, 16, 7, seed=3, head_dim=24)
    tops.store_kv(k, v, k_cache, v_cache, meta)
    expected = torch_ref.attend(q, k_cache, v_cache, meta, 0.2)
    assert_close(tops.attend(q, k_cache, v_cache, meta, 0.2), expected)


@pytest.mark.skipif(DEVICE == "cpu", reason="16-bit tensor-core paths only mean something on GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulates_in_float32(dtype):
    """In bfloat16 and float16, attend returns the input dtype and stays within 2e-2 of the float32
    reference on the same cache."""
    members = [(40, 1), (70, 1), (16, 40)]
    q, k, v, k_cache, v_cache, meta = make_case(members, 16, 4, seed=5, dtype=dtype)
    tops.store_kv(k, v, k_cache, v_cache, meta)
    expected = torch_ref.attend(q.float(), k_cache.float(), v_cache.float(), meta,
                                HEAD_DIM ** -0.5)
    out = tops.attend(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected.cpu(), rtol=2e-2, atol=2e-2)


def test_cpu_tensors_without_interpreter_fail_clearly(monkeypatch):
    """CPU tensors given to the Triton kernels without the interpreter raise RuntimeError naming
    TRITON_INTERPRET."""
    monkeypatch.setattr(tops, "_interpreted", lambda: False)
    q, k, v, k_cache, v_cache, meta = make_case([(3, 1)], 16, 1)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        tops.attend(q.cpu(), k_cache.cpu(), v_cache.cpu(), meta, 1.0)


def test_an_engine_refuses_triton_on_the_cpu_without_the_interpreter(monkeypatch,
                                                                    tiny_checkpoint):
    """Refused when the engine is built, not as an error in every request it later runs."""
    from minicb import Engine
    monkeypatch.setattr(tops, "_interpreted", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 before anything imports triton"):
        Engine(str(tiny_checkpoint("llama")), attention_backend="triton", num_pages=8,
               device="cpu")  # named: "auto" picks CUDA on a GPU machine, where Triton is fine


def test_store_skips_negative_slots():
    """A padded batch (CUDA graphs) marks its padding rows with slot -1: nothing is written."""
    q, k, v, k_cache, v_cache, meta = make_case([(5, 1), (9, 1), (0, 1)], 16, 1)
    slots = meta.slot_mapping.tolist()
    meta.slot_mapping[1] = -1
    tops.store_kv(k, v, k_cache, v_cache, meta)
    flat = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(flat[slots[0]], k[0]) and torch.equal(flat[slots[2]], k[2])
    assert flat[slots[1]].isnan().all()


def test_rms_norm_matches_reference_on_rows_and_strided_heads():
    """Hidden rows [T, D], and query heads as they sit in the fused q/k/v product (Qwen3 normalizes
    each head): the kernel reads the strided rows and writes a contiguous result."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(5, 96, generator=gen).to(DEVICE)
    weight = torch.rand(96, generator=gen).add(0.5).to(DEVICE)
    assert_close(tops.rms_norm(hidden, weight, 1e-6), torch_ref.rms_norm(hidden, weight, 1e-6))
    qkv = torch.randn(5, 6 * 16 + 2 * 2 * 16, generator=gen).to(DEVICE)
    q = qkv[:, :6 * 16].view(5, 6, 16)  # rows 16 apart inside each token's 160 values
    head_weight = torch.rand(16, generator=gen).to(DEVICE)
    out = tops.rms_norm(q, head_weight, 1e-6)
    assert out.shape == q.shape and out.is_contiguous()
    assert_close(out, torch_ref.rms_norm(q, head_weight, 1e-6))
    assert tops.rms_norm(hidden[:0], weight, 1e-6).shape == (0, 96)


@pytest.mark.parametrize("group", [1, 3])
def test_rope_rotates_q_and_k_in_place_and_nothing_else(group):
    """The rope kernel rotates q and k in place as the torch reference does, for one and several
    query heads per KV head, and leaves v in the same fused buffer untouched."""
    from minicb.model.llama import ModelConfig, rope_inv_freq
    gen = torch.Generator().manual_seed(group)
    tokens, kv_heads, head_dim = 7, 2, 16
    cfg = ModelConfig("llama", 32, 64, 64, 1, kv_heads * group, kv_heads, head_dim)
    angles = torch.outer(torch.tensor([0.0, 1, 5, 17, 100, 2047, 3]), rope_inv_freq(cfg))
    cos, sin = angles.cos()[:, None, :].to(DEVICE), angles.sin()[:, None, :].to(DEVICE)
    q_cols, kv_cols = kv_heads * group * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_cols + 2 * kv_cols, generator=gen).to(DEVICE)
    before = qkv.clone()
    q, k, v = qkv.split([q_cols, kv_cols, kv_cols], -1)
    q, k = q.view(tokens, -1, head_dim), k.view(tokens, -1, head_dim)
    expected_q, expected_k = torch_ref.rope(q.clone(), k.clone(), cos, sin)
    out_q, out_k = tops.rope(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert_close(out_q, expected_q)
    assert_close(out_k, expected_k)
    assert torch.equal(qkv[:, q_cols + kv_cols:], before[:, q_cols + kv_cols:])  # v untouched


def test_triton_backend_launches_one_kernel_per_norm_and_per_rope(tiny_llama_dir):
    """Per layer, the torch reference's RMSNorm and RoPE cost many small operators; the Triton
    backend launches one kernel per RMSNorm and one for RoPE on q and k (chapter 07)."""
    from minicb.model.loader import load_model
    counts = {}
    for name in ("torch", "triton"):
        model, info = load_model(str(tiny_llama_dir), device=DEVICE, attention_backend=name)
        kv = model.allocate_kv_cache(8, 16)
        ids, pos = torch.tensor([5, 6], device=DEVICE), torch.tensor([3, 9], device=DEVICE)

        def step(model=model, kv=kv, ids=ids, pos=pos):
            meta = build_metadata([[0], [1]], [3, 9], [1, 1], 16, device=DEVICE)
            return model(ids, pos, meta, kv, torch.arange(2, device=DEVICE))

        step()  # RoPE tables, Triton compilation
        counts[name] = count_launches(step)
    layers = info.config.num_layers
    triton_counts = counts["triton"]
    assert triton_counts["triton.rms_norm_kernel"] == 2 * layers + 1  # two per layer, final
    assert triton_counts["triton.rope_kernel"] == layers
    assert not any(op in triton_counts for op in ("torch.pow", "torch.rsqrt", "torch.cat"))
    assert sum(triton_counts.values()) * 2 < sum(counts["torch"].values())


@pytest.mark.parametrize("policy", ["continuous", "pd"])
def test_engine_tokens_match_torch_backend(tiny_llama_dir, policy):
    """The whole engine through the kernels: decode rows, prefill chunks and, in the second
    call, prefix-cache hits on the first call's pages, under greedy sampling."""
    from minicb import LLM, SamplingParams
    base = list(range(3, 40))  # a shared prefix longer than two pages
    first, rest = [base + [50, 51]], [base + [60], list(range(70, 75)), list(range(80, 101))]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    kw = dict(policy=policy, page_size=16, num_pages=64, max_num_seqs=4, chunk_size=16,
              max_num_batched_tokens=24, device=DEVICE, dtype="float32")
    results = {}
    for name in ("torch", "triton"):
        llm = LLM(str(tiny_llama_dir), attention_backend=name, **kw)
        outs = llm.generate(first, params) + llm.generate(rest, params)
        assert outs[1].num_cached_tokens >= 32
        results[name] = [o.token_ids for o in outs]
    assert results["triton"] == results["torch"]


def test_swap_on_the_device_returns_the_tokens_of_a_roomy_pool(tiny_llama_dir):
    """Swap through the kernels on the test device (on a GPU: device pages copied to host
    memory and back, decode steps replayed as CUDA graphs over the same pool): a pool too small
    for three requests swaps, discards nothing, and returns the tokens a roomy pool gives."""
    from minicb import LLM, SamplingParams
    from minicb.benchmark import metrics
    prompts = [[(5 * i + j) % 90 + 3 for j in range(20)] for i in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    kw = dict(policy="pd", page_size=16, max_num_seqs=3, attention_backend="triton",
              device=DEVICE, dtype="float32", check_invariants=True)
    roomy = LLM(str(tiny_llama_dir), num_pages=32, **kw)
    tight = LLM(str(tiny_llama_dir), num_pages=6, preemption_mode="swap", **kw)
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    got = [o.token_ids for o in tight.generate(prompts, params)]
    s = metrics.summarize(tight.engine.trace, metrics.request_records(tight.engine))
    assert s["swapped_out_pages"] == s["swapped_in_pages"] > 0 and s["discarded_tokens"] == 0
    assert got == want


def test_min_tokens_bans_stop_tokens_on_the_device(tiny_llama_dir):
    """A request short of its min_tokens has its stop tokens banned in the logits, on the
    logits' device (on a GPU a CPU index there failed every member of the step)."""
    from minicb import LLM, SamplingParams
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), attention_backend="triton", policy="pd", num_pages=32,
              device=DEVICE, dtype="float32")
    free = llm.generate([list(range(3, 20))], greedy)[0].token_ids
    banned = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, min_tokens=4,
                            stop_token_ids=[free[0]])
    out = llm.generate([list(range(3, 20))], banned)[0]
    assert out.finish_reason in ("length", "stop") and out.token_ids[0] != free[0]
    assert len(out.token_ids) >= 4


def test_qwen3_per_head_norms_through_the_kernels(tiny_qwen3_dir):
    """Qwen3 normalizes every query and key head before RoPE: the norm kernel on strided heads,
    inside the whole engine, gives the torch backend's tokens."""
    from minicb import LLM, SamplingParams
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 30)), list(range(40, 47))]
    tokens = {}
    for name in ("torch", "triton"):
        llm = LLM(str(tiny_qwen3_dir), attention_backend=name, policy="pd", num_pages=32,
                  max_num_batched_tokens=16, chunk_size=16, device=DEVICE, dtype="float32")
        tokens[name] = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]


def test_padded_decode_row_with_empty_context_gives_zeros():
    """A CUDA-graph batch may pad decode rows with context length 0: they must not make NaN."""
    q, k, v, k_cache, v_cache, meta = make_case([(5, 1), (9, 1)], 16, 4)
    tops.store_kv(k, v, k_cache, v_cache, meta)
    meta.context_lens[1] = 0
    out = tops.attend(q, k_cache, v_cache, meta, 1.0)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_graph_buckets_stop_at_the_slot_count():
    """CUDA-graph batch sizes are the powers of two up to the slot count, then the slot count
    itself, and never more than 64."""
    from minicb.cuda_graphs import graph_buckets
    assert graph_buckets(16) == (1, 2, 4, 8, 16)
    assert graph_buckets(3) == (1, 2, 3)
    assert graph_buckets(1) == (1,)
    assert graph_buckets(64) == graph_buckets(256) == (1, 2, 4, 8, 16, 32, 64)


def test_decode_graph_runner_matches_the_eager_engine(tiny_checkpoint):
    """The CUDA-graph runner gives the same tokens as the plain engine, for batch sizes between
    buckets. On a GPU its graphs are captured and replayed; on the CPU its padded static
    buffers run eagerly, with the kernels in the interpreter."""
    from minicb import Engine, SamplingParams
    from minicb.model.loader import load_model

    pair = load_model(str(tiny_checkpoint("llama")), device=DEVICE)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 5, 7 + i] * (i + 1) for i in range(3)]
    results = []
    for use_runner in (False, True):
        engine = Engine(pair, policy="continuous", attention_backend="triton", num_pages=32,
                        page_size=16, device=DEVICE, dtype="float32", use_cuda_graphs=False,
                        check_invariants=True)
        calls = []
        if use_runner:
            runner = engine.runner.make_graph_runner(capture=DEVICE == "cuda")
            engine.runner.graph_runner = runner
            plain_run = runner.run
            runner.run = lambda *a, c=calls, f=plain_run: c.append(len(a[0])) or f(*a)
        ids = [engine.add_request(p, params) for p in prompts]
        engine.run()
        results.append([engine.requests[i].output_token_ids for i in ids])
    assert results[0] == results[1]
    assert calls and 3 in calls, "decode-only steps of 3 requests went through the runner"
    assert engine.runner.graph_runner.bucket(3) == 4
    assert engine.runner.graph_runner.max_batch == engine.config.max_num_seqs


def test_padding_rows_of_a_smaller_decode_step_store_nothing(tiny_checkpoint):
    """A step of 3 then a step of 1 in the same 4-row bucket: the second step writes its one
    row's K/V and nothing else, not the first step's stale slots again (by then those pages
    may be another request's). A batch the size of a bucket runs in that bucket."""
    from minicb.cuda_graphs import DecodeGraphRunner
    from minicb.model.loader import load_model

    model, _ = load_model(str(tiny_checkpoint("llama")), device=DEVICE, prepack=False,
                          attention_backend="triton")
    kv = model.allocate_kv_cache(4, 16)
    runner = DecodeGraphRunner(model, kv, 16, 1, DEVICE, buckets=(2, 4),
                               capture=DEVICE == "cuda")
    assert (runner.bucket(1), runner.bucket(2), runner.bucket(3), runner.bucket(4)) == (2, 2, 4, 4)
    runner.run([5, 6, 7], [0, 0, 0], [0, 16, 32], [1, 1, 1], [[0], [1], [2]])
    before = [(k.clone(), v.clone()) for k, v in kv]
    out = runner.run([9], [1], [1], [2], [[0]])
    assert out.shape[0] == 1
    for (k, v), (k0, v0) in zip(kv, before):
        changed = ((k != k0) | (v != v0)).flatten(2).any(-1).nonzero().tolist()
        assert changed == [[0, 1]]  # page 0, offset 1: the one new token, nothing else


def test_graph_runner_buckets_are_sorted_and_its_steps_are_decode_rows():
    """A DecodeGraphRunner sorts its buckets whatever order they are given in (a step runs in
    the smallest graph that holds it; max_batch is the largest), and its metadata says every
    row is a decode row (so a captured step runs the decode kernel, not the prefill one)."""
    from minicb.cuda_graphs import DecodeGraphRunner
    runner = DecodeGraphRunner(None, [], 16, 3, "cpu", buckets=(4, 2), capture=False)
    assert (runner.buckets, runner.max_batch, runner.bucket(1), runner.bucket(3)) == \
        ((2, 4), 4, 2, 4)
    meta = runner.metadata(2)
    assert (meta.num_decodes, meta.num_members, meta.query_start_loc.tolist()) == (2, 2,
                                                                                  [0, 1, 2])
    assert meta.page_tables.shape == (2, 3)


def test_store_writes_slot_zero():
    """Slot 0 (page 0, offset 0) is a real slot: only negative slots are padding."""
    q, k, v, k_cache, v_cache, _ = paged_cases.make_case([(0, 3)], 16, 1)
    meta = build_metadata([[0]], [0], [3], 16)
    tops.store_kv(k, v, k_cache, v_cache, meta)
    assert torch.equal(k_cache[0, :3], k) and torch.equal(v_cache[0, :3], v)


def test_rms_norm_adds_eps_and_rounds_like_the_reference_in_float16():
    """eps is inside the root, and in 16-bit the normalized row is rounded before the weight
    multiplies it, bit for bit as the reference (float16: the interpreter truncates float32 to
    bfloat16, so bfloat16 cannot be compared bit for bit on the CPU)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 96, generator=gen)
    weight = torch.rand(96, generator=gen) + 0.5
    assert_close(tops.rms_norm(x, weight, 1.0), torch_ref.rms_norm(x, weight, 1.0))
    assert torch.equal(tops.rms_norm(torch.zeros(2, 96), weight, 1e-6), torch.zeros(2, 96))
    xh, wh = (x * 3).half(), weight.half()
    assert torch.equal(tops.rms_norm(xh, wh, 1e-6), torch_ref.rms_norm(xh, wh, 1e-6))


def test_a_mismatched_cache_dtype_and_a_strided_rope_are_refused():
    """Caches of another dtype than the query's are a TypeError; RoPE in place needs a
    contiguous last dimension (a ValueError otherwise)."""
    q, k, v, k_cache, v_cache, meta = paged_cases.make_case([(5, 1)], 16, 1)
    with pytest.raises(TypeError, match="must match the query's"):
        tops.attend(q, k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.25)
    cos = sin = torch.ones(1, 1, HEAD_DIM // 2)
    strided = torch.randn(1, NUM_KV_HEADS, 2 * HEAD_DIM)[..., ::2]
    with pytest.raises(ValueError, match="contiguous last dimension"):
        tops.rope(strided, k.contiguous(), cos, sin)
