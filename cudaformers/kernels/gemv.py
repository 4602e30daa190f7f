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
from .pdl import pdl_enabled, release_dependents, wait_for_producer

MAX_ROWS = 4
_ELEMENTS = 4096  # weights each program holds per K step (BLOCK_N * BLOCK_K)
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
def _gemv_kernel(x_ptr, u_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_um, stride_wn, stride_ym,
                 ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_PDL: tl.constexpr):
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
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    # Elementwise products accumulate in fp32 and are reduced once at the end: no per-step shuffles.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc += w0.to(tl.float32) * _input_tile(x_row, u_row, cols, k_ok, ACT)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * _input_tile(x_row, u_row, k, k_ok, ACT)[None, :]
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


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` -> ``[M, K]`` with unit stride along K; a strided view (a slice of a packed
    projection output) stays a view."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x2, u2, weight, bias, act: int) -> torch.Tensor:
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"input rows of {k} features do not match the weight {tuple(weight.shape)} ([N, K])")
    y = torch.empty(m, n, device=x2.device, dtype=x2.dtype)
    block_n = _block_n(n, x2.device)
    block_k = min(triton.next_power_of_2(k), _ELEMENTS // block_n)
    grid = (triton.cdiv(n, block_n), m)
    pdl = pdl_enabled(x2.device)  # GEMVs run without autograd only: always an inference launch
    _gemv_kernel[grid](x2, u2, weight, bias if bias is not None else y, y, n, k, x2.stride(0), u2.stride(0),
                       weight.stride(0), y.stride(0), ACT=act, HAS_BIAS=bias is not None, BLOCK_N=block_n,
                       BLOCK_K=block_k, USE_PDL=pdl, num_warps=4, num_stages=3, launch_pdl=pdl)
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
