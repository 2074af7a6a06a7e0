"""Logits into tokens (chapter 01): penalties, greedy, temperature, top-k, top-p, and logprobs."""
# a per-request seed: the same tokens whatever shares the batch (up to its rounding, chapter 03)

from __future__ import annotations

import torch

from minicb.request import SamplingParams


def make_generator(seed: int | None) -> torch.Generator | None:
    """A request's own random stream on the CPU, where `draw` runs (None: torch's global one)."""
    return None if seed is None else torch.Generator(device="cpu").manual_seed(seed)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf for every logit outside the top-k and the smallest set reaching probability top_p."""
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


class TokenCounts:
    """A request's prompt tokens and output token counts, rows [vocab], grown by `add`."""

    def __init__(self, prompt: list[int], output: list[int], vocab: int,
                 device: torch.device) -> None:
        def bins(ids: list[int]) -> torch.Tensor:
            return torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab)
        self.in_prompt = (bins(prompt) > 0).to(device)
        self.output = bins(output).float().to(device)

    def add(self, token: int) -> None:
        self.output[token] += 1


def penalise(logits: torch.Tensor, params: SamplingParams, counts: TokenCounts) -> torch.Tensor:
    """vLLM's penalties on one row of logits [vocab]: repetition, then frequency and presence."""
    # repetition divides a positive logit of a token seen and multiplies a negative one
    in_output = counts.output > 0
    rep = torch.where(counts.in_prompt | in_output, float(params.repetition_penalty), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    return (logits - float(params.frequency_penalty) * counts.output
            - float(params.presence_penalty) * in_output)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], banned: list[list[int]] | None = None,
           counts: list[TokenCounts | None] | None = None) -> list[int]:
    """One token per row of `logits` [N, vocab], row i under params[i], never one of banned[i] (a
    request's stop tokens before `min_tokens`), penalised by counts[i]; `logits` is not changed."""
    logits = logits.float()
    if (banned and any(banned)) or (counts and any(c is not None for c in counts)):
        logits = logits.clone()
    for i, ids in enumerate(banned or ()):
        if ids:
            row = logits[i].index_fill(0, torch.tensor(ids, device=logits.device), float("-inf"))
            if torch.isfinite(row).any():  # else nothing else could follow: keep the row
                logits[i] = row
    for i, c in enumerate(counts or ()):
        if c is not None:  # after the bans, as vLLM: a banned token stays at -inf
            logits[i] = penalise(logits[i], params[i], c)
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [greedy[i] if p.greedy else draw(probabilities(logits[i], p), generators[i])
            for i, p in enumerate(params)]


def top_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[dict[int, float]]:
    """Per row, the raw logprobs (vLLM's default) of its ks[i] most likely tokens and tokens[i]."""
    # one copy to the host for the whole batch
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, max(ks), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])
    table = torch.cat([top.indices.double(), top.values.double(), chosen.double()], -1).tolist()
    width = max(ks)  # the sampled token's entry is added if it is not among the top ones
    return [dict(zip(map(int, row[:k]), row[width:width + k])) | {token: row[-1]}
            for row, token, k in zip(table, tokens, ks)]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of logits [vocab] as the float32 CPU distribution a sampled request draws from."""
    # shifted first: the largest logit is 0, so a tiny temperature cannot overflow to inf
    # float(): an int temperature past int64 (2**70, accepted as finite) fails torch's division
    row = (logits.float() - logits.max()) / float(params.temperature)
    row = filter_logits(row, params.top_k, params.top_p)
    return torch.softmax(row, dim=-1).cpu()


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from `probs` [vocab]: the first whose cumulative mass passes a random draw."""
    # one random number (`torch.multinomial` would draw one per vocabulary entry)
    cdf = probs.double().cumsum(-1)  # float64: no drift over 150,000 entries
    if not 0 < cdf[-1] < float("inf"):
        raise ValueError("cannot sample: the probabilities are not finite (NaN in the logits?)")
    point = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, point, right=True))
    if index >= len(cdf):  # the product rounded up to the total: the last token with any mass
        index = int(torch.nonzero(probs).max())
    return index
