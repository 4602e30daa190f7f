"""Asking L2 for bytes a kernel will read soon, without waiting for them.

A prefetch moves no data into registers and changes no result, so a kernel may issue one before
its programmatic-dependent-launch wait (pdl.py) for data the previous kernel is not writing: the
paged decode prefetches its first K/V tile that way, and HBM is busy while the previous kernel
drains. The inline PTX has no interpreter form: callers compile it only for a GPU.

The same instruction, issued by the q/k/v GEMV for the next projections' weights, did not pay
(qwen3-0.6b decode on an H200: +1% for the o weights, -4% with gate/up too; RESULTS.md run 11):
the GEMV streams its own weights at full bandwidth, so the prefetch only competed with it.

``prefetch_weights`` is the other placement: a launch of its own that asks L2 for whole weight
matrices with Hopper's bulk prefetch (one instruction per 16 KB piece), placed where the step is
latency-bound and HBM idle (a small batch's attention), so the projections after it read L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_enabled, release_dependents, wait_for_producer

LINE_BYTES = 128  # an L2 line
PIECE_BYTES = 16 << 10  # bytes one bulk prefetch asks for
_PIECES = 32  # pieces a program issues: one per thread of its single warp
MAX_REGIONS = 4


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines holding ``ptrs``; nothing comes back to registers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _bulk_prefetch(ptrs, sizes):
    """Ask L2 for ``sizes`` bytes at each of ``ptrs`` (16-byte aligned, sizes multiples of 16; 0: none)."""
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
        "mov.u32 $0, 0;\n\t}", "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _region(base, nbytes, start, offs):
    """Pointers and sizes of this region's pieces among the concatenation's bytes ``offs``."""
    local = offs - start
    inside = (local >= 0) & (local < nbytes)
    size = tl.where(inside, tl.minimum(nbytes - local, PIECE), 0)
    return base + tl.where(inside, local, 0), (size // 16 * 16).to(tl.int32)


PIECE: tl.constexpr = tl.constexpr(PIECE_BYTES)


@triton.jit
def _prefetch(base, nbytes, start, offs, BULK: tl.constexpr):
    p, s = _region(base, nbytes, start, offs)
    if BULK:
        _bulk_prefetch(p, s)
    else:  # one line per element; lines past the region repeat its first
        prefetch_l2(tl.where(s > 0, p, base))


@triton.jit
def _prefetch_kernel(A, a_bytes, B, b_bytes, C, c_bytes, D, d_bytes, PIECES: tl.constexpr,
                     WAIT_FIRST: tl.constexpr, USE_PDL: tl.constexpr, BULK: tl.constexpr):
    # The regions are weights: no kernel of the step writes them, so the requests may go out before
    # the wait. WAIT_FIRST holds them until the previous kernel ends (it may be streaming HBM itself).
    if WAIT_FIRST:
        wait_for_producer(USE_PDL)
        release_dependents(USE_PDL)
    step = PIECE if BULK else 128
    offs = (tl.program_id(0) * PIECES + tl.arange(0, PIECES)).to(tl.int64) * step
    _prefetch(A, a_bytes, 0, offs, BULK)
    _prefetch(B, b_bytes, a_bytes, offs, BULK)
    _prefetch(C, c_bytes, a_bytes + b_bytes, offs, BULK)
    _prefetch(D, d_bytes, a_bytes + b_bytes + c_bytes, offs, BULK)
    if not WAIT_FIRST:
        wait_for_producer(USE_PDL)
        release_dependents(USE_PDL)


def prefetch_weights(tensors, wait_first: bool = True, bulk: bool = True) -> None:
    """Ask L2 for the bytes of up to ``MAX_REGIONS`` CUDA tensors (contiguous), in one launch on the
    current stream; returns at once. Only for Hopper and newer (the bulk prefetch is sm_90)."""
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return
    if len(tensors) > MAX_REGIONS:
        raise ValueError(f"prefetch_weights takes at most {MAX_REGIONS} tensors, got {len(tensors)}")
    device = tensors[0].device
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        raise ValueError(f"prefetch_weights needs a Hopper or newer GPU (bulk L2 prefetch), got {device}")
    regions = []
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError("prefetch_weights: each tensor must be contiguous and 16-byte aligned")
        regions += [t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1), t.numel() * t.element_size()]
    while len(regions) < 2 * MAX_REGIONS:
        regions += [regions[0], 0]
    total = sum(regions[1::2])
    # bulk: a warp of 16 KB pieces per program; else 128-byte lines, 16 a thread of 4 warps
    pieces, piece, warps = (_PIECES, PIECE_BYTES, 1) if bulk else (2048, LINE_BYTES, 4)
    grid = (triton.cdiv(total, piece * pieces),)
    pdl = pdl_enabled(device)
    _prefetch_kernel[grid](*regions, PIECES=pieces, WAIT_FIRST=wait_first, USE_PDL=pdl, BULK=bulk,
                           num_warps=warps, launch_pdl=pdl)
