"""Prepacked projections: the CPU's fast path for every matrix product (chapter 01, "A third
lever: the same bytes, a better layout").

`F.linear` hands a float32 product to torch's general matrix multiply (MKL in the x86 CPU
wheels), which copies the weight into the layout of its inner loops on every call. oneDNN's
inner-product primitive instead takes a weight stored once in its own blocked layout
(`AB16b64a` with AVX-512): `prepack_model` converts every projection of a loaded model, and the
LM head, once at load time. On the course machine (AMD EPYC, 2 cores, AVX-512) SmolLM2-135M's
projections then run 2.1-2.6x faster at every batch size from 1 to 2,048 rows (bench/README.md).
The results are the same float32 products, summed in a different order: they differ from
`F.linear`'s by about 1e-6 relative.

bfloat16 weights are prepacked the same way where oneDNN runs bf16 products (AVX-512 BF16 or
AMX): on an Intel Xeon with AMX a forward's products ran 1.2-1.4x faster at 1-32 rows (0.8-0.9x
at 512) and `pd` on the mixed chat benchmark 1.02-1.30x in three alternated pairs.

It is on by default for these weights on an x86-64 CPU; `load_model(..., prepack=False)` or
`MINICB_PREPACK=0` keeps `F.linear` (to compare, or where oneDNN is missing), and
`prepack=True` asks for it elsewhere (an Arm CPU, where it is unmeasured). The op is torch's own
(`torch.ops.mkldnn`, as `torch.compile` uses it on the CPU), not a new kernel. A prepacked model
is for inference where it was loaded: its packed weights cannot be copied, saved, cast or moved
to another device (load it again instead).
"""

from __future__ import annotations

import os
import platform

import torch
import torch.nn as nn

from minicb.model.llama import projections


def prepack_available() -> bool:
    """Whether this torch build can prepack: oneDNN present and the packing op registered."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def prepack_possible(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Float32 weights on the CPU, or bfloat16 ones on a CPU oneDNN runs bf16 on, with a torch
    that can prepack them."""
    if torch.device(device).type != "cpu" or not prepack_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_wanted(device: str | torch.device, dtype: torch.dtype) -> bool:
    """The default: possible, on an x86-64 CPU, and `MINICB_PREPACK` not "0" (only 0 or 1 are
    accepted). Other CPUs (Arm) keep `F.linear` unless asked: oneDNN's speed there is
    unmeasured."""
    setting = os.environ.get("MINICB_PREPACK") or "1"
    if setting not in ("0", "1"):
        raise ValueError(f"MINICB_PREPACK (environment) must be 0 (F.linear) or 1 (prepack "
                         f"where it can), got {setting!r}")
    return (prepack_possible(device, dtype) and platform.machine().lower() in ("x86_64", "amd64")
            and setting == "1")


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias, with the weight held in oneDNN's blocked layout.

    The packed weight is an opaque tensor: it has a shape and a dtype, but no strides, so only
    `forward` and `unpacked()` can read it (`copy.deepcopy`, `torch.save`, `.half()` and `.to()`
    fail on it). A projection's weight is a parameter (parameter counts stay the same); a tied
    LM head's is a buffer outside the state dict: a second float32 copy of the embedding (113 MB
    for SmolLM2), not counted twice."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tied: bool = False) -> None:
        super().__init__()
        # the batch size is only a hint for the layout; any number of rows works afterwards
        weight = weight.detach()
        if weight.dtype not in (torch.float32, torch.bfloat16):
            weight = weight.float()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)
        if tied:
            self.register_buffer("weight", packed, persistent=False)
        else:
            self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(
            bias.detach().to(weight.dtype).clone(), requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def unpacked(self) -> torch.Tensor:
        """The weight in the ordinary [out, in] layout (for tests and inspection)."""
        return self.weight.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def prepack_model(model: nn.Module) -> nn.Module:
    """Replace every projection of a float32 (or bfloat16) CPU `LlamaModel` and its LM head by a
    `PackedLinear`, in place (the embedding stays: a lookup reads rows, not products)."""
    for owner, name in projections(model):
        linear = getattr(owner, name)
        setattr(owner, name, PackedLinear(linear.weight, linear.bias))
    tied = model.lm_head is None
    head = model.embed_tokens.weight if tied else model.lm_head.weight
    model.lm_head = PackedLinear(head, tied=tied)
    model.prepacked = True
    return model
