"""Dequantize-matmul ``y = x @ dequant(W).T`` for weight-only quantized Linear layers, in Triton.

Weight formats (``PackedWeight.fmt``), W is ``[N, K]`` (out, in):

* ``int8``: ``qweight int8 [N, K4]`` (K rounded up to 4, zero padded), one fp32 scale per output
  row: ``w = q * s[n]``.
* ``int4``: ``qweight uint8 [N, Kp / 2]`` with ``Kp`` = K rounded up to the group size G; per group
  ``scales [N, Kp / G]`` and optional float ``zeros`` (none: symmetric, zero point 8):
  ``w = (q - z) * s``.
* ``lut4`` (NF4, FP4): as int4 but ``w = code[q] * absmax``; the absmax may itself be stored as int8
  with one fp32 scale per 256 absmax values plus a global offset ("double quantization").

4-bit packing is per group so that both halves of a group are contiguous in x: byte ``i`` of group
``g`` holds element ``g*G + i`` in its low nibble and ``g*G + G/2 + i`` in its high nibble. A kernel
then reads one group as a ``[BLOCK_N, G/2]`` byte tile and two contiguous ``[G/2]`` slices of x.

Two kernels: a GEMV for one row of x (decode at batch 1, memory bound: it must stream the packed
bytes at full bandwidth, so it splits K across programs to fill the GPU and keeps the group's scales
in registers), and a ``tl.dot`` tile kernel for more rows (split-K too while M is small).
``dequantize`` and ``quant_matmul_reference`` are the PyTorch definitions the kernels are tested on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FMT_INT8, FMT_INT4, FMT_LUT4 = 0, 1, 2
_FMT_IDS = {"int8": FMT_INT8, "int4": FMT_INT4, "lut4": FMT_LUT4}
DQ_BLOCK = 256  # absmax values per second-level scale (double quantization)


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


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------------
def unpack_4bit(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``uint8 [N, Kp/2]`` -> codes ``uint8 [N, Kp]`` in element order."""
    n, half = qweight.shape
    g = qweight.view(n, half // (group_size // 2), group_size // 2)
    return torch.cat([g & 15, g >> 4], dim=2).reshape(n, 2 * half)


def pack_4bit(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of ``unpack_4bit``: codes ``[N, Kp]`` (values 0..15) -> ``uint8 [N, Kp/2]``."""
    n, kp = codes.shape
    g = codes.to(torch.uint8).view(n, kp // group_size, group_size)
    lo, hi = g[..., : group_size // 2], g[..., group_size // 2:]
    return (lo | (hi << 4)).reshape(n, kp // 2)


def group_scales(w: PackedWeight) -> torch.Tensor:
    """Per-group fp32 scales ``[N, Kp/G]`` (undoing double quantization)."""
    if w.scales2 is None:
        return w.scales.float()
    flat = w.scales.reshape(-1).float()
    idx = torch.arange(flat.numel(), device=flat.device) // DQ_BLOCK
    return (flat * w.scales2[idx] + w.offset).view_as(w.scales)


def dequantize(w: PackedWeight, dtype=torch.float32) -> torch.Tensor:
    """The ``[N, K]`` weight the packed data stands for."""
    if w.fmt == "int8":
        return (w.qweight[:, : w.in_features].float() * w.scales.float()[:, None]).to(dtype)
    codes = unpack_4bit(w.qweight, w.group_size)
    n, kp = codes.shape
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
# Triton kernels
# ---------------------------------------------------------------------------------------------------
# Integer -> float conversion is a slow instruction (a quarter of the FMA rate); a small integer v
# placed in the mantissa of 2**23 converts with one OR and one subtraction instead. Without it, the
# 4-bit kernels would be bound by conversions, not by memory.
MAGIC = tl.constexpr(0x4B000000)  # the bits of 2.0 ** 23 (a constexpr object: compiled Triton reads no plain globals)


@triton.jit
def _small_int_to_f32(v):
    """int32 ``v`` in [0, 2**23) -> ``v + 2**23`` as fp32 (exact); subtract 2**23 (plus any zero point)."""
    return (v | MAGIC).to(tl.float32, bitcast=True)


@triton.jit
def _group_scales(s_ptr, z_ptr, s2_ptr, offset, rows, g, n_groups, N, HAS_ZEROS: tl.constexpr,
                  DOUBLE: tl.constexpr):
    """Scales ``[BLOCK_N]`` of group ``g`` and what to subtract from ``_small_int_to_f32`` codes."""
    mask_n = rows < N
    sidx = rows * n_groups + g
    s = tl.load(s_ptr + sidx, mask=mask_n, other=0).to(tl.float32)
    if DOUBLE:
        s = s * tl.load(s2_ptr + sidx // 256, mask=mask_n, other=0) + offset
    if HAS_ZEROS:
        bias = tl.load(z_ptr + sidx, mask=mask_n, other=0).to(tl.float32) + 8388608.0
    else:
        bias = tl.full([rows.shape[0]], 8388616.0, tl.float32)  # 2**23 + 8: symmetric zero point
    return s, bias


@triton.jit
def _codes_to_f32(c, code_ptr, bias, FMT: tl.constexpr):
    """4-bit codes (int32) -> unscaled values: ``code[c]`` (lut4) or ``c - zero`` (int4)."""
    if FMT == 2:
        return tl.load(code_ptr + c)
    return _small_int_to_f32(c) - bias[:, None]


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, code_ptr, s2_ptr, offset, out_ptr, N, K, n_groups, ld_q,
                 groups_per_split, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr, DOUBLE: tl.constexpr,
                 SPLIT: tl.constexpr):
    """One row of x; program (n block, k split) adds its partial dot products to fp32 ``out [N]``.

    Weights are read as int32 words (``q_ptr`` is the packed tensor viewed as int32, ``ld_q`` in
    words): 16-byte vector loads, and 4 bytes unpacked per register. Byte j of word w in a group is
    element 4w + j (low nibble) and G/2 + 4w + j (high nibble); for int8 it is element 4w + j.
    Products accumulate elementwise in ``[BLOCK_N, words]`` and are reduced across lanes only once.
    """
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    last = tl.minimum((pid_k + 1) * groups_per_split, n_groups)
    if FMT == 0:  # int8: steps of BLOCK_K columns; the row scale comes at the end
        WORDS: tl.constexpr = BLOCK_K // 4
        w_idx = tl.arange(0, WORDS)
        acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        for t in range(pid_k * groups_per_split, last):
            words = tl.load(q_ptr + rows[:, None] * ld_q + t * WORDS + w_idx[None, :],
                            mask=mask_n[:, None] & (t * BLOCK_K + 4 * w_idx[None, :] < K), other=0)
            for j in tl.static_range(4):
                k = t * BLOCK_K + 4 * w_idx + j
                xk = tl.load(x_ptr + k, mask=k < K, other=0).to(tl.float32)
                u = ((words >> (8 * j)) & 255) ^ 128  # two's complement byte + 128, in [0, 255]
                acc += (_small_int_to_f32(u) - 8388736.0) * xk[None, :]
        out = tl.sum(acc, axis=1) * tl.load(s_ptr + rows, mask=mask_n, other=0)
    else:
        WORDS: tl.constexpr = GROUP // 8
        HALF: tl.constexpr = GROUP // 2
        w_idx = tl.arange(0, WORDS)
        acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        for g in range(pid_k * groups_per_split, last):
            words = tl.load(q_ptr + rows[:, None] * ld_q + g * WORDS + w_idx[None, :], mask=mask_n[:, None], other=0)
            s, bias = _group_scales(s_ptr, z_ptr, s2_ptr, offset, rows, g, n_groups, N, HAS_ZEROS, DOUBLE)
            part = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
            for j in tl.static_range(4):
                k = g * GROUP + 4 * w_idx + j
                x_lo = tl.load(x_ptr + k, mask=k < K, other=0).to(tl.float32)
                x_hi = tl.load(x_ptr + k + HALF, mask=k + HALF < K, other=0).to(tl.float32)
                lo = _codes_to_f32((words >> (8 * j)) & 15, code_ptr, bias, FMT)
                hi = _codes_to_f32((words >> (8 * j + 4)) & 15, code_ptr, bias, FMT)
                part += lo * x_lo[None, :] + hi * x_hi[None, :]
            acc += part * s[:, None]
        out = tl.sum(acc, axis=1)
    if SPLIT == 1:
        tl.store(out_ptr + rows, out, mask=mask_n)
    else:
        tl.atomic_add(out_ptr + rows, out, mask=mask_n, sem="relaxed")


@triton.jit
def _group_codes(q_ptr, s_ptr, z_ptr, code_ptr, s2_ptr, offset, rows, g, n_groups, ld_q, N,
                 FMT: tl.constexpr, HALF: tl.constexpr, HAS_ZEROS: tl.constexpr, DOUBLE: tl.constexpr):
    """Group ``g`` of rows ``rows`` from the byte view: unscaled ``[BLOCK_N, HALF]`` halves and scales."""
    cols = tl.arange(0, HALF)
    b = tl.load(q_ptr + rows[:, None] * ld_q + g * HALF + cols[None, :], mask=(rows < N)[:, None], other=0)
    b = b.to(tl.int32)
    s, bias = _group_scales(s_ptr, z_ptr, s2_ptr, offset, rows, g, n_groups, N, HAS_ZEROS, DOUBLE)
    return _codes_to_f32(b & 15, code_ptr, bias, FMT), _codes_to_f32((b >> 4) & 15, code_ptr, bias, FMT), s


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter's low-precision tl.dot is wrong; fp32 operands hold the same values
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, code_ptr, s2_ptr, offset, out_ptr, M, N, K, n_groups, ld_x, ld_q,
                 groups_per_split, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 DOUBLE: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    """``out [M, N] (fp32) += x [M, K] @ W.T`` over this program's share of K; W dequantized per tile
    to x's dtype right before the tensor-core dot."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dt = x_ptr.dtype.element_ty
    if FMT == 0:
        cols = tl.arange(0, BLOCK_K)
        last = tl.minimum((pid_k + 1) * groups_per_split, n_groups)
        for t in range(pid_k * groups_per_split, last):
            k = t * BLOCK_K + cols
            xt = tl.load(x_ptr + rm[:, None] * ld_x + k[None, :], mask=mask_m[:, None] & (k[None, :] < K), other=0)
            q = tl.load(q_ptr + rows[:, None] * ld_q + k[None, :], mask=(rows[:, None] < N) & (k[None, :] < K),
                        other=0)
            acc += _dot(xt, tl.trans((_small_int_to_f32(q.to(tl.int32) + 128) - 8388736.0).to(dt)), UPCAST)
        acc *= tl.load(s_ptr + rows, mask=rows < N, other=0)[None, :]
    else:
        HALF: tl.constexpr = GROUP // 2
        cols = tl.arange(0, HALF)
        last = tl.minimum((pid_k + 1) * groups_per_split, n_groups)
        for g in range(pid_k * groups_per_split, last):
            k_lo = g * GROUP + cols
            x_lo = tl.load(x_ptr + rm[:, None] * ld_x + k_lo[None, :], mask=mask_m[:, None] & (k_lo[None, :] < K),
                           other=0)
            x_hi = tl.load(x_ptr + rm[:, None] * ld_x + HALF + k_lo[None, :],
                           mask=mask_m[:, None] & (k_lo[None, :] + HALF < K), other=0)
            lo, hi, s = _group_codes(q_ptr, s_ptr, z_ptr, code_ptr, s2_ptr, offset, rows, g, n_groups, ld_q, N,
                                     FMT, HALF, HAS_ZEROS, DOUBLE)
            w_lo = (lo * s[:, None]).to(dt)
            w_hi = (hi * s[:, None]).to(dt)
            acc += _dot(x_lo, tl.trans(w_lo), UPCAST) + _dot(x_hi, tl.trans(w_hi), UPCAST)
    offs = rm[:, None] * N + rows[None, :]
    mask = mask_m[:, None] & (rows[None, :] < N)
    if SPLIT == 1:
        tl.store(out_ptr + offs, acc, mask=mask)
    else:
        tl.atomic_add(out_ptr + offs, acc, mask=mask, sem="relaxed")


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _split(tiles: int, k_steps: int, device, target_waves: float = 2.0) -> tuple[int, int]:
    """(programs along K, K steps per program): enough programs for ``target_waves`` per SM."""
    want = max(1, min(k_steps, int(target_waves * _sm_count(device) / max(tiles, 1) + 0.999)))
    per = -(-k_steps // want)
    return -(-k_steps // per), per


def quant_matmul_triton(x: torch.Tensor, w: PackedWeight, bias=None) -> torch.Tensor:
    """``x [M, K]`` -> ``[M, N]`` in x's dtype, with the Triton kernels."""
    m, k = x.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"quant_matmul: x has {k} features, the weight expects {w.in_features}")
    x = x.contiguous()
    fmt = _FMT_IDS[w.fmt]
    dummy = w.scales
    args = (w.qweight, w.scales, w.zeros if w.zeros is not None else dummy,
            w.code if w.code is not None else dummy, w.scales2 if w.scales2 is not None else dummy,
            float(w.offset))
    flags = dict(FMT=fmt, GROUP=max(w.group_size, 2), HAS_ZEROS=w.zeros is not None, DOUBLE=w.scales2 is not None)
    if m == 1:
        block_n, block_k = (32, 128) if fmt == FMT_INT8 else (64, w.group_size)
        tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
        split, per = _split(tiles, steps, x.device)
        out = (torch.zeros if split > 1 else torch.empty)(1, n, device=x.device, dtype=torch.float32)
        words = w.qweight.view(torch.int32)  # rows of the packed tensor are whole words (see _gemv_kernel)
        _gemv_kernel[(tiles, split)](x, words, *args[1:], out, n, k, steps, words.stride(0), per, BLOCK_N=block_n,
                                     BLOCK_K=block_k, SPLIT=split, **flags, num_warps=4)
    else:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n, block_k = 64, (64 if fmt == FMT_INT8 else w.group_size)
        grid_mn = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        steps = triton.cdiv(k, block_k)
        # Split K only while the M x N tiles alone would leave SMs idle (small M: decode batches).
        split, per = _split(grid_mn[0] * grid_mn[1], steps, x.device, 1.0) if m <= 64 else (1, steps)
        out = (torch.zeros if split > 1 else torch.empty)(m, n, device=x.device, dtype=torch.float32)
        _gemm_kernel[grid_mn + (split,)](x, *args, out, m, n, k, steps, x.stride(0), w.qweight.stride(0), per,
                                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
                                         UPCAST=interpreting(), **flags, num_warps=4, num_stages=3)
    out = out.to(x.dtype)
    return out if bias is None else out + bias
