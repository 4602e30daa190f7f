"""``x[..., order]``: the features of x in another order, as act-order int4 layers read them (a GPTQ
act-order checkpoint stores each layer's input features sorted by quantization group).

At batch 1 the gather is a link of the decode chain before each such matmul. torch's ``index_select``
takes no part in programmatic dependent launch (``pdl.py``): the GEMV after it loses its early start,
and qwen3-8b's int4 decode on an H100 fell from 387 to 287 tok/s with every layer act-order
(bench/RESULTS.md run 30). This kernel loads the order (a constant) before its wait and releases the
GEMV after it as soon as it runs. Backward scatters the gradient back (the order is a permutation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_enabled, release_dependents, wait_for_producer


@triton.jit
def _gather_kernel(x_ptr, order_ptr, out_ptr, n, stride_x, stride_out, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    where = tl.load(order_ptr + cols, mask=ok, other=0, cache_modifier=".cg")  # a constant: before the wait
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    row = row.to(tl.int64)
    values = tl.load(x_ptr + row * stride_x + where, mask=ok)
    tl.store(out_ptr + row * stride_out + cols, values, mask=ok)


@triton.jit
def _scatter_kernel(dy_ptr, order_ptr, dx_ptr, n, stride_dy, stride_dx, BLOCK: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    where = tl.load(order_ptr + cols, mask=ok, other=0)
    row = row.to(tl.int64)
    tl.store(dx_ptr + row * stride_dx + where, tl.load(dy_ptr + row * stride_dy + cols, mask=ok), mask=ok)


def _launch(kernel, src: torch.Tensor, order: torch.Tensor, dst: torch.Tensor, **extra) -> None:
    n = src.shape[-1]
    block = min(2048, triton.next_power_of_2(n))
    grid = (src.shape[0], triton.cdiv(n, block))
    kernel[grid](src, order, dst, n, src.stride(0), dst.stride(0), BLOCK=block, num_warps=4 if block >= 1024 else 1,
                 **extra)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def gather_forward(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x[..., order]`` (any leading shape, rows of any stride) as a new contiguous tensor."""
    _check(x, order)
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.numel():
        pdl = pdl_enabled(x.device) and not (torch.is_grad_enabled() and x.requires_grad)
        _launch(_gather_kernel, x2, order, out, USE_PDL=pdl, launch_pdl=pdl)
    return out.view(x.shape)


def scatter_backward(dy: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The gradient of ``gather_forward``: ``dx[..., order] = dy``."""
    dy2 = _rows(dy)
    dx = torch.empty(dy2.shape, dtype=dy.dtype, device=dy.device)
    if dy2.numel():
        _launch(_scatter_kernel, dy2, order, dx)
    return dx.view(dy.shape)


def _check(x: torch.Tensor, order: torch.Tensor) -> None:
    if order.dim() != 1 or order.shape[0] != x.shape[-1] or order.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gather_features: order must be a 1-D int32/int64 permutation of x's last dimension "
                         f"({x.shape[-1]}), got {tuple(order.shape)} {order.dtype}")
    if order.device != x.device:
        raise ValueError(f"gather_features: order is on {order.device}, x on {x.device}; move it to x's device")


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order):
        ctx.save_for_backward(order)
        return gather_forward(x, order)

    @staticmethod
    def backward(ctx, dy):
        (order,) = ctx.saved_tensors
        return scatter_backward(dy, order), None


def gather_features(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x[..., order]`` for a permutation ``order`` of x's last dimension, differentiable."""
    return _Gather.apply(x, order)


def gather_features_reference(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return x.index_select(-1, order)
