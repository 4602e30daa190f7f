"""The packed q/k/v GEMV of a decode step finishing its own heads: qk_norm_rope's per-head RMSNorm,
rotary and KV-cache store in the GEMV's epilogue, one launch fewer a layer.

Why: at batch 1 a decode step is a chain of dependent launches, each costing ~3.4 us however little
it does (bench/RESULTS.md run 21), and qk_norm_rope is one of the six a layer. The GEMV cannot simply
do a head's norm in its programs: a head's 128 outputs come from 16 programs of 8 rows (the GEMV needs
hundreds of programs to stream its weights at full rate; one-head tiles cost the batch-32 projection
more than the launch saved, see ``fused_norm_decode.py``). So the programs keep their tiling, store
their rows as the plain GEMV does, and count their arrival on their head's counter
(``arrivals.py``); the last of a head to arrive reads the head back (from L2) and finishes it:

- a q head: normed and rotated into ``q_out`` (qk_norm_rope's output);
- a k head: the same into ``k_out``, and into the cache slot of its token;
- v rows need nothing from other programs: each program also writes its own into the cache.

The head is read back as the GEMV rounded it and goes through ``qk_norm_rope.norm_rope``, the
arithmetic qk_norm_rope runs on that same tensor, so outputs and cache are bit for bit those of the
two launches. The heads' outputs are a few hundred bytes; what the epilogue adds to the GEMV is the
last arrival's atomic and its read back, against a whole launch in the chain.

``HEAD_EPILOGUE`` switches it on for the decode layer (``fused_norm_decode.py``); it is off until it
has been measured on a GPU (bench/RESULTS.md, "Not yet run on a GPU").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters
from .gemv import _NO_ACT, _rows, gemv_rows, tiling, with_folded_norm
from .grid import cdiv, next_power_of_2
from .pdl import pdl_enabled
from .qk_norm_rope import norm_rope, rope_layout, rope_rows

# The decode layer's q/k/v GEMV finishes its heads (see the module docstring). Off until it has run on
# a GPU (bench/RESULTS.md, "Not yet run on a GPU"); bench/generate.py's ``+heads`` turns it on.
HEAD_EPILOGUE = False
_PLAIN_INPUT = tl.constexpr(_NO_ACT)  # gemv_rows' ACT: x as loaded


class Heads(NamedTuple):
    """What the epilogue needs to finish the heads of a packed ``[q | k | v]`` output: head counts and
    size, the step's rotary rows ``cos``/``sin [T, R]``, the q/k norms' weights and eps (weights None:
    no norm), and the layer's caches with a slot per token, or None (no cache to write)."""

    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    q_eps: float = 1e-6
    k_eps: float = 1e-6
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (k_cache, v_cache, slot_mapping)


@triton.jit
def _finish_head(y_row, head, m, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot, stride_ct,
                 stride_st, n_q_heads, n_kv_heads, q_eps, k_eps, half, rot, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr):
    """qk_norm_rope's work on head ``head`` of token ``m`` of the packed output row ``y_row`` (a q head,
    a k head past ``n_q_heads``, a v head past those), read back as the GEMV rounded it."""
    cols = tl.arange(0, BLOCK_D)[None, :]
    col_ok = cols < HEAD_DIM
    at = y_row + head * HEAD_DIM
    if head >= n_q_heads + n_kv_heads:  # v: into the cache as it is (qk_norm_rope's copy of v)
        if STORE:
            if slot >= 0:
                v = tl.load(at + cols, mask=col_ok)
                v_head = head - n_q_heads - n_kv_heads
                tl.store(vc_ptr + (slot * n_kv_heads + v_head) * HEAD_DIM + cols, v.to(vc_ptr.dtype.element_ty),
                         mask=col_ok)
    else:
        partner, sign, rotated = rope_layout(cols, half, rot)
        x = tl.load(at + cols, mask=col_ok, other=0.0).to(tl.float32)  # [1, BLOCK_D]
        xp = tl.load(at + partner, mask=col_ok, other=0.0).to(tl.float32)
        c, s = rope_rows(cos_ptr + m * stride_ct, sin_ptr + m * stride_st, cols, sign, rotated)
        if head < n_q_heads:
            w, wp = sign, sign  # not read without the norm
            if HAS_NORM:
                w = tl.load(qw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                wp = tl.load(qw_ptr + partner, mask=col_ok, other=0.0).to(tl.float32)
            q = norm_rope(x, xp, w, wp, c, s, q_eps, HEAD_DIM, HAS_NORM)
            tl.store(qo_ptr + (m * n_q_heads + head) * HEAD_DIM + cols, q.to(qo_ptr.dtype.element_ty), mask=col_ok)
        else:
            kv_head = head - n_q_heads
            w, wp = sign, sign
            if HAS_NORM:
                w = tl.load(kw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                wp = tl.load(kw_ptr + partner, mask=col_ok, other=0.0).to(tl.float32)
            k = norm_rope(x, xp, w, wp, c, s, k_eps, HEAD_DIM, HAS_NORM).to(ko_ptr.dtype.element_ty)
            tl.store(ko_ptr + (m * n_kv_heads + kv_head) * HEAD_DIM + cols, k, mask=col_ok)
            if STORE:  # the output's rounding, then the cache's cast (qk_norm_rope's fused store)
                if slot >= 0:
                    tl.store(kc_ptr + (slot * n_kv_heads + kv_head) * HEAD_DIM + cols,
                             k.to(kc_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def arrive_and_finish(y_row, head, m, arrived_ptr, programs_a_head, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr,
                      sin_ptr, kc_ptr, vc_ptr, slot, stride_ct, stride_st, n_q_heads, n_kv_heads, q_eps, k_eps, half,
                      rot, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
                      STORE: tl.constexpr):
    """Once this program has stored its rows of head ``head`` of token ``m``: count its arrival on the
    head's counter; the last of the head's ``programs_a_head`` to arrive finishes the head and sets the
    counter back to zero (``arrivals.py``)."""
    # Every store of this program happens before its arrival is counted (barrier, then a release at
    # GPU scope); the head's last arrival acquires them all before it reads the head back.
    tl.debug_barrier()
    counter = arrived_ptr + m * (n_q_heads + 2 * n_kv_heads) + head
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == programs_a_head - 1:
        _finish_head(y_row, head, m, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot, stride_ct,
                     stride_st, n_q_heads, n_kv_heads, q_eps, k_eps, half, rot, HEAD_DIM, BLOCK_D, HAS_NORM, STORE)
        tl.store(counter, 0)  # ready for the next launch, which stream order puts after this one


@triton.jit
def _gemv_heads_kernel(x_ptr, u_ptr, w_ptr, b_ptr, y_ptr, nw_ptr, s_ptr, N, K, eps, stride_xm, stride_um, stride_wn,
                       stride_ym, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
                       arrived_ptr, stride_ct, stride_st, n_q_heads, n_kv_heads, q_eps, k_eps, half, rot,
                       NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       HAS_QK_NORM: tl.constexpr, STORE: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    y, rows, row_ok = gemv_rows(x_ptr, u_ptr, w_ptr, b_ptr, nw_ptr, s_ptr, N, K, eps, stride_xm, stride_um,
                                stride_wn, pid_n, m, _PLAIN_INPUT, NORM, HAS_RESIDUAL, HAS_BIAS, BLOCK_N, BLOCK_K,
                                USE_PDL)
    y = y.to(y_ptr.dtype.element_ty)
    y_row = y_ptr + m.to(tl.int64) * stride_ym
    tl.store(y_row + rows, y, mask=row_ok)
    slot = -1  # no cache
    if STORE:  # a step input: read after gemv_rows' wait; padding tokens (negative slots) store nothing
        slot = tl.load(slot_ptr + m).to(tl.int64)
    qk_heads = n_q_heads + n_kv_heads
    head = pid_n * BLOCK_N // HEAD_DIM  # BLOCK_N divides HEAD_DIM: a program's rows lie in one head
    if head >= qk_heads:  # v rows need nothing from other programs: each writes its own into the cache
        if STORE:
            if slot >= 0:
                tl.store(vc_ptr + slot * n_kv_heads * HEAD_DIM + (rows - qk_heads * HEAD_DIM),
                         y.to(vc_ptr.dtype.element_ty), mask=row_ok)
    else:
        arrive_and_finish(y_row, head, m, arrived_ptr, HEAD_DIM // BLOCK_N, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr,
                          sin_ptr, kc_ptr, vc_ptr, slot, stride_ct, stride_st, n_q_heads, n_kv_heads, q_eps, k_eps,
                          half, rot, HEAD_DIM, BLOCK_D, HAS_QK_NORM, STORE)


def heads_declines(x: torch.Tensor, weight: torch.Tensor, heads: Heads) -> str | None:
    """Why ``gemv_heads`` cannot take this launch (where the caller should run the GEMV and
    qk_norm_rope apart), or None: a head must be whole programs of the GEMV's tiling, and the arrival
    counters must exist (inside a CUDA-graph capture they cannot be made)."""
    n, k = weight.shape
    rows = x.numel() // max(x.shape[-1], 1)
    block_n = tiling(n, k, x.device)[0]
    if heads.head_dim % block_n:
        return f"head_dim {heads.head_dim} is not a whole number of the GEMV's {block_n}-row programs"
    if arrival_counters(x.device, rows * (heads.n_q_heads + 2 * heads.n_kv_heads)) is None:
        return "no arrival counters (first needed inside a CUDA-graph capture)"
    return None


def check_heads(t: int, n: int, heads: Heads) -> None:
    """Raises unless ``heads`` describe a packed ``[T, n]`` q/k/v output (see ``Heads``)."""
    d = heads.head_dim
    if n != (heads.n_q_heads + 2 * heads.n_kv_heads) * d:
        raise ValueError(f"gemv_heads: a packed q/k/v weight of ({heads.n_q_heads} + 2 x {heads.n_kv_heads}) heads "
                         f"of {d} rows, got {n} rows")
    rot = heads.cos.shape[-1]
    if heads.cos.shape != heads.sin.shape or heads.cos.shape != (t, rot) or rot > d or rot % 2:
        raise ValueError(f"gemv_heads: cos/sin must be [T={t}, R] with an even R <= head_dim ({d}), got "
                         f"{tuple(heads.cos.shape)} and {tuple(heads.sin.shape)}")
    if (heads.q_weight is None) != (heads.k_weight is None) or (
            heads.q_weight is not None and (heads.q_weight.shape != (d,) or heads.k_weight.shape != (d,))):
        raise ValueError(f"gemv_heads: q and k norm weights both [head_dim={d}], or neither")
    if heads.cache is not None:
        k_cache, v_cache, slots = heads.cache
        if (k_cache.shape != v_cache.shape or k_cache.shape[2:] != (heads.n_kv_heads, d) or k_cache.dtype != v_cache.dtype
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or slots.shape != (t,)):
            raise ValueError(f"gemv_heads: contiguous caches [blocks, page, {heads.n_kv_heads}, {d}] of one dtype and "
                             f"a slot per token; got {tuple(k_cache.shape)} {k_cache.dtype}, {tuple(v_cache.shape)} "
                             f"{v_cache.dtype} and slots {tuple(slots.shape)}")


def gemv_heads(x: torch.Tensor, weight: torch.Tensor, heads: Heads, bias: torch.Tensor | None = None,
               norm: tuple[torch.Tensor, float, torch.Tensor | None] | None = None, out: torch.Tensor | None = None):
    """The packed ``[q | k | v]`` projection of ``x [T, K]`` (a few rows; with ``norm = (norm weight,
    eps, residual or None)`` of ``rms_norm(x + residual)``, as ``gemv.gemv_rms_norm``), finished per
    head as ``qk_norm_rope_forward`` with a ``KVStore`` would: returns ``(q [T, Hq, D], k [T, Hkv, D],
    v [T, Hkv, D], x + residual or None)``, the caches written at the slots. v is a view of the packed
    output, into ``out [T, N]`` where given. See ``heads_declines`` for what it cannot take."""
    from .qk_norm_rope import output_dtypes

    n = weight.shape[0]
    x2 = _rows(x)
    check_heads(x2.shape[0], n, heads)
    reason = heads_declines(x2, weight, heads)
    if reason is not None:
        raise ValueError(f"gemv_heads: {reason}; run the GEMV and qk_norm_rope apart")
    t, d, hq, hkv = x2.shape[0], heads.head_dim, heads.n_q_heads, heads.n_kv_heads
    y = out if out is not None else torch.empty(t, n, device=x.device, dtype=x.dtype)
    if y.shape != (t, n) or y.dtype != x.dtype or y.stride(-1) != 1:
        raise ValueError(f"gemv_heads: out must be [{t}, {n}] of {x.dtype} with unit column stride, got "
                         f"{tuple(y.shape)} {y.dtype}")
    q, k = y[:, :hq * d].view(t, hq, d), y[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    q_dtype, k_dtype = output_dtypes(q, k, heads.cos, heads.q_weight)
    q_out = torch.empty(t, hq, d, device=x.device, dtype=q_dtype)
    k_out = torch.empty(t, hkv, d, device=x.device, dtype=k_dtype)
    k_cache, v_cache, slots = heads.cache if heads.cache is not None else (k_out, k_out, k_out)  # unread then
    cos, sin = (c if c.stride(-1) == 1 else c.contiguous() for c in (heads.cos, heads.sin))
    has_norm = heads.q_weight is not None
    block_n, block_k, warps = tiling(n, x2.shape[1], x.device)
    arrived = arrival_counters(x.device, t * (hq + 2 * hkv))
    pdl = pdl_enabled(x.device)

    def launch(x2, u2, norm):
        norm_w, eps, s = norm if norm is not None else (y, 0.0, None)
        _gemv_heads_kernel[(cdiv(n, block_n), t)](
            x2, u2, weight, bias if bias is not None else y, y, norm_w, s if s is not None else y, n, x2.shape[1], eps,
            x2.stride(0), u2.stride(0), weight.stride(0), y.stride(0), q_out, k_out,
            heads.q_weight if has_norm else cos, heads.k_weight if has_norm else cos, cos, sin, k_cache, v_cache,
            slots, arrived, cos.stride(0), sin.stride(0), hq, hkv, heads.q_eps, heads.k_eps, cos.shape[-1] // 2,
            cos.shape[-1], NORM=norm is not None, HAS_RESIDUAL=s is not None, HAS_BIAS=bias is not None,
            BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=pdl, HEAD_DIM=d, BLOCK_D=next_power_of_2(d),
            HAS_QK_NORM=has_norm, STORE=heads.cache is not None, num_warps=warps, num_stages=3, launch_pdl=pdl)
        return y

    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    v = y[:, (hq + hkv) * d:].view(t, hkv, d)
    if norm is None:
        launch(x2, x2, None)
        return q_out, k_out, v, None
    norm_weight, eps, residual = norm
    summed = with_folded_norm(launch, x, n, norm_weight, eps, residual)
    return q_out, k_out, v, summed[1] if residual is not None else None


__all__ = ["HEAD_EPILOGUE", "Heads", "arrive_and_finish", "check_heads", "gemv_heads", "heads_declines"]
