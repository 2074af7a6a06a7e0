"""Gaps a mutation review of the model and attention code found: behaviour the rest of the suite
left unpinned (config fields the tiny checkpoints never vary, RoPE tables past their first size,
the int8 and prepack paths of biased or tied models, and the checks that guard the C kernel and
the Triton wrappers against bad input)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from paged_cases import HEAD_DIM, NUM_KV_HEADS, assert_close, make_case
from test_attention_ref import check_against_dense
from test_model import hf_greedy, load_hf, paged_greedy
from tiny_models import make_tiny_checkpoint, save_random_checkpoint

from minicb.attention import build_metadata, cpu_kernel, int_tensor, torch_ref
from minicb.model import ModelConfig, load_model
from minicb.model.llama import LlamaModel, rope_inv_freq
from minicb.model.prepack import prepack_possible
from minicb.model.quant import Int8Linear

PROMPT = [17, 3, 99, 42, 8, 8, 200]


def write_checkpoint(path, config) -> str:
    """A random checkpoint of a transformers config the tiny_models helper does not write."""
    return str(save_random_checkpoint(config, path))


def tiny_config(cls, **overrides):
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6, initializer_range=0.2,
                  tie_word_embeddings=False)
    return cls(**(common | overrides))


def assert_greedy_matches_hf(path, steps: int = 8) -> None:
    model, _ = load_model(path)
    hf = load_hf(path, ignore_eos=True)
    ours, our_logits = paged_greedy(model, PROMPT, steps)
    theirs, their_logits = hf_greedy(hf, PROMPT, steps)
    assert ours == theirs
    for a, b in zip(our_logits, their_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


# --- config fields the tiny checkpoints never vary ----------------------------------------------

def test_rms_norm_eps_from_the_config_reaches_every_norm_and_matches_hf(tmp_path):
    """A large rms_norm_eps (the tiny checkpoints all use 1e-6, where dropping it changes
    nothing visible) is read from config.json and used by every norm, as transformers does."""
    path = make_tiny_checkpoint(tmp_path / "eps")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.05
    (path / "config.json").write_text(json.dumps(cfg))
    model, info = load_model(path)
    assert info.config.rms_norm_eps == 0.05
    assert model.norm.eps == model.layers[0].input_layernorm.eps == 0.05
    assert_greedy_matches_hf(path, steps=4)


def test_head_dim_wider_than_hidden_over_heads_matches_hf(tmp_path):
    """Qwen3-0.6B has 16 heads of 128 on a hidden size of 1,024: head_dim comes from the config,
    not hidden_size // heads, and so does the attention scale."""
    from transformers import Qwen3Config
    path = write_checkpoint(tmp_path / "qwen3-wide", tiny_config(
        Qwen3Config, head_dim=32, rope_theta=1000000.0))
    model, info = load_model(path)
    assert info.config.head_dim == 32 and model.layers[0].self_attn.scale == 32 ** -0.5
    assert_greedy_matches_hf(path)


def test_llama_with_attention_bias_matches_hf(tmp_path):
    """Llama's attention_bias=True puts a bias on q, k, v and o_proj (Qwen2 has none on o)."""
    from transformers import LlamaConfig
    path = write_checkpoint(tmp_path / "llama-bias", tiny_config(LlamaConfig, attention_bias=True))
    model, info = load_model(path, prepack=False)
    assert info.config.attention_bias and info.config.o_proj_bias
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
    assert_greedy_matches_hf(path)


@pytest.mark.parametrize("change, match", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 1024}, "sliding"),
])
def test_configs_the_model_would_run_wrongly_are_refused(tiny_llama_dir, change, match):
    cfg = json.loads((tiny_llama_dir / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(cfg)


def test_rope_tables_grow_for_positions_past_their_first_size():
    """On the CPU the cos/sin tables start at 4,096 positions and grow in powers of two as a
    step needs: a later, longer position reads the right angle (not an IndexError or a stale
    table)."""
    cfg = ModelConfig("llama", 32, 64, 64, 1, 4, 2, 16, max_position_embeddings=128)
    model = LlamaModel(cfg)
    inv = rope_inv_freq(cfg)
    for positions in ([0, 7], [4095], [5000, 3], [9000, 4096, 1]):
        pos = torch.tensor(positions)
        cos, sin = model.rope(pos)
        angles = torch.outer(pos.float(), inv)[:, None, :]
        torch.testing.assert_close(cos, angles.cos(), rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, angles.sin(), rtol=0, atol=1e-6)


def test_a_bfloat16_model_returns_float32_logits(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir, dtype=torch.bfloat16, prepack=False)
    kv = model.allocate_kv_cache(4, 16)
    meta = build_metadata([[2]], [0], [5], 16)
    with torch.inference_mode():
        logits = model(torch.tensor([3, 1, 4, 1, 5]), torch.arange(5), meta, kv,
                       torch.tensor([4]))
    assert logits.dtype == torch.float32 and logits.shape == (1, 256)


# --- RMSNorm arithmetic ------------------------------------------------------------------------

def test_rms_norm_adds_eps_and_rounds_like_transformers_in_bfloat16():
    """eps inside the root (a zero row stays zero, not NaN; eps=1 visibly shrinks a row), and
    in bfloat16 the normalized row is rounded before the weight multiplies it, bit for bit as
    transformers' LlamaRMSNorm does."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 96, generator=gen)
    weight = torch.rand(96, generator=gen) + 0.5
    zero = torch_ref.rms_norm(torch.zeros(2, 96), weight, 1e-6)
    assert torch.equal(zero, torch.zeros(2, 96))
    expected = weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1.0)
    torch.testing.assert_close(torch_ref.rms_norm(x, weight, 1.0), expected)
    hf = LlamaRMSNorm(96, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(weight)
    xb = (x * 3).bfloat16()
    assert torch.equal(torch_ref.rms_norm(xb, hf.weight, 1e-6), hf(xb))


# --- the reference's causal mask --------------------------------------------------------------

def test_a_chunk_after_one_cached_token_sees_that_token():
    """A chunk one token shorter than its context is not "the whole context": query i sits at
    position 1 + i and sees keys 0..1 + i (plain is_causal would align it at 0)."""
    check_against_dense([(4, 1), (1, 5), (1, 2), (0, 3)], seed=0)


# --- int8 and prepacked weights -----------------------------------------------------------------

def test_int8_scale_is_per_output_row():
    """Rows of very different sizes each use the whole int8 range: one scale per row, not one
    for the tensor (which would round a small row to zeros)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 32, generator=gen) * torch.tensor([1e-3, 1, 100, 0.1, 5, 1e-2])[:, None]
    layer = Int8Linear(weight)
    assert layer.qweight.abs().amax(dim=1).tolist() == [127] * 6
    torch.testing.assert_close(layer.scale.float(), (weight.abs().amax(dim=1) / 127).bfloat16()
                               .float())
    rel = (layer.dequantized() - weight).abs().amax(dim=1) / weight.abs().amax(dim=1)
    assert (rel < 0.01).all()


def test_int8_keeps_the_projection_biases(tiny_qwen2_dir):
    """Qwen2's q/k/v biases survive quantization: the int8 layer adds the float bias."""
    fp32, _ = load_model(tiny_qwen2_dir, prepack=False)
    int8, _ = load_model(tiny_qwen2_dir, quantization="int8")
    for a, b in zip(fp32.layers, int8.layers):
        assert isinstance(b.self_attn.qkv_proj, Int8Linear)
        assert b.self_attn.qkv_proj.bias is not None
        assert torch.equal(b.self_attn.qkv_proj.bias, a.self_attn.qkv_proj.bias)
    _, ours = paged_greedy(int8, PROMPT, 1)
    _, ref = paged_greedy(fp32, PROMPT, 1)
    assert (ours[0] - ref[0]).abs().max() / ref[0].abs().max() < 0.1


@pytest.mark.skipif(not prepack_possible("cpu", torch.float32), reason="no oneDNN")
def test_a_prepacked_tied_head_is_not_a_second_parameter(tiny_checkpoint):
    """The tied LM head's packed copy is a buffer outside the state dict: parameter counts and
    state-dict keys stay those of the unpacked model."""
    path = tiny_checkpoint("llama", tie=True)
    packed, _ = load_model(path, prepack=True)
    plain, _ = load_model(path, prepack=False)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(packed) == count(plain)
    assert "lm_head.weight" not in packed.state_dict()


# --- what the CPU kernel's wrapper must refuse before C reads it --------------------------------

needs_cc = pytest.mark.skipif(cpu_kernel._compiler() is None, reason="no C compiler")


def cpu_case():
    q, k, v, k_cache, v_cache, meta = make_case([(20, 1), (40, 1)], 16, 2)
    torch_ref.store_kv(k, v, k_cache, v_cache, meta)
    return q, k_cache, v_cache, meta


@needs_cc
def test_cpu_kernel_refuses_a_negative_page_id():
    q, k_cache, v_cache, _ = cpu_case()
    bad = build_metadata([[0, -1], [2, 3]], [20, 30], [1, 1], 16)
    with pytest.raises(ValueError, match="outside the cache's"):
        cpu_kernel.attend(q, k_cache, v_cache, bad, 0.25)


@needs_cc
def test_cpu_kernel_refuses_a_page_table_narrower_than_the_context():
    q, k_cache, v_cache, meta = cpu_case()
    meta.__dict__["page_tables"] = meta.page_tables[:, :2].contiguous()  # member 1 needs 3 pages
    with pytest.raises(ValueError, match="too short"):
        cpu_kernel.attend(q, k_cache, v_cache, meta, 0.25)


@needs_cc
def test_cpu_kernel_refuses_context_lens_that_disagree_or_are_not_int32():
    q, k_cache, v_cache, meta = cpu_case()
    longer = build_metadata(meta.page_table_list, [20, 40], [1, 1], 16)
    longer.__dict__["context_lens"] = int_tensor([21, 48], torch.int32)  # the list says 41
    with pytest.raises(ValueError, match="disagree"):
        cpu_kernel.attend(q, k_cache, v_cache, longer, 0.25)
    wide = build_metadata(meta.page_table_list, [20, 40], [1, 1], 16)
    wide.__dict__["context_lens"] = wide.context_lens.long()
    with pytest.raises(ValueError, match="context_lens as a contiguous int32"):
        cpu_kernel.attend(q, k_cache, v_cache, wide, 0.25)


@needs_cc
def test_cpu_kernel_refuses_heads_that_do_not_fit_the_caches():
    q, k_cache, v_cache, meta = cpu_case()  # 4 query heads of 16 over 2 kv heads
    with pytest.raises(ValueError, match="heads of"):
        cpu_kernel.attend(torch.randn(2, 5, HEAD_DIM), k_cache, v_cache, meta, 0.25)
    with pytest.raises(ValueError, match="heads of"):
        cpu_kernel.attend(torch.randn(2, 4, HEAD_DIM // 2), k_cache, v_cache, meta, 0.25)
    with pytest.raises(ValueError, match="q has 3 rows"):  # C would ignore the extra row
        cpu_kernel.attend(torch.randn(3, 4, HEAD_DIM), k_cache, v_cache, meta, 0.25)


@needs_cc
def test_cpu_backend_gives_the_reference_on_non_contiguous_caches():
    """A cache whose rows are views into a wider pool (strided, not contiguous) is not what C
    can walk: the backend still returns the reference's answer."""
    q, k_cache, v_cache, meta = cpu_case()
    k_pool = torch.zeros(*k_cache.shape[:-1], 2 * HEAD_DIM)
    v_pool = torch.zeros_like(k_pool)
    k_pool[..., :HEAD_DIM], v_pool[..., :HEAD_DIM] = k_cache.nan_to_num(), v_cache.nan_to_num()
    k_view, v_view = k_pool[..., :HEAD_DIM], v_pool[..., :HEAD_DIM]
    assert not k_view.is_contiguous()
    expected = torch_ref.attend(q, k_view.contiguous(), v_view.contiguous(), meta, 0.25)
    assert_close(cpu_kernel.attend(q, k_view, v_view, meta, 0.25), expected)


@needs_cc
def test_cpu_kernel_is_never_handed_caches_of_two_dtypes(monkeypatch):
    """The kernel reads both caches as one type: float32 keys with bfloat16 values (half the
    bytes) would read past the value cache. Such caches go to the reference (which refuses)."""
    q, k_cache, v_cache, meta = cpu_case()

    def no_kernel(dtype):
        raise AssertionError(f"the C kernel was asked for {dtype} caches of two dtypes")
    monkeypatch.setattr(cpu_kernel, "kernel", no_kernel)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_kernel.attend(q, k_cache, v_cache.bfloat16(), meta, 0.25)


# --- the Triton wrappers (in the interpreter on the CPU) ----------------------------------------

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import, as test_triton


def triton_ops():
    tops = pytest.importorskip("minicb.attention.triton_ops")
    if not tops._interpreted():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    return tops


@pytest.mark.triton
def test_triton_store_writes_slot_zero():
    """Slot 0 (page 0, offset 0) is a real slot: only negative slots are padding."""
    tops = triton_ops()
    q, k, v, k_cache, v_cache, _ = make_case([(0, 3)], 16, 1)
    meta = build_metadata([[0]], [0], [3], 16)
    tops.store_kv(k, v, k_cache, v_cache, meta)
    assert torch.equal(k_cache[0, :3], k) and torch.equal(v_cache[0, :3], v)


@pytest.mark.triton
def test_triton_rms_norm_adds_eps_and_rounds_like_the_reference_in_float16():
    """eps inside the root, and in 16-bit the normalized row is rounded before the weight
    multiplies it, bit for bit as the reference. (float16: the interpreter rounds float32 to
    bfloat16 by truncation, so bfloat16 cannot be compared bit for bit on the CPU.)"""
    tops = triton_ops()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 96, generator=gen)
    weight = torch.rand(96, generator=gen) + 0.5
    assert_close(tops.rms_norm(x, weight, 1.0), torch_ref.rms_norm(x, weight, 1.0))
    assert torch.equal(tops.rms_norm(torch.zeros(2, 96), weight, 1e-6), torch.zeros(2, 96))
    xh, wh = (x * 3).half(), weight.half()
    assert torch.equal(tops.rms_norm(xh, wh, 1e-6), torch_ref.rms_norm(xh, wh, 1e-6))


@pytest.mark.triton
def test_triton_refuses_mismatched_cache_dtype_and_strided_rope():
    tops = triton_ops()
    q, k, v, k_cache, v_cache, meta = make_case([(5, 1)], 16, 1)
    with pytest.raises(TypeError, match="must match the query's"):
        tops.attend(q, k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.25)
    cos = sin = torch.ones(1, 1, HEAD_DIM // 2)
    strided = torch.randn(1, NUM_KV_HEADS, 2 * HEAD_DIM)[..., ::2]
    with pytest.raises(ValueError, match="contiguous last dimension"):
        tops.rope(strided, k.contiguous(), cos, sin)
