"""The vocabulary projection's GEMV at batch 1, by tiling: the one decode GEMV big enough to be
bandwidth-bound (qwen3-0.6b: 151,936 x 1,024 bf16, 311 MB, past L2 every step).

    python bench/lm_head_gemv.py [--vocab 151936] [--hidden 1024]

Each tiling runs 20 times in a CUDA graph (PDL on, as in the decode chain); the figure is us per
call and the weight stream's rate, beside the default tiling ``gemv.tiling`` picks.
"""

from __future__ import annotations

import argparse
import itertools

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_us  # noqa: E402


def main() -> None:
    from cudaformers.kernels import gemv
    from cudaformers.kernels.grid import cdiv
    from cudaformers.kernels.pdl import pdl_enabled

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()
    n, k = args.vocab, args.hidden
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    pdl = pdl_enabled(x.device)
    want = gemv.gemv(x, w)
    default = gemv.tiling(n, k, x.device)
    rows = []
    for block_n, block_k, warps, stages in itertools.product((8, 16, 32, 64), (256, 512, 1024), (4, 8), (2, 3)):
        if block_n * block_k > 32768 or block_k > k:
            continue

        def launch(bn=block_n, bk=block_k, nw=warps, ns=stages):
            gemv._gemv_kernel[(cdiv(n, bn), 1)](x, x, w, y, y, y, y, n, k, 0.0, x.stride(0), x.stride(0), w.stride(0),
                                                y.stride(0), ACT=-1, NORM=False, HAS_RESIDUAL=False, HAS_BIAS=False,
                                                BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl, num_warps=nw, num_stages=ns,
                                                launch_pdl=pdl)
        us = graph_us(launch, reps=20)
        ok = torch.allclose(y.float(), want.float(), atol=2e-2, rtol=2e-2)
        rows.append((us, block_n, block_k, warps, stages, ok))
    rows.sort()
    mb = n * k * 2 / 1e6
    print(f"vocab {n} x hidden {k} ({mb:.0f} MB); default tiling (BLOCK_N, BLOCK_K, warps) = {default}, 3 stages")
    for us, bn, bk, nw, ns, ok in rows:
        mark = " <- default" if (bn, bk, nw, ns) == (*default, 3) else ""
        print(f"  BLOCK_N {bn:3d} BLOCK_K {bk:5d} warps {nw} stages {ns}: {us:7.2f} us  {mb / us:5.2f} TB/s"
              f"{'' if ok else '  WRONG'}{mark}")


if __name__ == "__main__":
    main()
