"""Turning logits into tokens (chapter 01): greedy, temperature, top-k, top-p, and a per-request
seed so that the same seed gives the same tokens whatever else shares the batch, up to the
rounding the batch changes (chapter 03): a draw that lands within a rounding error of the line
between two tokens can go either way."""

from __future__ import annotations

import torch

from minicb.request import SamplingParams


def make_generator(seed: int | None) -> torch.Generator | None:
    """A request's own random stream (None without a seed: torch's global one), on the CPU
    where `draw` runs."""
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
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           banned: list[list[int]] | None = None) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32), row i under params[i], never one of
    banned[i] (the stop and end-of-sequence tokens of a request short of its `min_tokens`)."""
    logits = logits.float()
    if banned and any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            banned_ids = torch.tensor(ids, dtype=torch.long, device=logits.device)
            row = logits[i].index_fill(0, banned_ids, float("-inf"))
            if torch.isfinite(row).any():  # else nothing else could follow: keep the row
                logits[i] = row
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [greedy[i] if p.greedy else draw(probabilities(logits[i], p), generators[i])
            for i, p in enumerate(params)]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: one row of logits [vocab] under its
    temperature, top-k and top-p, as float32 on the CPU."""
    # shifted first: the largest logit is 0, so a tiny temperature cannot overflow to inf
    # float(): an int temperature past int64 (2**70, accepted as finite) fails torch's division
    row = (logits.float() - logits.max()) / float(params.temperature)
    row = filter_logits(row, params.top_k, params.top_p)
    return torch.softmax(row, dim=-1).cpu()


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from `probs` [vocab] by inverse transform: the first token whose cumulative
    probability passes one uniform number. `torch.multinomial` draws an exponential number per
    vocabulary entry instead: 1.2-1.8 ms for SmolLM2's 49,152 on the course machine, against
    about 60 us here, so 32 sampled rows cost 40-56 ms a step with it and 2 without."""
    cdf = probs.double().cumsum(-1)  # float64: no drift over 150,000 entries
    if not 0 < cdf[-1] < float("inf"):
        raise ValueError("cannot sample: the probabilities are not finite (NaN in the logits?)")
    point = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, point, right=True))
    if index >= len(cdf):  # the product rounded up to the total: the last token with any mass
        index = int(torch.nonzero(probs).max())
    return index
