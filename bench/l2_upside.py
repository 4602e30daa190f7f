"""How much faster a decode projection runs when its weights already sit in L2: the most that
prefetching a layer's later weights during its attention could give.

    python bench/l2_upside.py [--rows 1,32]

For each qwen3-0.6b projection, microseconds per call from one CUDA graph of chained calls (the
decode step's PDL chain): on one weight (hot: after the first call it is in L2) against a cycle of
copies that overflow L2 (cold: every call reads HBM). Rows 1 run the GEMV, 5-32 the skinny GEMM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, graph_us  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,32")
    args = ap.parse_args()
    from cudaformers.kernels.gemv import gemv
    from cudaformers.kernels.skinny_gemm import skinny_linear

    env = environment()
    print(f"{env['gpu']}, torch {env['torch']}, commit {env['commit']}")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"L2 {l2 / 2**20:.0f} MiB")
    for rows in (int(r) for r in args.rows.split(",")):
        op = gemv if rows <= 4 else skinny_linear
        total_hot = total_cold = 0.0
        for name, (n, k) in SHAPES.items():
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            copies = max(4, 3 * l2 // (n * k * 2) + 1)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            hot = graph_us(lambda: op(x, ws[0]))
            cold = graph_us([lambda w=w: op(x, w) for w in ws])
            total_hot, total_cold = total_hot + hot, total_cold + cold
            mb = n * k * 2 / 1e6
            print(f"rows {rows:2d} {name:8} {mb:5.1f} MB: cold {cold:6.2f} us ({mb / cold:5.2f} TB/s), "
                  f"hot {hot:6.2f} us ({mb / hot:5.2f} TB/s)")
        print(f"rows {rows:2d} layer's projections: cold {total_cold:.2f} us, hot {total_hot:.2f} us")


if __name__ == "__main__":
    main()
