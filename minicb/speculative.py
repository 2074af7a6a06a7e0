"""Speculative decoding by prompt lookup (chapter 08): a decode step that can produce several
tokens.

A decode step reads every weight of the model to produce one token per request; on a machine
where that read dominates, the step costs about the same for a few more query rows. So guess
the next `k` tokens cheaply, run the request's last token and the `k` guesses in one step (a
causal chunk, exactly like a prefill chunk over the request's pages), and keep the guesses the
model agrees with, plus the token the model itself says comes next. Every step still yields at
least one token; a good guess yields up to `k + 1`.

The guesser here needs no second model: *prompt lookup* (n-gram) finds the latest earlier place
where the request's last `n` tokens occurred and proposes what followed them there. Text that
repeats its prompt (summaries, code edits, quotes, extraction) gets long accepted runs.

Verification keeps the output exactly what the model would give without guesses: a greedy
request keeps the longest prefix of guesses equal to the model's argmax; a sampled request draws
its token at each position from the model's distribution with its own generator, one random
number per token as without guesses, and keeps going while the draw equals the guess. Guess `d`
is kept with probability p(d), as in speculative sampling with a guesser that puts all its mass
on `d`, and a seeded request gives the same tokens with or without guesses, whatever shares its
batch. Exactly so in float32 with the same attention for a chunk as for one token (the torch
reference); the default CPU backend's C decode kernel rounds otherwise than the reference that
computes chunks (about 5e-6 apart in float32), and bfloat16 or int8 more so, so where two
tokens nearly tie, or a seeded draw lands that close to the line between two, the pick can
differ.
"""

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
    every run of `n_min`..`n_max` tokens that has a token after it, updated as tokens arrive, so
    a guess costs O(n_max) instead of a scan of the whole context (3 ms at 16k tokens, for every
    decode member of every step)."""

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
