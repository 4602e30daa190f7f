"""Where a W1 generate() call's time goes: the per-token cost against the fixed cost per call.

    python bench/generate_overhead.py [--shape qwen3-0.6b] [--batch 1]

W1 (batch 1, 128-token prompt, 256 new tokens) measured 1,160 tok/s, i.e. 221 ms a call, while the
captured decode step alone took 0.78 ms (200 ms for 256 tokens). This script times whole calls at
several lengths (median of 5, GPU synchronised) and splits them: the slope between the two longest
is the cost of one more token, the intercept the cost every call pays once (prompt, setup, result).
Then one 64-token call runs under the profiler: GPU busy time against wall time, and the host
functions that took longest, so a fixed cost shows whether the GPU or the host spends it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, random_checkpoint  # noqa: E402

PROMPT = 128
LENGTHS = (1, 2, 17, 65, 256)


def call_ms(model, ids, new: int, reps: int = 5) -> float:
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--phases", action="store_true", help="only split one-token calls into generate()'s phases")
    args = ap.parse_args()

    from cudaformers import AutoModelForCausalLM

    env = environment()
    model = AutoModelForCausalLM.from_pretrained(random_checkpoint(args.shape), dtype=torch.bfloat16,
                                                 device_map="cuda", attn_implementation="triton", use_kernels=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 100000, (args.batch, PROMPT), generator=g).cuda()
    model.generate(ids, max_new_tokens=256, min_new_tokens=256, do_sample=False, eos_token_id=None)  # warm up
    print(f"{env['gpu']}, torch {env['torch']}, commit {env['commit']}: {args.shape}, batch {args.batch}, "
          f"{PROMPT}-token prompt")
    if args.phases:
        return phases(model, ids, args.top)
    times = {n: call_ms(model, ids, n) for n in LENGTHS}
    for n, ms in times.items():
        print(f"  {n:>4} new tokens: {ms:8.2f} ms per call ({args.batch * n / ms * 1e3:8.1f} tok/s)")
    a, b = LENGTHS[-2], LENGTHS[-1]
    per_token = (times[b] - times[a]) / (b - a)
    fixed = times[b] - per_token * b
    print(f"  per token {per_token:.3f} ms, fixed per call {fixed:.2f} ms "
          f"({fixed / times[b]:.0%} of a {b}-token call); the first token (prompt + setup) {times[1]:.2f} ms")

    from torch.profiler import ProfilerActivity, profile

    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    events = prof.key_averages()
    gpu_us = sum(getattr(e, "self_device_time_total", 0) for e in events if e.device_type.name == "CUDA")
    print(f"\n64-token call under the profiler: wall {wall:.2f} ms, GPU busy {gpu_us / 1e3:.2f} ms")
    host = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: e.cpu_time_total,
                  reverse=True)[: args.top]
    for e in host:
        print(f"  {e.cpu_time_total / 1e3:9.3f} ms  {e.count:5}x  {e.key[:80]}")
    return 0


def phases(model, ids, top: int, reps: int = 20) -> int:
    """One-token calls split into generate()'s phases: each phase's wall time with the GPU synchronised
    before and after it (host + GPU), then a cProfile of unsynchronised calls (host alone)."""
    import cProfile
    import pstats
    from collections import defaultdict

    from cudaformers.generation import decode, generate, loop, prefill

    spent = defaultdict(list)

    def timer(name, fn):
        def wrapped(*a, **k):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            spent[name].append((time.perf_counter() - t) * 1e3)
            return out
        return wrapped

    patches = [(generate, "resolve_config"), (generate, "prepare_prompts"), (generate, "get_runner"),
               (generate, "sampling_state"), (generate, "run_loop"), (decode.DecodeRunner, "loop"),
               (prefill.PromptPass, "__call__"), (loop.LoopState, "start")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patches]
    kw = dict(max_new_tokens=1, min_new_tokens=1, do_sample=False, eos_token_id=None)
    try:
        for obj, name, fn in saved:
            setattr(obj, name, timer(name, fn))
        for _ in range(reps):
            call_ms(model, ids, 1, reps=1)
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    whole = call_ms(model, ids, 1, reps=reps)
    print(f"one-token call {whole:.2f} ms unsynchronised inside (median of {reps}); phases, synchronised:")
    for name, ms in spent.items():
        print(f"  {statistics.median(ms):8.3f} ms  {name}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(ids, **kw)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    busy = sum(e.self_device_time_total for e in kernels)
    print(f"\nGPU kernels of one one-token call: busy {busy / 1e3:.3f} ms")
    for e in sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:12]:
        print(f"  {e.self_device_time_total / 1e3:8.3f} ms {e.count:5}x  {e.key[:90]}")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        model.generate(ids, **kw)
    torch.cuda.synchronize()
    profiler.disable()
    print(f"\nhost cProfile of {reps} one-token calls (cumulative):")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
