"""A Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) in plain PyTorch over the paged
KV cache (chapter 01): one flat token batch in, never a request; q/k/v and gate/up fused at load."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn as nn
import torch.nn.functional as F

from minicb.attention import AttentionMetadata, get_backend, torch_ref

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass
class ModelConfig:
    """The shape of a Llama-family model, read from a Hugging Face config.json (chapter 01)."""

    architecture: str  # "llama", "mistral", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # only {"rope_type": "llama3", ...} is supported
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always has it)
    o_proj_bias: bool = False  # bias on o_proj (Llama with attention_bias=True)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf(cls, cfg: Mapping) -> ModelConfig:
        """From a config.json dict with HF_DEFAULTS filled in; ValueError for what cannot run."""
        arch = (cfg.get("architectures") or [_ARCH_FROM_MODEL_TYPE.get(cfg.get("model_type"))])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch or cfg.get('model_type')!r}; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        name = SUPPORTED_ARCHITECTURES[arch]
        cfg = {**HF_DEFAULTS[name], **cfg}
        quant = cfg.get("quantization_config")
        if quant:  # its tensors are packed integers or fp8 plus scales, not weights to copy
            method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
            raise ValueError(f"pre-quantized checkpoint (quant_method {method!r}): use a float "
                             "checkpoint, and quantization='int8' to quantize it at load")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (only 'silu')")
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported: mlp_bias=True")
        window, max_len = cfg.get("sliding_window"), cfg["max_position_embeddings"]
        windowed = windowed_layers(name, cfg)
        if windowed and window < max_len:  # a window as long as the context changes nothing
            raise ValueError(f"unsupported: sliding-window attention ({arch}, sliding_window="
                             f"{window} < max_position_embeddings={max_len}, in layers {windowed})")
        # transformers >= 5 writes `rope_parameters`; older files have rope_theta + rope_scaling
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (only 'default' and 'llama3')")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("unsupported: partial_rotary_factor != 1")
        heads = cfg["num_attention_heads"]
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=name, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
            rope_scaling=rope if rope_type == "llama3" else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias or name == "qwen2", o_proj_bias=bias and name != "qwen2",
            qk_norm=name == "qwen3", max_position_embeddings=max_len,
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"))


def windowed_layers(family: str, cfg: Mapping) -> list[int]:
    """The layers transformers runs with a sliding window (Mistral: all; Qwen2/3: if asked)."""
    layers = range(cfg["num_hidden_layers"])
    if not cfg.get("sliding_window") or family == "llama":
        return []
    if family == "mistral":
        return list(layers)
    types = cfg.get("layer_types")  # else the layers from max_window_layers on
    return [i for i in layers if cfg.get("use_sliding_window") and (
        types[i] == "sliding_attention" if types else i >= cfg["max_window_layers"])]


# transformers' defaults for keys a family's config.json may leave out: a missing key must mean
# what it means there (Qwen2/3's context is 32768, Mistral attends through a window)
HF_DEFAULTS: dict[str, dict] = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8,
                "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32,
              "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128,
              "sliding_window": 4096, "max_window_layers": 28},
}
_ARCH_FROM_MODEL_TYPE = {name: arch for arch, name in SUPPORTED_ARCHITECTURES.items()}


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2] as transformers computes them (or "llama3")."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if not s:
        return inv_freq
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, by the backend's `rms_norm`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, backend: ModuleType = torch_ref) -> torch.Tensor:
        return backend.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k norm, RoPE, then the paged-cache backend."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim, self.q_size = cfg.head_dim, cfg.num_heads * cfg.head_dim
        qkv_size = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                backend: ModuleType) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).view(T, -1, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q, backend), self.k_norm(k, backend)
        q, k = backend.rope(q, k, cos, sin)
        k_cache, v_cache = kv_cache
        backend.store_kv(k, v, k_cache, v_cache, meta)
        out = backend.attend(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one product."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, kv_cache, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x, backend), cos, sin, meta, kv_cache,
                               backend)
        return x + self.mlp(self.post_attention_layernorm(x, backend))

    @functools.cached_property  # the same parameters, however their data moves or loads
    def row_weights(self) -> list[torch.Tensor | None]:
        """This layer's tensors in the order the cpu backend's `decode_layer` reads them."""
        attn, mlp = self.self_attn, self.mlp
        return [self.input_layernorm.weight, self.post_attention_layernorm.weight,
                attn.qkv_proj.weight, attn.qkv_proj.bias,
                attn.q_norm and attn.q_norm.weight, attn.k_norm and attn.k_norm.weight,
                attn.o_proj.weight, attn.o_proj.bias, mlp.gate_up_proj.weight,
                mlp.down_proj.weight]


def projections(model: LlamaModel) -> list[tuple[nn.Module, str]]:
    """(owner, name) of every layer's four projections, which int8 and prepacking replace."""
    return [(owner, name) for layer in model.layers
            for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj"))]


class LlamaModel(nn.Module):
    """Embeddings, layers, final norm and LM head (chapter 01); logits of `logits_indices` only."""

    def __init__(self, cfg: ModelConfig, attention_backend: str = "torch") -> None:
        super().__init__()
        self.config = cfg
        # weights come from a checkpoint: zeros skip a random init that is slow on "meta"
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.zeros(cfg.vocab_size, cfg.hidden_size), freeze=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.quantization: str | None = None  # "int8" after `quant.quantize_int8`
        self.prepacked = False  # True after `prepack.prepack_model` (oneDNN-packed float32)
        self.set_attention_backend(attention_backend)
        self._cos = self._sin = None  # RoPE tables, built on first use (see `rope`)

    def set_attention_backend(self, name: str) -> None:
        """Pick the backend module every layer calls ("torch", "cpu", "triton")."""
        self.attention_backend = get_backend(name)
        self.attention_backend_name = name

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim/2] of these positions, from tables built once."""
        # on the CPU the tables grow in powers of two; elsewhere they cover
        # max_position_embeddings at once, so the forward never reads positions back
        n = self.config.max_position_embeddings
        if positions.device.type == "cpu" and positions.numel():
            n = max(4096, 1 << int(positions.max()).bit_length())
        if self._cos is None or self._cos.device != positions.device or len(self._cos) < n:
            t = torch.arange(n, dtype=torch.float32)
            freqs = torch.outer(t, rope_inv_freq(self.config)).to(positions.device)
            self._cos, self._sin = freqs.cos(), freqs.sin()
        dtype = self.embed_tokens.weight.dtype
        return (self._cos[positions].to(dtype).unsqueeze(1),
                self._sin[positions].to(dtype).unsqueeze(1))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; kv_caches[layer] = (k_cache, v_cache) -> logits [N, V]."""
        cos, sin = self.rope(positions)
        x = self.embed_tokens(input_ids)
        backend, eps = self.attention_backend, self.config.rms_norm_eps
        # one decoded float32 row on the CPU: each layer is one C call (cpu_kernel.decode_layer)
        one_row = (len(input_ids) == 1 and hasattr(backend, "decode_layer")
                   and self.quantization is None and x.dtype == kv_caches[0][0].dtype
                   == torch.float32 and kv_caches[0][0].is_contiguous())
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            if one_row:
                x = backend.decode_layer(x, layer.row_weights, eps, cos, sin, meta, kv_cache,
                                         layer.self_attn.scale)
            else:
                x = layer(x, cos, sin, meta, kv_cache, backend)
        x = self.norm(x[logits_indices], self.attention_backend)
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        return logits.float()

    def allocate_kv_cache(self, num_pages: int, page_size: int, device=None,
                          dtype=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed per-layer (k_cache, v_cache), each [num_pages, page_size, kv_heads, head_dim]."""
        w = self.embed_tokens.weight
        shape = (num_pages, page_size, self.config.num_kv_heads, self.config.head_dim)
        kw = dict(device=device or w.device, dtype=dtype or w.dtype)
        return [(torch.zeros(shape, **kw), torch.zeros(shape, **kw))
                for _ in range(self.config.num_layers)]

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face tensors into this model, fusing q/k/v and gate/up; KeyError names a
        missing tensor, ValueError one not float (fp8, packed int) or not the configured shape."""
        def put(param: torch.Tensor, *names: str) -> None:
            missing = [n for n in names if n not in tensors]
            if missing:
                raise KeyError(f"checkpoint has no tensor {missing[0]!r}")
            for name in names:  # copy_ would cast fp8 or int silently
                t = tensors[name]
                if not t.is_floating_point() or t.element_size() < 2:
                    raise ValueError(f"tensor {name!r} is stored as {t.dtype}, a quantized "
                                     "format: use a float (unquantized) checkpoint")
            src = torch.cat([tensors[n] for n in names]) if len(names) > 1 else tensors[names[0]]
            if src.shape != param.shape:
                raise ValueError(f"tensor {' + '.join(names)!r} has shape {tuple(src.shape)}, "
                                 f"but config.json makes it {tuple(param.shape)}")
            param.copy_(src)

        fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}
        for name, param in self.named_parameters():
            hf = name if name.startswith("lm_head.") else "model." + name
            module, _, leaf = hf.rpartition(".")  # e.g. "model.layers.0.mlp.gate_up_proj", "weight"
            parent, _, child = module.rpartition(".")
            put(param, *([f"{parent}.{part}.{leaf}" for part in fused[child]] if child in fused
                         else [hf]))
