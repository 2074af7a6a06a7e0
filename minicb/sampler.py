"""Turning logits into tokens (chapter 01): greedy, temperature, top-k, top-p, and a per-request
seed so that the same seed gives the same tokens whatever else shares the batch."""

from __future__ import annotations

import torch

from minicb.request import SamplingParams


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set whose probability
    reaches top_p (the most likely token always stays)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > top_p  # mass before this token already reaches top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32), row i under params[i]."""
    logits = logits.float()
    greedy = torch.argmax(logits, dim=-1).tolist()
    tokens = []
    for i, p in enumerate(params):
        if p.greedy:
            tokens.append(greedy[i])
            continue
        row = filter_logits(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1).cpu()
        tokens.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return tokens
