"""A quantized layer's packed q/k/v fragment GEMV finishing its own heads at one row: qk_norm_rope's
per-head norm, rotary and KV-cache store in the epilogue of ``quant_gemv_mma``, one launch fewer a
decode layer (the arrival scheme and the head's arithmetic are ``gemv_heads.py``'s).

The GEMV's programs keep their plan (``quant_gemv_mma.default_plan``: 16 or 32 rows a program, so a
128-row head is 4-8 programs), store their rows exactly as the plain kernel does (with ``rms``, scaled
by ``1 / rms`` as there), then count their arrival on their head's counter; the head's last arrival
reads it back and finishes it: q and k normed and rotated (k also into its cache slot), v copied into
the cache. Outputs and cache are bit for bit the plain GEMV's followed by qk_norm_rope's fused store.
Switched with ``gemv_heads.HEAD_EPILOGUE`` (``quant_norm_fold.py`` and ``fused_norm_decode.py`` call it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters
from .gemv_heads import Heads, arrive_and_finish, check_heads
from .grid import next_power_of_2
from .pdl import pdl_enabled
from .quant_gemv_epilogues import store_rows
from . import quant_gemv_mma as fragment
from .quant_gemv_mma import DEPTHS, FMT_INT4, FMT_INT8, dots
from .quant_matmul import PackedWeight

_PLAIN = tl.constexpr(-1)  # dots' GATED: plain 16-row tiles


@triton.jit
def _heads_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, n_blocks, ld_q, p_ptr, n_shares, n_in, eps, qo_ptr, ko_ptr,
                  qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, arrived_ptr, n_q_heads, n_kv_heads, q_eps,
                  k_eps, half, rot, FMT: tl.constexpr, WARPS: tl.constexpr, TILES: tl.constexpr, DEPTH: tl.constexpr,
                  HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, SHARES: tl.constexpr,
                  USE_PDL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_QK_NORM: tl.constexpr,
                  STORE: tl.constexpr):
    acc, row0, rstd = dots(x_ptr, q_ptr, s_ptr, z_ptr, n_blocks, ld_q, 0, p_ptr, n_shares, n_in, eps, FMT, WARPS,
                           TILES, DEPTH, HAS_ZEROS, EVEN, _PLAIN, SHARES, USE_PDL)
    ROW_SCALE: tl.constexpr = FMT == FMT_INT8
    HAS_RSTD: tl.constexpr = SHARES > 0
    store_rows(acc[0], s_ptr, b_ptr, y_ptr, row0, rstd, WARPS, ROW_SCALE, HAS_RSTD, HAS_BIAS)
    store_rows(acc[1], s_ptr, b_ptr, y_ptr, row0 + 8, rstd, WARPS, ROW_SCALE, HAS_RSTD, HAS_BIAS)
    if TILES == 2:
        store_rows(acc[2], s_ptr, b_ptr, y_ptr, row0 + 16, rstd, WARPS, ROW_SCALE, HAS_RSTD, HAS_BIAS)
        store_rows(acc[3], s_ptr, b_ptr, y_ptr, row0 + 24, rstd, WARPS, ROW_SCALE, HAS_RSTD, HAS_BIAS)
    slot = -1  # no cache
    if STORE:  # a step input, read after dots' wait; a padding token (negative slot) stores nothing
        slot = tl.load(slot_ptr).to(tl.int64)
    # 16 * TILES rows a program divide HEAD_DIM: a program's rows lie in one head. One row: token 0.
    arrive_and_finish(y_ptr, row0 // HEAD_DIM, 0, arrived_ptr, HEAD_DIM // (16 * TILES), qo_ptr, ko_ptr, qw_ptr, kw_ptr,
                      cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot, 0, 0, n_q_heads, n_kv_heads, q_eps, k_eps, half, rot,
                      HEAD_DIM, BLOCK_D, HAS_QK_NORM, STORE)


def quant_heads_declines(x: torch.Tensor, w: PackedWeight, heads: Heads,
                         plan: tuple[int, int, int] | None = None) -> str | None:
    """Why ``quant_gemv_mma_heads`` cannot take this launch (run the GEMV and qk_norm_rope apart), or None."""
    if not fragment.supports(x, w):
        return "not a launch the fragment GEMV takes"
    tiles = (plan or fragment.default_plan(w.out_features, w.fmt, x.device))[1]
    if heads.head_dim % (16 * tiles):
        return f"head_dim {heads.head_dim} is not a whole number of the GEMV's {16 * tiles}-row programs"
    if arrival_counters(x.device, heads.n_q_heads + 2 * heads.n_kv_heads) is None:
        return "no arrival counters (first needed inside a CUDA-graph capture)"
    return None


def quant_gemv_mma_heads(x: torch.Tensor, w: PackedWeight, heads: Heads, bias: torch.Tensor | None = None,
                         rms: tuple[torch.Tensor, float] | None = None, plan: tuple[int, int, int] | None = None,
                         out: torch.Tensor | None = None):
    """``quant_gemv_mma(x, w, bias, rms=rms)`` of a packed ``[q | k | v]`` weight, finished per head as
    ``qk_norm_rope_forward`` with a ``KVStore`` would: ``(q [1, Hq, D], k [1, Hkv, D], v [1, Hkv, D])``,
    the caches written at the slot; v is a view of the packed output (``out [1, N]`` where given)."""
    from .qk_norm_rope import output_dtypes

    fragment._check(x, w)
    n, d, hq, hkv = w.out_features, heads.head_dim, heads.n_q_heads, heads.n_kv_heads
    check_heads(1, n, heads)
    plan = plan or fragment.default_plan(n, w.fmt, x.device)
    reason = quant_heads_declines(x, w, heads, plan)
    if reason is not None:
        raise ValueError(f"quant_gemv_mma_heads: {reason}; run the GEMV and qk_norm_rope apart")
    warps, tiles, depth = plan
    if n % (16 * tiles) or depth not in DEPTHS:
        raise ValueError(f"quant_gemv_mma_heads: {tiles} tiles of 16 rows a warp for {n} rows, depth {depth} "
                         f"(one of {DEPTHS})")
    y = out if out is not None else torch.empty(1, n, device=x.device, dtype=x.dtype)
    if y.shape != (1, n) or y.dtype != x.dtype or not y.is_contiguous():
        raise ValueError(f"quant_gemv_mma_heads: out must be a contiguous [1, {n}] of {x.dtype}, got "
                         f"{tuple(y.shape)} {y.dtype}")
    q, k = y[:, :hq * d].view(1, hq, d), y[:, hq * d:(hq + hkv) * d].view(1, hkv, d)
    q_dtype, k_dtype = output_dtypes(q, k, heads.cos, heads.q_weight)
    q_out = torch.empty(1, hq, d, device=x.device, dtype=q_dtype)
    k_out = torch.empty(1, hkv, d, device=x.device, dtype=k_dtype)
    k_cache, v_cache, slots = heads.cache if heads.cache is not None else (k_out, k_out, k_out)  # unread then
    cos, sin = (c if c.is_contiguous() else c.contiguous() for c in (heads.cos, heads.sin))
    has_norm = heads.q_weight is not None
    shares, eps = rms if rms is not None else (y, 0.0)  # not read without rms
    words = w.qweight.view(torch.int64)
    pdl = pdl_enabled(x.device)
    _heads_kernel[(n // (16 * tiles),)](
        x.view(torch.int64), words, w.scales, w.zeros if w.zeros is not None else w.scales,
        bias if bias is not None else y, y, w.n_blocks, words.stride(0), shares, shares.numel(), w.in_features, eps,
        q_out, k_out, heads.q_weight if has_norm else cos, heads.k_weight if has_norm else cos, cos, sin, k_cache,
        v_cache, slots, arrival_counters(x.device, hq + 2 * hkv), hq, hkv, heads.q_eps, heads.k_eps,
        cos.shape[-1] // 2, cos.shape[-1], FMT=FMT_INT8 if w.fmt == "int8" else FMT_INT4, WARPS=warps, TILES=tiles,
        DEPTH=depth, HAS_ZEROS=w.zeros is not None, HAS_BIAS=bias is not None,
        EVEN=fragment.UNMASKED_EVEN and w.n_blocks % warps == 0 and w.n_blocks >= depth * warps,
        SHARES=0 if rms is None else next_power_of_2(shares.numel()), USE_PDL=pdl, HEAD_DIM=d,
        BLOCK_D=next_power_of_2(d), HAS_QK_NORM=has_norm, STORE=heads.cache is not None, num_warps=warps,
        launch_pdl=pdl)
    return q_out, k_out, y[:, (hq + hkv) * d:].view(1, hkv, d)


__all__ = ["quant_gemv_mma_heads", "quant_heads_declines"]
