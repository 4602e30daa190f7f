"""Tensor-core dequantize-matmul for a few rows of x (decode, M <= 16): int4 and int8 weights.

At one token per step a quantized layer is worth its packed bytes, and a 4-bit weight arrives every
~0.1 ns on an H200: the kernel may spend about one instruction per code. The FMA GEMV
(``quant_gemv.py``) spends an AND and an FMA per code plus the activation's share, and measured
30-40% of the bandwidth for int4 (bench/RESULTS.md run 8). Here a code costs ~1.5 instructions and
the products go to the tensor cores:

* Codes become 16-bit floats two at a time (inline PTX). ``prmt`` puts the same 16 bits of two
  words side by side in one register; ``lop3`` keeps one code in each half and ORs in the exponent
  of 2**7 (bf16) or 2**10 (fp16), so each half reads exactly ``2**7 + c`` (``2**10 + c``); one packed
  ``fma`` takes off that offset plus the zero point. The interpreter, which cannot run PTX, computes
  the same values with plain Triton ops.
* With the plane packing (``quant_matmul.py``) plane ``j`` of a block's W words multiplies W
  *contiguous* activations, so each plane is one ``[BLOCK_N, W] x [W, 16]`` tensor-core product with x
  read as it lies. x is padded to 16 rows (the smallest dot); the tensor cores have ~50x the
  throughput decode needs, so the padding costs nothing that shows.
* int8 codes (-128..127) need 8 significant bits plus sign, which bf16 lacks: int8 is served for fp16
  x only. (Rescaling a bf16 x per row into fp16 inside the kernel measured 3-10x slower than the FMA
  GEMV: the scaled x no longer streams straight into shared memory.)

Per block the partial products are scaled (int4: per group, with ``z * sum(x)`` off for stored zero
points) and summed in fp32; the output is written once in x's dtype, bias added.

Serves int4 with groups of 128 or more (a plane must be >= 16 codes wide for the dot) for bf16 and
fp16 x, and int8 for fp16 x; everything else (NF4/FP4, small groups, fp32 x) runs the kernels of
``quant_gemv.py`` / ``quant_matmul.py``. ``supports`` says which.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters
from .grid import cdiv
from .pdl import pdl_enabled, release_dependents, wait_for_producer
from .quant_matmul import FMT_INT4, FMT_INT8, _FMT_IDS, PackedWeight, interpreting, sm_count

logger = logging.getLogger("cudaformers")

MAX_ROWS = 16  # rows of x: one 16-row tensor-core tile
_warned_capture: list[bool] = []


@functools.lru_cache(maxsize=None)
def _unpack_asm(bits: int, fp16: bool, zero: int) -> str:
    """PTX turning two int32 words ($P, $P+1) into their ``32 / bits`` planes, each a register of two
    16-bit floats ``code - zero`` (int8: the signed code). See the module docstring."""
    planes = 32 // bits
    one = 0x3C003C00 if fp16 else 0x3F803F80
    # The offset the OR put in (2**10 or 2**7) plus the zero point, negated, in both halves. int8 runs
    # in fp16 only, and its LOP3 also flips the sign bit (byte q reads 1024 + q + 128, zero is 128).
    off = _f16_bits(-(1024 + zero)) if fp16 else _bf16_bits(-(128 + zero))
    a, b = f"${planes}", f"${planes + 1}"
    lines = ["{", ".reg .b32 lo, hi, t, one, off;", f"mov.b32 one, {one:#010x};",
             f"mov.b32 off, {off * 0x10001:#010x};"]
    if bits == 4:
        magic = 0x64006400 if fp16 else 0x43004300
        lines += [f"prmt.b32 lo, {a}, {b}, 0x5410;", f"prmt.b32 hi, {a}, {b}, 0x7632;"]
        for j in range(planes):
            src = "lo" if j < 4 else "hi"
            shift = 4 * (j % 4)
            if shift:
                lines.append(f"shr.u32 t, {src}, {shift};")
            # (t & 0x000f000f) | magic: LUT 0xEA = (a & b) | c
            lines.append(f"lop3.b32 t, {'t' if shift else src}, 0x000f000f, {magic:#010x}, 0xea;")
            lines.append(f"fma.rn.{'f16x2' if fp16 else 'bf16x2'} ${j}, t, one, off;")
    else:
        for j in range(planes):
            # byte j of each word into the low byte of each half; LUT 0x6A = b ? (a ^ c) : c keeps
            # the low byte with its sign bit flipped (c = 0x80 there) and puts 0x64 above it
            lines.append(f"prmt.b32 t, {a}, {b}, {((4 + j) << 8) | j:#06x};")
            lines.append("lop3.b32 t, t, 0x00ff00ff, 0x64806480, 0x6a;")
            lines.append(f"fma.rn.f16x2 ${j}, t, one, off;")
    return "\n".join(lines + ["}"])


def _f16_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float16).view(torch.int16).item()) & 0xFFFF


def _bf16_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF


# All planes of ``words`` ``[BLOCK_N, W]`` at once, by the PTX of ``_unpack_asm``. One function per
# output dtype: Triton wants one return type per function, and a tuple of a constexpr dtype does not compile.
@triton.jit
def _unpack_int8(words, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [words], is_pure=True, pack=2,
                                     dtype=(tl.float16, tl.float16, tl.float16, tl.float16))


@triton.jit
def _unpack_int4_f16(words, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [words], is_pure=True, pack=2,
                                     dtype=(tl.float16, tl.float16, tl.float16, tl.float16,
                                            tl.float16, tl.float16, tl.float16, tl.float16))


@triton.jit
def _unpack_int4_bf16(words, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [words], is_pure=True, pack=2,
                                     dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                                            tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16))


@triton.jit
def _plane(words, unpacked, J: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr, DT: tl.constexpr,
           ASM: tl.constexpr):
    """Plane J of ``words`` ``[BLOCK_N, W]`` as ``code - ZERO`` in DT (int8: the signed code); with
    ASM, taken from ``unpacked`` (``_unpack``), else computed with plain ops (the interpreter)."""
    if ASM != "":
        return unpacked[J]
    code = (words >> (J * BITS)) & ((1 << BITS) - 1)
    if BITS == 8:
        code = code ^ 128  # two's complement byte -> q + 128
    return (code.to(tl.float32) - ZERO).to(DT)


@triton.jit
def _block_product(x_rows, q_rows, s_ptr, z_ptr, rows, row_ok, m_ok, blk, end, K, n_blocks, BITS: tl.constexpr,
                   BLOCK: tl.constexpr, W: tl.constexpr, HAS_ZEROS: tl.constexpr, DT: tl.constexpr,
                   ZERO: tl.constexpr, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, UPCAST: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """Block ``blk``'s share of ``W @ x^T`` ``[BLOCK_N, 16]`` in fp32: int4 scaled (and zero-corrected),
    int8 unscaled (its scale is per row, applied once at the end)."""
    PLANES: tl.constexpr = 32 // BITS
    wi = tl.arange(0, W)
    if not EVEN_K:  # past the program's last block (the step's blocks overhang): nothing loaded or added
        row_ok = row_ok & (rows * 0 + blk < end)
    words = tl.load(q_rows + blk * W, mask=row_ok[:, None], other=0)  # [BLOCK_N, W] int32
    unpacked = words
    if ASM != "":
        if BITS == 8:
            unpacked = _unpack_int8(words, ASM, CONSTRAINTS)
        elif DT == tl.float16:
            unpacked = _unpack_int4_f16(words, ASM, CONSTRAINTS)
        else:
            unpacked = _unpack_int4_bf16(words, ASM, CONSTRAINTS)
    part = tl.zeros([rows.shape[0], 16], tl.float32)
    xsum = tl.zeros([16], tl.float32)
    for j in tl.static_range(PLANES):
        k = blk * BLOCK + j * W + wi
        if EVEN_K:
            xt = tl.load(x_rows + k[:, None], mask=m_ok[None, :], other=0)  # x^T [W, 16]
        else:
            xt = tl.load(x_rows + k[:, None], mask=m_ok[None, :] & (k < K)[:, None], other=0)
        if HAS_ZEROS:
            xsum += tl.sum(xt.to(tl.float32), 0)
        a = _plane(words, unpacked, j, BITS, ZERO, DT, ASM)
        if UPCAST:  # the interpreter's 16-bit tl.dot is wrong; fp32 operands hold the same values
            part = tl.dot(a.to(tl.float32), xt.to(tl.float32), part, input_precision="ieee")
        else:
            part = tl.dot(a, xt, part)
    if BITS == 8:
        return part
    s = tl.load(s_ptr + rows * n_blocks + blk, mask=row_ok, other=0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + rows * n_blocks + blk, mask=row_ok, other=0).to(tl.float32)
        part -= z[:, None] * xsum[None, :]
    return part * s[:, None]


@triton.jit
def _mma_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, arrived_ptr, M, N, K, n_blocks, per_split,
                ld_x, ld_q, BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                SPLIT: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr,
                ZERO: tl.constexpr, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, UPCAST: tl.constexpr,
                EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    """``out [M, N] = x [M, K] @ W.T (+ b)`` for M <= 16; ``q_ptr`` the packed weight as int32 words.

    Each step works on GROUPS blocks, each loaded on its own: the software pipeline keeps
    ``(num_stages - 1) * GROUPS`` of them in flight. A layer with few rows for its length (o and down
    projections) also splits its blocks over SPLIT programs per row tile: each writes its fp32 partial
    ``part_ptr [SPLIT, M, N]``, counts its arrival, and the last to arrive sums the partials in split
    order (deterministic), writes the output and resets the counter, all in this launch."""
    W: tl.constexpr = BLOCK * BITS // 32
    tile = tl.program_id(0)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    mi = tl.arange(0, 16)
    m_ok = mi < M
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * tl.multiple_of(ld_q, W) + tl.arange(0, W)[None, :]
    x_rows = x_ptr + mi[None, :] * ld_x  # x^T: [1, 16]
    start = tl.program_id(1) * per_split
    end = tl.minimum(start + per_split, n_blocks)
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for b0 in range(start, end, GROUPS):
        for g in tl.static_range(GROUPS):
            acc += _block_product(x_rows, q_rows, s_ptr, z_ptr, rows, row_ok, m_ok, b0 + g, end, K, n_blocks, BITS,
                                  BLOCK, W, HAS_ZEROS, DT, ZERO, ASM, CONSTRAINTS, UPCAST, EVEN_K)
    offs = mi[None, :].to(tl.int64) * N + rows[:, None]
    mask = row_ok[:, None] & m_ok[None, :]
    if SPLIT > 1:
        tl.store(part_ptr + tl.program_id(1) * M * N + offs, acc, mask=mask)
        # The partial is stored before the arrival is counted (barrier, then a release at GPU scope);
        # the last arrival acquires every partial before reading them.
        tl.debug_barrier()
        counter = arrived_ptr + tile
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") != SPLIT - 1:
            return
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
        for split in range(SPLIT):  # .cg: written by other programs, maybe on other SMs
            acc += tl.load(part_ptr + split * M * N + offs, mask=mask, other=0, cache_modifier=".cg")
        tl.store(counter, 0)  # ready for the next launch, which stream order puts after this one
    if BITS == 8:
        acc *= tl.load(s_ptr + rows, mask=row_ok, other=0).to(tl.float32)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0).to(tl.float32)[:, None]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor, w: PackedWeight) -> bool:
    """Whether ``quant_mma`` serves this call: 1-16 rows of x, int4 in groups of >= 128 with bf16 or
    fp16 x, int8 with fp16 x."""
    if x.dtype != torch.float16 and not (w.fmt == "int4" and x.dtype == torch.bfloat16):
        return False
    return 1 <= x.shape[0] <= MAX_ROWS and w.block * w.bits // 32 >= 16 and w.scales2 is None


def preferred(x: torch.Tensor, w: PackedWeight) -> bool:
    """Whether a call ``supports`` serves is faster here than on the FMA GEMV (``quant_gemv.py``):
    always for 2-16 rows; for one row only where the default tiling makes at least two programs per
    SM. qwen3-8b's o projection (4096 x 4096) gets 256 on an H200's 132 SMs and measured 8.2-8.7 us
    here against 7.3-7.4 on the FMA GEMV (bench/RESULTS.md runs 13 and 14, int4); q/k/v (384
    programs), gate/up (768) and down (512) are faster here."""
    if x.shape[0] > 1:
        return True
    n = w.out_features
    block_n, _, split, _, _ = default_tiles(n, w.n_blocks, x.device, 1)
    return cdiv(n, block_n) * split >= 2 * sm_count(x.device)


def default_tiles(n: int, n_blocks: int, device: torch.device, rows: int = MAX_ROWS) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, GROUPS, SPLIT, num_warps, num_stages): 32-row tiles of two blocks a step, four stages,
    two warps; the blocks split over programs until there are 1.5 per SM, each split keeping at
    least 16 blocks. Swept on qwen3-8b's layers at M = 1 and 16 (bench/quant.py --parts mma, H200,
    bench/RESULTS.md runs 13 and 14): this picks the best measured split for q/k/v (2), o (2) and
    gate/up (1) at both M, and for down (2) at M = 16.

    One row of x against long rows of weights (64 blocks or more, down at 12,288 features) takes four
    blocks a step over three stages and four splits: 15.7 us against 18.8-21.3 for the rule above
    (three runs); at 16 rows the rule above stays best there."""
    block_n, groups = 32, 2
    if rows == 1 and n_blocks >= 64:
        return block_n, 4, 4, 2, 3
    tiles = cdiv(n, block_n)
    split = 1
    while 2 * tiles * split < 3 * sm_count(device) and n_blocks // (2 * split) >= 16:
        split *= 2
    return block_n, groups, split, 2, 4


def quant_mma(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
              tiles: tuple[int, int, int, int, int] | None = None, use_asm: bool | None = None) -> torch.Tensor:
    """``x [M, K]`` (M <= 16) -> ``[M, N]`` in x's dtype, bias added, one launch. ``tiles`` overrides
    ``default_tiles`` and ``use_asm=False`` the PTX unpack (benchmarks, tests)."""
    if not supports(x, w):
        raise ValueError(f"quant_mma: {w.fmt} weights in blocks of {w.block} with {x.shape[0]} rows of {x.dtype} x "
                         f"are not served here; quant_matmul_triton picks the right kernel")
    m, k = x.shape
    n = w.out_features
    fmt = _FMT_IDS[w.fmt]
    bits = w.bits
    fp16 = x.dtype == torch.float16
    has_zeros = fmt == FMT_INT4 and w.zeros is not None
    zero = 128 if fmt == FMT_INT8 else (0 if has_zeros else 8)
    if use_asm is None:
        use_asm = not interpreting()
    asm = _unpack_asm(bits, fp16, zero) if use_asm else ""
    words = w.qweight.view(torch.int32)
    n_blocks = w.n_blocks
    block_n, groups, split, warps, stages = tiles or default_tiles(n, n_blocks, x.device, m)
    # Each split gets whole steps of GROUPS blocks; a split left without blocks is dropped.
    per_split = cdiv(cdiv(n_blocks, split), groups) * groups
    split = cdiv(n_blocks, per_split)
    n_tiles = cdiv(n, block_n)
    arrived = arrival_counters(x.device, n_tiles) if split > 1 else None
    if split > 1 and arrived is None:  # inside a CUDA-graph capture that would have to make the counters
        if not _warned_capture:
            _warned_capture.append(True)
            logger.warning("quant_mma: a CUDA graph captured before any eager call has no split counters, so "
                           "its quantized matmuls run unsplit (slower for long layers with few rows); run one "
                           "step before capturing")
        split, per_split = 1, cdiv(n_blocks, groups) * groups
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    pdl = pdl_enabled(x.device)
    _mma_kernel[(n_tiles, split)](
        x, words, w.scales, w.zeros if has_zeros else w.scales, bias if bias is not None else out, out, part,
        arrived if arrived is not None else words, m, n, k, n_blocks, per_split, x.stride(0), words.stride(0),
        BITS=bits, BLOCK=w.block, BLOCK_N=block_n, GROUPS=groups, SPLIT=split, HAS_ZEROS=has_zeros,
        HAS_BIAS=bias is not None, DT=tl.float16 if fp16 else tl.bfloat16, ZERO=zero, ASM=asm,
        CONSTRAINTS="=r," * (32 // bits) + "r,r", UPCAST=interpreting(),
        EVEN_K=k == n_blocks * w.block and per_split * split == n_blocks, USE_PDL=pdl, num_warps=warps,
        num_stages=stages, launch_pdl=pdl)
    return out
