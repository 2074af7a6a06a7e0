"""The torch reference backend (chapter 01) against plain dense attention, member by member:
what the Triton kernels are then compared to (test_triton.py)."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cases import check_against_dense

from minicb.attention import torch_ref


def test_decode_groups_and_chunks_match_dense_attention():
    """21 decode rows (sorted into six groups, contexts 1-120 tokens in shuffled order) and two
    prefill chunks, over pages handed out in random order."""
    rng = random.Random(0)
    members = [(rng.randrange(0, 120), 1) for _ in range(21)] + [(0, 9), (13, 6)]
    assert len(members) - 2 > 2 * torch_ref.DECODE_GROUP
    check_against_dense(members, seed=0)


@settings(max_examples=40, deadline=None)
@given(decodes=st.lists(st.integers(0, 40), min_size=0, max_size=12),
       chunks=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), max_size=2),
       group=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_any_grouping_matches_dense_attention(decodes, chunks, group, seed):
    """Whatever the group size, the decode contexts and the chunks, each member's rows equal
    dense attention over its own K/V."""
    if not decodes and not chunks:
        return
    saved, torch_ref.DECODE_GROUP = torch_ref.DECODE_GROUP, group
    try:
        check_against_dense([(c, 1) for c in decodes] + chunks, seed)
    finally:
        torch_ref.DECODE_GROUP = saved


def test_rms_norm_adds_eps_and_rounds_like_transformers_in_bfloat16():
    """eps is inside the root (a zero row stays zero, eps=1 visibly shrinks a row), and in
    bfloat16 the normalized row is rounded before the weight multiplies it, bit for bit as
    transformers' LlamaRMSNorm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 96, generator=gen)
    weight = torch.rand(96, generator=gen) + 0.5
    assert torch.equal(torch_ref.rms_norm(torch.zeros(2, 96), weight, 1e-6), torch.zeros(2, 96))
    expected = weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1.0)
    torch.testing.assert_close(torch_ref.rms_norm(x, weight, 1.0), expected)
    hf = LlamaRMSNorm(96, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(weight)
    xb = (x * 3).bfloat16()
    assert torch.equal(torch_ref.rms_norm(xb, hf.weight, 1e-6), hf(xb))


def test_a_chunk_after_one_cached_token_sees_that_token():
    """A chunk one token shorter than its context is not the whole context: query i sits at
    position 1 + i and sees keys 0..1 + i (plain is_causal would align it at 0)."""
    check_against_dense([(4, 1), (1, 5), (1, 2), (0, 3)], seed=0)
