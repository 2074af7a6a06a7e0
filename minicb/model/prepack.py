"""Prepacked projections, the CPU's fast products (chapter 01, "the same bytes, a better
layout"; chapter 08): oneDNN's inner product over a weight packed once in its own layout, where
`F.linear` repacks it every call. On by default on x86-64 (`MINICB_PREPACK=0` or `prepack=False`:
off). A prepacked model cannot be copied, saved, cast or moved: load it again."""

from __future__ import annotations

import mmap
import os
import platform

import torch
import torch.nn as nn

from minicb.attention import cpu_kernel
from minicb.model.llama import projections


def prepack_possible(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Float32 weights on the CPU, or bfloat16 where oneDNN runs bf16, and a torch that packs."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available() or \
            not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_wanted(device: str | torch.device, dtype: torch.dtype) -> bool:
    """The default: possible, on x86-64 (Arm unmeasured), unless `MINICB_PREPACK=0`."""
    setting = os.environ.get("MINICB_PREPACK") or "1"
    if setting not in ("0", "1"):
        raise ValueError(f"MINICB_PREPACK (environment) must be 0 (F.linear) or 1 (prepack "
                         f"where it can), got {setting!r}")
    return (prepack_possible(device, dtype) and platform.machine().lower() in ("x86_64", "amd64")
            and setting == "1")


# One to three rows are memory-bound, and the C `gemv` streams the plain weight faster than
# oneDNN's packed product: the plain weight stays too (a second copy, on huge pages)
GEMV_ROWS = 3


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias, the weight plain ([out, in]) and packed (an opaque oneDNN tensor).
    A tied LM head's `weight` is the embedding, a buffer, so parameters are counted once."""

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
        if self.gemv and 0 < flat.shape[0] <= GEMV_ROWS and x.dtype == torch.float32:
            y = cpu_kernel.gemv(flat, self.weight, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self.packed, self.bias,
                                                   "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def into_huge_pages(tensors: list[torch.Tensor], align: int = 2 << 20) -> None:
    """Move these tensors' data into one anonymous mapping on 2 MB pages (MADV_HUGEPAGE)."""
    # a one-row step streams every weight once, and the prefetchers stop at each 4 KB page's edge
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # not Linux: the tensors stay where they are
        return
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    region = mmap.mmap(-1, sum(sizes) + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    offset = -arena.data_ptr() % align
    for t, size in zip(tensors, sizes, strict=True):
        view = arena[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        t.data = view.copy_(t)
        offset += size


def prepack_model(model: nn.Module) -> nn.Module:
    """Replace a CPU `LlamaModel`'s projections and LM head by `PackedLinear`s, on huge pages."""
    tied = model.lm_head is None
    into_huge_pages([*(getattr(owner, name).weight for owner, name in projections(model)),
                     model.embed_tokens.weight, *([] if tied else [model.lm_head.weight])])
    for owner, name in projections(model):
        linear = getattr(owner, name)
        setattr(owner, name, PackedLinear(linear.weight, linear.bias))
    head = model.embed_tokens.weight if tied else model.lm_head.weight
    model.lm_head = PackedLinear(head, tied=tied)
    model.prepacked = True
    return model
