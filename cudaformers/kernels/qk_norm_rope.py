"""Per-head RMSNorm of q and k (optional) and rotary embeddings, in one launch for inference.

q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` may be strided views of a packed projection (any token and
head strides, last dim contiguous); they are read once and written to new contiguous tensors, so the
attention kernels and the KV-cache store downstream never need a ``.contiguous()`` copy. The inputs
are left untouched, as in the reference. cos/sin ``[T, R]`` with ``R <= D`` rotate the first R
channels of every head (transformers' rotate_half layout); the rest pass through, normalised.

Everything is computed in fp32 from the loaded values and rounded once, at the store. There is no
backward: this is the inference kernel of the "rotary_pos_emb" layer type; when autograd needs
gradients through q or k it hands over to the differentiable kernels (``rms_norm`` + ``rotary``).
On Hopper it launches as part of the decode chain's programmatic dependent launch (``pdl.py``).

Given the layer's ``KVStore`` (v and the cache slots) the same launch also writes the rotated k, as
rounded for the output, and v into the paged KV cache, exactly as ``store_kv`` would afterwards: the
separate store kernel leaves the decode chain. Where the fused store could round differently from
``store_kv`` (see ``_fusable``) the store runs unfused.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from ..layers.rotary import apply_rotary_reference
from .grid import next_power_of_2
from .kv_store import supports as store_supported
from .pdl import pdl_enabled, release_dependents, wait_for_producer

logger = logging.getLogger("cudaformers")


@triton.jit
def rope_layout(cols, half, rot):
    """rotate_half over the first ``rot`` channels: each channel's partner, the partner's sign, and
    which channels rotate. Channel c < half pairs with c + half (and subtracts it), half <= c < rot
    with c - half; the rest pair with themselves and keep their value."""
    first = cols < half
    rotated = cols < rot
    partner = tl.where(first, cols + half, tl.where(rotated, cols - half, cols))
    sign = tl.where(first, -1.0, 1.0)
    return partner, sign, rotated


@triton.jit
def rope_rows(cos_row, sin_row, cols, sign, rotated):
    """fp32 cos and signed sin of one token, ``[1, BLOCK_D]``: channels past the rotary pass through."""
    c = tl.load(cos_row + cols, mask=rotated, other=1.0).to(tl.float32)
    s = sign * tl.load(sin_row + cols, mask=rotated, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def norm_rope(x, xp, w, w_partner, c, s, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads ``x [H, BLOCK_D]`` and their partner channels ``xp`` (fp32, zero past HEAD_DIM), RMS-normed
    per head (with fp32 weights) when HAS_NORM, then rotated: fp32, not yet rounded. The one
    definition of the arithmetic: the paged decode's fused prologue (paged_decode.py) rounds the
    same values as this file's kernel."""
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)    # [H]
        x = x * rstd[:, None] * w
        xp = xp * rstd[:, None] * w_partner
    return x * c + xp * s


@triton.jit
def _norm_rope_heads(x_ptr, o_ptr, w_ptr, cos_row, sin_row, stride_t, stride_h, t, n_heads, eps, half, rot,
                     cache_ptr, slot_ptr,
                     HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     USE_PDL: tl.constexpr, STORE: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)[None, :]
    col_ok = cols < HEAD_DIM
    partner, sign, rotated = rope_layout(cols, half, rot)
    if HAS_NORM:  # weights: requested while the previous kernel drains, used after the wait
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0)
        w_partner = tl.load(w_ptr + partner, mask=col_ok, other=0.0)
    else:  # never read: norm_rope skips the norm
        w = sign
        w_partner = sign
    # cos/sin are computed from the step's positions, q/k by the projection: both after the wait.
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    if STORE:  # slots come from the step's inputs: after the wait. Negative ones (padding) are skipped.
        slot = tl.load(slot_ptr + t).to(tl.int64)
        cache_row = cache_ptr + slot * n_heads * HEAD_DIM
    if HAS_NORM:
        w = w.to(tl.float32)
        w_partner = w_partner.to(tl.float32)
    c, s = rope_rows(cos_row, sin_row, cols, sign, rotated)
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < n_heads) & col_ok
        row = x_ptr + t * stride_t + heads * stride_h
        x = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)        # [BLOCK_H, BLOCK_D]
        xp = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)    # partner channels (L1 hits)
        y = norm_rope(x, xp, w, w_partner, c, s, eps, HEAD_DIM, HAS_NORM).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + (t * n_heads + heads) * HEAD_DIM + cols, y, mask=mask)
        if STORE:  # the output's rounding first, then the cache's cast: what store_kv does with the output
            if slot >= 0:
                tl.store(cache_row + heads * HEAD_DIM + cols, y.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(x_ptr, cache_ptr, slot_ptr, stride_t, stride_h, t, n_heads,
                HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """v into its cache slot, as ``_store_kv_kernel`` copies it."""
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, BLOCK_D)[None, :]
        for h0 in range(0, n_heads, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)[:, None]
            mask = (heads < n_heads) & (cols < HEAD_DIM)
            x = tl.load(x_ptr + t * stride_t + heads * stride_h + cols, mask=mask)
            tl.store(cache_ptr + (slot * n_heads + heads) * HEAD_DIM + cols, x.to(cache_ptr.dtype.element_ty),
                     mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                         v_ptr, kc_ptr, vc_ptr, slot_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, stride_vt, stride_vh,
                         n_q_heads, n_kv_heads, q_eps, k_eps, half, rot,
                         HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
                         BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
                         USE_PDL: tl.constexpr, STORE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cos_row = cos_ptr + t * stride_ct
    sin_row = sin_ptr + t * stride_st
    # Axis 1 picks q, k or (with STORE) v: one program each keeps the k heads and the v copy off the
    # q heads' critical path.
    part = tl.program_id(1)
    if part == 0:
        _norm_rope_heads(q_ptr, qo_ptr, qw_ptr, cos_row, sin_row, stride_qt, stride_qh, t, n_q_heads, q_eps,
                         half, rot, qo_ptr, slot_ptr, HEAD_DIM, HAS_NORM, BLOCK_HQ, BLOCK_D, USE_PDL, False)
    elif part == 1:
        _norm_rope_heads(k_ptr, ko_ptr, kw_ptr, cos_row, sin_row, stride_kt, stride_kh, t, n_kv_heads, k_eps,
                         half, rot, kc_ptr, slot_ptr, HEAD_DIM, HAS_NORM, BLOCK_HK, BLOCK_D, USE_PDL, STORE)
    else:
        if STORE:
            _copy_heads(v_ptr, vc_ptr, slot_ptr, stride_vt, stride_vh, t, n_kv_heads,
                        HEAD_DIM, BLOCK_HK, BLOCK_D, USE_PDL)


def _heads_per_tile(n_heads: int, block_d: int) -> int:
    # ~4k elements per tile: all heads of a decode-sized model at once, bounded registers for wide ones.
    return min(next_power_of_2(n_heads), max(1, 4096 // block_d))


def _norm_params(norm, name: str):
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if weight is None or eps is None:
        raise TypeError(f"qk_norm_rope: {name} must be an RMSNorm (with .weight and .variance_epsilon), "
                        f"got {type(norm).__name__}")
    return weight, float(eps)


def _fusable(kv_store, k_dtype: torch.dtype, shape: tuple, device: torch.device) -> bool:
    """Whether the fused store writes exactly what ``store_kv(..., k_out, v, ...)`` would."""
    v, k_cache, v_cache, slots = kv_store
    if not store_supported(k_cache, v_cache) or v.shape != shape or k_cache.shape[2:] != shape[1:]:
        return False  # store_kv's PyTorch copy (fp8 caches...) or its error
    if slots.shape != shape[:1] or not slots.is_contiguous():
        return False
    if any(x.device != device for x in (v, k_cache, v_cache, slots)):
        return False
    if torch.is_grad_enabled() and v.requires_grad:
        return False  # store_kv copies with PyTorch then
    if device.type == "cuda":
        return True  # store_kv runs the Triton store there: the same casts as the fused one
    # Elsewhere store_kv casts with PyTorch, which rounds to nearest where Triton's interpreter
    # truncates (fp32 -> bf16): only exact casts (none, a widening to fp32) are sure to agree.
    return all(c.dtype in (x, torch.float32) for c, x in ((k_cache, k_dtype), (v_cache, v.dtype)))


def output_dtypes(q, k, cos, q_weight=None) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes the reference produces for q and k (weight * normed, then times cos): the kernel's outputs'."""
    out_dtype = cos.dtype if q_weight is None else torch.promote_types(q_weight.dtype, cos.dtype)
    return torch.promote_types(q.dtype, out_dtype), torch.promote_types(k.dtype, out_dtype)


def qk_norm_rope_forward(q, k, cos, sin, q_weight=None, k_weight=None, q_eps: float = 1e-6, k_eps: float = 1e-6,
                         kv_store=None):
    """The kernel call: returns new contiguous ``(q, k)``; weights ``[D]`` both given or both None.

    With ``kv_store`` (``attention.kv_cache.KVStore``) the returned k and ``kv_store.v`` are in the
    cache on return: written by the same launch where ``_fusable``, else by ``store_kv`` after it.
    """
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: pass both q and k norm weights, or neither")
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"qk_norm_rope: expected q [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    t, hq, d = q.shape
    hkv = k.shape[1]
    rot = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape[0] != t or rot > d or rot % 2:
        raise ValueError(f"qk_norm_rope: cos/sin must be [T, R] with an even R <= head_dim ({d}), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)} for T={t}")
    has_norm = q_weight is not None
    if has_norm and (q_weight.shape != (d,) or k_weight.shape != (d,)):
        raise ValueError(f"qk_norm_rope: norm weights must be [head_dim={d}], got {tuple(q_weight.shape)} and "
                         f"{tuple(k_weight.shape)}")
    q_dtype, k_dtype = output_dtypes(q, k, cos, q_weight)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q_out = torch.empty((t, hq, d), device=q.device, dtype=q_dtype)
    k_out = torch.empty((t, hkv, d), device=k.device, dtype=k_dtype)
    fused = kv_store is not None and t > 0 and _fusable(kv_store, k_dtype, (t, hkv, d), q.device)
    if t > 0:
        v, k_cache, v_cache, slots = kv_store if fused else (k, k_out, k_out, k)  # unused without STORE
        v = v if v.stride(-1) == 1 else v.contiguous()
        block_d = next_power_of_2(d)
        pdl = pdl_enabled(q.device)  # no backward: always an inference launch
        _qk_norm_rope_kernel[(t, 3 if fused else 2)](
            q, k, q_out, k_out, q_weight if has_norm else cos, k_weight if has_norm else cos, cos, sin,
            v, k_cache, v_cache, slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), v.stride(0), v.stride(1),
            hq, hkv, q_eps, k_eps, rot // 2, rot,
            HEAD_DIM=d, HAS_NORM=has_norm, BLOCK_HQ=_heads_per_tile(hq, block_d),
            BLOCK_HK=_heads_per_tile(hkv, block_d), BLOCK_D=block_d, USE_PDL=pdl, STORE=fused,
            num_warps=4 if block_d * next_power_of_2(max(hq, hkv)) >= 2048 else 2, launch_pdl=pdl)
    if kv_store is not None and not fused:
        kv_store.store(k_out)
    return q_out, k_out


_warned_grad = False


def qk_norm_rope(q, k, cos, sin, q_norm=None, k_norm=None, kv_store=None):
    """``ApplyRotary.forward`` as one launch: optional per-head norm (the modules' weight and eps), then
    rope, and with a ``kv_store`` the KV-cache write of the new k and v."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("qk_norm_rope: pass both q_norm and k_norm, or neither")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        global _warned_grad
        if not _warned_grad:
            _warned_grad = True
            logger.info("kernels: qk_norm_rope has no backward; gradients are enabled, so q/k norm and "
                        "rotary run as the differentiable rms_norm + rotary kernels")
        from .rms_norm import rms_norm
        from .rotary import apply_rotary

        if q_norm is not None:
            q = rms_norm(q, *_norm_params(q_norm, "q_norm"))
            k = rms_norm(k, *_norm_params(k_norm, "k_norm"))
        else:  # the rotation is in place: do not modify the caller's projections
            q, k = q.clone(), k.clone()
        q, k = apply_rotary(q, k, cos, sin)
        if kv_store is not None:
            kv_store.store(k)
        return q, k
    if q_norm is None:
        return qk_norm_rope_forward(q, k, cos, sin, kv_store=kv_store)
    qw, qe = _norm_params(q_norm, "q_norm")
    kw, ke = _norm_params(k_norm, "k_norm")
    return qk_norm_rope_forward(q, k, cos, sin, qw, kw, qe, ke, kv_store)


def qk_norm_rope_reference(q, k, cos, sin, q_weight=None, k_weight=None, q_eps: float = 1e-6, k_eps: float = 1e-6):
    """The PyTorch definition: ``ApplyRotary``'s norm (transformers' RMSNorm numerics) then rotation."""
    from ..layers.norm import rms_norm_reference

    if q_weight is not None:
        q, k = rms_norm_reference(q, q_weight, q_eps), rms_norm_reference(k, k_weight, k_eps)
    return apply_rotary_reference(q, k, cos, sin)


__all__ = ["qk_norm_rope", "qk_norm_rope_forward", "qk_norm_rope_reference"]
