"""int8 weights times one row of x on the integer tensor cores (decode at batch 1), for any x dtype.

``quant_mma.py`` serves int8 only for fp16 x (bf16 cannot hold an int8 code exactly) and the FMA
GEMV (``quant_gemv.py``) spends an AND and an FMA per weight, which leaves int8 decode issue-bound.
Here the weights never become floats: x is split into four int8 *planes*,

    x ~= s * (a + b / 254 + c / 254**2 + d / 254**3),   s = max|x| / 127,  a, b, c, d in [-127, 127],

(each plane the rounded residue of the one before, so an element is off by at most
``max|x| * 2.4e-10``: exact for bf16 and fp16 x, near fp32's rounding for fp32 x), and one
``int8 x int8 -> int32`` tensor-core product per block gives all four plane sums at once: the
planes are four columns of the dot's 16-wide operand, the other columns zero. int32 sums are exact;
the output is ``scale[n] * s * (A + B / 254 + C / 254**2 + D / 254**3)``.

The weight bytes go to the dot as they lie in memory (plane packing, ``quant_matmul.py``: byte
``4w + j`` of a 64-element block is element ``16j + w``), so x's planes are built in that order.
Every program reads all of x once for ``max|x|`` and builds the planes of the blocks it streams;
both are shared by its BLOCK_N rows. Long rows split over programs like ``quant_mma``: each split
stores its fp32 partial and the last to arrive sums them in split order (``arrivals.py``).

Not used by default (``quant_matmul.USE_IMMA``) until measured on a GPU against the FMA GEMV.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters
from .grid import cdiv
from .pdl import pdl_enabled, release_dependents, wait_for_producer
from .quant_matmul import INT8_BLOCK, PackedWeight, sm_count

logger = logging.getLogger("cudaformers")

STEP = tl.constexpr(254.0)  # each plane holds the previous one's rounding residue times this
_warned_capture: list[bool] = []


@triton.jit
def _round(v):
    return tl.floor(v + 0.5)


@triton.jit
def _assemble(a, b, c, d):
    """``[L]`` tensors a, b, c, d -> ``[L, 16]``: each in one column, the other 12 columns zero."""
    four = tl.reshape(tl.join(tl.join(a, b), tl.join(c, d)), [a.shape[0], 4])
    eight = tl.reshape(tl.join(four, tl.zeros_like(four)), [a.shape[0], 8])
    return tl.reshape(tl.join(eight, tl.zeros_like(eight)), [a.shape[0], 16])


@triton.jit
def _planes(x_ptr, blk, inv, K, EVEN_K: tl.constexpr):
    """x's planes for block ``blk`` ``[64, 16]`` int8, in the byte order of the packed weights."""
    c = tl.arange(0, 64)
    k = blk * 64 + (c % 4) * 16 + c // 4
    if EVEN_K:
        t = tl.load(x_ptr + k).to(tl.float32) * inv
    else:
        t = tl.load(x_ptr + k, mask=k < K, other=0).to(tl.float32) * inv
    a = _round(t)
    r = (t - a) * STEP
    b = _round(r)
    r = (r - b) * STEP
    c = _round(r)
    d = _round((r - c) * STEP)
    return _assemble(a.to(tl.int8), b.to(tl.int8), c.to(tl.int8), d.to(tl.int8))


@triton.jit
def _imma_kernel(x_ptr, q_ptr, s_ptr, b_ptr, out_ptr, part_ptr, arrived_ptr, N, K, n_blocks, per_split, ld_q,
                 BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    """``out [N] = W @ x + b`` for one row ``x [K]``; ``q_ptr`` the packed int8 weight ``[N, Kp]``."""
    tile = tl.program_id(0)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * ld_q + tl.arange(0, 64)[None, :]
    start = tl.program_id(1) * per_split
    end = tl.minimum(start + per_split, n_blocks)
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    kk = tl.arange(0, 1024)
    amax = tl.zeros([1024], tl.float32)
    for k0 in range(0, K, 1024):
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + k0 + kk, mask=k0 + kk < K, other=0).to(tl.float32)))
    top = tl.max(amax, 0)
    inv = 127.0 / tl.maximum(top, 1e-30)  # all-zero x: planes of zeros
    acc = tl.zeros([16, BLOCK_N], tl.int32)  # [planes, rows]: the planes are the dot's 16-row side
    for b0 in range(start, end, GROUPS):
        for g in tl.static_range(GROUPS):
            blk = b0 + g
            if EVEN_K:
                w = tl.load(q_rows + blk * 64, mask=row_ok[:, None], other=0)
            else:  # a step may overhang the split's last block: nothing loaded, nothing added
                w = tl.load(q_rows + blk * 64, mask=row_ok[:, None] & (rows * 0 + blk < end)[:, None], other=0)
            acc = tl.dot(tl.trans(_planes(x_ptr, blk, inv, K, EVEN_K)), tl.trans(w), acc, out_dtype=tl.int32)
    one = tl.full([1], 1.0, tl.float32)
    weights = tl.reshape(_assemble(one, one / STEP, one / (STEP * STEP), one / (STEP * STEP * STEP)), [16])
    out = tl.sum(acc.to(tl.float32) * weights[:, None], 0) * (top / 127.0)
    if SPLIT > 1:
        tl.store(part_ptr + tl.program_id(1) * N + rows, out, mask=row_ok)
        tl.debug_barrier()  # the partial lands before the arrival is counted (released at GPU scope)
        counter = arrived_ptr + tile
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") != SPLIT - 1:
            return
        out = tl.zeros([BLOCK_N], tl.float32)
        for split in range(SPLIT):  # in split order: deterministic; .cg: written on other SMs
            out += tl.load(part_ptr + split * N + rows, mask=row_ok, other=0, cache_modifier=".cg")
        tl.store(counter, 0)  # zero again for the next launch
    out *= tl.load(s_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(b_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def supports(x: torch.Tensor, w: PackedWeight) -> bool:
    """One row of x (any float dtype) against int8 weights."""
    return x.dim() == 2 and x.shape[0] == 1 and w.fmt == "int8" and w.block == INT8_BLOCK


def default_tiles(n: int, n_blocks: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, GROUPS, SPLIT, num_warps, num_stages): 256-row tiles two blocks (128 bytes of each
    row) a step, the blocks split over programs until there are two per SM, each split keeping at
    least 4 blocks. Wide tiles share each block's planes among many rows: compiled for sm_90, a step
    costs ~400 instructions a thread at 256 rows (1.5 a weight), ~280 at 64 rows (4.4 a weight)."""
    block_n, groups = 256, 2
    tiles = cdiv(n, block_n)
    split = 1
    while tiles * split < 2 * sm_count(device) and n_blocks // (2 * split) >= 4:
        split *= 2
    return block_n, groups, split, 4, 3


def quant_imma(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
               tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x [1, K]`` -> ``[1, N]`` in x's dtype, bias added, one launch. ``tiles`` overrides
    ``default_tiles`` (benchmarks, tests)."""
    if not supports(x, w):
        raise ValueError(f"quant_imma: serves one row of x against int8 weights in blocks of {INT8_BLOCK}, got "
                         f"x {tuple(x.shape)} and {w.fmt} weights in blocks of {w.block}; quant_matmul_triton "
                         "picks the right kernel")
    n, k = w.out_features, w.in_features
    if x.shape[1] != k:
        raise ValueError(f"quant_imma: x has {x.shape[1]} features, the weight expects {k}")
    n_blocks = w.n_blocks
    block_n, groups, split, warps, stages = tiles or default_tiles(n, n_blocks, x.device)
    per_split = cdiv(cdiv(n_blocks, split), groups) * groups
    split = cdiv(n_blocks, per_split)
    n_tiles = cdiv(n, block_n)
    arrived = arrival_counters(x.device, n_tiles) if split > 1 else None
    if split > 1 and arrived is None:  # inside a CUDA-graph capture that would have to make the counters
        if not _warned_capture:
            _warned_capture.append(True)
            logger.warning("quant_imma: a CUDA graph captured before any eager call has no split counters, so "
                           "its int8 GEMVs run unsplit; run one step before capturing")
        split, per_split = 1, cdiv(n_blocks, groups) * groups
    x = x.contiguous()
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    part = torch.empty(split, n, device=x.device, dtype=torch.float32) if split > 1 else out
    pdl = pdl_enabled(x.device)
    _imma_kernel[(n_tiles, split)](
        x, w.qweight, w.scales, bias if bias is not None else out, out, part, arrived if arrived is not None else out,
        n, k, n_blocks, per_split, w.qweight.stride(0), BLOCK_N=block_n, GROUPS=groups, SPLIT=split,
        HAS_BIAS=bias is not None, EVEN_K=k == n_blocks * INT8_BLOCK and per_split * split == n_blocks,
        USE_PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return out
