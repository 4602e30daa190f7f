"""Varlen causal attention for prefill and training: the Triton kernels as an autograd op.

``flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)`` takes packed ``[T, H, D]`` tensors
(GQA: ``Hq`` a multiple of ``Hkv``), aligns queries bottom-right within each sequence, applies an
optional sliding window (key j visible from position p iff ``p - window < j <= p``) and is
differentiable in q, k and v. ``attention_reference`` is the PyTorch definition it is tested against.
"""

from __future__ import annotations

import torch

from .flash_attention_bwd import attention_bwd
from .flash_attention_fwd import attention_fwd, lse_natural


class _FlashAttnVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
        out, lse = attention_fwd(q, k, v, cu_q, cu_k, max_q, scale, window)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, window)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, window = ctx.args
        dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window)
        return dq, dk, dv, None, None, None, None, None, None


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                      scale: float, window: int | None = None, return_lse: bool = False):
    """``q [Tq, Hq, D]``, ``k/v [Tk, Hkv, D]`` -> ``out [Tq, Hq, D]`` (and ``lse [Hq, Tq]`` fp32, natural log)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _FlashAttnVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          scale, window)
    else:
        out, lse = attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, window)
    return (out, lse_natural(lse)) if return_lse else out


def attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale: float, window: int | None = None,
                        upcast: bool = False):
    """Per-sequence matmul-softmax-matmul; returns ``(out, lse [Hq, Tq])``. ``upcast`` computes in fp32."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        if upcast:
            qi, ki, vi = qi.float(), ki.float(), vi.float()
        ki, vi = ki.repeat_interleave(groups, 1), vi.repeat_interleave(groups, 1)
        sq, sk = qi.shape[0], ki.shape[0]
        q_pos = torch.arange(sk - sq, sk, device=q.device)[:, None]
        k_pos = torch.arange(sk, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        scores = torch.einsum("qhd,khd->hqk", qi, ki).float() * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        lses.append(torch.logsumexp(scores, -1))
        probs = torch.softmax(scores, -1).to(vi.dtype)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vi))
    return torch.cat(outs).to(q.dtype if not upcast else torch.float32), torch.cat(lses, dim=1)
