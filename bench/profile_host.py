"""Where the host's time goes in eager (not graph-captured) forwards: a decode step and a prefill.

    python bench/profile_host.py [--shape qwen3-0.6b] [--attn triton] [--kernels] [--top 25]

Eager forwards run whenever a CUDA graph cannot: prompts in generate(), the engine's mixed prefill
steps. There the GPU waits on the host, so the host's cost per launch is the step's cost. Prints the
wall time per eager decode step and per 128-token prefill (GPU synchronised), the kernels launched,
and cProfile's heaviest functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_checkpoint  # noqa: E402


def wall_ms(fn, reps: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000 / reps


def kernels_per_call(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def profile(name: str, fn, reps: int, top: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    print(f"--- {name}: cProfile over {reps} calls, by own time")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    from cudaformers import AutoModelForCausalLM
    from cudaformers.generation.decode import get_runner

    folder = random_checkpoint(args.shape, Path(f"/tmp/bench-{args.shape}"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                 attn_implementation=args.attn, use_kernels=args.kernels)
    with torch.inference_mode():
        model.generate(torch.randint(1000, 100000, (1, 128), device="cuda"), max_new_tokens=4, min_new_tokens=4)
        runner = get_runner(model, 1, 128 + 256, False)
        tok = torch.zeros(1, dtype=torch.long, device="cuda")
        pos = torch.full((1,), 130, device="cuda")
        ids = torch.randint(1000, 100000, (128,), device="cuda")

        def decode():
            runner.decode(tok, pos)

        def prefill():  # what generate() runs for a prompt when graphs are off
            runner.prompt([ids])

        for fn in (decode, prefill):
            fn()
        rows = [(name, wall_ms(fn, 20), kernels_per_call(fn)) for name, fn in (("decode", decode),
                                                                              ("prefill 128", prefill))]
        for name, ms, n in rows:
            print(f"{args.shape} attn={args.attn} kernels={args.kernels} eager {name}: {ms:.3f} ms wall, "
                  f"{n} kernels, {1000 * ms / max(n, 1):.1f} us per kernel")
        profile("eager decode", decode, 20, args.top)
        profile("prefill 128", prefill, 10, args.top)


if __name__ == "__main__":
    main()
