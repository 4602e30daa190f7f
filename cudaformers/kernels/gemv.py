"""Skinny matmul ``y = x @ W.T + b`` for decode (a few rows of x), as a weight-streaming Triton GEMV.

At one token per step every projection is memory-bound: all that matters is streaming W once at
full bandwidth. cuBLAS tiles these shapes for throughput and leaves most SMs idle on small models
(N = 1024 gets 16 CTAs); here each program owns a few output rows and walks all of K, so the grid
has hundreds of programs and every load is a long contiguous run of one weight row.

``linear`` is the entry point: it takes the Triton path only where it pays (CUDA or the
interpreter, half-precision or fp32 inputs, at most ``MAX_ROWS`` rows, no autograd), and otherwise
is ``F.linear``, the reference.

``gemv_act_mul`` is the gated MLP's down projection ``F.linear(act(gate) * up, W)`` in the same
launch: the input row is built in registers from gate and up as the weights stream past, so the
activation kernel and its intermediate tensor disappear from the decode step. Every program
recomputes the activation over all of K; that is a few thousand cheap flops against tens of KB of
weights, and gate/up are read from L2.

``gemv_rms_norm`` is a projection that consumes an RMSNorm, ``F.linear(rms_norm(x + residual), W)``
(the q/k/v and gate/up projections of a decoder layer), in one launch. Every program holds the whole
input row anyway, so it first sums the squares of ``x + residual`` over the row (pass 1), then
streams its weights against the normalised row (pass 2); one program per row also writes
``x + residual``, the next residual. The norm's launch, its output and the re-read of that output
disappear. The rounding steps are rms_norm's: the sum and the normalised row are rounded to x's
dtype, then scaled by the norm weight and rounded again, so greedy decoding is unchanged.

On Hopper the GEMV is launched with programmatic dependent launch (``pdl.py``): its grid is
scheduled while the previous kernel drains and starts streaming its first weight tile before it
waits for its input, which hides most of the ramp-up that dominates a few-microsecond kernel.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import _act_and_grad, _code
from .grid import cdiv, next_power_of_2
from .pdl import pdl_enabled, release_dependents, wait_for_producer

MAX_ROWS = 4
# How a GEMV is cut into programs: ``elements`` weights each program holds per K step (BLOCK_N *
# BLOCK_K), at least ``programs_per_sm`` programs per SM before rows per program grow, ``warps`` per
# program. bench/gemv_tiles.py sweeps these end to end (a decode step chains ~100 GEMVs, so a
# kernel's ramp-up and tail matter as much as its streaming rate): on an H200, 16 KB per program
# and two programs per SM beat 8 KB and four by 4-5% on W1 and W2 (bench/RESULTS.md run 9); most
# 0.6b projections then fit one tile, all of it requested before the wait for the input.
TILING = dict(elements=8192, programs_per_sm=2, warps=4)
_NO_ACT = -1      # ACT code of the plain GEMV: x is used as loaded


@triton.jit
def _input_tile(x_row, u_row, k, k_ok, ACT: tl.constexpr):
    """fp32 input columns ``k``: x as loaded, or ``act(gate) * up`` (x is the gate), never stored."""
    x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
    if ACT >= 0:
        a, _ = _act_and_grad(x, ACT)
        x = a * tl.load(u_row + k, mask=k_ok, other=0.0).to(tl.float32)
    return x


@triton.jit
def _residual_sum(x_row, r_row, k, k_ok, HAS_RESIDUAL: tl.constexpr):
    """``x + residual`` at columns ``k``, rounded to x's dtype as the unfused add is."""
    x = tl.load(x_row + k, mask=k_ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(r_row + k, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _normed(s, rstd, norm_w):
    """rms_norm's output at these columns, as fp32: normalised and rounded to the activation dtype,
    scaled by the norm weight and rounded again (the norm writes x's dtype, the GEMV reads it)."""
    normed = (s.to(tl.float32) * rstd).to(s.dtype).to(tl.float32)
    return (normed * norm_w.to(tl.float32)).to(s.dtype).to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, u_ptr, w_ptr, b_ptr, y_ptr, nw_ptr, s_ptr, N, K, eps, stride_xm, stride_um, stride_wn,
                 stride_ym, ACT: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    # Inputs by mode: plain (x), ACT (gate x, up u), NORM (x, residual u, norm weight nw, sum out s).
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    u_row = u_ptr + m.to(tl.int64) * stride_um
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    # The first weight tile (all of this program's weights when K fits one step) is requested while
    # the previous kernel drains: nothing in the step writes weights. Its input comes after the wait.
    k_ok = cols < K
    # Nothing may consume the tile before the wait, or the program would stall on it there instead
    # of having its input requested by the time the weights arrive.
    w0 = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if NORM:
        nw0 = tl.load(nw_ptr + cols, mask=k_ok, other=0.0)  # a weight too: nothing in the step writes it
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    if NORM:
        # Pass 1: the row's sum of squares. The first tile stays in registers for pass 2; program 0
        # of the row writes the sum (the next residual), which no other program reads.
        s_row = s_ptr + m.to(tl.int64) * K
        s_cols = tl.where(pid_n == 0, K, 0)  # columns this program writes: all or none
        s0 = _residual_sum(x_row, u_row, cols, k_ok, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(s_row + cols, s0, mask=cols < s_cols)
        sq = s0.to(tl.float32) * s0.to(tl.float32)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kk = k0 + cols
            kk_ok = kk < K
            s = _residual_sum(x_row, u_row, kk, kk_ok, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                tl.store(s_row + kk, s, mask=kk < s_cols)
            sq += s.to(tl.float32) * s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)  # as rms_norm computes it
        x0 = _normed(s0, rstd, nw0)
    else:
        x0 = _input_tile(x_row, u_row, cols, k_ok, ACT)
    # Elementwise products accumulate in fp32 and are reduced once at the end: no per-step shuffles.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc += w0.to(tl.float32) * x0[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if NORM:  # pass 2 past the first tile: the sum again (from L1/L2), normalised
            xk = _normed(_residual_sum(x_row, u_row, k, k_ok, HAS_RESIDUAL), rstd,
                         tl.load(nw_ptr + k, mask=k_ok, other=0.0))
        else:
            xk = _input_tile(x_row, u_row, k, k_ok, ACT)
        acc += w * xk[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def tiling(n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an ``[N, K]`` weight. Enough programs to cover every SM
    several times over, while keeping weight rows per program small; more rows per program only for
    wide outputs (gate/up, the vocabulary projection)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    block = 1
    while block < 16 and n // (block * 2) >= TILING["programs_per_sm"] * sms:
        block *= 2
    return block, min(next_power_of_2(k), max(TILING["elements"] // block, 16)), TILING["warps"]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` -> ``[M, K]`` with unit stride along K; a strided view (a slice of a packed
    projection output) stays a view."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x2, u2, weight, bias, act: int, norm: tuple | None = None) -> torch.Tensor:
    """``norm``: ``(norm weight, eps, sum output or None)`` for the NORM mode (u2 is the residual)."""
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"input rows of {k} features do not match the weight {tuple(weight.shape)} ([N, K])")
    y = torch.empty(m, n, device=x2.device, dtype=x2.dtype)
    block_n, block_k, warps = tiling(n, k, x2.device)
    grid = (cdiv(n, block_n), m)
    pdl = pdl_enabled(x2.device)  # GEMVs run without autograd only: always an inference launch
    norm_w, eps, s = norm if norm is not None else (y, 0.0, None)
    _gemv_kernel[grid](x2, u2, weight, bias if bias is not None else y, y, norm_w, s if s is not None else y,
                       n, k, eps, x2.stride(0), u2.stride(0), weight.stride(0), y.stride(0), ACT=act,
                       NORM=norm is not None, HAS_RESIDUAL=s is not None, HAS_BIAS=bias is not None,
                       BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=pdl, num_warps=warps, num_stages=3,
                       launch_pdl=pdl)
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x ``[..., K]`` (at most a few rows), weight ``[N, K]`` -> ``[..., N]`` in x's dtype."""
    x2 = _rows(x)
    return _launch(x2, x2, weight, bias, _NO_ACT).view(*x.shape[:-1], weight.shape[0])


def gemv_act_mul(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str = "silu") -> torch.Tensor:
    """``F.linear(act(gate) * up, weight, bias)`` in one launch, ``act`` computed in fp32.

    gate, up ``[..., K]`` (at most a few rows; may be strided views of one packed ``[..., 2K]``
    output), weight ``[N, K]`` -> ``[..., N]`` in gate's dtype. ``activation`` is a ``hidden_act``
    name from ``activation.KERNEL_ACTIVATIONS``.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must have "
                         "the same shape and dtype")
    act = _code(activation)
    return _launch(_rows(gate), _rows(up), weight, bias, act).view(*gate.shape[:-1], weight.shape[0])


def gemv_rms_norm(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None, bias: torch.Tensor | None = None):
    """``F.linear(rms_norm(x + residual), weight, bias)`` in one launch, rounded as the two ops are.

    x, residual ``[..., K]`` (at most a few rows, the same dtype), norm_weight ``[K]`` and weight
    ``[N, K]`` in x's dtype -> ``y [..., N]``; with a residual ``(y, x + residual)``, as
    ``RMSNorm(x, residual)`` returns the normed row and the sum.
    """
    return with_folded_norm(lambda x2, r2, norm: _launch(x2, r2, weight, bias, _NO_ACT, norm=norm),
                            x, weight.shape[0], norm_weight, eps, residual)


def with_folded_norm(launch, x: torch.Tensor, n: int, norm_weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None):
    """The frame of a projection with a folded RMSNorm: checks the inputs, allocates the residual sum
    and calls ``launch(x2, residual2, (norm weight, eps, sum or None))`` for the ``[M, n]`` output. Returns ``y [..., n]``, or ``(y, x + residual)`` with a residual."""
    k = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must have x's shape and dtype "
                         f"{tuple(x.shape)} {x.dtype}")
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} must be [{k}] in x's dtype "
                         f"{x.dtype} (the unfused norm would otherwise write another dtype); use rms_norm, then the "
                         "projection")
    x2 = _rows(x)
    s = torch.empty(x2.shape, device=x.device, dtype=x.dtype) if residual is not None else None
    y = launch(x2, _rows(residual) if residual is not None else x2,
               (norm_weight.contiguous(), float(eps), s)).view(*x.shape[:-1], n)
    return y if residual is None else (y, s.view(x.shape))


def gemv_rms_norm_reference(x, weight, norm_weight, eps: float, residual=None, bias=None):
    """The PyTorch definition ``gemv_rms_norm`` is tested against: the norm, then the matmul."""
    from .rms_norm import rms_norm_residual_reference

    normed = rms_norm_residual_reference(x, norm_weight, eps, residual)
    if residual is None:
        return F.linear(normed, weight, bias)
    return F.linear(normed[0], weight, bias), normed[1]


def _triton_ok(x: torch.Tensor) -> bool:
    if x.device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def gemv_applies(weight: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """Whether the GEMV kernel pays (and is exact) for ``inputs`` ``[..., K]`` against ``weight``:
    decode-sized, no autograd, one supported dtype throughout, a device Triton runs on."""
    x = inputs[0]
    rows = x.numel() // max(x.shape[-1], 1)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (weight, *inputs))
    return (rows <= MAX_ROWS and not needs_grad and weight.dim() == 2
            and all(t.dtype == weight.dtype for t in inputs)
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and _triton_ok(x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through the GEMV kernel for decode-sized inputs."""
    if gemv_applies(weight, x):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
