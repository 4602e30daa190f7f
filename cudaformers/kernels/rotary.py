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
from .grid import cdiv, next_power_of_2


@triton.jit
def _rotate(x_ptr, y_ptr, stride_xt, stride_xh, stride_yt, stride_yh, n_tokens, n_heads, cos_ptr, sin_ptr, half,
            sign, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # A [BLOCK_T, BLOCK_H, BLOCK_D] tile: a few tokens' worth of heads, so a program moves ~2k values.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    heads = tl.arange(0, BLOCK_H)[None, :, None]
    cols = tl.arange(0, BLOCK_D)[None, None, :]
    t_ok = t < n_tokens
    mask = t_ok & (heads < n_heads) & (cols < half)
    t = t.to(tl.int64)
    # cos/sin repeat their halves (cat(freqs, freqs)); each half is read for the channel it scales.
    cs = t * 2 * half + cols
    cs_mask = t_ok & (cols < half)
    c1 = tl.load(cos_ptr + cs, mask=cs_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + half, mask=cs_mask, other=0.0).to(tl.float32)
    s1 = sign * tl.load(sin_ptr + cs, mask=cs_mask, other=0.0).to(tl.float32)
    s2 = sign * tl.load(sin_ptr + cs + half, mask=cs_mask, other=0.0).to(tl.float32)
    px = x_ptr + t * stride_xt + heads * stride_xh + cols
    py = y_ptr + t * stride_yt + heads * stride_yh + cols
    x1 = tl.load(px, mask=mask, other=0.0)
    x2 = tl.load(px + half, mask=mask, other=0.0)
    y1 = x1.to(tl.float32) * c1 - x2.to(tl.float32) * s1
    y2 = x2.to(tl.float32) * c2 + x1.to(tl.float32) * s2
    tl.store(py, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(py + half, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _rotate_into(x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> None:
    """Writes ``x [T, H, D]`` rotated into ``out`` (which may be ``x`` itself). Channels past the
    rotated ones are not touched: ``out`` must already hold them."""
    t, h, _ = x.shape
    if t == 0:
        return
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("rotary kernel needs the head dimension to be contiguous (x.stride(-1) == 1)")
    half = cos.shape[-1] // 2
    block_h, block_d = next_power_of_2(h), next_power_of_2(half)
    block_t = max(1, 1024 // (block_h * block_d))
    _rotate[(cdiv(t, block_t),)](x, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1), t, h, cos,
                                 sin, half, sign, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d)


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> None:
    """Rotates ``x [T, H, D]`` in place."""
    _rotate_into(x, x, cos, sin, sign)


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
        # Out of place into a fresh buffer: the incoming gradient may be shared with other nodes.
        out = torch.empty(dx.shape, device=dx.device, dtype=dx.dtype)
        if cos.shape[-1] < dx.shape[-1]:  # partial rotary: the pass-through channels' gradient as is
            out[..., cos.shape[-1]:] = dx[..., cos.shape[-1]:]
        _rotate_into(dx if dx.stride(-1) == 1 else dx.contiguous(), out, cos, sin, -1.0)
        return out, None, None


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
