"""The int4 tensor-core GEMV (``kernels/quant_gemv_mma.py``) against the kernels decode runs today, on
qwen3-8b's layers at batch 1 (q/k/v and gate/up packed), weights read from HBM (copies cycled past L2).

    python bench/quant_gemv_mma.py

us per call in a CUDA graph of 50 calls (PDL as in decode; best of five replays), and the packed bytes' rate; the bf16
GEMV of the same layer for scale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_us  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def main() -> None:
    from cudaformers.kernels import quant_matmul as qm
    from cudaformers.kernels.gemv import gemv
    from cudaformers.kernels.quant_gemv import quant_gemv
    from cudaformers.kernels.quant_gemv_mma import quant_gemv_mma
    from cudaformers.quant.int4 import quantize_int4

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    total = {}
    for name, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k, device="cuda") * 0.02
        q, s, _ = quantize_int4(w32, 128)
        packed = qm.PackedWeight("int4", q, s, k, 128)
        nbytes = q.numel() + s.numel() * 2
        copies = max(1, -(-256 * 2 ** 20 // nbytes))
        ws = [packed] + [qm.PackedWeight("int4", q.clone(), s.clone(), k, 128) for _ in range(copies - 1)]
        bf = [w32.bfloat16()] + [w32.bfloat16().clone() for _ in range(max(0, -(-256 * 2 ** 20 // (n * k * 2)) - 1))]
        x = torch.randn(1, k, device="cuda").bfloat16()
        rows = {
            "bf16 GEMV": graph_us([lambda w=w: gemv(x, w) for w in bf]),
            "int4 dispatch today": graph_us([lambda w=w: qm.quant_matmul_triton(x, w) for w in ws]),
            "int4 FMA GEMV": graph_us([lambda w=w: quant_gemv(x, w) for w in ws]),
        }
        for warps, per_warp in ((8, 1), (16, 1), (4, 2), (8, 2), (16, 2)):
            rows[f"int4 mma GEMV, {warps}w x {per_warp}t"] = graph_us(
                [lambda w=w, c=(warps, per_warp): quant_gemv_mma(x, w, tiles=c) for w in ws])
        ref = qm.quant_matmul_reference(x.float(), packed)
        err = (quant_gemv_mma(x, packed).float() - ref).abs().max().item()
        print(f"{name} {n}x{k}: int4 {nbytes / 1e6:.1f} MB; mma GEMV max error {err:.2e} "
              f"(|ref| max {ref.abs().max():.2f})")
        for label, us in rows.items():
            mb = n * k * 2 / 1e6 if label.startswith("bf16") else nbytes / 1e6
            print(f"  {label:26s} {us:7.2f} us  {mb / us:5.2f} TB/s")
            total[label] = total.get(label, 0.0) + us
    print("a layer (four calls):", {k: round(v, 2) for k, v in total.items()})


if __name__ == "__main__":
    main()
