"""What the fragment GEMV (``quant_gemv_mma.py``) does with its rows' dot products once its loop ends.

Every lane holds the dots of its rows (``lane // 4`` of a tile's halves) summed over its warp's
blocks; a row's value is the sum over the program's warps, and every t of a row holds it (all 8 mma
columns are alike), so t = 0 stores. Besides the plain store:

- **gated** (``store_gated``): a packed gate/up projection comes out as ``act(gate) * up``; the lane
  holds both rows of its output, which the act-and-mul kernel's arithmetic then combines.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activation import _act_and_grad


@triton.jit
def row_values(acc, s_ptr, b_ptr, rows, WARPS: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """fp32 values of ``rows`` (one per lane): the dot summed over the warps, times the row's scale
    (int8), plus the bias."""
    out = tl.sum(tl.reshape(acc, [WARPS, 32]), axis=0)
    if ROW_SCALE:
        out *= tl.load(s_ptr + rows)
    if HAS_BIAS:
        out += tl.load(b_ptr + rows).to(tl.float32)
    return out


@triton.jit
def store_rows(acc, s_ptr, b_ptr, out_ptr, row, WARPS: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Rows ``row + lane // 4`` into ``out``."""
    lanes = tl.arange(0, 32)
    rows = row + lanes // 4
    out = row_values(acc, s_ptr, b_ptr, rows, WARPS, ROW_SCALE, HAS_BIAS)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=lanes % 4 == 0)


@triton.jit
def store_gated(gate, up, s_ptr, b_ptr, out_ptr, row, half, WARPS: tl.constexpr, ROW_SCALE: tl.constexpr,
                HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    """``act(gate) * up`` into rows ``row + lane // 4`` of the output, from the accumulators of packed
    rows ``row + lane // 4`` (gate) and ``half`` past them (up). gate and up are rounded to the output
    dtype first and the product computed as ``activation.py``'s act-and-mul kernel does, so the result
    is bit for bit the packed projection's output passed through that kernel."""
    lanes = tl.arange(0, 32)
    rows = row + lanes // 4
    dtype = out_ptr.dtype.element_ty
    g = row_values(gate, s_ptr, b_ptr, rows, WARPS, ROW_SCALE, HAS_BIAS).to(dtype).to(tl.float32)
    u = row_values(up, s_ptr, b_ptr, rows + half, WARPS, ROW_SCALE, HAS_BIAS).to(dtype).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(out_ptr + rows, (a * u).to(dtype), mask=lanes % 4 == 0)
