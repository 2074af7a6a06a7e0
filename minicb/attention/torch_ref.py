"""The reference attention backend in plain PyTorch (chapter 01): correct on any device, fast
enough on the CPU. Decode rows are batched into one padded gather; each prefill chunk attends
causally over its own pages. RMSNorm and RoPE are here too, so that a backend owns every small
per-layer operation a GPU would fuse (see triton_ops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minicb.attention import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension, computed in float32 like transformers:
    normalize, cast back to x's dtype, then scale (chapter 01)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, D] and k [T, kv_heads, D] by their positions' angles (cos, sin:
    [T, 1, D/2]); the same arithmetic as transformers' `x * cos + rotate_half(x) * sin`, with
    half the table (chapter 01)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)


def _context_slots(meta: AttentionMetadata, member: int, length: int) -> torch.Tensor:
    """Slots of one prefill member's context: computed once per step, shared by all layers."""
    key = ("context_slots", member)
    if key not in meta.cache:
        pos = torch.arange(length, device=meta.page_tables.device)
        pages = meta.page_tables[member].long()[pos // meta.page_size]
        meta.cache[key] = pages * meta.page_size + pos % meta.page_size
    return meta.cache[key]


def _decode_gather(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of every decode member's context, padded to the longest: computed once per step
    and shared by all layers."""
    if "decode_slots" not in meta.cache:
        n = meta.num_decodes
        lens = meta.context_lens[:n].long()
        width = int(max(meta.context_lens_list[:n]))
        pos = torch.arange(width, device=lens.device)
        valid = pos[None, :] < lens[:, None]
        page_idx = (pos // meta.page_size).clamp(max=meta.page_tables.shape[1] - 1)
        pages = meta.page_tables[:n].long()[:, page_idx]
        slots = torch.where(valid, pages * meta.page_size + pos % meta.page_size, 0)
        meta.cache["decode_slots"] = slots
        meta.cache["decode_mask"] = valid
    return meta.cache["decode_slots"], meta.cache["decode_mask"]


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        slots, valid = _decode_gather(meta)
        keys = k_flat[slots].transpose(1, 2)  # [B, Hkv, L, D]
        values = v_flat[slots].transpose(1, 2)
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)  # a query head group per kv head
        od = F.scaled_dot_product_attention(qd, keys, values, attn_mask=valid[:, None, None, :],
                                            scale=scale)
        out[:nd] = od.reshape(nd, num_heads, head_dim)
    qsl = meta.query_start_list  # host-side offsets: no device sync per layer
    for b in range(nd, meta.num_members):
        start, end, ctx = qsl[b], qsl[b + 1], meta.context_lens_list[b]
        slots = _context_slots(meta, b, ctx)
        keys = k_flat[slots].transpose(0, 1)  # [Hkv, ctx, D]
        values = v_flat[slots].transpose(0, 1)
        qb = q[start:end].transpose(0, 1)  # [H, qlen, D]
        qlen = end - start
        # query i sits at absolute position ctx - qlen + i and sees keys up to there
        qpos = torch.arange(ctx - qlen, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
        ob = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, scale=scale,
                                            enable_gqa=group > 1)
        out[start:end] = ob.transpose(0, 1)
    return out
