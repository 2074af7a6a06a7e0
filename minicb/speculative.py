"""Speculative decoding by prompt lookup (chapter 08): a decode step that can yield several
tokens. A decode step reads every weight to produce one token per request; where that read
dominates, a few more query rows cost little. So guess the next `k` tokens cheaply (where the
request's last `n` tokens occurred before, what followed them there), run the last token and
the guesses as one causal chunk, and keep the guesses the model agrees with, plus its own next
token. Verification keeps the output the model's own: a greedy request keeps the guesses equal
to the argmax; a sampled one draws each position with its own generator, one number per token
as without guesses, and goes on while the draw equals the guess, so guess `d` is kept with
probability p(d) and a seeded request gives the same tokens with or without guesses (up to the
rounding that differs between a chunk and a lone decode row, chapter 08)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from minicb.request import SamplingParams
from minicb.sampler import draw, probabilities


def propose_ngram(token_ids: Sequence[int], k: int, n_max: int = 4, n_min: int = 2
                  ) -> list[int]:
    """Up to `k` tokens to guess after `token_ids`: what followed the latest earlier occurrence
    of its last `n` tokens if `k` tokens follow it, else the earliest (in a run "a a a a" the
    latest overlaps the end), trying `n` from `n_max` down to `n_min`; [] when none occurs.
    A scan of the whole context: `NgramIndex` gives the same answer in O(n_max) a token."""
    ids = np.asarray(token_ids)
    for n in range(min(n_max, len(ids) - 1), n_min - 1, -1):
        # windows that end before the last token: each has at least one token after it
        hits = np.flatnonzero((sliding_window_view(ids[:-1], n) == ids[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1] if hits[-1] + n + k <= len(ids) else hits[0]) + n
            return ids[start:start + k].tolist()
    return []


class NgramIndex:
    """`propose_ngram` for one request whose tokens only grow: the first and the latest start of
    every run of `n_min`..`n_max` tokens with a token after it, kept as tokens arrive, so a
    guess costs O(n_max), not a scan of the whole context."""

    def __init__(self, n_max: int = 4, n_min: int = 2) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.first: dict[tuple[int, ...], int] = {}
        self.last: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # runs ending before this position are indexed

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens to guess after `token_ids` (the request's tokens so far)."""
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
    """Speculation in the engine's step (chapter 08), behind one object: `propose` before the
    forward gives decode members guesses, within the token budget the policy left and the free
    pages (nothing with num_speculative_tokens=0); the runner's sampling verifies them; `kept`
    after says what each member guessed and kept, for its `StepRecord`."""

    def __init__(self, config, pool) -> None:
        self.config, self.pool = config, pool

    def propose(self, batch) -> dict[str, list[int]]:
        """Request id -> guesses for its decode; each runs its last token and its guesses as one
        causal chunk."""
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
            if need > 0:
                req.page_table.extend(self.pool.allocate(need))
            drafts[req.request_id] = draft
            room -= len(draft)
        return drafts

    @staticmethod
    def kept(drafts: dict[str, list[int]], delivered: dict[str, int]
             ) -> dict[str, tuple[int, int]]:
        """Request id -> (tokens guessed, guesses kept) of the members that guessed and sampled:
        of the `delivered` tokens (a stop token may cut the kept guesses short), all but the
        model's own last one were guesses."""
        return {rid: (len(d), delivered[rid] - 1) for rid, d in drafts.items() if rid in delivered}


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams,
           generator: torch.Generator | None = None) -> list[int]:
    """The tokens one request keeps from a step that ran its last token and `draft`: `logits`
    [len(draft) + 1, vocab] are the model's predictions after each of them. Returns the accepted
    guesses, then one token of the model's own: between 1 and len(draft) + 1 tokens."""
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
