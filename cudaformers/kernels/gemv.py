"""Skinny matmul ``y = x @ W.T + b`` for decode (a few rows of x), as a weight-streaming Triton GEMV.

At one token per step every projection is memory-bound: all that matters is streaming W once at
full bandwidth. cuBLAS tiles these shapes for throughput and leaves most SMs idle on small models
(N = 1024 gets 16 CTAs); here each program owns a few output rows and walks all of K, so the grid
has hundreds of programs and every load is a long contiguous run of one weight row.

``linear`` is the entry point: it takes the Triton path only where it pays (CUDA or the
interpreter, half-precision or fp32 inputs, at most ``MAX_ROWS`` rows, no autograd), and otherwise
is ``F.linear``, the reference.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 4
_ELEMENTS = 4096  # weights each program holds per K step (BLOCK_N * BLOCK_K)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    # Elementwise products accumulate in fp32 and are reduced once at the end: no per-step shuffles.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def _block_n(n: int, device: torch.device) -> int:
    # Enough programs to cover every SM several times over, while keeping weight rows per program
    # small; more rows per program only for very wide outputs (the vocabulary projection).
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    block = 1
    while block < 16 and n // (block * 2) >= 4 * sms:
        block *= 2
    return block


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x ``[..., K]`` (at most a few rows), weight ``[N, K]`` -> ``[..., N]`` in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_n = _block_n(n, x.device)
    block_k = min(triton.next_power_of_2(k), _ELEMENTS // block_n)
    grid = (triton.cdiv(n, block_n), m)
    _gemv_kernel[grid](x2, weight, bias if bias is not None else y, y, n, k, x2.stride(0), weight.stride(0),
                       y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
                       num_warps=4, num_stages=3)
    return y.view(*shape[:-1], n)


def _triton_ok(x: torch.Tensor) -> bool:
    if x.device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through the GEMV kernel for decode-sized inputs."""
    rows = x.numel() // max(x.shape[-1], 1)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if (rows <= MAX_ROWS and not needs_grad and x.dtype == weight.dtype and weight.dim() == 2
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and _triton_ok(x)):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
