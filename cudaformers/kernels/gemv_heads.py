"""The q/k/v projection of a decode step that also finishes the heads: one launch for what is
otherwise the GEMV (``gemv.gemv_rms_norm``) and ``qk_norm_rope`` with its KV-cache store.

At batch 1 a layer is a chain of short launches, and under programmatic dependent launch (``pdl.py``)
what each one costs is mostly its place in the chain. qk_norm_rope does a few thousand flops over
one head's worth of rows per head; here it moves into the GEMV's tail. The GEMV's programs own
``BLOCK_N`` rows each, so a head of ``HEAD_DIM`` rows comes from ``HEAD_DIM / BLOCK_N`` programs.
Each stores its rows (the packed q/k/v output, as the GEMV does), then counts its arrival on the
head's counter; the last program to arrive reads the whole head back and does what qk_norm_rope does
with it: q heads RMS-normed and rotated into the query tensor, k heads normed, rotated and written to
their cache slot, v heads copied to theirs. It uses qk_norm_rope's own arithmetic (``norm_rope``) on
the same stored values, so the query and the cache hold the same bits as after the two launches.

The counters are the paged decode's (``paged_decode._arrival_counters``): all zero between launches,
each reset by the program that finishes its head. A launch uses them only after its wait for the
previous kernel, and the next kernel only after its own, so a chain never has two users at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .gemv import gemv_rows, tiling, with_folded_norm
from .paged_decode import _arrival_counters
from .pdl import pdl_enabled
from .qk_norm_rope import norm_rope, rope_layout, rope_rows


class Heads(NamedTuple):
    """What finishing the heads needs: the layout of the packed output (``n_q`` q heads, then
    ``n_kv`` k and ``n_kv`` v heads of ``head_dim``), the optional q/k RMSNorm weights ``[D]`` and
    eps, rotary ``cos``/``sin [T, R]``, the layer's caches ``[blocks, page, Hkv, D]`` and the
    tokens' cache ``slots [T]`` (negative: not stored), and the dtype q and k round to."""

    n_q: int
    n_kv: int
    head_dim: int
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    q_eps: float
    k_eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    out_dtype: torch.dtype


@triton.jit
def _normed_rotated(row, w_ptr, cols, col_ok, c, s, eps, half, rot, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """One head read back from the projection's output ``row``, as qk_norm_rope computes it (fp32)."""
    partner, sign, rotated = rope_layout(cols, half, rot)
    x = tl.load(row + cols, mask=col_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    xp = tl.load(row + partner, mask=col_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    w = sign  # never read without the norm
    w_partner = sign
    if HAS_NORM:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        w_partner = tl.load(w_ptr + partner, mask=col_ok, other=0.0).to(tl.float32)
    return norm_rope(x, xp, w, w_partner, c, s, eps, HEAD_DIM, HAS_NORM)


@triton.jit
def _finish_head(y_row, head, m, qo_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
                 stride_ct, stride_st, n_q, n_kv, q_eps, k_eps, half, rot,
                 HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)[None, :]
    col_ok = cols < HEAD_DIM
    row = y_row + head * HEAD_DIM
    slot = tl.load(slot_ptr + m).to(tl.int64)
    if head < n_q + n_kv:
        _, sign, rotated = rope_layout(cols, half, rot)
        c, s = rope_rows(cos_ptr + m * stride_ct, sin_ptr + m * stride_st, cols, sign, rotated)
        if head < n_q:
            y = _normed_rotated(row, qw_ptr, cols, col_ok, c, s, q_eps, half, rot, HEAD_DIM, HAS_NORM)
            tl.store(qo_ptr + (m * n_q + head) * HEAD_DIM + cols, y.to(qo_ptr.dtype.element_ty), mask=col_ok)
        elif slot >= 0:  # the output's rounding, then the cache's cast: what the unfused store does
            y = _normed_rotated(row, kw_ptr, cols, col_ok, c, s, k_eps, half, rot, HEAD_DIM, HAS_NORM)
            y = y.to(qo_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty)
            tl.store(kc_ptr + (slot * n_kv + head - n_q) * HEAD_DIM + cols, y, mask=col_ok)
    elif slot >= 0:
        v = tl.load(row + cols, mask=col_ok, cache_modifier=".cg")
        tl.store(vc_ptr + (slot * n_kv + head - n_q - n_kv) * HEAD_DIM + cols, v.to(vc_ptr.dtype.element_ty),
                 mask=col_ok)


@triton.jit
def _gemv_heads_kernel(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, nw_ptr, s_ptr, N, K, eps, stride_xm, stride_rm, stride_wn,
                       stride_ym, qo_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, count_ptr,
                       stride_ct, stride_st, n_q, n_kv, q_eps, k_eps, half, rot,
                       HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    y, rows, row_ok = gemv_rows(x_ptr, r_ptr, w_ptr, nw_ptr, s_ptr, N, K, eps, stride_xm, stride_rm, stride_wn,
                                -1, True, HAS_RESIDUAL, BLOCK_N, BLOCK_K, USE_PDL)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    m = tl.program_id(1).to(tl.int64)
    y_row = y_ptr + m * stride_ym
    tl.store(y_row + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)
    # The rows are stored before the arrival is counted (barrier, then a release at GPU scope); the
    # last arrival acquires the other programs' rows before reading the head back.
    head = tl.program_id(0) * BLOCK_N // HEAD_DIM
    counter = count_ptr + m * (n_q + 2 * n_kv) + head
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == HEAD_DIM // BLOCK_N - 1:
        _finish_head(y_row, head, m, qo_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_ct, stride_st, n_q, n_kv, q_eps, k_eps, half, rot, HEAD_DIM, HAS_NORM, BLOCK_D)
        tl.store(counter, 0)  # ready for the next launch, which stream order puts after this one


def heads_fit(n: int, k: int, head_dim: int, device: torch.device) -> bool:
    """Whether the GEMV's programs tile the heads: each program's rows lie in one head."""
    return head_dim % tiling(n, k, device)[0] == 0


def gemv_rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None, bias: torch.Tensor | None, heads: Heads,
                        out: torch.Tensor):
    """``gemv.gemv_rms_norm`` into ``out [T, N]`` (the packed q/k/v rows), then per head what
    ``qk_norm_rope`` with its cache store does, in one launch. Returns ``(q [T, n_q, D], x + residual)``
    (the sum only with a residual, as gemv_rms_norm), or None where the counters cannot be had (a CUDA
    graph captured before any eager call): then nothing ran and the caller takes the two launches."""
    t, n = out.shape
    d = heads.head_dim
    counters = _arrival_counters(x.device, t * (heads.n_q + 2 * heads.n_kv))
    if counters is None:
        return None
    if n != (heads.n_q + 2 * heads.n_kv) * d or not heads_fit(n, x.shape[-1], d, x.device):
        raise ValueError(f"gemv_rms_norm_heads: {n} output rows are not {heads.n_q} + 2 x {heads.n_kv} heads of {d} "
                         f"tiled by the GEMV's programs (check heads_fit first)")
    q = torch.empty(t, heads.n_q, d, device=x.device, dtype=heads.out_dtype)
    has_norm = heads.q_weight is not None
    rot = heads.cos.shape[-1]

    def launch(x2, r2, norm):
        norm_w, norm_eps, s = norm
        block_n, block_k, warps = tiling(n, x2.shape[1], x2.device)
        pdl = pdl_enabled(x2.device)
        cos, sin = heads.cos, heads.sin
        _gemv_heads_kernel[(triton.cdiv(n, block_n), t)](
            x2, r2, weight, bias if bias is not None else out, out, norm_w, s if s is not None else out, n,
            x2.shape[1], norm_eps, x2.stride(0), r2.stride(0), weight.stride(0), out.stride(0), q,
            heads.q_weight if has_norm else cos, heads.k_weight if has_norm else cos, cos, sin, heads.k_cache,
            heads.v_cache, heads.slots, counters, cos.stride(0), sin.stride(0), heads.n_q, heads.n_kv,
            heads.q_eps, heads.k_eps, rot // 2, rot, HAS_RESIDUAL=s is not None, HAS_BIAS=bias is not None,
            BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=pdl, HEAD_DIM=d, HAS_NORM=has_norm,
            BLOCK_D=triton.next_power_of_2(d), num_warps=warps, num_stages=3, launch_pdl=pdl)
        return out

    y = with_folded_norm(launch, x, n, norm_weight, eps, residual)
    return (q, None) if residual is None else (q, y[1])
