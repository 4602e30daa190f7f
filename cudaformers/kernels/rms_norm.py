"""RMSNorm with an optional fused residual add, forward and backward in Triton.

``rms_norm(x, weight, eps, residual=None)`` matches ``layers.norm.RMSNorm``: normalise in fp32, round
to the input dtype, scale by the weight; with a residual it also returns the sum ``x + residual`` that
the next layer adds to. One program handles a run of rows so the weight gradient is reduced in
registers and only ``[programs, H]`` partial sums reach memory.

The forward reads x and residual through their strides (rows of ``[outer, inner, H]`` views whose
last dim is contiguous, e.g. per-head q/k slices of a packed projection), so no copy precedes it;
its outputs are contiguous. Without autograd (inference) the forward takes part in the decode
chain's programmatic dependent launch (``pdl.py``): it loads its weight, then waits for its input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.norm import rms_norm_reference
from .pdl import pdl_enabled, release_dependents, wait_for_producer


@triton.jit
def _rms_norm_fwd(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr, n_rows, n_cols, eps, rows_per_program,
                  n_inner, stride_xo, stride_xi, stride_ro, stride_ri,
                  HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # The weight is requested before the wait (nothing in a step writes it), used only after it.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    w = w.to(tl.float32)
    for i in range(rows_per_program):
        row = pid * rows_per_program + i
        if row < n_rows:
            row64 = row.to(tl.int64)
            outer, inner = row64 // n_inner, row64 % n_inner
            off = row64 * n_cols + cols
            x = tl.load(x_ptr + outer * stride_xo + inner * stride_xi + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                # The sum is rounded to the activation dtype before it is normalised, as in PyTorch.
                r = tl.load(r_ptr + outer * stride_ro + inner * stride_ri + cols, mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
                tl.store(s_ptr + off, x, mask=mask)
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
            tl.store(rstd_ptr + row, rstd)
            normed = (xf * rstd).to(x.dtype).to(tl.float32)
            tl.store(y_ptr + off, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd(dy_ptr, ds_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, n_cols, rows_per_program,
                  HAS_DS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(rows_per_program):
        row = pid * rows_per_program + i
        if row < n_rows:
            off = row.to(tl.int64) * n_cols + cols
            x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            xhat = x * rstd
            dw += dy * xhat
            g = dy * w
            dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
            if HAS_DS:
                dx += tl.load(ds_ptr + off, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)


def _launch_shape(n_rows: int, n_cols: int, device) -> tuple[int, int, int]:
    block = triton.next_power_of_2(n_cols)
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = min(n_rows, sms * 8)
    else:
        programs = min(n_rows, 4)
    programs = max(programs, 1)
    return block, programs, triton.cdiv(max(n_rows, 1), programs)


def _rows(x: torch.Tensor, inner: int) -> torch.Tensor:
    """``x [..., inner, H]`` as an ``[outer, inner, H]`` view with a contiguous last dim; copies only
    when the leading dims cannot be merged into one stride."""
    if x.stride(-1) == 1:
        try:
            return x.view(-1, inner, x.shape[-1])
        except RuntimeError:
            pass
    return x.contiguous().view(-1, inner, x.shape[-1])


def rms_norm_forward(x, weight, eps, residual=None, pdl: bool = False):
    """x ``[..., H]`` -> ``(y, s, rstd)``; ``s`` is ``x + residual`` (or ``x``), rstd ``[rows]`` fp32.
    ``pdl``: launch as part of a programmatic-dependent chain (inference only; see ``pdl.py``)."""
    shape = x.shape
    n_cols = shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    if n_rows == 0:
        y = torch.empty(shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
        s = x if residual is None else x + residual
        return y, s, torch.empty(0, device=x.device, dtype=torch.float32)
    inner = shape[-2] if x.dim() >= 2 else 1
    x3 = _rows(x, inner)
    r3 = _rows(residual, inner) if residual is not None else None
    # Like ``weight * h.to(dtype)``: an fp32 weight (autocast master weights) gives an fp32 output.
    # Outputs are allocated in the caller's shape, not as views: callers modify them in place (rotary
    # on a normed q), which autograd forbids on views created inside a Function.
    y = torch.empty(shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    s = torch.empty(shape, device=x.device, dtype=x.dtype) if r3 is not None else x
    rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    block, programs, per = _launch_shape(n_rows, n_cols, x.device)
    r_or_x = r3 if r3 is not None else x3
    _rms_norm_fwd[(programs,)](x3, r_or_x, weight, y, s, rstd, n_rows, n_cols, eps, per,
                               inner, x3.stride(0), x3.stride(1), r_or_x.stride(0), r_or_x.stride(1),
                               HAS_RESIDUAL=r3 is not None, BLOCK=block, USE_PDL=pdl, launch_pdl=pdl)
    return y, s, rstd


def rms_norm_backward(dy, ds, s, weight, rstd):
    shape = s.shape
    s2 = s.reshape(-1, shape[-1]).contiguous()  # s is the (possibly strided) input when there was no residual
    n_rows, n_cols = s2.shape
    dy2 = dy.reshape(-1, n_cols).contiguous()
    ds2 = ds.reshape(-1, n_cols).contiguous() if ds is not None else None
    dx = torch.empty(shape, device=s.device, dtype=s.dtype)
    block, programs, per = _launch_shape(n_rows, n_cols, s.device)
    dw = torch.empty(programs, n_cols, device=s.device, dtype=torch.float32)
    _rms_norm_bwd[(programs,)](dy2, ds2 if ds2 is not None else dy2, s2, weight, rstd, dx, dw, n_rows, n_cols,
                               per, HAS_DS=ds2 is not None, BLOCK=block)
    return dx, dw.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        y, s, rstd = rms_norm_forward(x, weight, eps, residual)
        ctx.save_for_backward(s, weight, rstd)
        ctx.has_residual = residual is not None
        if residual is None:
            return y
        return y, s

    @staticmethod
    def backward(ctx, dy, ds=None):
        s, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, ds, s, weight, rstd)
        return dx, dw, None, (dx if ctx.has_residual else None)


def rms_norm(x, weight, eps: float, residual=None):
    """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (residual is not None and residual.requires_grad)):
        return _RMSNorm.apply(x, weight, eps, residual)
    y, s, _ = rms_norm_forward(x, weight, eps, residual, pdl=pdl_enabled(x.device))
    return y if residual is None else (y, s)


def rms_norm_residual_reference(x, weight, eps: float, residual=None):
    """The PyTorch definition the kernel is tested against."""
    if residual is None:
        return rms_norm_reference(x, weight, eps)
    s = x + residual
    return rms_norm_reference(s, weight, eps), s
