"""Asking L2 for lines a kernel will read soon, without waiting for them.

A prefetch moves no data into registers and changes no result, so a kernel may issue one before
its programmatic-dependent-launch wait (pdl.py) for data the previous kernel is not writing: the
paged decode prefetches its first K/V tile that way, and HBM is busy while the previous kernel
drains. The inline PTX has no interpreter form: callers compile it only for a GPU.

The same instruction, issued by the q/k/v GEMV for the next projections' weights, did not pay
(qwen3-0.6b decode on an H200: +1% for the o weights, -4% with gate/up too; RESULTS.md run 11).
Nor did a launch of its own between the q/k/v GEMV and the attention, which is latency-bound and
leaves HBM idle, asking L2 for the layer's o / gate-up / down weights (bulk or per-line prefetch):
W1 fell 9-58% (RESULTS.md run 17), though those projections run 21% faster from L2 than from HBM
(``bench/l2_upside.py``). Nor did kernels asking for their *own* later weights before their wait
(run 20): the skinny GEMM at 32 rows gained nothing on W3 (and its vocabulary projection lost 31%),
the GEMV with its later K steps lost 1.4% on W1 and 21% on W2. The paged decode's first tile is the
one placement that paid.
"""

from __future__ import annotations

import triton
import triton.language as tl

LINE_BYTES = 128  # an L2 line


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines holding ``ptrs``; nothing comes back to registers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
