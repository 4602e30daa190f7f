"""Backward of the varlen attention kernel (dq, dk, dv), in Triton.

Two kernels recompute the probabilities from the saved base-2 logsumexp instead of storing them:

* dk/dv: one program per (key tile, sequence, kv head) loops over every query head of its GQA group
  and every query tile that can see those keys, so GQA needs no atomics and no repeated K/V.
* dq: one program per (query tile, sequence, query head) streams the visible key tiles, as the forward.

``delta = rowsum(dO * O)`` is a cheap elementwise reduction left to PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flash_attention_fwd import (
    INTERPRET_BLOCK, LOG2E, NO_WINDOW, _UPCAST_DOT, _dot, _dot_precision, _key_runs, block_d,
    interpreting,
)
from .grid import cdiv


@triton.jit
def _query_runs(n_lo, n_hi, q_len, offset, window, BLOCK_M: tl.constexpr):
    """Query-index runs that see some key in [n_lo, n_hi]: masked [lo, full_lo), unmasked
    [full_lo, full_hi) (every query valid and seeing every key), masked [full_hi, hi)."""
    lo = (tl.maximum(n_lo - offset, 0) // BLOCK_M) * BLOCK_M
    hi = tl.minimum(tl.maximum(n_hi + window - offset, 0), q_len)
    full_lo = tl.cdiv(tl.maximum(n_hi - offset, 0), BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(n_lo + window - offset, 0), q_len)
    full_hi = tl.maximum((full_hi // BLOCK_M) * BLOCK_M, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, start_m, q_start, q_len, offset, offs_n, window, qk_scale,
               stride_qt, stride_dot, offs_d, d_mask,
               BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
               PREC: tl.constexpr, UPCAST: tl.constexpr):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    qd_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + rows[:, None] * stride_qt + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(LSE + q_start + offs_m, mask=m_mask, other=0.0)
    delta = tl.load(DELTA + q_start + offs_m, mask=m_mask, other=0.0)
    p_t = tl.exp2(_dot(k, tl.trans(q), PREC, UPCAST) * qk_scale - lse[None, :])  # [BLOCK_N, BLOCK_M]
    if MASKED:
        q_pos = offset + offs_m
        visible = (offs_n[:, None] <= q_pos[None, :]) & m_mask[None, :]
        if HAS_WINDOW:
            visible &= offs_n[:, None] > q_pos[None, :] - window
        p_t = tl.where(visible, p_t, 0.0)
    dv += _dot(p_t.to(do.dtype), do, PREC, UPCAST)
    dp_t = _dot(v, tl.trans(do), PREC, UPCAST)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += _dot(ds_t.to(q.dtype), q, PREC, UPCAST)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,  # Q/DO [Tq, Hq, D]; K/V/DK/DV [Tk, Hkv, D]; LSE/DELTA [Hq, Tq]
    cu_q, cu_k, qk_scale, scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    k_start = tl.load(cu_k + seq)
    k_len = tl.load(cu_k + seq + 1) - k_start
    n_start = pid_n * BLOCK_N
    if n_start >= k_len:
        return
    q_start = tl.load(cu_q + seq)
    q_len = tl.load(cu_q + seq + 1) - q_start
    offset = k_len - q_len

    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    kv_mask = (offs_n < k_len)[:, None] & d_mask[None, :]
    rows = (k_start + offs_n).to(tl.int64)
    k = tl.load(K + rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    n_hi = tl.minimum(n_start + BLOCK_N, k_len) - 1
    lo, full_lo, full_hi, hi = _query_runs(n_start, n_hi, q_len, offset, window, BLOCK_M)
    for g in range(GROUPS):
        head = kv_head * GROUPS + g
        Qh = Q + head * stride_qh
        DOh = DO + head * stride_doh
        LSEh = LSE + head * stride_lse
        DELTAh = DELTA + head * stride_lse
        for start_m in range(lo, full_lo, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, start_m, q_start, q_len, offset, offs_n,
                                window, qk_scale, stride_qt, stride_dot, offs_d, d_mask,
                                BLOCK_M, True, HAS_WINDOW, PREC, UPCAST)
        for start_m in range(full_lo, full_hi, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, start_m, q_start, q_len, offset, offs_n,
                                window, qk_scale, stride_qt, stride_dot, offs_d, d_mask,
                                BLOCK_M, False, HAS_WINDOW, PREC, UPCAST)
        for start_m in range(full_hi, hi, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, start_m, q_start, q_len, offset, offs_n,
                                window, qk_scale, stride_qt, stride_dot, offs_d, d_mask,
                                BLOCK_M, True, HAS_WINDOW, PREC, UPCAST)

    tl.store(DK + rows[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + rows[:, None] * stride_dvt + kv_head * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_tile(dq, q, do, lse, delta, K, V, start_n, q_pos, k_len, k_start, window, qk_scale,
             stride_kt, stride_vt, offs_d, d_mask,
             BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
             PREC: tl.constexpr, UPCAST: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    rows = (k_start + offs_n).to(tl.int64)
    kv_mask = (offs_n < k_len)[:, None] & d_mask[None, :]
    k = tl.load(K + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    p = tl.exp2(_dot(q, tl.trans(k), PREC, UPCAST) * qk_scale - lse[:, None])  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n < k_len)[None, :]
        if HAS_WINDOW:
            visible &= offs_n[None, :] > q_pos[:, None] - window
        p = tl.where(visible, p, 0.0)
    dp = _dot(do, tl.trans(v), PREC, UPCAST)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.to(k.dtype), k, PREC, UPCAST)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    cu_q, cu_k, qk_scale, scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lse,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_q + seq)
    q_len = tl.load(cu_q + seq + 1) - q_start
    m_start = pid_m * BLOCK_M
    if m_start >= q_len:
        return
    k_start = tl.load(cu_k + seq)
    k_len = tl.load(cu_k + seq + 1) - k_start
    offset = k_len - q_len

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < q_len
    qd_mask = m_mask[:, None] & d_mask[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(LSE + head * stride_lse + q_start + offs_m, mask=m_mask, other=0.0)
    delta = tl.load(DELTA + head * stride_lse + q_start + offs_m, mask=m_mask, other=0.0)
    q_pos = offset + offs_m
    kv_head = head // GROUPS
    Kh = K + kv_head * stride_kh
    Vh = V + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    p_lo = offset + m_start
    p_hi = offset + tl.minimum(m_start + BLOCK_M, q_len) - 1
    lo, full_lo, full_hi, hi = _key_runs(p_lo, p_hi, k_len, window, BLOCK_N)
    for start_n in range(lo, full_lo, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse, delta, Kh, Vh, start_n, q_pos, k_len, k_start, window, qk_scale,
                      stride_kt, stride_vt, offs_d, d_mask, BLOCK_N, True, HAS_WINDOW, PREC, UPCAST)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse, delta, Kh, Vh, start_n, q_pos, k_len, k_start, window, qk_scale,
                      stride_kt, stride_vt, offs_d, d_mask, BLOCK_N, False, HAS_WINDOW, PREC, UPCAST)
    for start_n in range(full_hi, hi, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse, delta, Kh, Vh, start_n, q_pos, k_len, k_start, window, qk_scale,
                      stride_kt, stride_vt, offs_d, d_mask, BLOCK_N, True, HAS_WINDOW, PREC, UPCAST)
    tl.store(DQ + rows[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=qd_mask)


def _configs(pairs):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in pairs]


# (BLOCK_M queries, BLOCK_N keys, warps, stages) for Hopper; small-footprint fallbacks last.
_DKDV_CONFIGS = {
    64: _configs([(64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 2)]),
    128: _configs([(64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 2)]),
    256: _configs([(32, 64, 8, 2), (16, 64, 4, 2), (32, 32, 4, 2), (16, 32, 4, 1)]),
}
_DQ_CONFIGS = {
    64: _configs([(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2)]),
    128: _configs([(128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 2)]),
    256: _configs([(64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (32, 16, 4, 1)]),
}
_KEY = ["HEAD_DIM", "GROUPS", "HAS_WINDOW"]
_dkdv_tuned = {d: triton.autotune(c, key=_KEY)(_attn_bwd_dkdv_kernel) for d, c in _DKDV_CONFIGS.items()}
_dq_tuned = {d: triton.autotune(c, key=_KEY)(_attn_bwd_dq_kernel) for d, c in _DQ_CONFIGS.items()}


def attention_bwd(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                  scale: float, window: int | None = None):
    """Gradients of :func:`attention_fwd` (packed keys only). ``lse`` is the forward's base-2 logsumexp."""
    do = do if do.stride(-1) == 1 else do.contiguous()
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k.shape[1]
    num_seqs = cu_seqlens_q.numel() - 1
    delta = (out.float() * do.float()).sum(-1).transpose(0, 1).contiguous()  # [Hq, Tq]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.shape[0] == 0 or num_seqs == 0:
        return dq, dk.zero_(), dv.zero_()
    bd = block_d(head_dim)
    common = (cu_seqlens_q, cu_seqlens_k, scale * LOG2E, scale, window or NO_WINDOW,
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              do.stride(0), do.stride(1))
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=bd, GROUPS=num_heads // num_kv_heads, HAS_WINDOW=bool(window),
                PREC=_dot_precision(q.dtype), UPCAST=_UPCAST_DOT)
    dkdv_args = (q, k, v, do, lse, delta, dk, dv, *common,
                 dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0))
    dq_args = (q, k, v, do, lse, delta, dq, *common, dq.stride(0), dq.stride(1), lse.stride(0))
    if interpreting():
        b = INTERPRET_BLOCK
        _attn_bwd_dkdv_kernel[(cdiv(max_seqlen_k, b), num_seqs, num_kv_heads)](
            *dkdv_args, BLOCK_M=b, BLOCK_N=b, **meta)
        _attn_bwd_dq_kernel[(cdiv(max_seqlen_q, b), num_seqs, num_heads)](
            *dq_args, BLOCK_M=b, BLOCK_N=b, **meta)
    else:
        key = max(64, bd)
        _dkdv_tuned[key][lambda m: (cdiv(max_seqlen_k, m["BLOCK_N"]), num_seqs, num_kv_heads)](
            *dkdv_args, **meta)
        _dq_tuned[key][lambda m: (cdiv(max_seqlen_q, m["BLOCK_M"]), num_seqs, num_heads)](
            *dq_args, **meta)
    return dq, dk, dv
