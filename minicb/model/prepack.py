"""Prepacked projections: the CPU's fast paths for every matrix product (chapter 01, "A third
lever: the same bytes, a better layout"; chapter 08, "CPU speed").

`F.linear` hands a float32 product to torch's general matrix multiply (MKL in the x86 CPU
wheels), which copies the weight into the layout of its inner loops on every call. oneDNN's
inner-product primitive instead takes a weight stored once in its own blocked layout:
`prepack_model` converts every projection of a loaded model, and the LM head, once at load
time, and batches of rows run 2.1-2.6x faster (bench/README.md).

One row is another problem: a decode step of one request reads every weight once and does two
flops per weight, so its speed is the memory's, and neither library streams a single row at it.
A `PackedLinear` therefore keeps the plain [out, in] weight too, and multiplies a single float32
row by it with the CPU backend's C `gemv` (each weight row read once, front to back, split over
the threads), where it builds; that costs a second copy of the projections in memory.

The packed and the plain products are the same float32 products, summed in different orders:
they differ by about 1e-6 relative. bfloat16 weights are prepacked the same way where oneDNN runs
bf16 products (AVX-512 BF16 or AMX); their single rows take oneDNN too.

It is on by default for these weights on an x86-64 CPU; `load_model(..., prepack=False)` or
`MINICB_PREPACK=0` keeps `F.linear` (to compare, or where oneDNN is missing), and
`prepack=True` asks for it elsewhere (an Arm CPU). The packed op is torch's own
(`torch.ops.mkldnn`, as `torch.compile` uses it on the CPU). A prepacked model is for inference
where it was loaded: its packed weights cannot be copied, saved, cast or moved (load it again).
"""

from __future__ import annotations

import os
import platform

import torch
import torch.nn as nn

from minicb.attention import cpu_kernel
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
    """y = x @ weight.T + bias, with the weight held twice: plain ([out, in], `weight`) for a
    single row, and in oneDNN's blocked layout (`packed`, an opaque tensor without strides that
    only oneDNN reads) for several. A tied LM head's `weight` is the embedding itself, a buffer
    outside the state dict, so parameters are counted once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tied: bool = False) -> None:
        super().__init__()
        weight = weight.detach().contiguous()
        if weight.dtype not in (torch.float32, torch.bfloat16):
            weight = weight.float()
        if tied:
            self.register_buffer("weight", weight, persistent=False)
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)
        # the batch size is only a hint for the layout; any number of rows works afterwards
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, 32),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(
            bias.detach().to(weight.dtype).clone(), requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self.gemv = weight.dtype == torch.float32 and cpu_kernel.unavailable_reason() is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.gemv and flat.shape[0] == 1 and x.dtype == torch.float32:
            y = cpu_kernel.gemv(flat, self.weight, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self.packed, self.bias,
                                                   "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

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
