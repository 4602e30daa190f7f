"""Where a decode layer's q/k/v GEMV finishes its own heads (``gemv_heads.py`` for bf16 weights,
``quant_gemv_heads.py`` for int4/int8): qk_norm_rope's per-head norm, rotary and KV-cache store done by
the last program of each head to arrive, so the attention backend gets the rotated q and k straight
from the GEMV and qk_norm_rope's launch leaves the decode chain.

It takes the place of ``Attention.forward`` (bf16, with or without the input norm folded in: see
``fused_norm_decode.py``) or of ``project_qkv`` + ``attend_heads`` (quantized, with the norm fold of
``quant_norm_fold.py`` or without), only where that is exactly what would run: the projection is the
GEMV the unfolded path launches (same kernel, same plan, same rounding), the rotary module runs the
hub's qk_norm_rope kernel (``rotation_declines``), and the kernel takes the shapes (a head a whole
number of its programs, the arrival counters made). Switched by ``gemv_heads.HEAD_EPILOGUE``.
"""

from __future__ import annotations

import torch

from ..layers.attention import Attention
from ..layers.norm import RMSNorm
from . import gemv_heads
from .fused_projections import PackedLinear


def rotation_declines(attn: Attention, q, k, v, cos, sin, batch) -> str | None:
    """Why a launch doing the rotary module's work on these heads would not compute what it does, or
    None: the module runs the hub's qk_norm_rope kernel alone (q/k norms plain RMSNorms or absent),
    no autograd, one even row of cos/sin per query, and with a cache qk_norm_rope would fuse its
    store (``_fusable``: its casts are then store_kv's)."""
    from ..layers.attention import ApplyRotary
    from .fused_norm_decode import _plain_norm, _unhooked
    from .hub import _qk_norm_rope
    from .qk_norm_rope import _fusable, output_dtypes

    rotary = attn.rotary
    if type(rotary) is not ApplyRotary or not _unhooked(rotary) or getattr(
            rotary.__dict__.get("forward"), "__func__", None) is not _qk_norm_rope:
        return "the rotary module does not run the hub's qk_norm_rope kernel alone"
    norms = (attn.q_norm, attn.k_norm)  # both absent, or both plain RMSNorms
    if any(n is not None for n in norms) and not all(n is not None and _plain_norm(n) for n in norms):
        return "the q/k norms are not both plain RMSNorms"
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return "autograd is on"
    t, hkv, d = k.shape
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != t or cos.shape[1] > d or cos.shape[1] % 2:
        return f"cos/sin {tuple(cos.shape)} are not one even row per query"
    cache = batch.kv_cache
    if cache is not None:
        k_dtype = output_dtypes(q, k, cos, None if attn.q_norm is None else attn.q_norm.weight)[1]
        store = (v, cache.k[attn.layer_idx], cache.v[attn.layer_idx], batch.slot_mapping)
        if batch.slot_mapping is None or not _fusable(store, k_dtype, (t, hkv, d), q.device):
            return "qk_norm_rope would not fuse this cache store"
    return None


def _layer_heads(attn: Attention, y: torch.Tensor, sizes, cos, sin, batch):
    """``(Heads, q, k, v)`` of ``attn`` for the packed output ``y [T, N]`` (q/k/v views of it)."""
    t, d, i = y.shape[0], attn.head_dim, attn.layer_idx
    q, k, v = (part.view(t, -1, d) for part in y.split(sizes, dim=-1))
    cache = batch.kv_cache
    heads = gemv_heads.Heads(q.shape[1], k.shape[1], d, cos, sin,
                             cache=None if cache is None else (cache.k[i], cache.v[i], batch.slot_mapping))
    if attn.q_norm is not None:
        heads = heads._replace(q_weight=attn.q_norm.weight, k_weight=attn.k_norm.weight,
                               q_eps=float(attn.q_norm.variance_epsilon), k_eps=float(attn.k_norm.variance_epsilon))
    return heads, q, k, v


def _attend_rotated(attn: Attention, q, k, v, batch) -> torch.Tensor:
    """``Attention.attend_heads`` past the rotary module: q and k rotated, the cache written."""
    t = q.shape[0]
    out = attn.backend(q, k, v, batch, attn.layer_idx, attn.scaling, attn.sliding_window,
                       kv_stored=batch.kv_cache is not None)
    return out.reshape(t, -1)


def _runs_gemv(packed: PackedLinear) -> bool:
    """Whether the packed projection runs the hub's decode matmul (the GEMV at 1-4 rows)."""
    from .hub import _linear

    return getattr(packed.__dict__.get("forward"), "__func__", None) is _linear


def attention_with_heads(attn: Attention, packed: PackedLinear | None, hidden, cos, sin, batch,
                         norm: RMSNorm | None = None, residual=None):
    """``Attention.forward`` on ``hidden`` with the packed bf16 q/k/v GEMV finishing its heads; with
    ``norm``, of ``norm(hidden + residual)``, the norm folded in as well (as ``gemv_rms_norm``),
    returning ``(attention output, hidden + residual)``. None where it does not apply (see the module
    docstring; the fold's conditions are ``fused_norm_decode._foldable``)."""
    from .fused_norm_decode import _foldable
    from .gemv import gemv_applies

    if not gemv_heads.HEAD_EPILOGUE or packed is None or torch.is_autocast_enabled(hidden.device.type):
        return None
    if norm is not None:
        if not _foldable(norm, packed, hidden, residual):
            return None
    elif not (_runs_gemv(packed) and gemv_applies(packed.weight, hidden)):
        return None  # without the norm it replaces only the projection: only where that is the GEMV already
    y = torch.empty(hidden.shape[0], packed.weight.shape[0], device=hidden.device, dtype=hidden.dtype)
    heads, q, k, v = _layer_heads(attn, y, packed.sizes, cos, sin, batch)
    if (rotation_declines(attn, q, k, v, cos, sin, batch) or gemv_heads.heads_declines(hidden, packed.weight, heads)
            or v.stride(-1) != 1):
        return None
    folded = None if norm is None else (norm.weight, norm.variance_epsilon, residual)
    q, k, v, summed = gemv_heads.gemv_heads(hidden, packed.weight, heads, packed.bias, folded, out=y)
    out = attn.o_proj(_attend_rotated(attn, q, k, v, batch))
    if norm is None:
        return out
    return out, hidden if residual is None else summed


def quant_attention_heads(attn: Attention, hidden: torch.Tensor, cos, sin, batch, rms=None):
    """``attn.attend_heads(*attn.project_qkv(hidden))`` of a quantized layer at one row (``[1, N*D]``,
    before the output projection) with the packed q/k/v fragment GEMV finishing its heads; with
    ``rms = (shares, eps)`` the GEMV scaled by ``1 / rms`` as ``quant_gemv_mma(..., rms=)``
    (``quant_norm_fold.py``'s prenormed input). None where it does not apply: the projection must be
    the fragment GEMV ``project_qkv`` would launch (see the module docstring)."""
    from . import quant_gemv_mma as fragment
    from . import quant_matmul
    from ..quant.linear import QuantLinear
    from .fused_norm_decode import _unhooked
    from .fused_projections import _qkv
    from .quant_gemv_heads import quant_gemv_mma_heads, quant_heads_declines
    from .quant_norm_fold import _packed_quant

    if not gemv_heads.HEAD_EPILOGUE or not (quant_matmul.USE_MMA and quant_matmul.USE_FRAGMENT_GEMV):
        return None
    if (type(attn) is not Attention or any(name in attn.__dict__ for name in ("forward", "attend", "attend_heads"))
            or getattr(attn.__dict__.get("project_qkv"), "__func__", None) is not _qkv or not _unhooked(attn)):
        return None  # not the packed projection in the plain attention forward
    packed = _packed_quant(attn, "packed_qkv", attn.q_proj)
    if packed is None or torch.is_autocast_enabled(hidden.device.type) or hidden.dim() != 2 or hidden.shape[0] != 1:
        return None
    layer = packed.layer
    if (type(layer).forward is not QuantLinear.forward or type(layer).matmul is not QuantLinear.matmul
            or not _unhooked(layer) or layer.compute_dtype != hidden.dtype):
        return None  # the projection would not run exactly the fragment GEMV on this row
    w = layer.packed()
    y = torch.empty(1, w.out_features, device=hidden.device, dtype=hidden.dtype)
    heads, q, k, v = _layer_heads(attn, y, packed.sizes, cos, sin, batch)
    if (rotation_declines(attn, q, k, v, cos, sin, batch) or not hidden.is_contiguous()
            or quant_heads_declines(hidden, w, heads)):
        return None
    bias = None if layer.bias is None else layer.bias.to(hidden.dtype)  # as QuantLinear.forward passes it
    q, k, v = quant_gemv_mma_heads(hidden, w, heads, bias, rms, out=y)
    return _attend_rotated(attn, q, k, v, batch)


__all__ = ["attention_with_heads", "quant_attention_heads", "rotation_declines"]
