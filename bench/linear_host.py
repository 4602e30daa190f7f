"""Host time of one ``F.linear`` launch at prefill sizes, when the row count repeats and when each
call brings a new one (a serving engine's mixed steps: a new token count every step).

    python bench/linear_host.py

Launch-only time (no synchronisation between calls, the GPU kept ahead by a long first kernel),
median over calls, for the four projections of a qwen3-0.6b layer.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"q/k/v": (4096, 1024), "o": (1024, 2048), "gate/up": (6144, 1024), "down": (1024, 3072)}


def host_us(rows_seq, n, k) -> float:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in set(rows_seq)}
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the GPU busy for a while: launches only queue, never wait
    times = []
    for m in rows_seq:
        t = time.perf_counter()
        F.linear(xs[m], w)
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, (n, k) in SHAPES.items():
        host_us([8192] * 20, n, k)  # warm-up
        same = host_us([8192] * 40, n, k)
        new = host_us(list(range(8001, 8041)), n, k)
        print(f"{name:8} N={n:5} K={k:5}: same row count {same:7.1f} us, a new row count each call {new:7.1f} us")


if __name__ == "__main__":
    main()
