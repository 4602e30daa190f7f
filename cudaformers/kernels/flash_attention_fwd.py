"""FlashAttention-2-style forward over packed variable-length sequences, in Triton.

One program owns ``BLOCK_M`` queries of one (sequence, query head) and streams that sequence's keys in
``BLOCK_N`` tiles with an online softmax, so the ``[Sq, Sk]`` score matrix never exists. Queries are
the last ``q_len`` positions of their sequence (bottom-right causal), which lets one kernel serve
plain prefill (``q_len == k_len``) and prefill on top of a cached prefix. Keys come either from a packed
``[Tk, Hkv, D]`` tensor (``cu_seqlens_k``) or straight from the paged cache through the block table.

Key tiles split into three runs per query block: a masked run at the left window edge, an unmasked
interior, and a masked run at the causal diagonal; tiles outside the window are never loaded.
Scores are kept in base 2 (``qk_scale = scale * log2(e)``) and the stored logsumexp is base 2 too.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .grid import cdiv, next_power_of_2


LOG2E = 1.4426950408889634


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# The interpreter's bf16 tl.dot returns garbage (triton 3.9); it gets fp32 operands instead. Inputs
# are rounded to their dtype before the upcast, so numerics match a fp32-accumulating tensor core.
_UPCAST_DOT = interpreting()


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _kv_rows(offs_n, k_len, k_start, bt_row, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Row of each key position in the (flattened) key tensor: packed offset or paged slot."""
    if PAGED:
        block = tl.load(bt_row + offs_n // PAGE_SIZE, mask=offs_n < k_len, other=0)
        return block.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
    return (k_start + offs_n).to(tl.int64)


@triton.jit
def _key_runs(p_lo, p_hi, k_len, window, BLOCK_N: tl.constexpr):
    """Key ranges for queries at absolute positions [p_lo, p_hi]: masked [lo, full_lo), unmasked
    [full_lo, full_hi), masked [full_hi, hi). Tiles in the unmasked run are visible to every query.
    ``window`` is huge when there is no sliding window."""
    hi = tl.minimum(p_hi + 1, k_len)
    lo = (tl.maximum(p_lo - window + 1, 0) // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(tl.maximum(p_hi - window + 1, 0), BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(((p_lo + 1) // BLOCK_N) * BLOCK_N, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, K, V, start_n, q_pos, k_len, k_start, bt_row, window, qk_scale,
              stride_kt, stride_vt, offs_d, d_mask,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
              PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    rows = _kv_rows(offs_n, k_len, k_start, bt_row, PAGED, PAGE_SIZE)
    kv_mask = (offs_n < k_len)[:, None] & d_mask[None, :]
    k = tl.load(K + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = _dot(q, tl.trans(k), PREC, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n < k_len)[None, :]
        if HAS_WINDOW:
            visible &= offs_n[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:  # a row may have seen no key yet: keep exp2 away from (-inf) - (-inf)
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.exp2(s - m_new_safe[:, None])
    alpha = tl.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, PREC, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE,  # Q/O [Tq, Hq, D]; K/V [Tk, Hkv, D] or flattened pages; LSE [Hq, Tq] fp32 (log2)
    cu_q, cu_k, block_table,
    qk_scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lse, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
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
    offset = k_len - q_len  # absolute position of this sequence's first query

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < q_len
    q_ptrs = Q + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = offset + offs_m

    kv_head = head // GROUPS
    Kh = K + kv_head * stride_kh
    Vh = V + kv_head * stride_vh
    bt_row = block_table + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    p_lo = offset + m_start
    p_hi = offset + tl.minimum(m_start + BLOCK_M, q_len) - 1
    lo, full_lo, full_hi, hi = _key_runs(p_lo, p_hi, k_len, window, BLOCK_N)
    for start_n in range(lo, full_lo, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, Kh, Vh, start_n, q_pos, k_len, k_start, bt_row, window,
                                  qk_scale, stride_kt, stride_vt, offs_d, d_mask,
                                  BLOCK_N, True, HAS_WINDOW, PAGED, PAGE_SIZE, PREC, UPCAST)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, Kh, Vh, start_n, q_pos, k_len, k_start, bt_row, window,
                                  qk_scale, stride_kt, stride_vt, offs_d, d_mask,
                                  BLOCK_N, False, HAS_WINDOW, PAGED, PAGE_SIZE, PREC, UPCAST)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, Kh, Vh, start_n, q_pos, k_len, k_start, bt_row, window,
                                  qk_scale, stride_kt, stride_vt, offs_d, d_mask,
                                  BLOCK_N, True, HAS_WINDOW, PAGED, PAGE_SIZE, PREC, UPCAST)

    # Every real query sees at least its own key; padding rows (never stored) get l = 1.
    l_i = tl.where(m_mask, l_i, 1.0)
    out = acc / l_i[:, None]
    o_ptrs = O + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    tl.store(LSE + head * stride_lse + q_start + offs_m, m_i + tl.log2(l_i), mask=m_mask)


def _configs(pairs):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in pairs]


# Candidates for Hopper, smallest shared-memory footprint last so the largest head dim always has one
# that fits; the autotuner drops configs that run out of resources.
_FWD_CONFIGS = {
    64: _configs([(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4)]),
    128: _configs([(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)]),
    256: _configs([(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2)]),
}
_KEY = ["HEAD_DIM", "GROUPS", "HAS_WINDOW", "PAGED"]
_fwd_tuned = {d: triton.autotune(cfgs, key=_KEY)(_attn_fwd_kernel) for d, cfgs in _FWD_CONFIGS.items()}
NO_WINDOW = 1 << 30  # stands in for "no sliding window" in the loop bounds
INTERPRET_BLOCK = 16  # tl.dot needs every dimension >= 16


def block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    d = q.shape[-1]
    if d > 256:
        raise ValueError(f"the Triton attention kernels support head_dim up to 256, got {d}; "
                         "use attn_implementation='sdpa' for this model")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"{q.shape[-2]} query heads are not a multiple of {k.shape[-2]} key/value heads")
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"q, k, v head dims differ: {d}, {k.shape[-1]}, {v.shape[-1]}")


def output_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked to take an attention output for ``q`` (its shape, dtype and device, last dim
    contiguous), or a new tensor."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} must have q's shape, dtype and "
                         f"device {tuple(q.shape)} {q.dtype} {q.device}, its last dim contiguous")
    return out


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through tf32 on the GPU; users who ask for fp32 get fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


def attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, scale: float,
                  window: int | None = None, block_table: torch.Tensor | None = None,
                  out: torch.Tensor | None = None):
    """Varlen causal attention forward. Returns ``out [Tq, Hq, D]`` and ``lse [Hq, Tq]`` (fp32, base 2).

    With ``block_table``, ``k``/``v`` are the paged cache ``[num_blocks, page, Hkv, D]`` and
    ``cu_seqlens_k`` counts each sequence's cached keys (context + new tokens). ``out`` (q's shape and
    dtype, last dim contiguous) receives the result instead of a new tensor.
    """
    check_inputs(q, k, v)
    q = q if q.stride(-1) == 1 else q.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    out = output_like(q, out)
    lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=q.device)
    num_seqs = cu_seqlens_q.numel() - 1
    if num_tokens == 0 or num_seqs == 0:
        return out, lse
    paged = block_table is not None
    if paged:
        page_size = k.shape[1]
        k = k.view(-1, *k.shape[2:])
        v = v.view(-1, *v.shape[2:])
    else:
        page_size = 1
        block_table = cu_seqlens_k  # never read; keeps the signature uniform
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    bd = block_d(head_dim)
    args = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, scale * LOG2E, window or NO_WINDOW,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), block_table.stride(0) if paged else 0)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=bd, GROUPS=num_heads // k.shape[1], HAS_WINDOW=bool(window),
                PAGED=paged, PAGE_SIZE=page_size, PREC=_dot_precision(q.dtype), UPCAST=_UPCAST_DOT)
    if interpreting():
        grid = (cdiv(max_seqlen_q, INTERPRET_BLOCK), num_seqs, num_heads)
        _attn_fwd_kernel[grid](*args, BLOCK_M=INTERPRET_BLOCK, BLOCK_N=INTERPRET_BLOCK, **meta)
    else:
        def grid(m):
            return (cdiv(max_seqlen_q, m["BLOCK_M"]), num_seqs, num_heads)
        _fwd_tuned[max(64, bd)][grid](*args, **meta)
    return out, lse


def lse_natural(lse2: torch.Tensor) -> torch.Tensor:
    """Base-2 logsumexp from the kernels -> natural log, as flash-attn reports it."""
    return lse2 * math.log(2.0)
