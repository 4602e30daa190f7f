"""A decode step's inputs in one launch: key lengths, cache slots, key offsets and the rotary rows.

generate()'s decode step over the static cache (``generation/decode.py``) derives everything from
the positions buffer on the device: each row's key count (position + 1), the cache slot its new key
and value go to (through the block table), the prefix sums of the key counts, and the rotary cos/sin
of its position. As torch ops that is about twenty launches of a few hundred bytes each, ahead of
the first layer and outside the chain of programmatic dependent launches (``pdl.py``). Here it is
one launch: on an H200, qwen3-0.6b decode 2-3% faster at batch 1 and 32, 194 -> 174 kernels a
batch-1 step (bench/RESULTS.md run 12).

The rotary rows are gathered from a table of every position the runner can reach, computed once by
the model's own ``RotaryEmbedding``: bitwise the cos/sin the model would compute per step (its
rotary is elementwise in the position), without a sine or cosine in the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid import cdiv, next_power_of_2


ROPE_ROWS = 16  # rotary rows gathered per program; program 0 also writes the per-row metadata


@triton.jit
def _step_inputs_kernel(POS, TABLE, SEQLENS, SLOTS, CU_K, COS_TABLE, SIN_TABLE, COS, SIN, B, stride_table, D,
                        PAGE: tl.constexpr, BLOCK_B: tl.constexpr, HAS_ROPE: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 0:  # the per-row metadata: one program, since the prefix sum needs every row
        rows = tl.arange(0, BLOCK_B)
        ok = rows < B
        pos = tl.load(POS + rows, mask=ok, other=0).to(tl.int64)
        lens = (pos + 1).to(tl.int32)
        block = tl.load(TABLE + rows.to(tl.int64) * stride_table + pos // PAGE, mask=ok, other=0)
        tl.store(SEQLENS + rows, lens, mask=ok)
        tl.store(SLOTS + rows, block.to(tl.int64) * PAGE + pos % PAGE, mask=ok)
        tl.store(CU_K + 1 + rows, tl.cumsum(tl.where(ok, lens, 0), 0), mask=ok)
        tl.store(CU_K + rows, tl.zeros([BLOCK_B], tl.int32), mask=rows == 0)
    if HAS_ROPE:  # [ROWS, D] of cos and sin per program, copied bit for bit
        rows = pid * ROWS + tl.arange(0, ROWS)
        ok = rows < B
        cols = tl.arange(0, BLOCK_D)
        pos = tl.load(POS + rows, mask=ok, other=0).to(tl.int64)
        mask = ok[:, None] & (cols < D)[None, :]
        src = pos[:, None] * D + cols[None, :]
        dst = rows.to(tl.int64)[:, None] * D + cols[None, :]
        tl.store(COS + dst, tl.load(COS_TABLE + src, mask=mask), mask=mask)
        tl.store(SIN + dst, tl.load(SIN_TABLE + src, mask=mask), mask=mask)


def step_inputs(positions: torch.Tensor, block_table: torch.Tensor, block_size: int,
                rope_table: tuple[torch.Tensor, torch.Tensor] | None = None):
    """``generation.decode.step_inputs_torch`` in one launch (CUDA, or the interpreter). Positions
    past the rope table's rows are the caller's to rule out (the runner sizes the table to its
    capacity)."""
    dev = positions.device
    if positions.dim() != 1 or block_table.dim() != 2 or block_table.shape[0] != positions.numel():
        raise ValueError(f"positions {tuple(positions.shape)} and block_table {tuple(block_table.shape)} must be "
                         "[B] and [B, blocks per row]")
    b = positions.numel()
    seqlens = torch.empty(b, dtype=torch.int32, device=dev)
    slots = torch.empty(b, dtype=torch.int64, device=dev)
    cu_k = torch.empty(b + 1, dtype=torch.int32, device=dev)
    if rope_table is not None:
        cos_table, sin_table = rope_table
        if cos_table.shape != sin_table.shape or cos_table.dim() != 2 or not (
                cos_table.is_contiguous() and sin_table.is_contiguous()):
            raise ValueError("rope_table must be two contiguous [positions, rotary dim] tensors of one shape")
        d = cos_table.shape[1]
        cos = torch.empty(b, d, dtype=cos_table.dtype, device=dev)
        sin = torch.empty(b, d, dtype=sin_table.dtype, device=dev)
    else:
        cos_table = sin_table = cos = sin = seqlens  # never read
        d = 1
    if b == 0:
        cu_k.zero_()
        return seqlens, slots, cu_k, None if rope_table is None else (cos, sin)
    grid = (cdiv(b, ROPE_ROWS) if rope_table is not None else 1,)
    _step_inputs_kernel[grid](positions, block_table, seqlens, slots, cu_k, cos_table, sin_table, cos, sin, b,
                              block_table.stride(0), d, PAGE=block_size, BLOCK_B=next_power_of_2(b),
                              HAS_ROPE=rope_table is not None, ROWS=ROPE_ROWS,
                              BLOCK_D=next_power_of_2(d))
    return seqlens, slots, cu_k, None if rope_table is None else (cos, sin)
