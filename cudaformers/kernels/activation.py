"""Gated activations ``act(gate) * up`` (SiLU, GELU tanh, GELU erf) in one Triton pass, with backward.

The gated MLP's intermediate is the largest activation of a decoder layer; fusing the activation
with the product reads gate and up once and writes one tensor (and the backward reads them again
instead of keeping ``act(gate)`` alive).

gate and up are usually the two halves of one packed ``[T, 2I]`` projection output, so the kernels
read rows through their strides (a ``rows x column-blocks`` grid) and never copy their inputs.
``act_and_mul_packed`` takes the packed tensor itself: its backward writes ``d(gate_up)`` as one
``[T, 2I]`` buffer, where separate gate/up gradients would be concatenated by autograd's split
backward (one more read and write of the whole gradient).

The inference forward takes part in the decode chain's programmatic dependent launch (``pdl.py``);
the autograd forward and the backward launch plainly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import UnsupportedError
from ..layers.activation import act_and_mul_reference
from .grid import cdiv, next_power_of_2
from .pdl import pdl_enabled, release_dependents, wait_for_producer

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


# Rows on grid axis 0 (up to 2**31 - 1 of them: training batches), column blocks on axis 1.
@triton.jit
def _act_mul_fwd(g_ptr, u_ptr, y_ptr, n_cols, stride_g, stride_u, stride_y,
                 ACT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    wait_for_producer(USE_PDL)  # nothing but activations to read
    release_dependents(USE_PDL)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(y_ptr + row * stride_y + cols, (a * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_mul_bwd(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_cols, stride_dy, stride_g, stride_u, stride_dg, stride_du,
                 ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT)
    tl.store(dg_ptr + row * stride_dg + cols, (dy * u * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * stride_du + cols, (dy * a).to(du_ptr.dtype.element_ty), mask=mask)


def _code(name: str) -> int:
    try:
        return KERNEL_ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedError(f"no fused kernel for hidden_act={name!r}; kernels exist for "
                               f"{sorted(KERNEL_ACTIVATIONS)} (keep the plain layer for others)") from None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., I]`` -> ``[R, I]`` with unit column stride: a view for slices of a packed projection
    output; a copy only for layouts one row stride cannot describe."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _grid(n_rows: int, n_cols: int, device: torch.device) -> tuple[tuple[int, int], int, int]:
    # 1024 columns per program for wide batches; narrower blocks when there are few rows (a small
    # decode batch), so that the grid still covers every SM about twice.
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    block = min(1024, next_power_of_2(n_cols))
    while block > 128 and n_rows * cdiv(n_cols, block) < 2 * sms:
        block //= 2
    return (n_rows, cdiv(n_cols, block)), block, max(1, min(4, block // 256))


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")


def act_and_mul_forward(gate, up, name: str = "silu", pdl: bool = False):
    """The forward kernel: gate, up ``[..., I]`` (any row strides) -> a new contiguous ``[..., I]``.
    ``pdl``: launch as part of a programmatic-dependent chain (inference only; see ``pdl.py``)."""
    _check(gate, up)
    y = torch.empty(gate.shape, device=gate.device, dtype=torch.promote_types(gate.dtype, up.dtype))
    if gate.numel() == 0:
        return y
    g2, u2, y2 = _rows(gate), _rows(up), y.view(-1, y.shape[-1])
    grid, block, warps = _grid(*g2.shape, gate.device)
    _act_mul_fwd[grid](g2, u2, y2, g2.shape[1], g2.stride(0), u2.stride(0), y2.stride(0), ACT=_code(name),
                       BLOCK=block, USE_PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return y


def _backward_into(dy, gate, up, dgate, dup, name: str) -> None:
    """Writes the gradients of ``act(gate) * up`` into ``dgate``, ``dup`` (``[..., I]`` views with
    unit column stride, e.g. the halves of one packed buffer)."""
    if gate.numel() == 0:
        return
    n_cols = gate.shape[-1]
    dy2, g2, u2 = _rows(dy), _rows(gate), _rows(up)
    dg2, du2 = dgate.view(-1, n_cols), dup.view(-1, n_cols)
    grid, block, warps = _grid(*g2.shape, gate.device)
    _act_mul_bwd[grid](dy2, g2, u2, dg2, du2, n_cols, dy2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0),
                       du2.stride(0), ACT=_code(name), BLOCK=block, num_warps=warps)


class _ActAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, name):
        ctx.save_for_backward(gate, up)  # views stay views: the packed output is kept, not copied
        ctx.name = name
        return act_and_mul_forward(gate, up, name)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dgate = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
        dup = torch.empty(up.shape, device=up.device, dtype=up.dtype)
        _backward_into(dy, gate, up, dgate, dup, ctx.name)
        return dgate, dup, None


class _ActAndMulPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, name):
        ctx.save_for_backward(gate_up)
        ctx.name = name
        return act_and_mul_forward(*_halves(gate_up), name)

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        d = torch.empty(gate_up.shape, device=gate_up.device, dtype=gate_up.dtype)
        _backward_into(dy, *_halves(gate_up), *_halves(d), ctx.name)
        return d, None


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    i = t.shape[-1] // 2
    return t[..., :i], t[..., i:]


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, name: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for ``name`` in ``KERNEL_ACTIVATIONS``; differentiable in gate and up.
    gate and up may be strided views (rows of a packed projection output): they are not copied."""
    _code(name)
    _check(gate, up)
    if _needs_grad(gate, up):
        return _ActAndMul.apply(gate, up, name)
    return act_and_mul_forward(gate, up, name, pdl=pdl_enabled(gate.device))


def act_and_mul_packed(gate_up: torch.Tensor, name: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up = cat([gate, up], -1)`` ``[..., 2I]`` -> ``[..., I]``;
    differentiable, with the gradient written as one ``[..., 2I]`` tensor (no concatenation)."""
    _code(name)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"act_and_mul_packed: the last dim of gate_up {tuple(gate_up.shape)} must hold gate and "
                         "up side by side (an even size 2 * intermediate)")
    if _needs_grad(gate_up):
        return _ActAndMulPacked.apply(gate_up, name)
    return act_and_mul_forward(*_halves(gate_up), name, pdl=pdl_enabled(gate_up.device))


__all__ = ["KERNEL_ACTIVATIONS", "act_and_mul", "act_and_mul_packed", "act_and_mul_reference"]
