"""Host time of one ``F.linear`` launch at prefill sizes, when the row count repeats and when each
call brings a new one (a serving engine's mixed steps: a new token count every step).

    python bench/linear_host.py

Launch-only time (no synchronisation between calls, the GPU kept ahead by a long first kernel),
median over calls, for the four projections of a qwen3-0.6b layer; then the same with each BLAS
library torch offers, with the rows padded to a multiple of 128, and in an engine-like pattern (one
new row count per step, shared by all 28 layers' four projections).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

_next_rows = [7001]  # every engine-like step brings a row count no call has used
SHAPES = {"q/k/v": (4096, 1024), "o": (1024, 2048), "gate/up": (6144, 1024), "down": (1024, 3072)}


def host_us(rows_seq, n, k, pad_to: int = 0) -> float:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in set(rows_seq)}
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the GPU busy for a while: launches only queue, never wait
    times = []
    for m in rows_seq:
        t = time.perf_counter()
        if pad_to:
            x = xs[m]
            F.linear(F.pad(x, (0, 0, 0, -m % pad_to)), w)[:m]
        else:
            F.linear(xs[m], w)
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def engine_like_us(steps: int, layers: int = 28) -> float:
    """Mean host us per linear when each step brings a new row count for all layers' projections."""
    ws = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n, k in SHAPES.values()] for _ in range(layers)]
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    calls, start = 0, time.perf_counter()
    for s in range(steps):
        m = _next_rows[0]
        _next_rows[0] += 13
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES.values()}
        for layer in ws:
            for w in layer:
                F.linear(xs[w.shape[1]], w)
                calls += 1
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"default BLAS library: {torch.backends.cuda.preferred_blas_library()}")
    for i in range(3):
        print(f"  engine-like, default library, round {i}: {engine_like_us(4):7.1f} us a call")
    for lib in ("cublaslt", "cublas"):
        torch.backends.cuda.preferred_blas_library(lib)
        print(f"preferred BLAS library: {torch.backends.cuda.preferred_blas_library()}")
        for name, (n, k) in SHAPES.items():
            host_us([8192] * 20, n, k)  # warm-up
            same = host_us([8192] * 40, n, k)
            new = host_us(list(range(8001 + 1000 * (lib == "cublas"), 8041 + 1000 * (lib == "cublas"))), n, k)
            print(f"  {name:8} N={n:5} K={k:5}: same row count {same:7.1f} us, a new row count each call {new:7.1f} us")
        padded = host_us(list(range(6001 + 500 * (lib == "cublas"), 6041 + 500 * (lib == "cublas"))), 4096, 1024, 128)
        print(f"  q/k/v, a new row count each call padded to a multiple of 128: {padded:7.1f} us")
        for i in range(2):
            print(f"  engine-like (a new row count per step, 28 layers x 4 projections), round {i}: "
                  f"{engine_like_us(4):7.1f} us a call")


if __name__ == "__main__":
    main()
