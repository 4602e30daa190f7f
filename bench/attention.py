"""Attention backends side by side on one GPU: prefill forward, forward+backward, and paged decode.

Qwen3 attention shapes (16 query heads, 8 kv heads, head_dim 128), bf16. Compares cudaformers'
Triton kernels with the sdpa backend, flex_attention and, when the package is installed, flash-attn 2.

    python bench/attention.py                     # everything
    python bench/attention.py --only decode --backends triton,sdpa

Prints one table: time per call (median), achieved TFLOP/s (prefill; causal FLOPs only) or GB/s of
K/V read (decode), and the speed-up over sdpa.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback

import torch
import triton.testing

from cudaformers.attention.kv_cache import KVCache
from cudaformers.attention.metadata import AttentionBatch
from cudaformers.attention.registry import get_backend

HQ, HKV, D = 16, 8, 128
DTYPE = torch.bfloat16
PAGE = 16
PREFILL = [("1x1k", [1024]), ("1x4k", [4096]), ("1x16k", [16384]), ("1x32k", [32768]), ("8x2k", [2048] * 8),
           ("ragged 12k", [100, 3000, 517, 8000, 64, 700])]
DECODE = [(b, ctx) for b in (1, 32) for ctx in (1024, 4096, 16384, 32768)]


def _backends(requested):
    names = []
    for name in requested:
        if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            print("flash_attention_2: flash-attn is not installed; skipped (it would run the Triton kernel)")
            continue
        names.append(name)
    return names


def _causal_flops(lens):
    return sum(4 * HQ * D * n * (n + 1) / 2 for n in lens)  # QK^T and PV over the visible half


def bench_prefill(name, lens, backward):
    dev = torch.device("cuda")
    backend = get_backend(name, device=dev, dtype=DTYPE, head_dim=D, training=backward)
    batch = AttentionBatch.from_seqlens(lens, dev)
    t = sum(lens)
    q = torch.randn(t, HQ, D, device=dev, dtype=DTYPE, requires_grad=backward)
    k = torch.randn(t, HKV, D, device=dev, dtype=DTYPE, requires_grad=backward)
    v = torch.randn(t, HKV, D, device=dev, dtype=DTYPE, requires_grad=backward)
    dout = torch.randn(t, HQ, D, device=dev, dtype=DTYPE)

    def run():
        out = backend.prefill(q, k, v, batch, D ** -0.5, None)
        if backward:
            torch.autograd.grad(out, (q, k, v), dout)

    with torch.set_grad_enabled(backward):
        ms = triton.testing.do_bench(run, warmup=5, rep=50)
    flops = _causal_flops(lens) * (3.5 if backward else 1.0)  # backward does 2.5x the forward's matmuls
    return ms, f"{flops / ms / 1e9:.0f} TFLOP/s"


def bench_decode(name, batch_size, ctx):
    dev = torch.device("cuda")
    backend = get_backend(name, device=dev, dtype=DTYPE, head_dim=D)
    cache = KVCache(1, batch_size * (-(-ctx // PAGE)), PAGE, HKV, D, DTYPE, dev)
    cache.k[0].normal_()
    cache.v[0].normal_()
    table = cache.contiguous_block_table(batch_size, ctx, dev)
    slots = table[:, (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE
    batch = AttentionBatch.with_cache([1] * batch_size, [ctx] * batch_size, cache, slots, table, dev)
    q = torch.randn(batch_size, HQ, D, device=dev, dtype=DTYPE)

    def run():
        backend.with_cache(q, cache.k[0], cache.v[0], batch, D ** -0.5, None)

    run()  # compile outside the graph
    ms = triton.testing.do_bench_cudagraph(run, rep=50)
    read = 2 * batch_size * ctx * HKV * D * cache.k[0].element_size()
    return ms, f"{read / ms / 1e6:.0f} GB/s"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="triton,sdpa,flex_attention,flash_attention_2")
    parser.add_argument("--only", choices=["prefill", "train", "decode"], default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/attention.py needs a CUDA GPU")
    names = _backends(args.backends.split(","))
    jobs = []
    if args.only in (None, "prefill"):
        jobs += [("prefill fwd", label, lambda n, ls=ls: bench_prefill(n, ls, False)) for label, ls in PREFILL]
    if args.only in (None, "train"):
        jobs += [("prefill fwd+bwd", label, lambda n, ls=ls: bench_prefill(n, ls, True)) for label, ls in PREFILL]
    if args.only in (None, "decode"):
        jobs += [("decode", f"b{b} ctx{c // 1024}k", lambda n, b=b, c=c: bench_decode(n, b, c)) for b, c in DECODE]

    rows = []
    for op, shape, fn in jobs:
        base = None
        for name in (["sdpa"] if "sdpa" in names else []) + [n for n in names if n != "sdpa"]:
            try:
                ms, rate = fn(name)
            except Exception as e:  # a backend failing one shape should not hide the others
                traceback.print_exc(limit=1)
                rows.append((op, shape, name, "error", type(e).__name__, ""))
                continue
            finally:
                torch.cuda.empty_cache()
            base = ms if name == "sdpa" else base
            rows.append((op, shape, name, f"{ms:.3f}", rate, f"{base / ms:.2f}x" if base else ""))
            print(*rows[-1], sep=" | ", flush=True)

    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"Hq={HQ} Hkv={HKV} D={D} {str(DTYPE).removeprefix('torch.')}")
    header = ("op", "shape", "backend", "ms", "rate", "vs sdpa")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
