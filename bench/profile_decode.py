"""Where a decode step's time goes: kernels per step and GPU time by kernel, eager vs graph replay.

    python bench/profile_decode.py [--shape qwen3-0.6b] [--batch 1] [--attn triton] [--kernels]
                                   [--quant int4|int8|...]   (a method of bench/quant.py)
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--quant", default=None, help="a method of bench/quant.py (int4, int8, int4_head, ...)")
    args = ap.parse_args()
    from cudaformers import AutoModelForCausalLM
    from cudaformers.generation.decode import get_runner

    from quant import method_config

    folder = random_checkpoint(args.shape, Path(f"/tmp/bench-{args.shape}"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                 attn_implementation=args.attn, use_kernels=args.kernels,
                                                 quantization_config=method_config(args.quant or "bf16"))
    ids = torch.randint(1000, 100000, (args.batch, 128), device="cuda")
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8)
        runners = {}
        for graph in (False, True):
            r = get_runner(model, args.batch, 128 + 256, graph)
            tok = torch.zeros(args.batch, dtype=torch.long, device="cuda")
            pos = torch.full((args.batch,), 130, device="cuda")
            for _ in range(3):
                r.decode(tok, pos)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                r.decode(tok, pos)
            end.record()
            torch.cuda.synchronize()
            runners[graph] = start.elapsed_time(end) / 50
            if not graph:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        r.decode(tok, pos)
                    torch.cuda.synchronize()
    by_name, count, total = defaultdict(float), defaultdict(int), 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:70]] += e.device_time / 5
            count[e.name[:70]] += 1
            total += e.device_time / 5
    n = sum(count.values()) / 5
    print(f"{args.shape} {args.quant or 'bf16'} batch {args.batch} attn {args.attn} kernels {args.kernels}: "
          f"{n:.0f} kernels/step, "
          f"GPU busy {total / 1000:.3f} ms/step; eager step {runners[False]:.3f} ms, graph step {runners[True]:.3f} ms "
          f"-> {args.batch * 1000 / runners[True]:.0f} tok/s")
    for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:40]:
        print(f"  {t / 1000:8.4f} ms  {count[name] / 5:6.0f}x  {name}")


if __name__ == "__main__":
    main()
