"""A decode step's attention past its projections in one launch: q/k norm + rope, the KV-cache store
and flash-decoding over the paged cache (``paged_decode.paged_decode_rope``).

Unfused, a decode layer runs ``qk_norm_rope`` (with the store) and then the triton backend's
``paged_decode``: two launches, and the decode kernel can only start reading the cache once the
rope kernel has finished, because that kernel writes the newest row. Fused, each program of the
decode kernel has L2 fetch its first tile of keys before it waits for the q/k/v projection, then
computes its q heads and the new key itself; the program whose keys include the newest stores it
(and v) before reading its tiles. One launch per layer leaves the chain.

Used by the "DecoderLayer" kernel (``fused_norm_decode``) for each decode step, only where the
unfused path would run exactly these kernels: the layer's rotary module runs ``qk_norm_rope``, its
backend is "triton", the batch is one query per sequence with a cache, no autograd, and the
projections, norm weights, cos/sin and the cache share one dtype. Otherwise ``Attention.attend``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.attention import ApplyRotary, Attention


def _unhooked(module: nn.Module) -> bool:
    return not module._forward_hooks and not module._forward_pre_hooks


def _rope_kernel_bound(rotary: nn.Module) -> bool:
    from .hub import _qk_norm_rope

    bound = rotary.__dict__.get("forward")
    return (type(rotary) is ApplyRotary and _unhooked(rotary)
            and getattr(bound, "__func__", None) is _qk_norm_rope)


def _norm_weights(attn: Attention):
    """(q weight, k weight, q eps, k eps), all None without the per-head norm; False where the norms
    are not the plain RMSNorm ``qk_norm_rope`` reads the weight and eps of."""
    if attn.q_norm is None and attn.k_norm is None:
        return None, None, 1e-6, 1e-6
    params = []
    for norm in (attn.q_norm, attn.k_norm):
        weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
        if weight is None or eps is None:
            return False
        params.append((weight, float(eps)))
    return params[0][0], params[1][0], params[0][1], params[1][1]


def _applies(attn: Attention, q, k, v, cos, sin, batch, norms) -> bool:
    from ..attention.triton_backend import TritonAttention
    from .kv_store import supports

    cache = batch.kv_cache
    if cache is None or not batch.is_decode or q.shape[0] != batch.num_seqs or norms is False:
        return False
    if not isinstance(attn.backend, TritonAttention) or not _rope_kernel_bound(attn.rotary):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return False
    k_cache, v_cache = cache.k[attn.layer_idx], cache.v[attn.layer_idx]
    weights = [w for w in norms[:2] if w is not None]
    dtype = q.dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32) or not supports(k_cache, v_cache):
        return False
    if any(t.dtype != dtype or t.device != q.device for t in (k, v, cos, sin, k_cache, v_cache, *weights)):
        return False
    rot = cos.shape[-1]
    return (cos.dim() == 2 and cos.shape == sin.shape and rot <= attn.head_dim and rot % 2 == 0
            and batch.slot_mapping is not None and batch.slot_mapping.is_contiguous())


def fused_decode_attention(attn: Attention, q, k, v, cos, sin, batch) -> torch.Tensor:
    """``attn.attend(q, k, v, cos, sin, batch)`` for projections ``[T, N*D]``, in one launch where that
    gives the unfused kernels' result."""
    norms = _norm_weights(attn)
    if not _applies(attn, q, k, v, cos, sin, batch, norms):
        return attn.attend(q, k, v, cos, sin, batch)
    from .paged_decode import paged_decode_rope

    t, d, i = q.shape[0], attn.head_dim, attn.layer_idx
    cache = batch.kv_cache
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = paged_decode_rope(q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d), cos, sin, cache.k[i], cache.v[i],
                            batch.slot_mapping, batch.seqlens_k, batch.block_table, batch.max_seqlen_k, attn.scaling,
                            attn.sliding_window, *norms)
    return attn.o_proj(out.reshape(t, -1))


def plain_attention(attn: nn.Module) -> bool:
    """Whether ``attn(hidden, ...)`` is exactly ``Attention.forward`` (so its parts may run separately)."""
    return type(attn) is Attention and "forward" not in attn.__dict__ and _unhooked(attn)
