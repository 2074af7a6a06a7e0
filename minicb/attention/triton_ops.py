"""The Triton attention backend (chapter 07): the torch reference's `store_kv`, `attend`,
`rms_norm` and `rope` as GPU kernels over the paged KV cache, accumulating in float32 (caches
have the query's dtype). On the CPU, Triton's interpreter runs them only if `TRITON_INTERPRET=1`
was set before anything imported `triton`; otherwise CPU tensors raise a RuntimeError."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minicb.attention.metadata import AttentionMetadata

LOG2E = 1.4426950408889634


# Triton compiles a variant per integer argument that is 1 or a multiple of 16: the ones that
# change from step to step are not specialized, so no step of a timed run stops to compile.
@triton.jit(do_not_specialize=["num_tokens"])
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcs, stride_kch, stride_vcs, stride_vch,
                     HEAD_DIM: tl.constexpr, NUM_COLS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Copy BLOCK_T tokens' K and V rows (all kv heads: NUM_COLS columns) to their slots."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.arange(0, BLOCK_C)
    head, d = col // HEAD_DIM, col % HEAD_DIM
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0)[:, None] & (col < NUM_COLS)[None, :]
    k = tl.load(k_ptr + t[:, None] * stride_kt + (head * stride_kh + d)[None, :], mask=ok)
    v = tl.load(v_ptr + t[:, None] * stride_vt + (head * stride_vh + d)[None, :], mask=ok)
    tl.store(k_cache_ptr + slot[:, None] * stride_kcs + (head * stride_kch + d)[None, :], k,
             mask=ok)
    tl.store(v_cache_ptr + slot[:, None] * stride_vcs + (head * stride_vch + d)[None, :], v,
             mask=ok)


# RMSNorm and RoPE are one launch each where PyTorch launches 6-8 and 14: a small model's GPU step
# is hundreds of tiny kernels whose number sets its time (bench/GPU.md). In 16-bit, RoPE here
# rounds once, from float32, where PyTorch rounds after every operation.
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, stride_xt, stride_xh, stride_ot, stride_oh,
                     DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Row (token t, head h): normalize in float32, cast, then scale, as transformers does."""
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < DIM
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=ok, other=0.0).to(tl.float32)
    normed = x / tl.sqrt(tl.sum(x * x, 0) / DIM + eps)
    normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d,
             (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_heads(ptr, stride_h, num_heads, cos, sin, d, d_ok,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate the first and second halves of every head of one token, in place."""
    h = tl.arange(0, BLOCK_H)
    ok = (h < num_heads)[:, None] & d_ok[None, :]
    first = ptr + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=ok)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, num_q_heads, num_k_heads,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token: its position's cos/sin row once, then every query and key head, in place."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    cos = tl.load(cos_ptr + t * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, d, d_ok, HALF, BLOCK_H)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, cos, sin, d, d_ok, HALF, BLOCK_H)


# One online-softmax loop over a member's pages. A program owns one kv head and a tile of BLOCK_M
# rows (BLOCK_Q queries times the GROUP query heads sharing that kv head, so K/V are read once per
# group); each key's page is looked up in the page table, so any page size and order works and
# shared prefix pages are the same ids in several tables. It runs once for the decode rows and
# once for the prefill chunks (causal; a chunk may start mid-page).
@triton.jit(do_not_specialize=["stride_pt"])  # the page-table width, see _store_kv_kernel
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                            qsl_ptr, ctx_ptr, page_table_ptr, work_ptr, scale_log2,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                            stride_pt,
                            HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                            GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            DECODE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    kv_head = tl.program_id(1)
    if DECODE:  # one program per decode member: its single query is row block 0
        member = tl.program_id(0)
        q_off = 0
    else:  # the host listed (member, first query of the tile) for every prefill tile
        member = tl.load(work_ptr + 2 * tl.program_id(0))
        q_off = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
    q_start = tl.load(qsl_ptr + member)
    q_len = tl.load(qsl_ptr + member + 1) - q_start
    ctx = tl.load(ctx_ptr + member)

    # row r of the tile is query q_off + r // GROUP, query head kv_head * GROUP + r % GROUP
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_off + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx - q_len + q_idx  # absolute position: the query sees keys 0..q_pos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_qt + (head * stride_qh)[:, None]
                + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # a finite start for the running max keeps rows with no visible key (tile padding) NaN-free
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # keys after the tile's last query are invisible to every row: stop the loop there
    kv_end = ctx - q_len + tl.minimum(q_off + BLOCK_Q, q_len)
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        page = tl.load(page_table_ptr + member * stride_pt + n // PAGE_SIZE, mask=n_ok, other=0)
        page = page.to(tl.int64)  # page * stride overflows int32 in a large pool
        k_off = page * stride_kp + (n % PAGE_SIZE) * stride_ks + kv_head * stride_kh
        v_off = page * stride_vp + (n % PAGE_SIZE) * stride_vs + kv_head * stride_vh
        # masked loads matter: slots past the context may hold anything, NaN included
        k = tl.load(k_cache_ptr + k_off[None, :] + d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # a row that saw no key (tile padding, or a padded decode row with context 0) gives 0
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + q_idx)[:, None] * stride_ot + (head * stride_oh)[:, None]
             + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


_KERNELS = {f.__name__: f for f in (_store_kv_kernel, _rms_norm_kernel, _rope_kernel,
                                     _paged_attention_kernel)}


def _interpreted() -> bool:
    """True when these kernels and Triton's own helpers (tl.max) both run in the interpreter."""
    return all(type(f).__name__ == "InterpretedFunction" for f in (*_KERNELS.values(), tl.max))


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not _interpreted():
        raise RuntimeError("Triton kernels need CUDA tensors; on the CPU set TRITON_INTERPRET=1 "
                           "in the environment before triton is first imported")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Write k, v [T, num_kv_heads, head_dim] into the caches at `meta.slot_mapping`."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _check_device(k)
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    num_kv_heads, head_dim = k_cache.shape[-2:]
    kc = k_cache.view(-1, num_kv_heads, head_dim)  # slot-major view, as in the reference
    vc = v_cache.view(-1, num_kv_heads, head_dim)
    cols = num_kv_heads * head_dim
    block_c = triton.next_power_of_2(cols)
    block_t = max(1, min(64, 8192 // block_c))  # a tile of a few thousand elements
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, kc, vc, meta.slot_mapping, num_tokens, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        HEAD_DIM=head_dim, NUM_COLS=cols, BLOCK_T=block_t, BLOCK_C=block_c)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`torch_ref.rms_norm` as one kernel over x [T, D] or [T, heads, D] (rows may be strided)."""
    _check_device(x)
    x = _last_dim_contiguous(x)
    rows = x if x.dim() == 3 else x.unsqueeze(1)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        dim = rows.shape[-1]
        _rms_norm_kernel[(rows.shape[0], rows.shape[1])](
            rows, weight, out, eps, rows.stride(0), rows.stride(1), out.stride(0), out.stride(1),
            DIM=dim, BLOCK=triton.next_power_of_2(dim))
    return out.view(x.shape)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_ref.rope` as one kernel rotating q and k in place (this step's fresh projections)."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    _check_device(q)
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope rotates in place: q and k need a contiguous last dimension")
    cos, sin = cos.reshape(num_tokens, -1), sin.reshape(num_tokens, -1)
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q, k, cos, sin, num_q_heads, k.shape[1], q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), cos.stride(0), HALF=half, BLOCK_D=triton.next_power_of_2(half),
        BLOCK_H=triton.next_power_of_2(max(num_q_heads, k.shape[1])))
    return q, k


# Tile shapes. tl.dot needs every side >= 16 on GPUs, so a decode tile is padded to 16 rows
# (GROUP query heads of one query fill part of it: wasted compute, but decode is bound by
# reading K/V, not by arithmetic). Prefill tiles hold 64 rows.
DECODE_BLOCK_M, PREFILL_BLOCK_M = 16, 64
# (BLOCK_N keys, num_warps, num_stages) of each kind of tile, for 16-bit inputs. Apart because
# `gpu_check.py` sweeps (and overrides) the decode tile only: a decode winner such as
# (128, 4, 2) would give a 64-row prefill tile at head_dim 128 145 KiB of shared memory on
# sm_90, and on sm_86/89 (about 100 KiB) 96 KiB with 188 bytes spilled inside the key loop
# (`bench/compile_check.py --arch 86`)
DECODE_TILES, PREFILL_TILES = (64, 4, 2), (64, 4, 2)
# Float32 tiles multiply on the FMA units, not the tensor cores ("ieee" precision), and hold q,
# k, scores and the accumulator in registers: with the tiles above ptxas spills 14-29 KB per
# thread in a prefill tile on sm_90 and a few hundred bytes in a decode tile on sm_80. Key
# blocks of 2,048 elements (32 keys of 64, 16 of 128), and 8 warps for a prefill tile, spill
# nothing on either (bench/compile_check.py compiles every kernel for a GPU on any machine).
FLOAT32_KEY_BLOCK, FLOAT32_PREFILL_NUM_WARPS = 2048, 8


def _prefill_work(meta: AttentionMetadata, block_q: int, device: torch.device) -> torch.Tensor:
    """(member, first query) of every prefill tile, flattened; built on the host once a step."""
    key = ("triton_prefill_work", block_q)
    if key not in meta.cache:
        work = [x for b in range(meta.num_decodes, meta.num_members)
                for off in range(0, meta.query_lens[b], block_q) for x in (b, off)]
        meta.cache[key] = torch.tensor(work, dtype=torch.int32).to(device, non_blocking=True)
    return meta.cache[key]


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Paged attention for the mixed batch: q [T, heads, head_dim] -> same shape (into `out`)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    _check_device(q)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"KV cache dtype {k_cache.dtype} must match the query's {q.dtype}")
    q = _last_dim_contiguous(q)
    fp32 = q.dtype == torch.float32
    block_d = max(16, triton.next_power_of_2(head_dim))
    # float32 stays exact (no TF32) so the kernel matches the reference; 16-bit inputs use the
    # tensor cores natively and ignore this
    common = dict(HEAD_DIM=head_dim, PAGE_SIZE=meta.page_size, GROUP=group, BLOCK_D=block_d,
                  DOT_PRECISION="ieee" if fp32 else "tf32")
    args = [q, k_cache, v_cache, out, meta.query_start_loc, meta.context_lens, meta.page_tables]
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
               meta.page_tables.stride(0))
    scale_log2 = scale * LOG2E
    key_block = max(16, FLOAT32_KEY_BLOCK // block_d)  # float32's BLOCK_N
    gpu = not _interpreted()  # compiled for a GPU: the interpreter takes no launch options
    if meta.num_decodes:  # one program per decode member (the work list goes unused)
        block_n, warps, stages = DECODE_TILES
        block_m = max(DECODE_BLOCK_M, triton.next_power_of_2(group))
        options = dict(num_warps=warps, num_stages=stages) if gpu else {}
        _paged_attention_kernel[(meta.num_decodes, num_kv_heads)](
            *args, meta.query_start_loc, scale_log2, *strides, BLOCK_Q=block_m // group,
            BLOCK_M=block_m, BLOCK_N=key_block if fp32 else block_n, DECODE=True, **common,
            **options)
    if meta.num_decodes < meta.num_members:  # one program per prefill tile
        block_n, warps, stages = PREFILL_TILES
        block_m = max(PREFILL_BLOCK_M, triton.next_power_of_2(group))
        work = _prefill_work(meta, block_m // group, q.device)
        warps = FLOAT32_PREFILL_NUM_WARPS if fp32 else warps
        options = dict(num_warps=warps, num_stages=stages) if gpu else {}
        _paged_attention_kernel[(work.numel() // 2, num_kv_heads)](
            *args, work, scale_log2, *strides, BLOCK_Q=block_m // group, BLOCK_M=block_m,
            BLOCK_N=key_block if fp32 else block_n, DECODE=False, **common, **options)
    return out
