"""One launch of each quantized decode kernel for a hardware-counter profiler to read.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... python bench/profile_quant.py
        [--layers gate_up,down] [--methods int4,int8] [--kernels fma,mma,frag,bf16]

Each kernel first runs a few times (compile, autotune, warm the caches of its launch path) outside the
profiled range; then ``cudaProfilerStart`` opens the range and each case launches once, so the
profiler sees one launch per (layer, method, kernel), in that order, and prints it with its label.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant import KERNEL_SHAPES, _bf16_layer, method_config  # noqa: E402


def cases(layers, methods, kernels):
    from cudaformers.kernels import quant_gemv_mma as fragment
    from cudaformers.kernels.quant_mma import quant_mma, supports
    from cudaformers.quant.apply import quantize

    for label in layers:
        n, k = KERNEL_SHAPES[label]
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        torch.nn.init.normal_(linear.weight, std=0.02)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        if "bf16" in kernels:
            yield f"{label} bf16 gemv", (lambda f=_bf16_layer(linear), x=x: f(x))
        for method in methods:
            w = quantize(torch.nn.Sequential(linear), method_config(method))[0].packed()
            from cudaformers.kernels.quant_gemv import quant_gemv

            if "fma" in kernels:
                yield f"{label} {method} fma", (lambda w=w, x=x: quant_gemv(x, w))
            xm = x.half() if method == "int8" else x
            if "mma" in kernels and supports(xm, w):
                yield f"{label} {method} mma", (lambda w=w, xm=xm: quant_mma(xm, w))
            if "frag" in kernels and fragment.supports(x, w):  # the fragment GEMV (what batch 1 runs)
                yield f"{label} {method} frag", (lambda w=w, x=x: fragment.quant_gemv_mma(x, w))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="gate_up,down")
    ap.add_argument("--methods", default="int4,int8")
    ap.add_argument("--kernels", default="fma,mma,bf16", help="any of fma, mma, frag, bf16")
    args = ap.parse_args()
    todo = list(cases(args.layers.split(","), args.methods.split(","), args.kernels.split(",")))
    with torch.no_grad():
        for _, fn in todo:
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for label, fn in todo:
            print(f"profiled launch: {label}", flush=True)
            fn()
            torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
