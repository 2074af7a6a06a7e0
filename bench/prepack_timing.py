"""Time SmolLM2-135M's projections through `F.linear` and through minicb's prepacked layer
(bench/README.md, "The CPU fast path"). Random weights of the real shapes; no model download.

    python bench/prepack_timing.py [--threads 2] [--rows 1 32 512 2048]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from minicb.model.prepack import PackedLinear

# (in, out) of one SmolLM2-135M layer's fused products: qkv, o, gate_up, down
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
NUM_LAYERS = 30


def seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512, 2048])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * NUM_LAYERS
    weights = [torch.randn(n, k, generator=gen) * 0.02 for k, n in shapes]
    packed = [PackedLinear(w) for w in weights]
    print(f"{'rows':>6}{'F.linear ms':>14}{'prepacked ms':>14}{'speed-up':>10}{'max rel diff':>14}")
    for rows in args.rows:
        x = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        repeats = max(2, min(10, 2048 // rows))
        plain = seconds(lambda x=x: [F.linear(x[k], w) for (k, _), w in zip(shapes, weights)],
                        repeats)
        fast = seconds(lambda x=x: [layer(x[k]) for (k, _), layer in zip(shapes, packed)], repeats)
        a, b = F.linear(x[576], weights[2]), packed[2](x[576])
        rel = float((a - b).abs().max() / a.abs().max())
        print(f"{rows:>6}{plain * 1e3:>14.1f}{fast * 1e3:>14.1f}{plain / fast:>9.1f}x{rel:>14.1e}")


if __name__ == "__main__":
    main()
