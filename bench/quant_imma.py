"""int8 decode GEMV at qwen3-8b's layer shapes: the integer tensor-core kernel (quant_imma.py) against
the FMA GEMV that serves int8 with bf16 x today (quant_gemv.py), in CUDA graphs, weights cycled past L2.

    python bench/quant_imma.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, graph_us  # noqa: E402
from cudaformers import Int8Config  # noqa: E402
from cudaformers.kernels.quant_gemv import quant_gemv  # noqa: E402
from cudaformers.kernels.quant_imma import quant_imma  # noqa: E402
from cudaformers.kernels.quant_matmul import quant_matmul_reference  # noqa: E402
from cudaformers.quant.apply import quantize  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]


def main() -> None:
    env = environment()
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    print(f"{'layer':8} {'N':>6} {'K':>6} {'gemv us':>8} {'imma us':>8} {'TB/s':>6} {'max err':>9}")
    for name, n, k in SHAPES:
        layers = []
        for _ in range(max(1, (160 << 20) // (n * k))):
            holder = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda"))
            layers.append(quantize(holder, Int8Config())[0].packed())
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = quant_matmul_reference(x.float(), layers[0])
        err = (quant_imma(x, layers[0]).float() - ref).abs().max().item() / ref.abs().max().item()
        gemv = graph_us([lambda w=w: quant_gemv(x, w) for w in layers])
        imma = graph_us([lambda w=w: quant_imma(x, w) for w in layers])
        print(f"{name:8} {n:6} {k:6} {gemv:8.2f} {imma:8.2f} {n * k / imma / 1e6:6.2f} {err:9.2e}")


if __name__ == "__main__":
    main()
