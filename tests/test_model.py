"""The model and loader (chapter 01) against Hugging Face transformers, with no engine: a small
local greedy loop drives the model over a paged KV cache whose pages are shuffled."""

from __future__ import annotations

import json
import platform
import random
import shutil

import pytest
import torch
from tiny_models import (
    CHATS,
    PAGE_SIZE,
    hf_greedy,
    load_hf,
    make_tiny_checkpoint,
    paged_greedy,
    save_random_checkpoint,
    tiny_config,
)

from minicb.attention import build_metadata, cpu_kernel
from minicb.model import ModelConfig, is_bundled, load_model
from minicb.model.llama import LlamaModel, rope_inv_freq
from minicb.model.prepack import PackedLinear, prepack_possible

needs_prepack = pytest.mark.skipif(not prepack_possible("cpu", torch.float32),
                                   reason="torch built without oneDNN")
needs_cc = pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                              reason="the CPU kernels do not build here")

PROMPTS = [[5], [17, 3, 99, 42, 8, 8, 200], list(range(30, 53))]  # 1 token, < 2 pages, 6 pages


# --- parity with transformers on tiny random checkpoints ----------------------------------------

@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_cc)])
@pytest.mark.parametrize("prepack", [False, pytest.param(True, marks=needs_prepack)],
                         ids=["F.linear", "prepacked"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3-rope"])
def test_greedy_matches_hf(tiny_checkpoint, arch, tie, prepack, backend):
    """Greedy tokens equal transformers', and every step's logits within 1e-4, whichever
    products (F.linear, oneDNN's packed ones, the C one-row product) and whichever attention
    backend (the cpu one runs each decoded row's layer as one C call) the model takes."""
    path = tiny_checkpoint(arch, tie=tie)
    model, info = load_model(path, prepack=prepack, attention_backend=backend)
    assert model.prepacked == prepack and info.config.tie_word_embeddings == tie
    assert (model.lm_head is None) == (tie and not prepack)  # prepacking packs a tied head too
    hf = load_hf(path, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        ours, our_logits = paged_greedy(model, prompt, 32, seed=i)
        theirs, their_logits = hf_greedy(hf, prompt, 32)
        assert ours == theirs, f"prompt {i}"
        for step, (a, b) in enumerate(zip(our_logits, their_logits)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"prompt {i} step {step}")


def test_mixed_batch_equals_single_requests(tiny_qwen3_dir):
    """Two decode rows and one (second) prefill chunk share a forward and a page pool; each
    member's logits equal what it gets alone."""
    model, _ = load_model(tiny_qwen3_dir)
    prompts = {"a": list(range(40, 50)), "b": [7, 8, 9, 10, 11], "c": list(range(100, 113))}
    nxt = {"a": 77, "b": 78}  # the token each decode member feeds this step
    pool = random.Random(1).sample(range(64), 64)
    tables = {"a": pool[:4], "b": pool[4:8], "c": pool[8:12]}
    caches = model.allocate_kv_cache(64, PAGE_SIZE)

    def run(members, rows):  # members: (name, num_computed, new token ids)
        ids = [t for _, _, new in members for t in new]
        pos = [p for _, s, new in members for p in range(s, s + len(new))]
        meta = build_metadata([tables[n] for n, _, _ in members], [s for _, s, _ in members],
                              [len(new) for _, _, new in members], PAGE_SIZE)
        with torch.inference_mode():
            return model(torch.tensor(ids), torch.tensor(pos), meta, caches, torch.tensor(rows))

    # alone: each request in its own forwards
    run([("a", 0, prompts["a"])], [9])
    alone_a = run([("a", 10, [nxt["a"]])], [0])
    run([("b", 0, prompts["b"])], [4])
    alone_b = run([("b", 5, [nxt["b"]])], [0])
    alone_c = run([("c", 0, prompts["c"])], list(range(6, 13)))
    # mixed: a and b re-run their decode step (same slots), c redoes chunk 2 after chunk 1
    run([("c", 0, prompts["c"][:6])], [5])
    mixed = run([("a", 10, [nxt["a"]]), ("b", 5, [nxt["b"]]), ("c", 6, prompts["c"][6:])],
                [0, 1, *range(2, 9)])
    torch.testing.assert_close(mixed[0], alone_a[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[1], alone_b[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[2:], alone_c, atol=1e-5, rtol=0)


def test_metadata_slots_and_tables_match_the_formula():
    """`build_metadata` keeps lists and builds tensors on first use: slot of position p is
    page_table[p // page_size] * page_size + p % page_size, for chunks starting mid-page."""
    rng = random.Random(3)
    for page_size in (4, 16):
        members = [(rng.randrange(0, 40), n) for n in (1, 1, 7, 2 + rng.randrange(30))]
        members.sort(key=lambda m: m[1] != 1)
        tables = [rng.sample(range(100), -(-(c + n) // page_size)) for c, n in members]
        meta = build_metadata(tables, [c for c, _ in members], [n for _, n in members],
                              page_size)
        tables[0].append(99)  # the caller's lists may change after the step: meta kept a copy
        expected = [t[p // page_size] * page_size + p % page_size
                    for t, (c, n) in zip(meta.page_table_list, members)
                    for p in range(c, c + n)]
        assert meta.slot_mapping.tolist() == expected
        assert meta.query_start_loc.tolist() == [0, 1, 2, 9, 9 + members[3][1]]
        assert meta.context_lens.tolist() == [c + n for c, n in members]
        assert meta.num_decodes == 2 and meta.page_tables.shape == (
            4, max(len(t) for t in meta.page_table_list))
        assert meta.page_tables[0].tolist()[:len(meta.page_table_list[0])] == \
            meta.page_table_list[0]
    with pytest.raises(ValueError, match="cannot hold"):
        build_metadata([[0]], [10], [7], 16)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_int_tensor_equals_torch_tensor(dtype):
    """int_tensor gives the same values and dtype as torch.tensor, in int64 and int32, for an empty
    list, one value, negatives and the int32 maximum."""
    from minicb.attention import int_tensor
    for values in ([], [7], list(range(-5, 600)), [2**31 - 1]):
        got = int_tensor(values, dtype)
        assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))


def test_rope_inv_freq_matches_transformers(tiny_checkpoint):
    """The llama3-scaled rope inverse frequencies equal those transformers computes for the same
    config."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    path = tiny_checkpoint("llama3-rope")
    ours = rope_inv_freq(ModelConfig.from_hf(json.loads((path / "config.json").read_text())))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(path))
    assert torch.equal(ours, theirs)


def test_sharded_checkpoint_loads_the_same(tiny_llama_dir, tmp_path):
    """A checkpoint saved in shards with an index file loads to the same weights as the single
    file."""
    hf = load_hf(tiny_llama_dir)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a, _ = load_model(tiny_llama_dir, prepack=False)  # packed weights have no strides to compare
    b, _ = load_model(tmp_path, prepack=False)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


# --- prepacked float32 projections (oneDNN's layout) --------------------------------------------

@needs_prepack
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_the_same_product(bias):
    """Batches (oneDNN's packed weight), one to three rows (the C product over the plain
    weight), strided and empty inputs: all F.linear's product to float32 rounding."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=gen)
    b = torch.randn(40, generator=gen) if bias else None
    layer = PackedLinear(weight, b)
    assert torch.equal(layer.weight, weight)
    for x in (torch.randn(3, 5, 24, generator=gen), torch.randn(1, 24, generator=gen),
              torch.randn(3, 24, generator=gen)):
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, b),
                                   rtol=1e-5, atol=1e-5)
    strided = torch.randn(24, 7, generator=gen).T  # not contiguous
    torch.testing.assert_close(layer(strided), strided @ weight.T + (0 if b is None else b),
                               rtol=1e-5, atol=1e-5)
    assert layer(torch.empty(0, 24)).shape == (0, 40)


@needs_prepack
def test_prepacked_plain_weights_move_to_one_huge_page_region(tiny_llama_dir):
    """prepack_model copies the plain weights the one-row products stream (projections and the
    embedding, the tied head's) into one mapping starting on a 2 MB boundary (Linux), values
    unchanged."""
    import mmap
    plain, _ = load_model(tiny_llama_dir, prepack=False)
    packed, _ = load_model(tiny_llama_dir, prepack=True)
    weights = [packed.layers[0].self_attn.qkv_proj.weight, packed.layers[1].mlp.down_proj.weight,
               packed.embed_tokens.weight]
    assert torch.equal(weights[0], plain.layers[0].self_attn.qkv_proj.weight)
    assert torch.equal(weights[2], plain.embed_tokens.weight)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert packed.layers[0].self_attn.qkv_proj.weight.data_ptr() % (2 << 20) == 0
        assert len({w.untyped_storage().data_ptr() for w in weights}) == 1  # one region


@needs_prepack
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="prepacking is the default on x86-64 only")
def test_prepack_is_the_float32_cpu_default(tiny_llama_dir, monkeypatch):
    """On x86-64, a float32 CPU model is prepacked by default with the same weights and parameter
    count; MINICB_PREPACK=0 and int8 turn it off, and a MINICB_PREPACK other than 0 or 1 raises
    ValueError."""
    packed, _ = load_model(tiny_llama_dir)
    plain, _ = load_model(tiny_llama_dir, prepack=False)
    assert packed.prepacked and not plain.prepacked
    assert isinstance(packed.layers[0].mlp.down_proj, PackedLinear)
    assert torch.equal(packed.layers[0].mlp.down_proj.weight,
                       plain.layers[0].mlp.down_proj.weight)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(packed) == count(plain)
    monkeypatch.setenv("MINICB_PREPACK", "0")
    assert not load_model(tiny_llama_dir)[0].prepacked
    assert not load_model(tiny_llama_dir, quantization="int8")[0].prepacked
    monkeypatch.setenv("MINICB_PREPACK", "maybe")  # refused, not silently taken as on
    with pytest.raises(ValueError, match="MINICB_PREPACK .* must be 0 .* or 1"):
        load_model(tiny_llama_dir)


@needs_prepack
def test_prepack_is_asked_for_on_other_cpus(tiny_llama_dir, monkeypatch):
    """On an Arm CPU oneDNN's speed is unmeasured: F.linear stays the default there."""
    monkeypatch.setattr("minicb.model.prepack.platform.machine", lambda: "arm64")
    assert not load_model(tiny_llama_dir)[0].prepacked
    assert load_model(tiny_llama_dir, prepack=True)[0].prepacked


needs_bf16_prepack = pytest.mark.skipif(
    not prepack_possible("cpu", torch.bfloat16), reason="oneDNN runs no bf16 on this CPU")


@needs_bf16_prepack
def test_packed_bfloat16_is_the_same_product_and_model():
    """A bfloat16 PackedLinear keeps its weights unchanged and computes the plain linear product
    within 2e-2."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    layer = PackedLinear(weight, bias)
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight, weight)
    x = torch.randn(3, 24, generator=gen).bfloat16()
    torch.testing.assert_close(layer(x).float(), torch.nn.functional.linear(x, weight, bias)
                               .float(), rtol=2e-2, atol=2e-2)


@needs_bf16_prepack
def test_a_prepacked_bfloat16_model_gives_the_same_logits(tiny_llama_dir):
    """A prepacked bfloat16 model gives the unpacked model's logits within 0.05 and the same
    argmax."""
    from minicb.attention import build_metadata
    logits = {}
    for prepack in (False, True):
        model, _ = load_model(tiny_llama_dir, dtype=torch.bfloat16, prepack=prepack)
        assert model.prepacked == prepack
        kv = model.allocate_kv_cache(4, 16)
        meta = build_metadata([[0]], [0], [5], 16)
        logits[prepack] = model(torch.tensor([3, 1, 4, 1, 5]), torch.arange(5), meta, kv,
                                torch.tensor([4]))
    torch.testing.assert_close(logits[True], logits[False], rtol=0.05, atol=0.05)
    assert logits[True].argmax() == logits[False].argmax()


def test_prepack_refuses_what_it_cannot_pack(tiny_llama_dir, monkeypatch):
    """prepack=True with int8, or with 16-bit weights where the CPU lacks bfloat16 support, raises
    ValueError asking for float32; a prepack that is not None, True or False is refused naming the
    value."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    for kwargs in (dict(quantization="int8"), dict(dtype=torch.bfloat16),
                   dict(dtype=torch.float16)):
        with pytest.raises(ValueError, match="prepack=True needs float32 weights on the CPU"):
            load_model(tiny_llama_dir, prepack=True, **kwargs)
    with pytest.raises(ValueError, match="prepack must be None, True or False, got 'yes'"):
        load_model(tiny_llama_dir, prepack="yes")


# --- the loader's answers to good and bad input -------------------------------------------------

def test_eos_ids_outside_the_vocabulary_are_left_out(tmp_path):
    """A checkpoint naming an EOS id it cannot produce: the id is dropped, and a min_tokens
    request (which bans the EOS ids) still runs."""
    from minicb import LLM, SamplingParams
    path = make_tiny_checkpoint(tmp_path / "odd-eos")
    for name in ("config.json", "generation_config.json"):
        data = json.loads((path / name).read_text())
        data["eos_token_id"] = [2, 300, -1]  # vocab is 256
        (path / name).write_text(json.dumps(data))
    model, info = load_model(path)
    assert info.eos_token_ids == (2,)
    out = LLM((model, info)).generate([[5, 6, 7]], SamplingParams(max_tokens=4, min_tokens=3))
    assert out[0].finish_reason in ("length", "stop") and len(out[0].token_ids) >= 3


def test_info_of_tiny_checkpoint(tiny_qwen2_dir):
    """load_model's info for a tokenizer-less Qwen2 checkpoint has no tokenizer, eos id 2, the qwen2
    architecture with attention bias and the given path, and no parameter requires grad."""
    model, info = load_model(tiny_qwen2_dir)
    assert info.tokenizer is None and info.eos_token_ids == (2,)
    assert info.config.architecture == "qwen2" and info.config.attention_bias
    assert info.path == tiny_qwen2_dir and not any(p.requires_grad for p in model.parameters())


def test_unknown_name_is_refused():
    """A name that is neither a bundled model nor a directory raises ValueError listing the bundled
    names."""
    with pytest.raises(ValueError, match="neither a bundled model.*smollm2-135m"):
        load_model("no-such-model")


def test_directory_without_config_is_refused(tmp_path):
    """A directory without config.json raises ValueError naming config.json."""
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)


def test_unsupported_architecture_is_refused(tiny_llama_dir, tmp_path):
    """A checkpoint of an unsupported architecture raises ValueError naming it and the supported
    ones."""
    shutil.copytree(tiny_llama_dir, tmp_path / "gpt2")
    cfg = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path / "gpt2")


@pytest.mark.parametrize("change, match", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "sliding_window": 1024, "max_window_layers": 0}, "sliding"),
])
def test_unsupported_config_is_refused(tiny_llama_dir, change, match):
    """A config with yarn rope scaling, a gelu activation or Qwen2 sliding-window layers raises
    ValueError naming the feature."""
    cfg = json.loads((tiny_llama_dir / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(cfg)


def test_bundled_names_match_case_insensitively_with_or_without_instruct():
    """Bundled names match case-insensitively, with or without the -Instruct suffix, and other names
    are not bundled."""
    assert is_bundled("smollm2-135m") and is_bundled("SmolLM2-135M-Instruct")
    assert not is_bundled("llama-7b")


def test_unknown_attention_backend_is_refused(tiny_llama_dir):
    """set_attention_backend with an unknown name raises ValueError naming it."""
    model, _ = load_model(tiny_llama_dir)
    with pytest.raises(ValueError, match="bogus"):
        model.set_attention_backend("bogus")


# --- the bundled SmolLM2-135M-Instruct ----------------------------------------------------------

@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2_dir):
    """On SmolLM2-135M chat prompts, the paged model's 16 greedy tokens equal Hugging Face's and its
    first logits are within 1e-3."""
    model, info = load_model("smollm2-135m")
    assert info.path == smollm2_dir and info.tokenizer is not None and 2 in info.eos_token_ids
    hf = load_hf(smollm2_dir)
    for i, text in enumerate(CHATS):
        prompt = info.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True, tokenize=True)
        prompt = list(getattr(prompt, "input_ids", prompt))
        ours, our_logits = paged_greedy(model, prompt, 16, eos_ids=info.eos_token_ids, seed=i)
        theirs, their_logits = hf_greedy(hf, prompt, 16)
        assert ours == theirs, (text, info.tokenizer.decode(ours), info.tokenizer.decode(theirs))
        torch.testing.assert_close(our_logits[0], their_logits[0], atol=1e-3, rtol=0)


def test_eos_ids_take_generation_config_first_and_stay_below_the_vocab_size(tmp_path):
    """generation_config.json's EOS ids (what a chat model stops on) are the stop ids, not
    config.json's as well (as HF generate); an id equal to the vocabulary size (256) cannot be
    sampled and is left out like any other id past the end."""
    path = make_tiny_checkpoint(tmp_path / "two-eos")
    for name, ids in (("generation_config.json", [7, 256]), ("config.json", 2)):
        data = json.loads((path / name).read_text())
        data["eos_token_id"] = ids
        (path / name).write_text(json.dumps(data))
    _, info = load_model(path, prepack=False)
    assert info.eos_token_ids == (7,)


def test_a_checkpoint_with_only_tokenizer_json_gets_its_tokenizer(tmp_path):
    """Most checkpoints ship tokenizer.json and tokenizer_config.json but neither
    tokenizer.model nor vocab.json: any one of the tokenizer files is enough."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    path = make_tiny_checkpoint(tmp_path / "with-tokenizer")
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 5, "world": 9}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    _, info = load_model(path, prepack=False)
    assert info.tokenizer is not None
    assert info.tokenizer.encode("hello world") == [5, 9]


def test_load_model_builds_the_attention_backend_asked_for(tiny_llama_dir):
    """A model used without an Engine (chapter 07's notebook calls it directly) attends with
    the backend load_model was given, not the torch default."""
    model, _ = load_model(tiny_llama_dir, prepack=False, attention_backend="cpu")
    assert model.attention_backend_name == "cpu"


# --- config fields the tiny checkpoints never vary ----------------------------------------------

def assert_greedy_matches_hf(path, steps: int = 8, **load) -> None:
    model, _ = load_model(path, **load)
    ours, our_logits = paged_greedy(model, PROMPTS[1], steps)
    theirs, their_logits = hf_greedy(load_hf(path, ignore_eos=True), PROMPTS[1], steps)
    assert ours == theirs
    for a, b in zip(our_logits, their_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_rms_norm_eps_from_the_config_reaches_every_norm(tmp_path):
    """config.json's rms_norm_eps is every norm's eps, as in transformers (0.05 here: at the
    tiny checkpoints' 1e-6, dropping it would change nothing visible)."""
    path = make_tiny_checkpoint(tmp_path / "eps")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"rms_norm_eps": 0.05}))
    model, info = load_model(path)
    assert info.config.rms_norm_eps == 0.05
    assert model.norm.eps == model.layers[0].input_layernorm.eps == 0.05
    assert_greedy_matches_hf(path, steps=4)
    assert_greedy_matches_hf(path, steps=4, attention_backend="cpu")  # the one-row C layer


def test_head_dim_comes_from_the_config_not_hidden_over_heads(tmp_path):
    """Qwen3-0.6B has 16 heads of 128 on a hidden size of 1,024: head_dim, and with it the
    attention scale, are the config's."""
    from transformers import Qwen3Config
    path = save_random_checkpoint(tiny_config(Qwen3Config, head_dim=32, rope_theta=1e6),
                                  tmp_path / "qwen3-wide")
    model, info = load_model(path)
    assert info.config.head_dim == 32 and model.layers[0].self_attn.scale == 32 ** -0.5
    assert_greedy_matches_hf(path)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_cc)])
def test_llama_attention_bias_is_on_q_k_v_and_o(tmp_path, backend):
    """Llama's attention_bias=True puts a bias on q, k, v and o_proj (Qwen2 has none on o), in
    the per-operation layers and in the cpu backend's one-row C layer alike."""
    from transformers import LlamaConfig
    path = save_random_checkpoint(tiny_config(LlamaConfig, attention_bias=True),
                                  tmp_path / "llama-bias")
    model, info = load_model(path, prepack=False)
    assert info.config.attention_bias and info.config.o_proj_bias
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
    assert_greedy_matches_hf(path, attention_backend=backend)


def test_rope_tables_grow_for_positions_past_their_first_size():
    """On the CPU the cos/sin tables start at 4,096 positions and grow in powers of two: a later,
    longer position reads its own angle (no IndexError, no stale table)."""
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
    """Logits come back in float32 whatever the weights' dtype."""
    model, _ = load_model(tiny_llama_dir, dtype=torch.bfloat16, prepack=False)
    kv = model.allocate_kv_cache(4, 16)
    meta = build_metadata([[2]], [0], [5], 16)
    with torch.inference_mode():
        logits = model(torch.tensor([3, 1, 4, 1, 5]), torch.arange(5), meta, kv,
                       torch.tensor([4]))
    assert logits.dtype == torch.float32 and logits.shape == (1, 256)


@needs_prepack
def test_a_prepacked_tied_head_is_not_a_second_parameter(tiny_checkpoint):
    """A tied LM head, packed, is a buffer outside the state dict: parameter counts and
    state-dict keys are the unpacked model's."""
    path = tiny_checkpoint("llama", tie=True)
    packed, _ = load_model(path, prepack=True)
    plain, _ = load_model(path, prepack=False)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(packed) == count(plain)
    assert "lm_head.weight" not in packed.state_dict()
