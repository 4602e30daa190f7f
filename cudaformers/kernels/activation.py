"""Gated activations ``act(gate) * up`` (SiLU, GELU tanh, GELU erf) in one Triton pass, with backward.

The gated MLP's intermediate is the largest activation of a decoder layer; fusing the activation
with the product reads gate and up once and writes one tensor (and the backward reads them again
instead of keeping ``act(gate)`` alive).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import UnsupportedError
from ..layers.activation import act_and_mul_reference

# hidden_act name -> kernel code
KERNEL_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu": 2}
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """fp32 gate -> (act(g), act'(g))."""
    if ACT == 0:
        s = tl.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * g * g)
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * d_inner
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(g * _INV_SQRT_2))
        return g * cdf, cdf + g * _INV_SQRT_2PI * tl.exp(-0.5 * g * g)


@triton.jit
def _act_mul_fwd(g_ptr, u_ptr, y_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(y_ptr + offs, (a * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_mul_bwd(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT)
    tl.store(dg_ptr + offs, (dy * u * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * a).to(du_ptr.dtype.element_ty), mask=mask)


_BLOCK = 1024


def _code(name: str) -> int:
    try:
        return KERNEL_ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedError(f"no fused kernel for hidden_act={name!r}; kernels exist for "
                               f"{sorted(KERNEL_ACTIVATIONS)} (keep the plain layer for others)") from None


def act_and_mul_forward(gate, up, name: str = "silu"):
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty(gate.shape, device=gate.device, dtype=torch.promote_types(gate.dtype, up.dtype))
    n = gate.numel()
    if n:
        _act_mul_fwd[(triton.cdiv(n, _BLOCK),)](gate, up, y, n, ACT=_code(name), BLOCK=_BLOCK)
    return y


class _ActAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, name):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.name = name
        return act_and_mul_forward(gate, up, name)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _act_mul_bwd[(triton.cdiv(n, _BLOCK),)](dy, gate, up, dg, du, n, ACT=_code(ctx.name), BLOCK=_BLOCK)
        return dg, du, None


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, name: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for ``name`` in ``KERNEL_ACTIVATIONS``; differentiable in gate and up."""
    _code(name)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _ActAndMul.apply(gate, up, name)
    return act_and_mul_forward(gate, up, name)


__all__ = ["KERNEL_ACTIVATIONS", "act_and_mul", "act_and_mul_reference"]
