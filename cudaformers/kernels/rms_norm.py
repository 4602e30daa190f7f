"""RMSNorm with an optional fused residual add, forward and backward in Triton.

``rms_norm(x, weight, eps, residual=None)`` matches ``layers.norm.RMSNorm``: normalise in fp32, round
to the input dtype, scale by the weight; with a residual it also returns the sum ``x + residual`` that
the next layer adds to.

Both kernels work on ``[BLOCK_R, BLOCK_N]`` tiles of whole rows, ~4k values each: a narrow row (q/k
norms over head_dim 64-256, hundreds of thousands of rows in a training step) shares its program
with 16-64 others, so loads are wide and the grid is a few thousand programs rather than one
latency-bound program per row or per long serial run of rows. The forward has one tile per program,
shrinking the tile while that leaves fewer than two programs per SM (decode batches). The backward
runs a fixed grid of a few programs per SM, each walking the tiles ``pid, pid + grid, ...`` and
summing its share of the weight gradient in registers; the ``[programs, H]`` partial sums are then
reduced by one small ``sum``. The assignment of tiles to programs depends only on the shape, so the
weight gradient is deterministic.

x and residual (forward) and x (backward) are read through their strides (rows of ``[outer, inner,
H]`` views whose last dim is contiguous, e.g. per-head q/k slices of a packed projection), so no
copy precedes either kernel; outputs are contiguous. Without autograd (inference) the forward takes
part in the decode chain's programmatic dependent launch (``pdl.py``): it loads its weight, then
waits for its input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.norm import rms_norm_reference
from .grid import cdiv, next_power_of_2, sm_count
from .pdl import pdl_enabled, release_dependents, wait_for_producer

TILE = 4096  # values per tile (fp32 registers: 16 a thread at 8 warps)


@triton.jit
def _row_offsets(rows, n_inner, stride_o, stride_i):
    """Offsets of rows of an ``[outer, inner, H]`` view: one 64-bit offset per row."""
    rows = rows.to(tl.int64)
    return (rows // n_inner) * stride_o + (rows % n_inner) * stride_i


# The row counts follow the step's token count: specialised, each divisibility class (and a single
# row) compiled its own variant, and a serving engine compiled them while requests waited (W5).
@triton.jit(do_not_specialize=["n_rows", "n_inner"])
def _rms_norm_fwd(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr, n_rows, n_cols, eps,
                  n_inner, stride_xo, stride_xi, stride_ro, stride_ri,
                  HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                  USE_PDL: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    # The weight is requested before the wait (nothing in a step writes it), used only after it.
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0)
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & col_ok[None, :]
    x_off = _row_offsets(rows, n_inner, stride_xo, stride_xi)[:, None] + cols[None, :]
    out_off = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype before it is normalised, as in PyTorch.
        r_off = _row_offsets(rows, n_inner, stride_ro, stride_ri)[:, None] + cols[None, :]
        r = tl.load(r_ptr + r_off, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + out_off, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)  # [BLOCK_R]
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    normed = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    tl.store(y_ptr + out_off, (normed * w.to(tl.float32)[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd(dy_ptr, ds_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, n_cols, n_tiles,
                  n_inner, stride_xo, stride_xi,
                  HAS_DS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for tile in range(pid, n_tiles, grid):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        off = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x_off = _row_offsets(rows, n_inner, stride_xo, stride_xi)[:, None] + cols[None, :]
        x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
        xhat = x * rstd
        dw += dy * xhat
        g = dy * w[None, :]
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=1) / n_cols)[:, None])
        if HAS_DS:
            dx += tl.load(ds_ptr + off, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(dw, axis=0), mask=col_ok)


def _programs_per_wave(device: torch.device) -> int:
    """Two programs per SM on CUDA; a handful on the interpreter."""
    return 2 * sm_count(device, 2)


def _tile(n_rows: int, n_cols: int, device: torch.device) -> tuple[int, int, int]:
    """-> (BLOCK_R, BLOCK_N, num_warps): ~TILE values, fewer rows while the forward grid would leave SMs idle."""
    block_n = next_power_of_2(n_cols)
    block_r = max(1, TILE // block_n)
    while block_r > 1 and cdiv(n_rows, block_r) < _programs_per_wave(device):
        block_r //= 2
    return block_r, block_n, min(8, max(4, block_r * block_n // 512))


def _rows(x: torch.Tensor, inner: int) -> torch.Tensor:
    """``x [..., inner, H]`` as an ``[outer, inner, H]`` view with a contiguous last dim; copies only
    when the leading dims cannot be merged into one stride."""
    if x.stride(-1) == 1:
        try:
            return x.view(-1, inner, x.shape[-1])
        except RuntimeError:
            pass
    return x.contiguous().view(-1, inner, x.shape[-1])


def rms_norm_forward(x, weight, eps, residual=None, pdl: bool = False, out_dtype=None):
    """x ``[..., H]`` -> ``(y, s, rstd)``; ``s`` is ``x + residual`` (or ``x``), rstd ``[rows]`` fp32.
    ``pdl``: launch as part of a programmatic-dependent chain (inference only; see ``pdl.py``).
    ``out_dtype``: y's dtype (default: x's promoted with the weight's)."""
    shape = x.shape
    n_cols = shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    out_dtype = out_dtype or torch.promote_types(x.dtype, weight.dtype)
    if n_rows == 0:
        y = torch.empty(shape, device=x.device, dtype=out_dtype)
        s = x if residual is None else x + residual
        return y, s, torch.empty(0, device=x.device, dtype=torch.float32)
    inner = shape[-2] if x.dim() >= 2 else 1
    x3 = _rows(x, inner)
    r3 = _rows(residual, inner) if residual is not None else None
    # Like ``weight * h.to(dtype)``: an fp32 weight (autocast master weights) gives an fp32 output.
    # Outputs are allocated in the caller's shape, not as views: callers modify them in place (rotary
    # on a normed q), which autograd forbids on views created inside a Function.
    y = torch.empty(shape, device=x.device, dtype=out_dtype)
    s = torch.empty(shape, device=x.device, dtype=x.dtype) if r3 is not None else x
    rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    block_r, block_n, warps = _tile(n_rows, n_cols, x.device)
    r_or_x = r3 if r3 is not None else x3
    _rms_norm_fwd[(cdiv(n_rows, block_r),)](
        x3, r_or_x, weight, y, s, rstd, n_rows, n_cols, eps, inner, x3.stride(0), x3.stride(1),
        r_or_x.stride(0), r_or_x.stride(1), HAS_RESIDUAL=r3 is not None, BLOCK_R=block_r, BLOCK_N=block_n,
        USE_PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return y, s, rstd


def rms_norm_backward(dy, ds, s, weight, rstd):
    """-> (dx, dweight); ``s`` is the normalised input as the forward saw it (any ``[outer, inner, H]``
    view), dy and ds gradients of the outputs."""
    shape = s.shape
    n_cols = shape[-1]
    n_rows = s.numel() // n_cols if n_cols else 0
    dx = torch.empty(shape, device=s.device, dtype=s.dtype)
    if n_rows == 0:
        return (dx if ds is None else ds.to(s.dtype)), torch.zeros_like(weight)
    inner = shape[-2] if s.dim() >= 2 else 1
    s3 = _rows(s, inner)
    dy2 = dy.reshape(-1, n_cols).contiguous()
    ds2 = ds.reshape(-1, n_cols).contiguous() if ds is not None else None
    # The forward's tile shape, with the grid no larger than a few programs per SM: each program's
    # partial weight gradient is one row of ``dw``.
    block_r, block_n, warps = _tile(n_rows, n_cols, s.device)
    n_tiles = cdiv(n_rows, block_r)
    programs = min(n_tiles, 2 * _programs_per_wave(s.device))
    dw = torch.empty(programs, n_cols, device=s.device, dtype=torch.float32)
    _rms_norm_bwd[(programs,)](dy2, ds2 if ds2 is not None else dy2, s3, weight, rstd, dx, dw, n_rows, n_cols,
                               n_tiles, inner, s3.stride(0), s3.stride(1), HAS_DS=ds2 is not None,
                               BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps)
    return dx, dw.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, residual, out_dtype):
        y, s, rstd = rms_norm_forward(x, weight, eps, residual, out_dtype=out_dtype)
        ctx.save_for_backward(s, weight, rstd)
        ctx.has_residual = residual is not None
        if residual is None:
            return y
        return y, s

    @staticmethod
    def backward(ctx, dy, ds=None):
        s, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, ds, s, weight, rstd)
        return dx, dw, None, (dx if ctx.has_residual else None), None


def rms_norm(x, weight, eps: float, residual=None, out_dtype=None):
    """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``; the norm in
    ``out_dtype`` when given (under autocast: the dtype its consumers would cast it to anyway)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (residual is not None and residual.requires_grad)):
        return _RMSNorm.apply(x, weight, eps, residual, out_dtype)
    y, s, _ = rms_norm_forward(x, weight, eps, residual, pdl=pdl_enabled(x.device), out_dtype=out_dtype)
    return y if residual is None else (y, s)


def rms_norm_residual_reference(x, weight, eps: float, residual=None):
    """The PyTorch definition the kernel is tested against."""
    if residual is None:
        return rms_norm_reference(x, weight, eps)
    s = x + residual
    return rms_norm_reference(s, weight, eps), s
