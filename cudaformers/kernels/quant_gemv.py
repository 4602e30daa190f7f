"""Weight-streaming GEMV for quantized Linear layers: one row of x, decode at batch 1.

At one token per step a quantized matmul is worth exactly its packed bytes: it must stream them at
full bandwidth, in one launch, with as few instructions per weight as the memory allows (a 4-bit
weight arrives every ~0.1 ns on an H200: a handful of instructions each is all the SMs can spend).

Each program owns ``BLOCK_N`` rows and walks all of K (no split-K: the rows alone give several
programs per SM at model sizes, and the output is written once, in x's dtype, bias added). One step
is a ``[BLOCK_N, BLOCKS, W]`` tile of int32 words, 16 bytes per lane, so every thread holds a few
rows of the same columns and reuses each activation it loads for all of them. With the plane
packing (``quant_matmul.py``) code ``j`` of those words multiplies W contiguous activations.

Codes become floats without any conversion instruction: ``word & mask`` read as fp32 is the
*denormal* ``code * 2**(P - 149)`` for a code at bit position ``P`` (exact; FMA handles denormals at
full rate), so a code costs one AND plus its FMA, with the activation pre-scaled by ``2**(85 - P)``
once per program for all its rows: products carry ``2**-64``, undone at the end. Codes above bit 22
(the exponent) are read from the word shifted right by 16. Zero points (int4's 8 or its stored
zeros, int8's 128 after flipping the sign bits) come off per block as ``z * sum(x)``. NF4/FP4 codes
go through their 16-entry table, which stays in L1.

On Hopper the launch uses programmatic dependent launch (``pdl.py``): the first tile of weights and
scales is requested before waiting for the previous kernel, and x after.

Tried and measured slower (bench/RESULTS.md run 19): int8 weights fed unconverted to the integer
tensor cores (``int8 x int8 -> int32`` mma), with x split per program into four int8 planes of its
residues (exact for bf16 x) as three columns of the dot's 16-wide operand. The weights stream
through shared memory without a single conversion, but moving each block's planes into the dot's
layout costs ~150 instructions and 10 barriers a thread per 64-code block: at 256-row tiles 1.5
instructions a weight in all, and 12-27% slower than this GEMV on every qwen3-8b layer.

fp8 (e4m3) weights with per-row scales get a plain GEMV of their own (``fp8_gemv``): weight-only, x
stays in its dtype (no per-token activation quantization at batch 1, where only bytes count).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid import cdiv, next_power_of_2
from .pdl import pdl_enabled, release_dependents, wait_for_producer
from .quant_matmul import FMT_INT8, _FMT_IDS, PackedWeight, kernel_args, sm_count

SIGN_BITS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as int32: the sign bit of every byte
UNSCALE = tl.constexpr(2.0 ** 64)  # undoes the 2**-64 every product carries (see the module docstring)
DOWN = tl.constexpr(2.0 ** -64)


@triton.jit
def _plane_times_x(words, high, xj, J: tl.constexpr, BITS: tl.constexpr):
    """``code_j * x * 2**-64`` for plane J of ``words`` ``[BLOCK_N, BLOCKS, W]`` and its x ``[BLOCKS, W]``."""
    LOW: tl.constexpr = 5 if BITS == 4 else 2  # planes whose bits all lie in the fp32 mantissa (bits 0..22)
    P: tl.constexpr = J * BITS if J < LOW else J * BITS - 16  # the others are read from word >> 16
    MASK: tl.constexpr = ((1 << BITS) - 1) << P
    src = words if J < LOW else high
    code = (src & MASK).to(tl.float32, bitcast=True)  # code * 2**(P - 149), a denormal: exact
    return code * (xj * (2.0 ** (85 - P)))[None, :, :]


@triton.jit
def _load_tile(q_rows, s_ptr, z_ptr, s2_ptr, offset, rows, row_ok, blk, n_blocks, FMT: tl.constexpr,
               W: tl.constexpr, HAS_ZEROS: tl.constexpr, DOUBLE: tl.constexpr):
    """Words ``[BLOCK_N, BLOCKS, W]`` of blocks ``blk`` with their scales and zero points ``[BLOCK_N, BLOCKS]``:
    weights only, so this may run before the previous kernel has finished."""
    wi = tl.arange(0, W)
    blk_ok = blk < n_blocks
    words = tl.load(q_rows + blk[None, :, None] * W + wi[None, None, :],
                    mask=row_ok[:, None, None] & blk_ok[None, :, None], other=0)
    sidx = rows[:, None] * n_blocks + blk[None, :]
    smask = row_ok[:, None] & blk_ok[None, :]
    if FMT == 0:
        s = tl.zeros([rows.shape[0], blk.shape[0]], tl.float32)  # int8: the row scale comes at the end
    else:
        s = tl.load(s_ptr + sidx, mask=smask, other=0).to(tl.float32)
        if DOUBLE:
            s = s * tl.load(s2_ptr + sidx // 256, mask=smask, other=0) + offset
    if HAS_ZEROS:
        z = tl.load(z_ptr + sidx, mask=smask, other=0).to(tl.float32)
    else:
        z = tl.full([rows.shape[0], blk.shape[0]], 128.0 if FMT == 0 else 8.0, tl.float32)
    return words, s, z


@triton.jit
def _tile_dot(words, s, z, x_ptr, code_ptr, blk, K, FMT: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr,
              EVEN_K: tl.constexpr):
    """Elementwise partial dot products ``[BLOCK_N, BLOCKS, W]`` of one tile (int formats: times 2**-64)."""
    BITS: tl.constexpr = 8 if FMT == 0 else 4
    wi = tl.arange(0, W)
    if FMT == 0:
        words = words ^ SIGN_BITS  # two's complement bytes -> q + 128, in [0, 255]
    high = words >> 16
    part = tl.zeros(words.shape, tl.float32)
    xsum = tl.zeros([blk.shape[0], W], tl.float32)
    for j in tl.static_range(32 // BITS):
        k = blk[:, None] * BLOCK + j * W + wi[None, :]
        if EVEN_K:
            xj = tl.load(x_ptr + k).to(tl.float32)
        else:
            xj = tl.load(x_ptr + k, mask=k < K, other=0).to(tl.float32)
        if FMT == 2:
            part += tl.load(code_ptr + ((words >> (4 * j)) & 15)) * xj[None, :, :]
        else:
            part += _plane_times_x(words, high, xj, j, BITS)
            xsum += xj
    if FMT == 2:
        return part * s[:, :, None]
    part -= (z * DOWN)[:, :, None] * xsum[None, :, :]
    if FMT == 0:
        return part
    return part * s[:, :, None]


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, code_ptr, s2_ptr, offset, b_ptr, out_ptr, N, K, n_blocks, ld_q,
                 FMT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, DOUBLE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """``out [N] = W @ x + b`` for one row ``x [K]``; ``q_ptr`` is the packed weight as int32 words."""
    W: tl.constexpr = BLOCK * (8 if FMT == 0 else 4) // 32
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    bi = tl.arange(0, BLOCKS)
    q_rows = q_ptr + rows.to(tl.int64)[:, None, None] * tl.multiple_of(ld_q, W)
    words, s, z = _load_tile(q_rows, s_ptr, z_ptr, s2_ptr, offset, rows, row_ok, bi, n_blocks, FMT, W, HAS_ZEROS,
                             DOUBLE)
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    # Registers double-buffer the weights: the next tile is requested before this one is worked on,
    # so a program's loads stay in flight while it computes (the loop's loads feed no tl.dot, so the
    # compiler's pipeliner leaves them alone). Same products in the same order as a plain loop.
    acc = tl.zeros(words.shape, tl.float32)
    for b0 in range(BLOCKS, n_blocks, BLOCKS):
        ahead = _load_tile(q_rows, s_ptr, z_ptr, s2_ptr, offset, rows, row_ok, b0 + bi, n_blocks, FMT, W,
                           HAS_ZEROS, DOUBLE)
        acc += _tile_dot(words, s, z, x_ptr, code_ptr, b0 - BLOCKS + bi, K, FMT, BLOCK, W, EVEN_K)
        words, s, z = ahead
    acc += _tile_dot(words, s, z, x_ptr, code_ptr, (n_blocks - 1) // BLOCKS * BLOCKS + bi, K, FMT, BLOCK, W,
                     EVEN_K)
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if FMT != 2:
        out *= UNSCALE
    if FMT == 0:
        out *= tl.load(s_ptr + rows, mask=row_ok, other=0)
    if HAS_BIAS:
        out += tl.load(b_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv_tiles(n: int, n_blocks: int, words_per_block: int, device: torch.device,
               int4: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCKS, num_warps): steps of 512 words (2 KB) per row, 4 words per lane, and as many rows
    per program (up to 8, reusing each activation) as still leaves 4 programs per SM.

    int4 spends more instructions per byte than it waits for bytes: half-size steps (256 words) with
    8 rows per program, which reuse each activation most, measured 5-15% faster on qwen3-8b's o, gate/up
    and down projections and equal on qkv (bench/quant.py --parts tiles, H200)."""
    sms = sm_count(device)
    step_words = 256 if int4 else 512
    blocks = min(max(step_words // words_per_block, 1), next_power_of_2(n_blocks))
    warps = min(4, max(1, blocks * words_per_block // 128))
    if int4 and n >= 8 * sms:
        return 8, blocks, warps
    block_n = 1
    while block_n < 8 and n // (2 * block_n) >= 4 * sms:
        block_n *= 2
    return block_n, blocks, warps


def quant_gemv(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
               tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x [1, K]`` -> ``[1, N]`` in x's dtype, one launch. ``tiles`` overrides ``gemv_tiles`` (benchmarks)."""
    n, k = w.out_features, w.in_features
    fmt = _FMT_IDS[w.fmt]
    words = w.qweight.view(torch.int32)  # rows are whole blocks of whole words (quant_matmul.check_packed)
    n_blocks = w.n_blocks
    wpb = w.block * w.bits // 32
    block_n, blocks, warps = tiles or gemv_tiles(n, n_blocks, wpb, x.device, int4=w.fmt == "int4")
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    pdl = pdl_enabled(x.device)
    even = k == n_blocks * w.block and n_blocks % blocks == 0
    _gemv_kernel[(cdiv(n, block_n),)](
        x, words, *kernel_args(w)[1:], bias if bias is not None else out, out, n, k, n_blocks, words.stride(0),
        FMT=fmt, BLOCK=w.block, BLOCK_N=block_n, BLOCKS=blocks, HAS_ZEROS=w.zeros is not None and fmt != FMT_INT8,
        DOUBLE=w.scales2 is not None, HAS_BIAS=bias is not None, EVEN_K=even, USE_PDL=pdl, num_warps=warps,
        launch_pdl=pdl)
    return out


# ---------------------------------------------------------------------------------------------------
# fp8 (e4m3) weights, one fp32 scale per row
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _fp8_tile(w, x_ptr, k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        xk = tl.load(x_ptr + k).to(tl.float32)
    else:
        xk = tl.load(x_ptr + k, mask=k < K, other=0).to(tl.float32)
    return w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * xk[None, :]


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, K, ld_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    """``out [N] = (W_fp8 @ x) * s + b`` for one row ``x [K]``; ``w_ptr`` is the e4m3 weight as bytes."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * ld_w
    w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0)
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    acc = _fp8_tile(w, x_ptr, cols, K, EVEN_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_rows + k0 + cols[None, :], mask=row_ok[:, None] & (k0 + cols < K)[None, :], other=0)
        acc += _fp8_tile(w, x_ptr, k0 + cols, K, EVEN_K)
    out = tl.sum(acc, axis=1) * tl.load(s_ptr + rows, mask=row_ok, other=0)
    if HAS_BIAS:
        out += tl.load(b_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [1, K]`` -> ``(x @ W.T) * scale + bias`` ``[1, N]`` in x's dtype; weight e4m3 ``[N, K]``, scale fp32 ``[N]``."""
    n, k = weight.shape
    if x.shape != (1, k) or weight.stride(1) != 1:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} and a row-major [{n}, {k}] weight expected")
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = weight.view(torch.uint8)
    block_k = min(2048, next_power_of_2(k))  # 16 bytes per lane at 4 warps
    block_n = 1
    while block_n < 4 and n // (2 * block_n) >= 4 * sm_count(x.device):
        block_n *= 2
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    pdl = pdl_enabled(x.device)
    _fp8_gemv_kernel[(cdiv(n, block_n),)](x, w, scale, bias if bias is not None else out, out, n, k,
                                      w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                      HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, USE_PDL=pdl,
                                      num_warps=4, launch_pdl=pdl)
    return out
