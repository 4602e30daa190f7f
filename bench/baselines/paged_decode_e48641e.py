# The paged-decode kernel as of commit e48641e (two launches: split kernel + combine), kept verbatim
# below this header so that bench/paged_decode.py can time before and after in one run.
"""Flash-decoding over the paged KV cache, in Triton: one new query token per sequence.

Grid ``(sequence, kv head, split)``: each program reads one slice of its sequence's keys through the
block table once and serves every query head of its GQA group with it (decode is bound by reading
the cache, so each key byte is read once per step). Long contexts are cut into splits so that a
small batch still fills the GPU; a second kernel merges the splits' partial outputs by their
logsumexps.

The number of splits is fixed by the grid, but each program sizes its slice from the sequence's
actual length, on the device: ``cdiv(k_len / splits, BLOCK_N)`` tiles. A graph captured for a
16k-token capacity therefore spreads a 130-key context over 3 one-tile programs (latency ~ one tile)
instead of giving all of it to the first split; the splits left without keys only write their
logsumexp (-inf), and the merge skips their partial outputs.

CUDA-graph capturable: the grid depends only on tensor shapes and the Python int ``max_seqlen_k``
(the cache capacity during capture), and nothing is read back to the host.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .flash_attention import attention_reference
from .flash_attention_fwd import LOG2E, _UPCAST_DOT, _dot, _dot_precision, _kv_rows, block_d, check_inputs, interpreting

MAX_SPLITS = 64


@triton.jit
def _paged_decode_kernel(
    Q, K, V, O, LSE,  # Q [B, Hq, D]; K/V flattened pages [slots, Hkv, D]; O [B, Hq, S, D]; LSE [B, Hq, S]
    seqlens_k, block_table, qk_scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, WRITE_LSE: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    k_len = tl.load(seqlens_k + seq)
    lo = 0
    if HAS_WINDOW:  # the query sits at position k_len - 1 and sees keys j > k_len - 1 - window
        lo = tl.maximum(k_len - window, 0)
    # Whole tiles per split, sized from this sequence's visible keys rather than the grid's capacity.
    per_split = tl.cdiv(tl.cdiv(k_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, k_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUPS
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUPS + offs_g
    q_ptrs = Q + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    Kh = K + kv_head * stride_kh
    Vh = V + kv_head * stride_vh
    bt_row = block_table + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        # Every tile holds at least one real key, so the running max stays finite.
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        rows = _kv_rows(offs_n, end, 0, bt_row, True, PAGE_SIZE)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(Kh + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), PREC, UPCAST) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(Vh + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, PREC, UPCAST)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_ptrs = O + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if WRITE_LSE:  # an empty split's partial is never read: its logsumexp says so
        o_mask = o_mask & (~empty)[:, None]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(LSE + seq * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _combine_splits_kernel(
    O_PART, LSE, O,  # O_PART [B, Hq, S, D] fp32; LSE [B, Hq, S] fp32 (base 2); O [B, Hq, D]
    num_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(LSE + seq * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
    # Empty splits left their partials unwritten: do not read them (nor pay for the bytes).
    filled = s_mask & (lse > float("-inf"))
    part_ptrs = O_PART + seq.to(tl.int64) * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    part = tl.load(part_ptrs, mask=filled[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * part, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(O + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_plan(num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device,
               block_n: int) -> tuple[int, int]:
    """``(num_splits, keys_per_split at full capacity)``: enough programs for ~2 waves, at least one tile each.

    The kernel re-sizes the splits from each sequence's length, so many splits cost a short context
    only empty programs (no partials written or read), while a long one gets the whole GPU.
    """
    sms = 4 if interpreting() or device.type != "cuda" else _sm_count(device.index or 0)
    programs = max(1, num_seqs * num_kv_heads)
    splits = min(triton.cdiv(2 * sms, programs), triton.cdiv(max(max_seqlen_k, 1), block_n), MAX_SPLITS)
    return _even_splits(max(1, splits), max_seqlen_k, block_n)


def _even_splits(splits: int, max_seqlen_k: int, block_n: int) -> tuple[int, int]:
    per_split = triton.cdiv(triton.cdiv(max(max_seqlen_k, 1), splits), block_n) * block_n
    return triton.cdiv(max(max_seqlen_k, 1), per_split), per_split


def paged_decode(q, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k: int, scale: float,
                 window: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """One query per sequence against its paged keys: ``q [B, Hq, D]`` -> ``[B, Hq, D]``.

    ``k_cache``/``v_cache`` are ``[num_blocks, page, Hkv, D]``; sequence b has ``seqlens_k[b]`` keys
    (its query is the last of them) at the slots named by ``block_table[b]``. ``max_seqlen_k`` bounds
    every ``seqlens_k[b]`` and sizes the grid.
    """
    check_inputs(q, k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} decode queries")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k_cache.view(-1, num_kv_heads, head_dim)
    v = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    bd = block_d(head_dim)
    block_n = 16 if interpreting() else (64 if bd <= 128 else 32)
    if num_splits is None:
        splits, _ = split_plan(num_seqs, num_kv_heads, max_seqlen_k, q.device, block_n)
    else:
        splits, _ = _even_splits(num_splits, max_seqlen_k, block_n)
    groups = num_heads // num_kv_heads
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=bd, GROUPS=groups, BLOCK_G=max(16, triton.next_power_of_2(groups)),
                BLOCK_N=block_n, PAGE_SIZE=page_size, HAS_WINDOW=bool(window), PREC=_dot_precision(q.dtype),
                UPCAST=_UPCAST_DOT, num_warps=4, num_stages=2 if bd > 128 else 3)
    grid = (num_seqs, num_kv_heads, splits)
    common = (seqlens_k, block_table, scale * LOG2E, window or 0,
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_table.stride(0))
    if splits == 1:  # the only split is the answer: write it straight to the output
        _paged_decode_kernel[grid](q, k, v, out, out, *common, out.stride(0), out.stride(1), 0, 0, 0,
                                   WRITE_LSE=False, **meta)
        return out
    part = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[grid](q, k, v, part, lse, *common, part.stride(0), part.stride(1), part.stride(2),
                               lse.stride(0), lse.stride(1), WRITE_LSE=True, **meta)
    _combine_splits_kernel[(num_seqs, num_heads)](
        part, lse, out, splits, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_S=triton.next_power_of_2(splits))
    return out


def paged_decode_reference(q, k_cache, v_cache, seqlens_k, block_table, scale: float, window: int | None = None,
                           upcast: bool = False) -> torch.Tensor:
    """Gather each sequence's keys through the block table, then plain attention of its last position."""
    page = k_cache.shape[1]
    outs = []
    for b, n in enumerate(seqlens_k.tolist()):
        pos = torch.arange(n, device=q.device)
        slots = block_table[b, pos // page].long() * page + pos % page
        keys = k_cache.view(-1, *k_cache.shape[2:])[slots].to(q.dtype)
        values = v_cache.view(-1, *v_cache.shape[2:])[slots].to(q.dtype)
        cu_q = torch.tensor([0, 1], dtype=torch.int32)
        cu_k = torch.tensor([0, n], dtype=torch.int32)
        outs.append(attention_reference(q[b:b + 1], keys, values, cu_q, cu_k, scale, window, upcast)[0])
    return torch.cat(outs)
