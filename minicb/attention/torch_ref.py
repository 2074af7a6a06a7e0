"""The reference attention backend in plain PyTorch (chapter 01), correct on any device and what
the kernels are tested against; RMSNorm and RoPE too, which kernels may fuse."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minicb.attention.metadata import AttentionMetadata, int_tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight as transformers: normalize in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions' angles: transformers' `rotate_half`, half the table."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)


def _slots(meta: AttentionMetadata, members: torch.Tensor | slice, width: int) -> torch.Tensor:
    """[n, width]: the cache slots of positions 0 .. width-1 of these members' contexts."""
    pos = torch.arange(width, device=meta.page_tables.device)
    pages = meta.page_tables[members].long()[:, pos // meta.page_size]
    return pages * meta.page_size + pos % meta.page_size


def _context_slots(meta: AttentionMetadata, member: int, length: int) -> torch.Tensor:
    """Slots [1, length] of one prefill member's context: once per step, shared by all layers."""
    key = ("context_slots", member)
    if key not in meta.cache:
        meta.cache[key] = _slots(meta, slice(member, member + 1), length)
    return meta.cache[key]


DECODE_GROUP = 4  # decode rows per padded gather (see _decode_groups)


def _decode_groups(meta: AttentionMetadata) -> list[tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]]:
    """Decode members sorted by context length in groups of DECODE_GROUP (one on a GPU), each
    padded to its own longest: [(rows, slots [n, width], valid [n, width])], once per step."""
    # one group of spread contexts gathers ~2x the keys (SmolLM2, 32 rows: 166 ms a step;
    # groups of 4: 81-83; row by row: 104)
    if "decode_groups" not in meta.cache:
        lens = meta.context_lens_list[:meta.num_decodes]
        order = sorted(range(len(lens)), key=lens.__getitem__)
        # on a GPU the reference keeps one padded group: there a launch costs more than padding
        size = DECODE_GROUP if meta.page_tables.device.type == "cpu" else max(1, len(order))
        groups = []
        for i in range(0, len(order), size):
            rows = int_tensor(order[i:i + size], device=meta.page_tables.device)
            width = lens[order[min(i + size, len(order)) - 1]]
            slots = _slots(meta, rows, width)
            valid = torch.arange(width, device=rows.device) < meta.context_lens[rows, None]
            # padding repeats the row's own first slot (masked out): a slot it does not own
            # may hold anything, and a NaN there would poison the row even at weight 0
            groups.append((rows, torch.where(valid, slots, slots[:, :1]), valid))
        meta.cache["decode_groups"] = groups
    return meta.cache["decode_groups"]


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of a flat cache at `slots` [n, width] -> [n, heads, width, D] (`index_select`)."""
    n, width = slots.shape
    return flat.index_select(0, slots.flatten()).view(n, width, *flat.shape[1:]).transpose(1, 2)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, D] -> [T, heads, D]: decode rows, then each chunk causally over its pages."""
    out = torch.empty_like(q)
    attend_decodes(q, k_cache, v_cache, meta, scale, out)
    attend_prefills(q, k_cache, v_cache, meta, scale, out)
    return out


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1, *cache.shape[-2:])  # [slots, kv_heads, D]


def attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Write rows [0, num_decodes) of `out`: each decode row over its gathered context."""
    nd = meta.num_decodes
    if not nd:
        return
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[-2]
    k_flat, v_flat = _flat(k_cache), _flat(v_cache)
    qd = q[:nd].view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)  # a query head
    for rows, slots, valid in _decode_groups(meta):                        # group per kv head
        od = F.scaled_dot_product_attention(
            qd.index_select(0, rows), _gather(k_flat, slots), _gather(v_flat, slots),
            attn_mask=valid[:, None, None, :], scale=scale)
        out.index_copy_(0, rows, od.reshape(len(rows), num_heads, head_dim))


def attend_prefills(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Write the prefill chunks' rows of `out`: each chunk causally over its context."""
    group = q.shape[1] // k_cache.shape[-2]
    k_flat, v_flat = _flat(k_cache), _flat(v_cache)
    qsl = meta.query_start_list  # host-side offsets: no device sync per layer
    for b in range(meta.num_decodes, meta.num_members):
        start, end, ctx = qsl[b], qsl[b + 1], meta.context_lens_list[b]
        slots = _context_slots(meta, b, ctx)
        # [1, heads, tokens, D]: given 3-D tensors, the CPU's scaled_dot_product_attention
        # takes its unfused path (1.4x slower for a 512-token prompt, 2x for 2,048)
        keys, values = _gather(k_flat, slots), _gather(v_flat, slots)
        qb = q[start:end].transpose(0, 1)[None]
        qlen = end - start
        if qlen == ctx:  # the chunk is its whole context: plain causal, which skips the
            mask, causal = None, True  # masked-out blocks (2x at 2,048 tokens)
        else:  # query i sits at absolute position ctx - qlen + i and sees keys up to there
            qpos = torch.arange(ctx - qlen, ctx, device=q.device)
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None], False
        ob = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, is_causal=causal,
                                            scale=scale, enable_gqa=group > 1)
        out[start:end] = ob[0].transpose(0, 1)
