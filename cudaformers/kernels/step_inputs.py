"""A decode step's inputs in one launch: key lengths, cache slots, key offsets, the rotary rows and
the token embeddings.

generate()'s decode step over the static cache (``generation/decode.py``) derives everything from
the positions buffer on the device: each row's key count (position + 1), the cache slot its new key
and value go to (through the block table), the prefix sums of the key counts, and the rotary cos/sin
of its position. As torch ops that is about twenty launches of a few hundred bytes each, ahead of
the first layer and outside the chain of programmatic dependent launches (``pdl.py``). Here it is
one launch: on an H200, qwen3-0.6b decode 2-3% faster at batch 1 and 32, 194 -> 174 kernels a
batch-1 step (bench/RESULTS.md run 12).

The same launch gathers each row's token embedding (a plain table lookup, so bit for bit
``nn.Embedding``): torch's gather was one more launch outside the PDL chain. The launch joins the
chain itself: it waits for the previous step's last kernel (which wrote the tokens and positions)
and lets the first layer's GEMV start streaming its weights while it runs.

The rotary rows are gathered from a table of every position the runner can reach, computed once by
the model's own ``RotaryEmbedding``: bitwise the cos/sin the model would compute per step (its
rotary is elementwise in the position), without a sine or cosine in the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.metadata import StepInputs
from .pdl import pdl_enabled, release_dependents, wait_for_producer

ROPE_ROWS = 16  # rotary rows gathered per program; program 0 also writes the per-row metadata
EMBED_BLOCK = 1024  # embedding features one program copies (programs past the rotary ones)


@triton.jit
def _step_inputs_kernel(POS, TABLE, SEQLENS, SLOTS, CU_K, COS_TABLE, SIN_TABLE, COS, SIN, TOKENS, EMBED, HIDDEN,
                        B, stride_table, D, H, rope_programs,
                        PAGE: tl.constexpr, BLOCK_B: tl.constexpr, HAS_ROPE: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_D: tl.constexpr, HAS_EMBED: tl.constexpr, BLOCK_H: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    wait_for_producer(USE_PDL)  # the positions and tokens are the previous step's last writes
    release_dependents(USE_PDL)
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
    if pid < rope_programs:
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
    elif HAS_EMBED:  # one row's [BLOCK_H] features of its token's embedding per program
        e = pid - rope_programs
        chunks = tl.cdiv(H, BLOCK_H)
        row = e // chunks
        feats = (e % chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
        feat_ok = feats < H
        token = tl.load(TOKENS + row).to(tl.int64)
        tl.store(HIDDEN + row.to(tl.int64) * H + feats, tl.load(EMBED + token * H + feats, mask=feat_ok),
                 mask=feat_ok)


def step_inputs(positions: torch.Tensor, block_table: torch.Tensor, block_size: int,
                rope_table: tuple[torch.Tensor, torch.Tensor] | None = None,
                tokens: torch.Tensor | None = None, embedding: torch.Tensor | None = None) -> StepInputs:
    """``generation.decode.step_inputs_torch`` in one launch (CUDA, or the interpreter). Positions
    past the rope table's rows, and tokens past the embedding's, are the caller's to rule out (the
    runner sizes the table to its capacity; its tokens come from the model's own logits or from
    checked prompts)."""
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
    if (tokens is None) != (embedding is None):
        raise ValueError("step_inputs gathers embeddings from tokens and an embedding table: pass both or neither")
    if embedding is not None:
        if tokens.shape != positions.shape or embedding.dim() != 2 or not embedding.is_contiguous():
            raise ValueError(f"tokens {tuple(tokens.shape)} must be [B] like positions and the embedding "
                             f"{tuple(embedding.shape)} a contiguous [vocab, hidden] table")
        h = embedding.shape[1]
        hidden = torch.empty(b, h, dtype=embedding.dtype, device=dev)
    else:
        tokens = embedding = hidden = seqlens  # never read
        h = 1
    rope = None if rope_table is None else (cos, sin)
    out = StepInputs(seqlens, slots, cu_k, rope, None if tokens is seqlens else hidden)
    if b == 0:
        cu_k.zero_()
        return out
    rope_programs = triton.cdiv(b, ROPE_ROWS) if rope_table is not None else 1
    embed_programs = b * triton.cdiv(h, EMBED_BLOCK) if out.hidden is not None else 0
    pdl = pdl_enabled(dev)
    _step_inputs_kernel[(rope_programs + embed_programs,)](
        positions, block_table, seqlens, slots, cu_k, cos_table, sin_table, cos, sin, tokens, embedding, hidden,
        b, block_table.stride(0), d, h, rope_programs, PAGE=block_size, BLOCK_B=triton.next_power_of_2(b),
        HAS_ROPE=rope_table is not None, ROWS=ROPE_ROWS, BLOCK_D=triton.next_power_of_2(d),
        HAS_EMBED=out.hidden is not None, BLOCK_H=min(EMBED_BLOCK, triton.next_power_of_2(h)), USE_PDL=pdl,
        launch_pdl=pdl)
    return out
