"""PTX that turns one packed block of int4 or int8 codes straight into ``mma.sync.m16n8k16`` (bf16)
fragments and multiplies it with one row of bf16 x: the inner block of ``quant_gemv_mma.py``.

Both formats use the plane packing of ``quant_matmul.py`` and give a lane the same loads: a block's
row is 16 words (64 bytes), and lane ``(g, t)`` (``g = lane // 4``, ``t = lane % 4``) of a warp that
owns a 16-row tile loads words ``4t .. 4t + 3`` of rows ``g`` and ``g + 8``. Word ``i``'s code ``j`` is
element ``16 j + i`` of the block (int4: 8 codes a word, 128 elements; int8: 4 bytes, 64 elements).

An mma contracts 16 "slots"; which element a slot stands for is free as long as A (the weights) and
B (x) agree. Lane ``(g, t)`` feeds slots ``2t, 2t + 1`` (A's registers 0 and 1: rows g and g + 8) and
``2t + 8, 2t + 9`` (registers 2 and 3); its B registers hold x at the same elements, identical for
every ``g``, so all 8 output columns are the row's dot product and output registers 0 and 2 hold rows
``g`` and ``g + 8``.

bf16 has 7 mantissa bits, so a code becomes a float by ORing the exponent of 2**7 over it: ``lop3``
of ``(word >> s) & mask | 0x4300`` in both 16-bit halves gives two bf16 ``128 + code`` at once.

* int4: codes ``p`` and ``p + 4`` of a word sit 16 bits apart: one shift and one ``lop3`` make an A
  register of two codes, 8 codes in 7 instructions. One mma takes four such registers; the block's
  sum of x (for the bias of 128 and the zero point, removed per group outside) comes from an mma with
  A = 1 on the same B.
* int8: a byte has 8 bits, one too many for the mantissa, so each byte fills two slots of the same
  x: its low 7 bits as ``128 + low`` (mask ``0x007F007F``, ``| 0x4300``) and its sign bit as -256 or
  -128 (mask ``0x00800080``, ``| 0xC300``: the bit lands on the exponent's lowest bit, turning -2**7
  into -2**8). The two sum to the signed byte exactly, so no bias is left to take off: int8 has one
  scale per row, and its sums pass from block to block through the tensor cores' accumulators. Bytes
  0 and 2 of a word pair up as they lie, bytes 1 and 3 after ``>> 8``: 4 bytes in 5 instructions a
  row, and two mmas (low bits, sign bits) per word on one B, x at the word's 4 elements.

Products are exact (bf16 inputs, fp32 accumulate). ``tests/ptx_exec.py`` runs these blocks on the CPU
lane by lane with the ISA's fragment layouts, against the plain dot product.
"""

from __future__ import annotations

MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
INT4_GROUP = 128  # elements of an int4 block: 16 words of 8 codes
INT8_BLOCK = 64  # elements of an int8 block: 16 words of 4 bytes


def _words(tiles: int, first: int) -> tuple[str, list[str]]:
    """(the declaration, the moves) of registers w{u}_r (row g of tile u) and v{u}_r (row g + 8), from
    operands ``first ..``: two int64 a row and tile."""
    decl = f".reg .b32 {', '.join(f'w{u}_<4>, v{u}_<4>' for u in range(tiles))};"
    movs = []
    for u in range(tiles):
        op = first + 4 * u
        movs += [f"mov.b64 {{w{u}_0, w{u}_1}}, ${op};", f"mov.b64 {{w{u}_2, w{u}_3}}, ${op + 1};",
                 f"mov.b64 {{v{u}_0, v{u}_1}}, ${op + 2};", f"mov.b64 {{v{u}_2, v{u}_3}}, ${op + 3};"]
    return decl, movs


def int4_block_asm(tiles: int = 1) -> str:
    """One int4 block of one lane over ``tiles`` 16-row tiles. Inputs (after the 2 * tiles + 1 outputs):
    per tile the lane's 4 words of rows g and g + 8 (two int64 each), then x[16 j + 4 t .. + 3] for
    j = 0..7 (int64 each). Outputs: per tile the dots of rows g and g + 8 with ``128 + code``, then the
    block's sum of x."""
    first = 2 * tiles + 1  # the first input operand
    decl, movs = _words(tiles, first)
    lines = ["{", decl, ".reg .b32 xa<16>, pa, pb, pc, pd, b0, b1, sh, one;",
             f".reg .f32 {', '.join(f'c{u}_<4>' for u in range(tiles))}, s<4>;", *movs]
    xs = first + 4 * tiles
    lines += [f"mov.b64 {{xa{2 * j}, xa{2 * j + 1}}}, ${xs + j};" for j in range(8)]
    lines += [f"mov.f32 c{u}_{i}, 0f00000000;" for u in range(tiles) for i in range(4)]
    lines += [f"mov.f32 s{i}, 0f00000000;" for i in range(4)]
    lines.append("mov.b32 one, 0x3F803F80;")

    def pair(word: str, p: int, out: str) -> list[str]:
        # codes p (low half) and p + 4 (high half) as bf16 128 + code: (w >> 4p) & 0x000F000F | 0x43004300
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
            lines.append(f"prmt.b32 b0, xa{4 * m + r // 2}, xa{4 * m + 8 + r // 2}, {sel};")
            lines.append(f"prmt.b32 b1, xa{4 * m + 2 + r // 2}, xa{4 * m + 10 + r // 2}, {sel};")
            for u in range(tiles):
                lines += pair(f"w{u}_{r}", 2 * m, "pa") + pair(f"v{u}_{r}", 2 * m, "pb")
                lines += pair(f"w{u}_{r}", 2 * m + 1, "pc") + pair(f"v{u}_{r}", 2 * m + 1, "pd")
                c = ", ".join(f"c{u}_{i}" for i in range(4))
                lines.append(f"{MMA} {{{c}}}, {{pa, pb, pc, pd}}, {{b0, b1}}, {{{c}}};")
            lines.append(f"{MMA} {{s0, s1, s2, s3}}, {{one, one, one, one}}, {{b0, b1}}, {{s0, s1, s2, s3}};")
    for u in range(tiles):
        lines += [f"mov.f32 ${2 * u}, c{u}_0;", f"mov.f32 ${2 * u + 1}, c{u}_2;"]
    lines += [f"mov.f32 ${2 * tiles}, s0;", "}"]
    return "\n".join(lines)


def int8_block_asm(tiles: int = 1) -> str:
    """One int8 block of one lane over ``tiles`` 16-row tiles, added to running sums. Inputs (after the
    2 * tiles outputs): per tile the running sums of rows g and g + 8 (fp32), then per tile the lane's 4
    words of rows g and g + 8 (two int64 each), then x[16 j + 4 t .. + 3] for j = 0..3 (int64 each).
    Outputs: per tile the running sums plus the block's ``q . x`` of rows g and g + 8."""
    sums = 2 * tiles  # the first input operand
    first = sums + 2 * tiles
    decl, movs = _words(tiles, first)
    lines = ["{", decl, ".reg .b32 xa<8>, pa, pb, pc, pd, pe, pf, pg, ph, be, bo, sh, sv;",
             f".reg .f32 {', '.join(f'c{u}_<4>' for u in range(tiles))};", *movs]
    xs = first + 4 * tiles
    lines += [f"mov.b64 {{xa{2 * j}, xa{2 * j + 1}}}, ${xs + j};" for j in range(4)]
    for u in range(tiles):  # all 8 columns of a row hold its sum
        lines += [f"mov.f32 c{u}_0, ${sums + 2 * u};", f"mov.f32 c{u}_1, ${sums + 2 * u};",
                  f"mov.f32 c{u}_2, ${sums + 2 * u + 1};", f"mov.f32 c{u}_3, ${sums + 2 * u + 1};"]

    def split(word: str, low: str, top: str) -> list[str]:
        # bytes 0 (low half) and 2 (high half) of the word: 128 + their low 7 bits, and their sign bit
        # as -256 (set) or -128 (clear); the two sum to the signed byte
        return [f"lop3.b32 {low}, {word}, 0x007F007F, 0x43004300, 0xEA;",
                f"lop3.b32 {top}, {word}, 0x00800080, 0xC300C300, 0xEA;"]

    for r in range(4):  # word 4t + r of the lane: byte j is element 16 j + 4 t + r
        sel = "0x7632" if r % 2 else "0x5410"  # the high or low bf16 of each 4-byte piece of x
        lines.append(f"prmt.b32 be, xa{r // 2}, xa{4 + r // 2}, {sel};")  # x at bytes 0 and 2: slots 2t, 2t + 1
        lines.append(f"prmt.b32 bo, xa{2 + r // 2}, xa{6 + r // 2}, {sel};")  # bytes 1 and 3: slots 2t + 8, 2t + 9
        for u in range(tiles):
            c = ", ".join(f"c{u}_{i}" for i in range(4))
            lines += [f"shr.u32 sh, w{u}_{r}, 8;", f"shr.u32 sv, v{u}_{r}, 8;"]  # bytes 1 and 3 where 0 and 2 were
            lines += split(f"w{u}_{r}", "pa", "pc") + split(f"v{u}_{r}", "pb", "pd")
            lines += split("sh", "pe", "pg") + split("sv", "pf", "ph")
            lines.append(f"{MMA} {{{c}}}, {{pa, pb, pe, pf}}, {{be, bo}}, {{{c}}};")  # the low bits
            lines.append(f"{MMA} {{{c}}}, {{pc, pd, pg, ph}}, {{be, bo}}, {{{c}}};")  # the sign bits
    for u in range(tiles):
        lines += [f"mov.f32 ${2 * u}, c{u}_0;", f"mov.f32 ${2 * u + 1}, c{u}_2;"]
    lines.append("}")
    return "\n".join(lines)
