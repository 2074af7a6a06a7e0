"""Would prepacking bfloat16 weights pay on a CPU with AMX? SmolLM2-135M's products (one
layer's four, times 30 layers, plus the LM head) with bf16 weights: `F.linear` against oneDNN's
prepacked `_linear_pointwise`, median of 60 calls each, at 1, 32 and 512 rows. minicb prepacks
float32 only; bench/README.md has the numbers this measured.

    python bench/prepack_bf16_timing.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

# out_features, in_features of SmolLM2-135M's fused products and its LM head
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
LAYERS = 30


def median_seconds(fn, calls: int = 60) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 2]


def main() -> None:
    torch.manual_seed(0)
    for rows in (1, 32, 512):
        total_linear = total_packed = 0.0
        for name, (out_features, in_features) in SHAPES.items():
            weight = torch.randn(out_features, in_features).bfloat16()
            x = torch.randn(rows, in_features).bfloat16()
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)

            def run_packed(x=x, packed=packed):
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

            error = (F.linear(x, weight).float() - run_packed().float()).abs().max().item()
            linear = median_seconds(lambda x=x, weight=weight: F.linear(x, weight))
            prepacked = median_seconds(run_packed)
            count = 1 if name == "head" else LAYERS
            total_linear += linear * count
            total_packed += prepacked * count
            print(f"rows {rows:4} {name:8} F.linear {linear * 1e3:7.3f} ms  prepacked "
                  f"{prepacked * 1e3:7.3f} ms  {linear / prepacked:5.2f}x  max diff {error:.3g}")
        print(f"rows {rows:4} one forward's products: F.linear {total_linear * 1e3:.1f} ms, "
              f"prepacked {total_packed * 1e3:.1f} ms, {total_linear / total_packed:.2f}x")


if __name__ == "__main__":
    main()
