"""Weight-only int8 quantization for CPU decoding (chapter 01, "bytes per token"): a one-row
step streams every weight once, and int8 with one scale per row streams a quarter of float32."""

from __future__ import annotations

import torch
import torch.nn as nn

from minicb.model.llama import projections


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): q = round(weight / scale) in int8, scale = max |row| / 127 (floored > 0)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias: q int8 [out, in], one bfloat16 scale per output row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        q, scale = quantize_rows(weight)
        self.register_buffer("qweight", q.to(weight.device))
        self.register_buffer("scale", scale.to(torch.bfloat16).to(weight.device))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)
        self.out_features, self.in_features = weight.shape
        # the packed kernel reads the inner dimension in blocks of 16 and returns garbage
        # for any other width, so odd shapes (tiny test models) take the dequantizing path
        self.packed = self.in_features % 16 == 0 and weight.device.type == "cpu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # bfloat16 activations and scales, as in gpt-fast (the kernel's float32 path is 10-30x
        # slower): results differ by those roundings
        if self.packed:
            y = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16).contiguous(),
                                                   self.qweight, self.scale).to(x.dtype)
        else:
            y = flat @ (self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]).T
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float weight this layer multiplies by (for tests and error reports)."""
        return self.qweight.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every projection and the LM head by an `Int8Linear`, in place."""
    for owner, name in projections(model):
        linear = getattr(owner, name)
        setattr(owner, name, Int8Linear(linear.weight, linear.bias))
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = Int8Linear(head)  # a tied head gets its own int8 copy
    model.quantization = "int8"
    return model
