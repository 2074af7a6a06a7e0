"""Speculative decoding by prompt lookup (chapter 08): guess a request's next tokens from what
followed its last few tokens before, check them in one forward, keep those the model agrees with."""
# a decode step reads every weight for one token per request, so a few more query rows cost
# little; a sampled request draws each position as it would without guesses: the same output

from __future__ import annotations

from collections.abc import Sequence

import torch

from minicb.request import SamplingParams
from minicb.sampler import draw, probabilities


class NgramIndex:
    """Prompt lookup for one request: what followed an earlier run of its last n tokens."""
    # n from n_max down to n_min; the latest occurrence, or the earliest if fewer than `k` tokens
    # follow the latest; the first and latest start of every run of n_min..n_max tokens are kept
    # as tokens arrive, so a guess costs O(n_max), not a scan

    def __init__(self, n_max: int = 4, n_min: int = 2) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.first: dict[tuple[int, ...], int] = {}
        self.last: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # runs ending before this position are indexed

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens to guess after `token_ids` (the request's tokens so far); [] if none."""
        for end in range(self.num_indexed, len(token_ids) - 1):  # runs ending at `end` now
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):  # have a token after
                run = tuple(token_ids[end - n + 1:end + 1])
                self.first.setdefault(run, end - n + 1)
                self.last[run] = end - n + 1
        self.num_indexed = max(self.num_indexed, len(token_ids) - 1)
        for n in range(min(self.n_max, len(token_ids) - 1), self.n_min - 1, -1):
            run = tuple(token_ids[-n:])
            if run in self.last:
                latest = self.last[run]
                start = (latest if latest + n + k <= len(token_ids) else self.first[run]) + n
                return list(token_ids[start:start + k])
        return []


class Speculator:
    """Speculation in the step: guesses before the forward, how many were kept after it."""

    def __init__(self, config, pool) -> None:
        self.config, self.pool = config, pool

    def propose(self, batch) -> dict[str, list[int]]:
        """Request id -> guesses for its decode."""
        cfg = self.config
        room = cfg.max_num_batched_tokens - batch.num_tokens
        drafts: dict[str, list[int]] = {}
        for req, num_tokens in batch.items if cfg.num_speculative_tokens else ():
            k = min(cfg.num_speculative_tokens, room,
                    req.params.max_tokens - len(req.output_token_ids) - 1)  # after this token
            if k < 1 or num_tokens != 1 or req.is_prefill \
                    or len(req.output_token_ids) < req.params.min_tokens \
                    or req.params.penalised or req.params.logprobs is not None:
                continue  # bans, penalties and logprobs are computed one token at a time
            if req.ngram_index is None:
                req.ngram_index = NgramIndex(cfg.prompt_lookup_max, cfg.prompt_lookup_min)
            draft = req.ngram_index.propose(req.all_token_ids, k)
            need = self.pool.pages_needed(req.num_tokens + len(draft)) - len(req.page_table)
            if not draft or need > self.pool.num_available:
                continue
            req.page_table.extend(self.pool.allocate(max(0, need)))
            drafts[req.request_id] = draft
            room -= len(draft)
        return drafts

    @staticmethod
    def kept(drafts: dict[str, list[int]], delivered: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Request id -> (tokens guessed, guesses kept): all `delivered` tokens but the last."""
        return {rid: (len(d), delivered[rid] - 1) for rid, d in drafts.items() if rid in delivered}


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams,
           generator: torch.Generator | None = None) -> list[int]:
    """The kept guesses of `draft`, then one of the model's own; `logits`: [len(draft) + 1, V]."""
    # a sampled request keeps a guess while its own draw equals it: with the model's probability
    if params.greedy:
        target = torch.argmax(logits, dim=-1).tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target[accepted]:
            accepted += 1
        return target[:accepted + 1]
    out = []
    for row, guess in zip(logits, [*draft, None]):
        out.append(draw(probabilities(row, params), generator))  # as if nobody had guessed
        if out[-1] != guess:  # the guess was wrong (or there is none left): the rows after
            return out  # it assumed a token the request does not have
    return out
