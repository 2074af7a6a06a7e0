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

Verification keeps the output distribution exactly the model's: a greedy request keeps the
longest prefix of guesses equal to the model's argmax; a sampled request accepts guess `d` with
probability p(d) and, on a rejection, samples from p with `d` removed (the residual
distribution of speculative sampling, with the guesser's distribution a point mass on `d`).
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
    of its last `n` tokens with `k` tokens after it (else the earliest, which has the most),
    trying `n` from `n_max` down to `n_min`; [] when none occurs."""
    ids = np.asarray(token_ids)
    for n in range(min(n_max, len(ids) - 1), n_min - 1, -1):
        # windows that end before the last token: each has at least one token after it
        hits = np.flatnonzero((sliding_window_view(ids[:-1], n) == ids[-n:]).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= len(ids)]  # in a run "a a a a", the latest occurrence
            start = int(full[-1] if len(full) else hits[0]) + n  # overlaps the end
            return ids[start:start + k].tolist()
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
    for row, guess in zip(logits, draft):
        probs = probabilities(row, params)
        if torch.rand(1, generator=generator, dtype=torch.float64).item() < probs[guess]:
            out.append(guess)  # accepted with probability p(guess)
            continue
        probs[guess] = 0.0  # rejected: sample from what p puts everywhere else
        out.append(draw(probs, generator))
        return out
    out.append(draw(probabilities(logits[len(draft)], params), generator))
    return out
