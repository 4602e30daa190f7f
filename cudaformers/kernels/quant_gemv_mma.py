"""int4 and int8 GEMV on the tensor cores with the weights decoded straight into mma fragments: one
row of bf16 x (decode at batch 1), int4 in groups of 128 or int8 with one scale a row, the plane
packing of ``quant_matmul.py`` as it lies.

Why: at batch 1 the FMA GEMV (``quant_gemv.py``) spends ~3.2 instructions per int4 weight (an AND
and an FMA per code plus the zero point, the scale and the activation's share; sm_90 SASS), and the
``tl.dot`` kernel (``quant_mma.py``) ~2.9, most of it moving tiles through shared memory into the
dot's layout. An H200 streams ~7 G int4 weights per ms, about what its SMs issue at 4-5 instructions
a weight: the kernels are issue-bound, not memory-bound. Here every lane loads the words whose codes
its own ``mma.sync.m16n8k16`` fragment holds, so nothing moves between lanes; ``quant_fragments.py``
has the PTX of a block and how codes become fragments (int4: 8 codes in 7 instructions, the sum of x
for the bias and zero point from one more mma; int8: a byte as two bf16 slots, its low 7 bits and
its sign bit, summing to the signed code, so no bias at all).

A warp owns a 16-row tile (or two, which share x and its pairing); warps of a program take
interleaved blocks of the same rows (split K inside the program, summed at the end). int4 applies
each block's scale and zero point in fp32 as the block ends; int8 carries its sums in the tensor
cores' accumulators and applies the row scale once. Each warp asks for ``DEPTH`` blocks of words ahead
of the one it works on, but in registers ptxas decides where the loads go (``LOADS`` says what it does
and the two ways around it); where every warp has the same number of blocks, ``UNMASKED_EVEN`` drops
the load masks.
``WIDE_LOADS`` makes a row's 16 bytes a lane one read-only load. Measured slower on an H200 and removed
(bench/RESULTS.md run 23): x requested a block ahead like the weights (-10%), and a block's dependent
mmas in two chains an accumulator (-13%: more registers, fewer programs an SM).
``quant_gemv_plans.default_plan`` picks warps, tiles, depth and load mode per GPU, format and layer
size. On an H200 qwen3-8b's layers stream at 1.6-2.5 TB/s (int4) and 2.2-3.2 TB/s (int8), against
1.0-1.5 and 1.8-2.7 for the FMA GEMV (bench/quant_gemv_mma.py, bench/RESULTS.md runs 21-22).

With ``act``, a packed gate/up projection comes out as ``act(gate) * up``: the lane that holds gate row
i also holds up row i (its tile's second half, or its second tile, lies at the up half), so the
epilogue applies the act-and-mul kernel's own arithmetic to the rounded rows and the decode MLP loses
that launch (``quant_gemv_plans.gated_formats``, through ``hub._gated_quant``; the epilogue in
``quant_gemv_epilogues.py``).
The decode layer's RMSNorms folded around these GEMVs (o ending in the residual add and the norm's
shares of ``sum(h^2)``, gate/up scaled by ``1 / rms``) were built and measured slower on an H200
(bench/RESULTS.md run 23: int4 419 -> 409 tok/s, int8 303 -> 294): removed.

On the CPU the tests run the whole kernel through the interpreter with its PTX emulated lane by lane
(tests/ptx_exec.py, the ISA's fragment layouts) against the plain dot product and the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import _code
from .pdl import pdl_enabled, release_dependents, wait_for_producer
from .quant_gemv_epilogues import store_gated, store_rows
from .quant_fragments import INT4_GROUP, INT8_BLOCK, int4_block_asm, int8_block_asm
from .quant_gemv_plans import (DEPTHS, LOADS, ORDERED, PINNED, PINNED_COHERENT, REGISTERS, STAGED, STAGED_WEIGHTS,
                               default_plan)
from .quant_matmul import PackedWeight, interpreting

INT4_ASM = tl.constexpr(int4_block_asm(1))
INT4_ASM2 = tl.constexpr(int4_block_asm(2))
INT8_ASM = tl.constexpr(int8_block_asm(1))
INT8_ASM2 = tl.constexpr(int8_block_asm(2))
FMT_INT4, FMT_INT8 = tl.constexpr(0), tl.constexpr(1)
# How a warp's blocks of weights reach it: the load modes of a plan (``quant_gemv_plans``), bench letters in
# brackets:
# - REGISTERS: loaded DEPTH blocks ahead in the source. But ptxas schedules the loads again, for its
#   registers: in sm_90 SASS (bench/sass_schedule.py, triton 3.6's ptxas 12.8) the next block's loads sit
#   30-50 instructions before their first use whatever the depth, an eighth to a third of a block ahead
#   (int4 gate/up: 0.12 blocks), so each block waits for most of its own latency (the hardware profile
#   of bench/RESULTS.md run 24: 5.9 of 13.1 cycles between a warp's instructions on global loads).
# - STAGED ("s"), STAGED_WEIGHTS ("w"): the pipeliner copies the blocks (with x, or the weights only)
#   into DEPTH + 1 shared-memory stages with cp.async, which holds no registers, so nothing is sunk.
# - PINNED ("p"), PINNED_COHERENT ("c"): in registers, with a CTA-scope fence between the blocks ahead's
#   loads and the block's work. x's loads come after the fence and the work needs them, so the work cannot
#   rise above it. The coherent loads (with int4's scales, ``_ahead``) cannot sink below it: exactly DEPTH
#   blocks ahead in SASS. The read-only ones (PINNED) may, and do on some plans: int4 gate/up 1.00 blocks
#   ahead at 90 registers against 76, int8 8,2,1 0.06. The fence (MEMBAR.ALL.CTA a block and warp) costs
#   nothing measurable on an H100: ORDERED, without it, is within 2% at depths 1-2 (bench/RESULTS.md run 34).
# - ORDERED ("o"): in place of the fence, the weights, int4's scales and x all load as ``ld.relaxed.cta``,
#   which ptxas keeps in program order among themselves (x comes after the blocks ahead, and the work needs
#   x): about the distances of PINNED_COHERENT without a MEMBAR. On an H100 no faster than it (run 34; at
#   depth 3 slower); the H200 has not run it.


def load_constexprs(loads: int) -> dict:
    """A load mode as the kernel's STAGED and PIN."""
    return dict(STAGED={STAGED: 1, STAGED_WEIGHTS: 2}.get(loads, 0),
                PIN={PINNED: 1, PINNED_COHERENT: 2, ORDERED: 3}.get(loads, 0))
# Where every warp has the same number of blocks, load without masks (EVEN in the kernel): 9-18% fewer
# instructions a block in sm_90 SASS, but not faster on an H200 (run 23, qwen3-8b decode: int4 +0.8%
# alone, -2.9% with the gated GEMV and the wide loads; int8 -2.2%). Off.
UNMASKED_EVEN = False
# A lane's 16 bytes of a row as one load (``ld.global.nc.L1::no_allocate.v2.u64``: the read-only path,
# not kept in L1, since each weight is read once) instead of two 8-byte loads, each of which touches half
# of the same two sectors: half the load instructions and requests for the weights (sm_90 SASS:
# LDG.E.NA.128.CONSTANT for LDG.E.64 pairs). qwen3-8b decode on an H200 (run 23): int4 with the gated
# GEMV 425 -> 431 tok/s, int8 308 -> 309.
WIDE_LOADS = True
_LOAD = "ld.global.nc.L1::no_allocate.v2.u64 {$0, $1}, [$2];"
_LOAD_IF = "{ .reg .pred p; setp.ne.b32 p, $3, 0; mov.b64 $0, 0; mov.b64 $1, 0; @p " + _LOAD + " }"
_PAIR, _PAIR_IF = tl.constexpr(_LOAD), tl.constexpr(_LOAD_IF)
# The same loads on the coherent path, which a fence keeps in place (``PIN``).
_PAIR_C, _PAIR_C_IF = tl.constexpr(_LOAD.replace(".nc", "")), tl.constexpr(_LOAD_IF.replace(".nc", ""))
# And as relaxed CTA-scope loads (``ORDERED``), which ptxas does not reorder among themselves.
_RELAXED = _LOAD.replace("ld.global.nc.L1::no_allocate", "ld.relaxed.cta.global.L1::no_allocate")
_PAIR_R, _PAIR_R_IF = tl.constexpr(_RELAXED), tl.constexpr(_LOAD_IF.replace(_LOAD, _RELAXED))
_FENCE = tl.constexpr("fence.acq_rel.cta;\n\tmov.u32 $0, 0;")
_X_LOAD_IF = "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b64 $0, 0; @p ld.global.nc.u64 $0, [$1]; }"
_X_IF, _X_R_IF = tl.constexpr(_X_LOAD_IF), tl.constexpr(_X_LOAD_IF.replace("ld.global.nc", "ld.relaxed.cta.global"))
_HALF_R_IF = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b16 $0, 0; @p ld.relaxed.cta.global.b16 $0, [$1]; }")


@triton.jit
def _pair(at, ok, WIDE: tl.constexpr, EVEN: tl.constexpr, PIN: tl.constexpr = 0):
    """Words ``at[0]`` and ``at[1]`` (int64; 16-byte aligned for WIDE), or where not ``ok`` any value
    (0 when WIDE). PIN 2: on the coherent path; 3: relaxed, always 16 bytes (``PIN``)."""
    if WIDE or PIN == 3:
        if EVEN:  # ok is constant true
            a, b = tl.inline_asm_elementwise(_PAIR_R if PIN == 3 else _PAIR_C if PIN == 2 else _PAIR, "=l,=l,l", [at],
                                             dtype=(tl.int64, tl.int64), is_pure=False, pack=1)
        else:
            a, b = tl.inline_asm_elementwise(_PAIR_R_IF if PIN == 3 else _PAIR_C_IF if PIN == 2 else _PAIR_IF,
                                             "=l,=l,l,r", [at, ok.to(tl.int32)], dtype=(tl.int64, tl.int64),
                                             is_pure=False, pack=1)
    else:
        a = tl.load(at, mask=ok)
        b = tl.load(at + 1, mask=ok)
    return a, b


@triton.jit
def _words(at, ld_q, ok, r1, r2, TILES: tl.constexpr, WIDE: tl.constexpr, EVEN: tl.constexpr, PIN: tl.constexpr = 0):
    """The lane's 4 words of a block in rows g, g + r1 (and g + r2, g + r2 + r1 with two tiles; see
    ``_kernel`` for r1 and r2), as two int64 a row (weights: may be requested before the previous
    kernel has finished). Words of blocks past the row's end need no fill value: they are only ever
    multiplied by x and scales masked to 0, and every bit pattern decodes to a finite bf16."""
    w0, w1 = _pair(at, ok, WIDE, EVEN, PIN)
    w2, w3 = _pair(at + r1 * ld_q, ok, WIDE, EVEN, PIN)
    if TILES == 2:
        w4, w5 = _pair(at + r2 * ld_q, ok, WIDE, EVEN, PIN)
        w6, w7 = _pair(at + (r2 + r1) * ld_q, ok, WIDE, EVEN, PIN)
    else:  # not read
        w4, w5, w6, w7 = w0, w1, w2, w3
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _pinned(xb, like, PIN: tl.constexpr):
    """``xb`` past a fence (PIN > 0), which keeps the loads issued before it ahead of the block's work: x's
    loads, which the work needs, come after it. ``like``: any int32 of the lanes' shape (the asm's operand).
    PIN 3 (``ORDERED``) needs no fence: x's relaxed loads stay after the blocks ahead's."""
    if PIN == 1 or PIN == 2:
        xb += tl.inline_asm_elementwise(_FENCE, "=r,r", [like], dtype=tl.int32, is_pure=False, pack=1)
    return xb


@triton.jit
def _row_words(at, ok):
    """Words ``at[0]`` and ``at[1]`` as one ``[lanes, 2]`` load split in two: the form Triton's pipeliner
    turns into a 16-byte ``cp.async`` into shared memory (``STAGED``); 0 where not ``ok``."""
    pair = tl.load(at[:, None] + tl.arange(0, 2)[None, :], mask=ok[:, None], other=0)
    return tl.split(pair)


@triton.jit
def _staged_words(at, ld_q, ok, r1, r2, TILES: tl.constexpr):
    """``_words`` through the pipeliner's shared-memory stages."""
    w0, w1 = _row_words(at, ok)
    w2, w3 = _row_words(at + r1 * ld_q, ok)
    if TILES == 2:
        w4, w5 = _row_words(at + r2 * ld_q, ok)
        w6, w7 = _row_words(at + (r2 + r1) * ld_q, ok)
    else:  # not read
        w4, w5, w6, w7 = w0, w1, w2, w3
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _half(at, ok, RELAXED: tl.constexpr):
    """One 2-byte value at ``at`` (0 where not ``ok``); RELAXED: as ``ld.relaxed.cta`` (``ORDERED``)."""
    if RELAXED:
        bits = tl.inline_asm_elementwise(_HALF_R_IF, "=h,l,r", [at, ok.to(tl.int32)], dtype=tl.int16, is_pure=False,
                                         pack=1)
        return bits.to(at.dtype.element_ty, bitcast=True)
    else:
        return tl.load(at, mask=ok, other=0)


@triton.jit
def _scale_zero(s_at, z_at, ok, HAS_ZEROS: tl.constexpr, RELAXED: tl.constexpr = False):
    """A row's scale and zero point of one block as stored (0 where not ``ok``; without zero points the
    scale twice, and ``_scaled`` takes 8)."""
    scale = _half(s_at, ok, RELAXED)
    zero = _half(z_at, ok, RELAXED) if HAS_ZEROS else scale
    return scale, zero


@triton.jit
def _scales(s_at, z_at, n_blocks, ok, r1, r2, HAS_ZEROS: tl.constexpr, TILES: tl.constexpr,
            RELAXED: tl.constexpr = False):
    """The lane's rows' scales and zero points of one block (rows as ``_words``), as 8 values."""
    s0, z0 = _scale_zero(s_at, z_at, ok, HAS_ZEROS, RELAXED)
    s1, z1 = _scale_zero(s_at + r1 * n_blocks, z_at + r1 * n_blocks, ok, HAS_ZEROS, RELAXED)
    if TILES == 2:
        s2, z2 = _scale_zero(s_at + r2 * n_blocks, z_at + r2 * n_blocks, ok, HAS_ZEROS, RELAXED)
        s3, z3 = _scale_zero(s_at + (r2 + r1) * n_blocks, z_at + (r2 + r1) * n_blocks, ok, HAS_ZEROS, RELAXED)
    else:  # not read
        s2, z2, s3, z3 = s0, z0, s1, z1
    return s0, z0, s1, z1, s2, z2, s3, z3


@triton.jit
def _scaled(d, xs, scale, zero, HAS_ZEROS: tl.constexpr):
    """``s * (d - (128 + z) * sum(x))``: a row's share of one block, its codes' bias and zero point off."""
    z = zero.to(tl.float32) if HAS_ZEROS else 8.0
    return scale.to(tl.float32) * (d - (128.0 + z) * xs)


@triton.jit
def _ahead(at, s_at, z_at, n_blocks, ld_q, ok, r1, r2, FMT: tl.constexpr, TILES: tl.constexpr, WIDE: tl.constexpr,
           EVEN: tl.constexpr, PIN: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """A block's words (``_words``); pinned on the coherent path, int4's scales and zero points with them
    (16 values), so the fence keeps their loads ahead too (sm_90 SASS, bench/sass_schedule.py: a block or
    more ahead, against 20-40 instructions in place; with read-only loads (PIN 1) they cost the weights
    their lead, int4 gate/up 1.00 -> 0.17 blocks, so there they load in place)."""
    words = _words(at, ld_q, ok, r1, r2, TILES, WIDE, EVEN, PIN)
    if PIN >= 2 and FMT == FMT_INT4:
        words = words + _scales(s_at, z_at, n_blocks, ok, r1, r2, HAS_ZEROS, TILES, PIN == 3)
    return words


@triton.jit
def _x(at, ok, DIRECT: tl.constexpr, RELAXED: tl.constexpr = False):
    """One int64 of x, 0 where not ``ok``; DIRECT: an inline load, which the pipeliner leaves in place
    (x, read by 8 lanes alike, is not worth a shared-memory stage); RELAXED: as ``ld.relaxed.cta``."""
    if DIRECT or RELAXED:
        return tl.inline_asm_elementwise(_X_R_IF if RELAXED else _X_IF, "=l,l,r", [at, ok.to(tl.int32)],
                                         dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.load(at, mask=ok, other=0)


@triton.jit
def _xs(xb, ok, FMT: tl.constexpr, DIRECT: tl.constexpr = False, RELAXED: tl.constexpr = False):
    """The lane's pieces of x for one block (``xb`` at its first 4-element piece, x as int64): 8 for
    int4, 4 for int8; 0 outside the K range (``ok`` false)."""
    if FMT == FMT_INT8:
        return (_x(xb, ok, DIRECT, RELAXED), _x(xb + 4, ok, DIRECT, RELAXED), _x(xb + 8, ok, DIRECT, RELAXED),
                _x(xb + 12, ok, DIRECT, RELAXED))
    else:
        return (_x(xb, ok, DIRECT, RELAXED), _x(xb + 4, ok, DIRECT, RELAXED), _x(xb + 8, ok, DIRECT, RELAXED),
                _x(xb + 12, ok, DIRECT, RELAXED), _x(xb + 16, ok, DIRECT, RELAXED), _x(xb + 20, ok, DIRECT, RELAXED),
                _x(xb + 24, ok, DIRECT, RELAXED), _x(xb + 28, ok, DIRECT, RELAXED))


@triton.jit
def _scaled_at(d, xs, s_at, z_at, ok, HAS_ZEROS: tl.constexpr):
    """``_scaled`` with the row's scale and zero point loaded here (each converted as it loads: the order
    the measured plans compiled with)."""
    scale = tl.load(s_at, mask=ok, other=0).to(tl.float32)
    zero = tl.load(z_at, mask=ok, other=0).to(tl.float32) if HAS_ZEROS else 8.0
    return scale * (d - (128.0 + zero) * xs)


@triton.jit
def _block4(w, x, s_at, z_at, n_blocks, ok, acc, r1, r2, HAS_ZEROS: tl.constexpr, TILES: tl.constexpr,
            PRELOADED: tl.constexpr):
    """``acc += s * (w - z) . x`` over one int4 block for the lane's rows (as ``_words``); ``x`` the
    lane's pieces of x (``_xs``), ``s_at``/``z_at`` at row g's scale (zero point) of the block, loaded
    here unless ``w`` brings them (PRELOADED: ``_ahead`` pinned on the coherent path)."""
    if TILES == 2:
        d0, d1, d2, d3, xs = tl.inline_asm_elementwise(
            INT4_ASM2, "=f,=f,=f,=f,=f" + ",l" * 16,
            [w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        if PRELOADED:
            acc2 = acc[2] + _scaled(d2, xs, w[12], w[13], HAS_ZEROS)
            acc3 = acc[3] + _scaled(d3, xs, w[14], w[15], HAS_ZEROS)
        else:
            acc2 = acc[2] + _scaled_at(d2, xs, s_at + r2 * n_blocks, z_at + r2 * n_blocks, ok, HAS_ZEROS)
            acc3 = acc[3] + _scaled_at(d3, xs, s_at + (r2 + r1) * n_blocks, z_at + (r2 + r1) * n_blocks, ok,
                                       HAS_ZEROS)
    else:
        d0, d1, xs = tl.inline_asm_elementwise(
            INT4_ASM, "=f,=f,=f" + ",l" * 12,
            [w[0], w[1], w[2], w[3], x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]],
            dtype=(tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        acc2, acc3 = acc[2], acc[3]
    if PRELOADED:
        acc0 = acc[0] + _scaled(d0, xs, w[8], w[9], HAS_ZEROS)
        acc1 = acc[1] + _scaled(d1, xs, w[10], w[11], HAS_ZEROS)
    else:
        acc0 = acc[0] + _scaled_at(d0, xs, s_at, z_at, ok, HAS_ZEROS)
        acc1 = acc[1] + _scaled_at(d1, xs, s_at + r1 * n_blocks, z_at + r1 * n_blocks, ok, HAS_ZEROS)
    return acc0, acc1, acc2, acc3


@triton.jit
def _block8(w, x, acc, TILES: tl.constexpr):
    """``acc += q . x`` over one int8 block for the lane's rows, through the tensor cores' accumulators
    (the row scale comes at the end); ``x`` as in ``_block4`` (0 outside the K range)."""
    if TILES == 2:
        acc0, acc1, acc2, acc3 = tl.inline_asm_elementwise(
            INT8_ASM2, "=f,=f,=f,=f,f,f,f,f" + ",l" * 12,
            [acc[0], acc[1], acc[2], acc[3], w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], x[0], x[1], x[2],
             x[3]], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        acc0, acc1 = tl.inline_asm_elementwise(
            INT8_ASM, "=f,=f,f,f" + ",l" * 8, [acc[0], acc[1], w[0], w[1], w[2], w[3], x[0], x[1], x[2], x[3]],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        acc2, acc3 = acc[2], acc[3]
    return acc0, acc1, acc2, acc3


@triton.jit
def _block(w, x, s_at, z_at, n_blocks, ok, acc, r1, r2, FMT: tl.constexpr, HAS_ZEROS: tl.constexpr,
           TILES: tl.constexpr, PRELOADED: tl.constexpr = False):
    if FMT == FMT_INT8:
        return _block8(w, x, acc, TILES)
    else:
        return _block4(w, x, s_at, z_at, n_blocks, ok, acc, r1, r2, HAS_ZEROS, TILES, PRELOADED)


@triton.jit
def _rotating(at, xb, s_at, z_at, n_blocks, ld_q, warp, steps, r1, r2, acc, FMT: tl.constexpr, WARPS: tl.constexpr,
              TILES: tl.constexpr, DEPTH: tl.constexpr, HAS_ZEROS: tl.constexpr, EVEN: tl.constexpr,
              USE_PDL: tl.constexpr, WIDE: tl.constexpr, PIN: tl.constexpr):
    """A warp's blocks with DEPTH blocks of words in flight in registers."""
    X_STEP: tl.constexpr = 32 if FMT == FMT_INT4 else 16
    if EVEN:
        ok = tl.full([32 * WARPS], 1, tl.int1)
    else:
        ok = warp < n_blocks
    words = _ahead(at, s_at, z_at, n_blocks, ld_q, ok, r1, r2, FMT, TILES, WIDE, EVEN, PIN, HAS_ZEROS)
    ok_1, words_1 = ok, words  # the next block (DEPTH >= 2)
    ok_2, words_2 = ok, words  # the one after (DEPTH 3)
    if DEPTH >= 2:
        if not EVEN:
            ok_1 = warp + WARPS < n_blocks
        words_1 = _ahead(at + 8 * WARPS, s_at + WARPS, z_at + WARPS, n_blocks, ld_q, ok_1, r1, r2, FMT, TILES, WIDE,
                         EVEN, PIN, HAS_ZEROS)
    if DEPTH == 3:
        if not EVEN:
            ok_2 = warp + 2 * WARPS < n_blocks
        words_2 = _ahead(at + 16 * WARPS, s_at + 2 * WARPS, z_at + 2 * WARPS, n_blocks, ld_q, ok_2, r1, r2, FMT,
                         TILES, WIDE, EVEN, PIN, HAS_ZEROS)
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    # The blocks in flight rotate through DEPTH + 1 sets of registers: unrolled DEPTH + 1 times (pinned on
    # the coherent path) no words move between them, which ptxas would otherwise place after the loads
    # and so wait on them; the other modes keep the unrolling they were measured with (DEPTH).
    for step in tl.range(1, steps, loop_unroll_factor=DEPTH + 1 if PIN >= 2 else DEPTH):
        if EVEN:
            ahead_ok = ok
            blocks_on = tl.where(step + DEPTH - 1 < steps, WARPS * DEPTH, 0)
            ahead = _ahead(at + 8 * blocks_on, s_at + blocks_on, z_at + blocks_on, n_blocks, ld_q, ahead_ok, r1, r2,
                           FMT, TILES, WIDE, EVEN, PIN, HAS_ZEROS)
        else:
            ahead_ok = warp + (step + DEPTH - 1) * WARPS < n_blocks
            ahead = _ahead(at + 8 * WARPS * DEPTH, s_at + WARPS * DEPTH, z_at + WARPS * DEPTH, n_blocks, ld_q,
                           ahead_ok, r1, r2, FMT, TILES, WIDE, EVEN, PIN, HAS_ZEROS)
        acc = _block(words, _xs(_pinned(xb, warp, PIN), ok, FMT, False, PIN == 3), s_at, z_at, n_blocks, ok, acc, r1,
                     r2, FMT, HAS_ZEROS, TILES, PIN >= 2)
        if DEPTH == 3:
            words, ok, words_1, ok_1, words_2, ok_2 = words_1, ok_1, words_2, ok_2, ahead, ahead_ok
        elif DEPTH == 2:
            words, ok, words_1, ok_1 = words_1, ok_1, ahead, ahead_ok
        else:
            words, ok = ahead, ahead_ok
        at += 8 * WARPS
        xb += X_STEP * WARPS
        s_at += WARPS
        z_at += WARPS
    acc = _block(words, _xs(xb, ok, FMT, False, PIN == 3), s_at, z_at, n_blocks, ok, acc, r1, r2, FMT, HAS_ZEROS, TILES,
                 PIN >= 2)
    return acc


@triton.jit
def _kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, n_blocks, ld_q, half, FMT: tl.constexpr, WARPS: tl.constexpr,
            TILES: tl.constexpr, DEPTH: tl.constexpr,
            HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr,
            USE_PDL: tl.constexpr, WIDE: tl.constexpr, STAGED: tl.constexpr, PIN: tl.constexpr):
    # WIDE: each row's 16 bytes a lane as one load (``WIDE_LOADS``). STAGED: a block's weights (1: and its
    # x; 2: not x) reach it through DEPTH + 1 pipeliner stages in shared memory (``cp.async``) instead of
    # registers. PIN: a fence a block between the loads ahead and the work (1: read-only loads, 2: coherent).
    # GATED >= 0, an activation code: act(gate) * up of a packed gate/up (quant_gemv_epilogues.py).
    # One element per lane: [32 * WARPS] tensors are laid out one per thread, element e on thread e.
    e = tl.arange(0, 32 * WARPS)
    lane = e % 32
    warp = e // 32  # warp w takes blocks w, w + WARPS, ...
    t = lane % 4
    # Lane (g, t) holds rows g and g + r1 of each tile, and the second tile lies r2 rows past the first.
    # Plain: 16-row tiles (r1 = 8, r2 = 16). Gated (GATED, an activation code), gate row i's partner is
    # up row half + i: one tile pairs 8 gate rows with their up rows (r1 = half), two tiles pair 16
    # (r2 = half); either way each lane holds both halves of its output rows.
    if GATED >= 0:
        if TILES == 1:
            r1 = half
            r2 = 16  # unused
        else:
            r1 = 8
            r2 = half
        row0 = tl.program_id(0) * 8 * TILES
    else:
        r1 = 8
        r2 = 16
        row0 = tl.program_id(0) * 16 * TILES
    row_g = row0 + lane // 4
    # Pointers at the warp's first block, moved on by WARPS blocks a step: 8 int64 of words a row (both
    # formats: 64 bytes), the block's x as 4 bf16 per int64 (piece j of the lane at 4j + t), int4's
    # scale (zero point) of the block a row.
    X_STEP: tl.constexpr = 32 if FMT == FMT_INT4 else 16
    at = q_ptr + row_g.to(tl.int64) * ld_q + warp * 8 + 2 * t
    xb = x_ptr + warp * X_STEP + t
    s_at = s_ptr + row_g * n_blocks + warp
    z_at = z_ptr + row_g * n_blocks + warp
    zero = tl.zeros([32 * WARPS], tl.float32)
    acc = (zero, zero, zero, zero)
    # DEPTH blocks of words in flight while a block is worked on (weights: requested before the wait).
    # EVEN: every warp has the same number of blocks, at least DEPTH: no load needs a mask (a constant
    # true one folds away, and with it the register fills of masked loads); the blocks "ahead" of the
    # last ones re-read the current block instead of reading past the row.
    steps = tl.cdiv(n_blocks, WARPS)
    if STAGED:
        wait_for_producer(USE_PDL)
        release_dependents(USE_PDL)
        for step in tl.range(0, steps, num_stages=DEPTH + 1):
            ok = warp + step * WARPS < n_blocks
            words = _staged_words(at + step * 8 * WARPS, ld_q, ok, r1, r2, TILES)
            xs = _xs(xb + step * X_STEP * WARPS, ok, FMT, STAGED == 2)
            acc = _block(words, xs, s_at + step * WARPS, z_at + step * WARPS, n_blocks, ok, acc, r1, r2, FMT, HAS_ZEROS,
                         TILES)
    else:
        acc = _rotating(at, xb, s_at, z_at, n_blocks, ld_q, warp, steps, r1, r2, acc, FMT, WARPS, TILES, DEPTH,
                        HAS_ZEROS, EVEN, USE_PDL, WIDE, PIN)
    ROW_SCALE: tl.constexpr = FMT == FMT_INT8
    if GATED >= 0:
        if TILES == 1:
            store_gated(acc[0], acc[1], s_ptr, b_ptr, out_ptr, row0, half, WARPS, ROW_SCALE, HAS_BIAS, GATED)
        else:
            store_gated(acc[0], acc[2], s_ptr, b_ptr, out_ptr, row0, half, WARPS, ROW_SCALE, HAS_BIAS, GATED)
            store_gated(acc[1], acc[3], s_ptr, b_ptr, out_ptr, row0 + 8, half, WARPS, ROW_SCALE, HAS_BIAS, GATED)
    else:
        store_rows(acc[0], s_ptr, b_ptr, out_ptr, row0, WARPS, ROW_SCALE, HAS_BIAS)
        store_rows(acc[1], s_ptr, b_ptr, out_ptr, row0 + 8, WARPS, ROW_SCALE, HAS_BIAS)
        if TILES == 2:
            store_rows(acc[2], s_ptr, b_ptr, out_ptr, row0 + 16, WARPS, ROW_SCALE, HAS_BIAS)
            store_rows(acc[3], s_ptr, b_ptr, out_ptr, row0 + 24, WARPS, ROW_SCALE, HAS_BIAS)

def supports(x: torch.Tensor, w: PackedWeight) -> bool:
    """One row of bf16 x on a GPU with bf16 mma (sm_80+), whole 16-row tiles, and int4 in groups of 128
    (single-level scales) or int8 whose K is whole 64-element blocks (x is read 4 elements at a time,
    nothing past K); not under the interpreter, which cannot run PTX."""
    fmt_ok = ((w.fmt == "int4" and w.group_size == INT4_GROUP and w.scales2 is None) or
              (w.fmt == "int8" and w.scales.dtype == torch.float32))
    return (fmt_ok and x.is_cuda and not interpreting() and x.dtype == torch.bfloat16 and x.dim() == 2
            and x.shape[0] == 1 and x.stride(1) == 1 and x.data_ptr() % 16 == 0 and w.out_features % 16 == 0
            and w.in_features == w.n_blocks * w.block and w.qweight.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device)[0] >= 8)


def _check(x: torch.Tensor, w: PackedWeight) -> None:
    if not supports(x, w):
        raise ValueError(f"quant_gemv_mma: needs one contiguous row of bf16 x on a GPU of compute capability 8.0+, "
                         f"whole 16-row tiles, and int4 weights in groups of {INT4_GROUP} or int8 with K a multiple "
                         f"of {INT8_BLOCK}; got x {tuple(x.shape)} {x.dtype} on {x.device}, {w.fmt} (group "
                         f"{w.group_size}) of {w.out_features} x {w.in_features}")


def quant_gemv_mma(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
                   plan: tuple | None = None, act: str | None = None) -> torch.Tensor:
    """``x [1, K]`` bf16 -> ``[1, N]`` bf16, bias added; see ``supports``. ``plan`` (warps, tiles a warp,
    blocks in flight: one of ``DEPTHS``[, how they load: one of ``LOADS``]) overrides ``default_plan``
    (benchmarks, tests).

    With ``act`` (an ``activation.KERNEL_ACTIVATIONS`` name), ``w`` is a packed gate/up projection
    (gate rows, then as many up rows) and the result is ``act(gate) * up``, ``[1, N / 2]``: bit for bit
    the packed output passed through the act-and-mul kernel, without that launch. Each program does
    the work of the plain plan's program (8 or 16 output rows from as many gate and up rows)."""
    _check(x, w)
    return _launch(x, w, bias, plan or default_plan(w.out_features, w.fmt, x.device), act)


def _launch(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, plan: tuple, act: str | None = None):
    """The launch behind ``quant_gemv_mma``, past its checks of the device (the tests run it on the CPU
    through the interpreter, with the PTX emulated)."""
    n = w.out_features
    warps, per_warp, depth, *mode = plan
    loads = int(mode[0]) if mode else REGISTERS
    gated = -1 if act is None else _code(act)
    rows_out, rows_a_program = (n, 16 * per_warp) if act is None else (n // 2, 8 * per_warp)
    if rows_out % rows_a_program or depth not in DEPTHS or loads not in LOADS:
        what = "" if act is None else f" (gated: {per_warp} x 8 of the {n // 2} output rows a program)"
        raise ValueError(f"quant_gemv_mma: {per_warp} tiles of 16 rows a warp for {n} rows{what}, depth {depth} "
                         f"(one of {DEPTHS}), loads {loads} (one of {LOADS})")
    words = w.qweight.view(torch.int64)
    out = torch.empty(1, rows_out, device=x.device, dtype=x.dtype)
    pdl = pdl_enabled(x.device)
    zeros = w.zeros if w.zeros is not None else w.scales  # not read without zero points
    _kernel[(rows_out // rows_a_program,)](
        x.view(torch.int64), words, w.scales, zeros, bias if bias is not None else out, out, w.n_blocks,
        words.stride(0), n // 2, FMT=FMT_INT8 if w.fmt == "int8" else FMT_INT4, WARPS=warps, TILES=per_warp,
        DEPTH=depth, HAS_ZEROS=w.zeros is not None, HAS_BIAS=bias is not None,
        EVEN=UNMASKED_EVEN and w.n_blocks % warps == 0 and w.n_blocks >= depth * warps, GATED=gated, USE_PDL=pdl,
        WIDE=WIDE_LOADS, **load_constexprs(loads), num_warps=warps, launch_pdl=pdl)
    return out
