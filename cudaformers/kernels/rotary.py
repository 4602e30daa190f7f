"""Rotary embeddings applied in place to q and k in one Triton launch (transformers' rotate_half layout).

q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` (last dim contiguous), cos/sin ``[T, R]`` with ``R <= D``: the
first R channels of every head rotate, the rest pass through. A rotation's inverse is the rotation by
``-sin``, so the backward is the same kernel on the incoming gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.rotary import apply_rotary_reference


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, n_heads, cos_ptr, sin_ptr, half, sign,
            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (cols < half)
    # cos/sin repeat their halves (cat(freqs, freqs)); each half is read for the channel it scales.
    c1 = tl.load(cos_ptr + t * 2 * half + cols, mask=cols < half, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * 2 * half + half + cols, mask=cols < half, other=0.0).to(tl.float32)
    s1 = sign * tl.load(sin_ptr + t * 2 * half + cols, mask=cols < half, other=0.0).to(tl.float32)
    s2 = sign * tl.load(sin_ptr + t * 2 * half + half + cols, mask=cols < half, other=0.0).to(tl.float32)
    p1 = x_ptr + t * stride_t + heads * stride_h + cols
    p2 = p1 + half
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    y1 = x1.to(tl.float32) * c1 - x2.to(tl.float32) * s1
    y2 = x2.to(tl.float32) * c2 + x1.to(tl.float32) * s2
    tl.store(p1, y1.to(x1.dtype), mask=mask)
    tl.store(p2, y2.to(x2.dtype), mask=mask)


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> None:
    """Rotates ``x [T, H, D]`` in place."""
    t, h, _ = x.shape
    if t == 0:
        return
    if x.stride(-1) != 1:
        raise ValueError("rotary kernel needs the head dimension to be contiguous (x.stride(-1) == 1)")
    half = cos.shape[-1] // 2
    _rotate[(t,)](x, x.stride(0), x.stride(1), h, cos, sin, half, sign,
                  BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(half))


class _Rotary(torch.autograd.Function):
    # One tensor per call: autograd can rebase the history of a view modified in place only when the
    # Function returns that single tensor (q and k are views of their projections).
    @staticmethod
    def forward(ctx, x, cos, sin):
        _rotate_(x, cos, sin, 1.0)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        return x

    @staticmethod
    def backward(ctx, dx):
        cos, sin = ctx.saved_tensors
        dx = dx.contiguous().clone()
        _rotate_(dx, cos, sin, -1.0)
        return dx, None, None


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotates q and k in place and returns them; differentiable in q and k."""
    cos, sin = cos.contiguous(), sin.contiguous()
    out = []
    for x in (q, k):
        if torch.is_grad_enabled() and x.requires_grad:
            out.append(_Rotary.apply(x, cos, sin))
        else:
            _rotate_(x, cos, sin, 1.0)
            out.append(x)
    return tuple(out)


__all__ = ["apply_rotary", "apply_rotary_reference"]
