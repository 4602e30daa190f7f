"""int4 GEMV on the tensor cores with the weights decoded straight into mma fragments: one row of
bf16 x (decode at batch 1), groups of 128, the plane packing of ``quant_matmul.py`` as it lies.

Why: at batch 1 the FMA GEMV (``quant_gemv.py``) spends ~3.2 instructions per int4 weight (an AND
and an FMA per code plus the zero point, the scale and the activation's share; sm_90 SASS), and the
``tl.dot`` kernel (``quant_mma.py``) ~2.9, most of it moving tiles through shared memory into the
dot's layout. An H200 streams ~7 G int4 weights per ms, about what its SMs issue at 4-5 instructions
a weight: the kernels are issue-bound, not memory-bound. Here every lane loads the words whose codes
its own ``mma.sync.m16n8k16`` fragment holds, so nothing moves between lanes:

* A warp owns a 16-row tile. Lane ``(g, t)`` (``g = lane // 4``, ``t = lane % 4``) holds rows ``g``
  and ``g + 8``; of each block's 16 words per row it loads words ``4t .. 4t + 3``. Word ``i``'s code
  ``j`` is element ``16 j + i`` of the block, and codes ``p`` and ``p + 4`` sit 16 bits apart, so one
  ``lop3`` of the word shifted by ``4 p`` yields a register of two bf16 ``128 + code`` (the exponent
  of 2**7 ORed in): an A fragment pair, 8 codes in 7 instructions.
* An mma contracts 16 "slots"; which element of the block a slot stands for is free, as long as A
  and B agree. Lane ``(g, t)``'s slots ``2t, 2t + 1, 2t + 8, 2t + 9`` stand for the elements of its own
  codes, the same for every ``g``; its B fragment is x at those elements (two ``prmt`` pick them from
  the 8-byte pieces of x it loads), identical in all 8 columns, so each output column is the row's
  dot product. 8 mmas cover a block; 8 more with A = 1 give ``sum(x)`` over the block in fp32.
* Per block: ``s * (sum((128 + q) x) - (128 + z) sum(x))``, in fp32. Products are exact (bf16
  inputs), the bias costs ~7 of fp32's 24 bits of the sum: far below the bf16 output's rounding.

~1.3 instructions a weight in all (sm_90 SASS; ``tests/test_kernels_quant_gemv_mma.py``). Warps of a
program take interleaved blocks of the same 16 rows (split K inside the program, summed at the end),
so a program streams 16 rows with several warps' loads in flight; the next block's words are
requested before the current one is worked on. The PTX of a block runs on the CPU in the tests, lane
by lane through a small interpreter of its instructions with the ISA's fragment layouts, against the
plain dot product; the kernel itself runs on the GPU only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid import cdiv
from .pdl import pdl_enabled, release_dependents, wait_for_producer
from .quant_matmul import PackedWeight

GROUP = 128  # elements per block: 16 words of 8 codes


def _block_asm() -> str:
    """PTX for one block of one lane: inputs $3..$6 the lane's 4 words of rows g and g + 8 (two int64
    each), $7..$14 x[16 j + 4 t .. + 3] for j = 0..7 (int64 each); outputs $0 the dot of row g, $1 of row
    g + 8 (both biased by 128 per code, see the module docstring), $2 the block's sum of x."""
    lines = ["{", ".reg .b32 w<4>, v<4>, xa<16>, pa, pb, pc, pd, b0, b1, sh, one;", ".reg .f32 c<4>, s<4>;",
             "mov.b64 {w0, w1}, $3;", "mov.b64 {w2, w3}, $4;", "mov.b64 {v0, v1}, $5;", "mov.b64 {v2, v3}, $6;"]
    lines += [f"mov.b64 {{xa{2 * j}, xa{2 * j + 1}}}, ${7 + j};" for j in range(8)]
    lines += [f"mov.f32 {r}{i}, 0f00000000;" for r in "cs" for i in range(4)]
    lines.append("mov.b32 one, 0x3F803F80;")

    def pair(word: str, p: int, out: str) -> list[str]:
        # codes p (-> low half) and p + 4 (-> high half) as bf16 128 + code: (w >> 4p) & 0x000F000F | 0x43004300
        src = word
        ops = []
        if p:
            ops.append(f"shr.u32 sh, {word}, {4 * p};")
            src = "sh"
        ops.append(f"lop3.b32 {out}, {src}, 0x000F000F, 0x43004300, 0xEA;")
        return ops

    for r in range(4):  # word 4t + r of the lane
        sel = "0x7632" if r % 2 else "0x5410"  # the high or low bf16 of each 4-byte piece of x
        for m in range(2):  # codes (2m, 2m + 4) and (2m + 1, 2m + 5) of the word
            lines += pair(f"w{r}", 2 * m, "pa") + pair(f"v{r}", 2 * m, "pb")
            lines += pair(f"w{r}", 2 * m + 1, "pc") + pair(f"v{r}", 2 * m + 1, "pd")
            lines.append(f"prmt.b32 b0, xa{4 * m + r // 2}, xa{4 * m + 8 + r // 2}, {sel};")
            lines.append(f"prmt.b32 b1, xa{4 * m + 2 + r // 2}, xa{4 * m + 10 + r // 2}, {sel};")
            lines.append("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {c0, c1, c2, c3}, "
                         "{pa, pb, pc, pd}, {b0, b1}, {c0, c1, c2, c3};")
            lines.append("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {s0, s1, s2, s3}, "
                         "{one, one, one, one}, {b0, b1}, {s0, s1, s2, s3};")
    lines += ["mov.f32 $0, c0;", "mov.f32 $1, c2;", "mov.f32 $2, s0;", "}"]
    return "\n".join(lines)


BLOCK_ASM = tl.constexpr(_block_asm())


@triton.jit
def _words(at_g, at_h, ok):
    """The lane's 4 words of a block in rows g and g + 8, as two int64 each (weights: may be requested
    before the previous kernel has finished)."""
    return (tl.load(at_g, mask=ok, other=0), tl.load(at_g + 1, mask=ok, other=0),
            tl.load(at_h, mask=ok, other=0), tl.load(at_h + 1, mask=ok, other=0))


@triton.jit
def _block(words, xb, sg, sh, zg, zh, ok, acc_g, acc_h, HAS_ZEROS: tl.constexpr):
    """``acc += s * (w - z) . x`` over one block for rows g and g + 8 of the lane; ``xb`` points at the
    lane's first 4-element piece of x in the block (x as int64), ``sg``/``sh`` (``zg``/``zh``) at the
    rows' scales (zero points) of the block."""
    dg, dh, xs = tl.inline_asm_elementwise(
        BLOCK_ASM, "=f,=f,=f,l,l,l,l,l,l,l,l,l,l,l,l",
        [words[0], words[1], words[2], words[3],
         tl.load(xb, mask=ok, other=0), tl.load(xb + 4, mask=ok, other=0), tl.load(xb + 8, mask=ok, other=0),
         tl.load(xb + 12, mask=ok, other=0), tl.load(xb + 16, mask=ok, other=0), tl.load(xb + 20, mask=ok, other=0),
         tl.load(xb + 24, mask=ok, other=0), tl.load(xb + 28, mask=ok, other=0)],
        dtype=(tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    s_g = tl.load(sg, mask=ok, other=0).to(tl.float32)
    s_h = tl.load(sh, mask=ok, other=0).to(tl.float32)
    if HAS_ZEROS:
        z_g = tl.load(zg, mask=ok, other=0).to(tl.float32)
        z_h = tl.load(zh, mask=ok, other=0).to(tl.float32)
    else:
        z_g = 8.0
        z_h = 8.0
    acc_g += s_g * (dg - (128.0 + z_g) * xs)
    acc_h += s_h * (dh - (128.0 + z_h) * xs)
    return acc_g, acc_h


@triton.jit
def _kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, n_blocks, ld_q, WARPS: tl.constexpr, HAS_ZEROS: tl.constexpr,
            HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr):
    # One element per lane: [32 * WARPS] tensors are laid out one per thread, element e on thread e.
    e = tl.arange(0, 32 * WARPS)
    lane = e % 32
    warp = e // 32  # warp w takes blocks w, w + WARPS, ...
    g = lane // 4
    t = lane % 4
    row_g = tl.program_id(0) * 16 + g
    # Pointers at the warp's first block, moved on by WARPS blocks a step: 8 int64 of words a row, 32 of
    # x (4 bf16 each; piece j of the lane at 4j + t), one scale a row.
    wg = q_ptr + row_g.to(tl.int64) * ld_q + warp * 8 + 2 * t
    wh = wg + 8 * ld_q
    xb = x_ptr + warp * 32 + t
    sg = s_ptr + row_g * n_blocks + warp
    sh = sg + 8 * n_blocks
    zg = z_ptr + row_g * n_blocks + warp
    zh = zg + 8 * n_blocks
    acc_g = tl.zeros([32 * WARPS], tl.float32)
    acc_h = tl.zeros([32 * WARPS], tl.float32)
    ok = warp < n_blocks
    words = _words(wg, wh, ok)
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    for step in range(1, tl.cdiv(n_blocks, WARPS)):
        ahead_ok = warp + step * WARPS < n_blocks
        ahead = _words(wg + 8 * WARPS, wh + 8 * WARPS, ahead_ok)  # requested before this block is worked on
        acc_g, acc_h = _block(words, xb, sg, sh, zg, zh, ok, acc_g, acc_h, HAS_ZEROS)
        words, ok = ahead, ahead_ok
        wg += 8 * WARPS
        wh += 8 * WARPS
        xb += 32 * WARPS
        sg += WARPS
        sh += WARPS
        zg += WARPS
        zh += WARPS
    acc_g, acc_h = _block(words, xb, sg, sh, zg, zh, ok, acc_g, acc_h, HAS_ZEROS)
    # Sum the warps' shares; every t of a row holds its dot (all 8 mma columns are alike): t = 0 stores.
    out_g = tl.sum(tl.reshape(acc_g, [WARPS, 32]), axis=0)
    out_h = tl.sum(tl.reshape(acc_h, [WARPS, 32]), axis=0)
    lanes = tl.arange(0, 32)
    rows = tl.program_id(0) * 16 + lanes // 4
    if HAS_BIAS:
        out_g += tl.load(b_ptr + rows).to(tl.float32)
        out_h += tl.load(b_ptr + rows + 8).to(tl.float32)
    store = lanes % 4 == 0
    tl.store(out_ptr + rows, out_g.to(out_ptr.dtype.element_ty), mask=store)
    tl.store(out_ptr + rows + 8, out_h.to(out_ptr.dtype.element_ty), mask=store)


def supports(x: torch.Tensor, w: PackedWeight) -> bool:
    """One row of bf16 x on a GPU with bf16 mma (sm_80+), int4 in groups of 128 (single-level
    scales), whole 16-row tiles."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1
            and x.data_ptr() % 16 == 0 and w.fmt == "int4" and w.group_size == GROUP and w.scales2 is None
            and w.out_features % 16 == 0 and w.in_features == w.n_blocks * GROUP and w.qweight.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device)[0] >= 8)


def default_warps(n: int, device: torch.device) -> int:
    """Warps per program: 16 where the 16-row programs are at most two per SM (qwen3-8b's o and down on
    an H200: 5.8 / 12.2 us against 6.4 / 14.9 with 8), else 8 (q/k/v 7.7 against 10.2, gate/up 20.9
    against 28.3). More warps put more of a program's blocks in flight at once (bench/quant_gemv_mma.py,
    bench/RESULTS.md run 21)."""
    return 16 if n // 16 <= 2 * torch.cuda.get_device_properties(device).multi_processor_count else 8


def quant_gemv_mma(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
                   warps: int | None = None) -> torch.Tensor:
    """``x [1, K]`` bf16 -> ``[1, N]`` bf16, bias added; see ``supports``. ``warps`` overrides
    ``default_warps`` (benchmarks)."""
    if not supports(x, w):
        raise ValueError(f"quant_gemv_mma: needs one contiguous row of bf16 x on a GPU of compute capability 8.0+ "
                         f"and int4 weights in groups of {GROUP} with whole 16-row tiles; got x {tuple(x.shape)} "
                         f"{x.dtype} on {x.device}, {w.fmt} group {w.group_size}, {w.out_features} rows")
    n = w.out_features
    warps = warps or default_warps(n, x.device)
    words = w.qweight.view(torch.int64)
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    pdl = pdl_enabled(x.device)
    _kernel[(n // 16,)](x.view(torch.int64), words, w.scales, w.zeros if w.zeros is not None else w.scales,
                        bias if bias is not None else out, out, w.n_blocks, words.stride(0), WARPS=warps,
                        HAS_ZEROS=w.zeros is not None, HAS_BIAS=bias is not None, USE_PDL=pdl, num_warps=warps,
                        launch_pdl=pdl)
    return out

