"""Dequantize-matmul ``y = x @ dequant(W).T + b`` for weight-only quantized Linear layers, in Triton.

Weight formats (``PackedWeight.fmt``), W is ``[N, K]`` (out, in), ``Kp`` is K rounded up to the
packing block:

* ``int8``: ``qweight int8 [N, Kp]`` (blocks of 64, zero padded), one fp32 scale per output row:
  ``w = q * s[n]``.
* ``int4``: ``qweight uint8 [N, Kp / 2]`` in blocks of the group size G; per group ``scales [N, Kp / G]``
  and optional float ``zeros`` (none: symmetric, zero point 8): ``w = (q - z) * s``.
* ``lut4`` (NF4, FP4): as int4 but ``w = code[q] * absmax``; the absmax may itself be stored as int8
  with one fp32 scale per 256 absmax values plus a global offset ("double quantization").

Packing ("planes"). Every block of B elements of a row (B = G for 4 bits, 64 for int8) is stored as
W = B / P little-endian int32 words, where P is the number of codes a word holds (8 nibbles or 4
bytes): code ``j`` of word ``w`` (bits ``j*bits .. j*bits+bits-1``) is element ``j*W + w`` of the
block. A kernel that reads one word per lane thus multiplies code ``j`` of W consecutive lanes with
W *contiguous* activations: x is read with vector loads, once per step, whatever the format. Rows of
every format quantize independently, so stacking the rows of several layers (q/k/v, gate/up) is exact.

One row of bf16 x against int4 in groups of 128 or int8 (decode at batch 1) runs ``quant_gemv_mma.py``,
which decodes the codes straight into tensor-core fragments; other single rows run the weight-streaming
GEMV of ``quant_gemv.py`` (or ``quant_mma.py`` where it is faster); more rows run
the ``tl.dot`` kernel below, which dequantizes one block at a time into x's dtype right before the
tensor-core dot. Both write x's dtype (bias added) in a single launch. ``dequantize`` and
``quant_matmul_reference`` are the PyTorch definitions the kernels are tested against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .grid import cdiv
from .grid import sm_count as grid_sm_count


FMT_INT8, FMT_INT4, FMT_LUT4 = 0, 1, 2
_FMT_IDS = {"int8": FMT_INT8, "int4": FMT_INT4, "lut4": FMT_LUT4}
DQ_BLOCK = 256  # absmax values per second-level scale (double quantization)
INT8_BLOCK = 64  # int8 packing block (elements): 16 words of 4 codes
# Up to 16 rows of x, int4 (groups >= 128) and int8 run the tensor-core kernel of quant_mma.py; False
# keeps them on the FMA GEMV / tl.dot kernels (benchmarks compare the two).
USE_MMA = True
# One row of bf16 x against int4 in groups of 128 or int8 runs quant_gemv_mma.py's kernel (codes decoded
# straight into mma fragments) where USE_MMA holds; False: the kernels before it (int4: quant_mma.py's
# tl.dot kernel; int8: the FMA GEMV).
USE_FRAGMENT_GEMV = True


@dataclass
class PackedWeight:
    fmt: str  # "int8" | "int4" | "lut4"
    qweight: torch.Tensor
    scales: torch.Tensor  # int8: [N]; 4-bit: [N, Kp/G] (int8 when double-quantized)
    in_features: int
    group_size: int = 0  # 4-bit only
    zeros: torch.Tensor | None = None  # int4 asymmetric: [N, Kp/G] float
    code: torch.Tensor | None = None  # lut4: [16] fp32
    scales2: torch.Tensor | None = None  # double quant: [ceil(N*Kp/G / 256)] fp32
    offset: float = 0.0  # double quant: added to every absmax

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def block(self) -> int:
        """Elements per packing block."""
        return INT8_BLOCK if self.fmt == "int8" else self.group_size

    @property
    def bits(self) -> int:
        return 8 if self.fmt == "int8" else 4

    @property
    def n_blocks(self) -> int:
        """Packing blocks per row (K padded to whole blocks)."""
        return self.qweight.shape[1] * 8 // self.bits // self.block


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------------------------------------------
# Packing and the PyTorch reference
# ---------------------------------------------------------------------------------------------------
def pack_planes(codes: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """Codes ``[N, Kp]`` (Kp a multiple of ``block``; values < 2**bits) -> packed bytes ``[N, Kp*bits/8]``
    (uint8 for 4 bits, int8 for 8) in the plane layout of the module docstring."""
    n, kp = codes.shape
    per_word = 32 // bits
    planes = codes.reshape(n, kp // block, per_word, block // per_word).transpose(-1, -2)  # [N, blocks, W, P]
    if bits == 8:
        return planes.to(torch.int8).reshape(n, kp)
    planes = planes.to(torch.uint8)
    return (planes[..., 0::2] | (planes[..., 1::2] << 4)).reshape(n, kp // 2)  # byte b: codes 2b, 2b+1


def unpack_planes(packed: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """Inverse of ``pack_planes``: codes ``[N, Kp]`` in element order (int8 values stay signed)."""
    n = packed.shape[0]
    per_word = 32 // bits
    if bits == 8:
        words = packed.reshape(n, -1, block // per_word, per_word)
    else:
        b = packed.reshape(n, -1, block // per_word, per_word // 2)
        words = torch.stack([b & 15, b >> 4], dim=-1).reshape(n, -1, block // per_word, per_word)
    return words.transpose(-1, -2).reshape(n, -1)


def pack_4bit(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """4-bit codes ``[N, Kp]`` (values 0..15) -> ``uint8 [N, Kp/2]``."""
    return pack_planes(codes, group_size, 4)


def unpack_4bit(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``uint8 [N, Kp/2]`` -> codes ``uint8 [N, Kp]`` in element order."""
    return unpack_planes(qweight, group_size, 4)


def group_scales(w: PackedWeight) -> torch.Tensor:
    """Per-group fp32 scales ``[N, Kp/G]`` (undoing double quantization)."""
    if w.scales2 is None:
        return w.scales.float()
    flat = w.scales.reshape(-1).float()
    idx = torch.arange(flat.numel(), device=flat.device) // DQ_BLOCK
    return (flat * w.scales2[idx] + w.offset).view_as(w.scales)


def dequantize(w: PackedWeight, dtype=torch.float32) -> torch.Tensor:
    """The ``[N, K]`` weight the packed data stands for."""
    codes = unpack_planes(w.qweight, w.block, w.bits)
    if w.fmt == "int8":
        return (codes[:, : w.in_features].float() * w.scales.float()[:, None]).to(dtype)
    if w.fmt == "lut4":
        values = w.code.float()[codes.long()]
    else:
        zero = 8.0 if w.zeros is None else w.zeros.float().repeat_interleave(w.group_size, 1)
        values = codes.float() - zero
    scale = group_scales(w).repeat_interleave(w.group_size, 1)
    return (values * scale)[:, : w.in_features].to(dtype)


def quant_matmul_reference(x: torch.Tensor, w: PackedWeight, bias=None) -> torch.Tensor:
    """Dequantize to x's dtype, then a plain matmul: ``x [..., K]`` -> ``[..., N]``."""
    return torch.nn.functional.linear(x, dequantize(w, x.dtype), bias)


# ---------------------------------------------------------------------------------------------------
# The tl.dot kernel (two rows of x and more)
# ---------------------------------------------------------------------------------------------------
# Integer -> float conversion is a slow instruction (a quarter of the FMA rate); a small integer v
# placed in the mantissa of 2**23 converts with one OR and one subtraction instead.
MAGIC = tl.constexpr(0x4B000000)  # the bits of 2.0 ** 23 (a constexpr object: compiled Triton reads no plain globals)


@triton.jit
def _block_scales(s_ptr, z_ptr, s2_ptr, offset, rows, blk, n_blocks, N, FMT: tl.constexpr, HAS_ZEROS: tl.constexpr,
                  DOUBLE: tl.constexpr):
    """Scales of block ``blk`` for rows ``rows`` ``[BLOCK_N]`` and the zero point to subtract (int4)."""
    mask_n = rows < N
    sidx = rows * n_blocks + blk
    s = tl.load(s_ptr + sidx, mask=mask_n, other=0).to(tl.float32)
    if DOUBLE:
        s = s * tl.load(s2_ptr + sidx // 256, mask=mask_n, other=0) + offset
    if HAS_ZEROS:
        z = tl.load(z_ptr + sidx, mask=mask_n, other=0).to(tl.float32)
    else:
        z = tl.full([rows.shape[0]], 8.0, tl.float32)
    return s, z


@triton.jit
def _block_codes(q_ptr, code_ptr, rows, blk, ld_q, N, FMT: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``blk`` of rows ``rows`` as unscaled values ``[BLOCK_N, BLOCK]`` in element order: the
    signed int8 codes, the int4 codes 0..15 or the NF4/FP4 code values (all exact in fp32)."""
    BITS: tl.constexpr = 8 if FMT == 0 else 4
    PER: tl.constexpr = 32 // BITS
    W: tl.constexpr = BLOCK // PER
    wi = tl.arange(0, W)
    words = tl.load(q_ptr + rows[:, None] * ld_q + blk * W + wi[None, :], mask=(rows < N)[:, None], other=0)
    shifts = tl.arange(0, PER) * BITS
    codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [BLOCK_N, PER, W]
    if FMT == 0:  # flipping the sign bit of a two's complement byte gives q + 128, in [0, 255]
        vals = _small_int_to_f32(codes ^ 128) - 8388736.0
    elif FMT == 2:
        vals = tl.load(code_ptr + codes)
    else:
        vals = _small_int_to_f32(codes) - 8388608.0
    return tl.reshape(vals, (rows.shape[0], BLOCK))


@triton.jit
def _small_int_to_f32(v):
    """int32 ``v`` in [0, 2**23) -> ``v + 2**23`` as fp32 (exact); subtract 2**23 (plus any zero point)."""
    return (v | MAGIC).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter's low-precision tl.dot is wrong; fp32 operands hold the same values
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, code_ptr, s2_ptr, offset, b_ptr, out_ptr, M, N, K, n_blocks, ld_x,
                 ld_q, FMT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, DOUBLE: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr):
    """``out [M, N] = x [M, K] @ W.T (+ b)`` in x's dtype; W dequantized one packing block at a time to
    x's dtype right before the tensor-core dot."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK)
    mask_m = rm < M
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * ld_x
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dt = x_ptr.dtype.element_ty
    for blk in range(0, n_blocks):
        k = blk * BLOCK + cols
        xt = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & (k[None, :] < K), other=0)
        w = _block_codes(q_ptr, code_ptr, rows, blk, ld_q, N, FMT, BLOCK)
        part = _dot(xt, tl.trans(w.to(dt)), UPCAST)  # integer codes are exact in x's dtype
        if FMT == 0:
            acc += part
        else:  # the block's scale (and zero point: z * sum(x)) apply to the [BLOCK_M, BLOCK_N] tile
            s, z = _block_scales(s_ptr, z_ptr, s2_ptr, offset, rows, blk, n_blocks, N, FMT, HAS_ZEROS, DOUBLE)
            if FMT == 1:
                part -= tl.sum(xt.to(tl.float32), axis=1)[:, None] * z[None, :]
            acc += part * s[None, :]
    if FMT == 0:
        acc *= tl.load(s_ptr + rows, mask=rows < N, other=0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=rows < N, other=0).to(tl.float32)[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (rows[None, :] < N))


def sm_count(device: torch.device) -> int:
    return grid_sm_count(device, 8)


def kernel_args(w: PackedWeight) -> tuple:
    """(qweight, scales, zeros, code, scales2, offset) with the scales tensor standing in for absent ones."""
    dummy = w.scales
    return (w.qweight, w.scales, w.zeros if w.zeros is not None else dummy, w.code if w.code is not None else dummy,
            w.scales2 if w.scales2 is not None else dummy, float(w.offset))


def check_packed(w: PackedWeight) -> None:
    n, k = w.out_features, w.in_features
    kp = -(-k // w.block) * w.block
    if w.qweight.shape != (n, kp * w.bits // 8) or not w.qweight.is_contiguous():
        raise ValueError(f"quant_matmul: packed {w.fmt} weight is {tuple(w.qweight.shape)} (contiguous: "
                         f"{w.qweight.is_contiguous()}); a {k} -> {n} layer in blocks of {w.block} needs a contiguous "
                         f"[{n}, {kp * w.bits // 8}]")


def quant_matmul_triton(x: torch.Tensor, w: PackedWeight, bias=None) -> torch.Tensor:
    """``x [M, K]`` -> ``[M, N]`` in x's dtype (bias added), one Triton launch."""
    m, k = x.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"quant_matmul: x has {k} features, the weight expects {w.in_features}")
    check_packed(w)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if USE_MMA and USE_FRAGMENT_GEMV and m == 1 and x.is_cuda:
        from .quant_gemv_mma import quant_gemv_mma, supports

        if supports(x, w):
            return quant_gemv_mma(x, w, bias)
    if USE_MMA:
        from . import quant_mma

        if quant_mma.supports(x, w) and quant_mma.preferred(x, w):
            return quant_mma.quant_mma(x, w, bias)
    if m == 1:
        from .quant_gemv import quant_gemv

        return quant_gemv(x, w, bias)
    fmt = _FMT_IDS[w.fmt]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    # Small M (decode batches) is memory bound: narrow tiles give every SM a share of the weights.
    tiles_m = cdiv(m, block_m)
    block_n = 64
    while block_n > 16 and tiles_m * cdiv(n, block_n) < 2 * sm_count(x.device):
        block_n //= 2
    grid = (tiles_m, cdiv(n, block_n))
    n_blocks = w.n_blocks
    words = w.qweight.view(torch.int32)
    _gemm_kernel[grid](x, words, *kernel_args(w)[1:], bias if bias is not None else out, out, m, n, k, n_blocks,
                       x.stride(0), words.stride(0), FMT=fmt, BLOCK=w.block, BLOCK_M=block_m, BLOCK_N=block_n,
                       HAS_ZEROS=w.zeros is not None, DOUBLE=w.scales2 is not None, HAS_BIAS=bias is not None,
                       UPCAST=interpreting(), num_warps=4, num_stages=3)
    return out
