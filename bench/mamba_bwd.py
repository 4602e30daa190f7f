"""Mamba training ops, forward + backward: Triton kernels vs the PyTorch references (time, peak memory).

    python bench/mamba_bwd.py [--batch 4] [--seq 2048] [--channels 3072] [--state 16]

Defaults: one Mamba-1.4B layer (intermediate 3072, state 16). Prints one table.
"""

from __future__ import annotations

import argparse
import time

import torch

from cudaformers.kernels.mamba import causal_conv1d, causal_conv1d_reference, selective_scan, \
    selective_scan_reference


def measure(fn, inputs, repeats: int) -> tuple[float, float]:
    """(ms per fwd+bwd, peak GiB above the inputs)."""
    def step():
        leaves = [t.detach().requires_grad_() for t in inputs]  # all trainable, as in a Mamba layer
        out = fn(*leaves)[0]
        out.float().sum().backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / repeats * 1e3
    return ms, (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--channels", type=int, default=3072)
    p.add_argument("--state", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    dtype, dev = getattr(torch, args.dtype), "cuda"
    b, i, seq, n = args.batch, args.channels, args.seq, args.state
    act = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype)  # noqa: E731
    conv_in = [act(b, i, seq), act(i, 4), act(i)]
    scan_in = [act(b, i, seq), act(b, i, seq), -torch.exp(torch.randn(i, n, device=dev)), act(b, n, seq),
               act(b, n, seq), torch.randn(i, device=dev), act(b, i, seq), torch.randn(i, device=dev)]
    rows = []
    for what, kernel, ref, inputs, reps in [
        ("causal_conv1d+silu", lambda *a: causal_conv1d(*a, silu=True),
         lambda *a: causal_conv1d_reference(*a, silu=True), conv_in, 20),
        ("selective_scan", selective_scan, selective_scan_reference, scan_in, 3),
    ]:
        k_ms, k_mem = measure(kernel, inputs, reps)
        r_ms, r_mem = measure(ref, inputs, reps)
        rows.append((what, k_ms, r_ms, r_ms / k_ms, k_mem, r_mem))
    print(f"\nfwd+bwd, B={b} I={i} L={seq} N={n} {args.dtype}, {torch.cuda.get_device_name()}")
    print(f"{'op':<20}{'triton ms':>11}{'torch ms':>11}{'speedup':>9}{'triton GiB':>12}{'torch GiB':>11}")
    for what, k_ms, r_ms, sp, k_mem, r_mem in rows:
        print(f"{what:<20}{k_ms:>11.2f}{r_ms:>11.2f}{sp:>8.1f}x{k_mem:>12.2f}{r_mem:>11.2f}")


if __name__ == "__main__":
    main()
