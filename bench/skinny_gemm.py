"""Decode-batch projections (M = 8..128 rows): the skinny Triton GEMM vs F.linear (cuBLAS), in CUDA graphs.

    python bench/skinny_gemm.py                 # heuristic launch plan, ~30 s
    python bench/skinny_gemm.py --sweep --m 32  # also time a grid of plans per shape (minutes)
    python bench/skinny_gemm.py --knobs --m 32 --models 0.6b  # the heuristic plan under each KNOBS setting

Shapes are the four projections of qwen3-0.6b and qwen3-8b (q/k/v and gate/up packed) and the
0.6b vocabulary projection, bf16, no bias. Each op is captured 50 times into one CUDA graph and the graph replayed; the 50 calls cycle
through enough copies of the weight to overflow L2, so every call streams its weights from HBM as
a decode step does (each layer has its own). TB/s counts weight bytes only. The last tables give the
crossover (the row counts where the skinny kernel wins, per shape) and the four projections of one
layer summed, which is what a decode step gains per layer.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_us  # noqa: E402
from cudaformers.kernels.skinny_gemm import (  # noqa: E402
    SkinnyConfig, pipeline_stages, plan, skinny_linear, sm_count)

DTYPE = torch.bfloat16
REPS = 50
SHAPES = [  # model, projection, N, K
    ("0.6b", "qkv", 4096, 1024), ("0.6b", "o", 1024, 2048), ("0.6b", "gate_up", 6144, 1024), ("0.6b", "down", 1024, 3072),
    ("8b", "qkv", 6144, 4096), ("8b", "o", 4096, 4096), ("8b", "gate_up", 24576, 4096), ("8b", "down", 4096, 12288),
    ("0.6b", "lm_head", 151936, 1024),  # once per step, not per layer: left out of the layer sums
]
LAYER = ("qkv", "o", "gate_up", "down")


# name -> skinny_gemm module settings: how deep a program alone on its SM pipelines, and how many
# programs per SM 17-32-row launches aim for.
KNOBS = {
    "default": {},
    "alone: 3 stages": {"ALONE_STAGES": 3},
    "alone: 4 stages": {"ALONE_STAGES": 4},
    "alone: 6 stages": {"ALONE_STAGES": 6},
    "1/2 per SM": {"WIDE_PROGRAMS_PER_SM": 0.5},
    "1/4 per SM": {"WIDE_PROGRAMS_PER_SM": 0.25},
}


def knob_ab(models: list[str], ms: list[int]) -> None:
    """The heuristic plan timed under each KNOBS setting, per shape and summed per layer."""
    from cudaformers.kernels import skinny_gemm

    saved = {k: getattr(skinny_gemm, k) for v in KNOBS.values() for k in v}
    rows, layer = [], {}
    for model, name, n, k in SHAPES:
        if model not in models:
            continue
        ws = weight_copies(n, k)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            cells = []
            for label, knobs in KNOBS.items():
                for key, value in {**saved, **knobs}.items():
                    setattr(skinny_gemm, key, value)
                us = graph_us([lambda w=w: skinny_linear(x, w) for w in ws])
                cells.append(f"{us:.2f}")
                if name in LAYER:
                    layer[model, m, label] = layer.get((model, m, label), 0.0) + us
            rows.append((f"{model} {name}", str(m), *cells))
        del ws
        torch.cuda.empty_cache()
    for key, value in saved.items():
        setattr(skinny_gemm, key, value)
    print("\nus per call, weights from HBM, by setting")
    table(("shape", "M", *KNOBS), rows)
    table(("layer", "M", *KNOBS), [(model, str(m), *(f"{layer[model, m, lb]:.2f}" for lb in KNOBS))
                                   for model in models for m in ms])


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    count = min(REPS, max(1, -(-2 * l2 // (n * k * DTYPE.itemsize))))
    return [(torch.randn(n, k, device="cuda") / k ** 0.5).to(DTYPE) for _ in range(count)]


def sweep_configs(m: int, n: int, k: int) -> list[SkinnyConfig]:
    block_m = min(max(16, triton.next_power_of_2(m)), 128)
    out = []
    for block_n, block_k, splits, warps in itertools.product((16, 32, 64, 128), (64, 128, 256), (1, 2, 4, 8),
                                                             (4, 8)):
        if block_m > 64 and block_k > 128:
            continue
        per = -(-k // block_k) // splits
        tiles = -(-n // block_n) * -(-m // block_m)
        if per >= 1 and (splits == 1 or tiles <= 4096):
            out.append(SkinnyConfig(block_m, block_n, block_k, per * block_k, num_warps=warps,
                                    num_stages=pipeline_stages(block_m, block_n, block_k, DTYPE.itemsize, per)))
    return out


def _compile_shapes(jobs: list[tuple[int, int, int, list[SkinnyConfig]]]) -> None:
    """One worker's share of the sweep's kernels, compiled by calling each once: the kernels land in
    the Triton cache on disk, where the timing process finds them."""
    for m, n, k, configs in jobs:
        x = torch.zeros(m, k, device="cuda", dtype=DTYPE)
        w = torch.zeros(n, k, device="cuda", dtype=DTYPE)
        for c in configs:
            skinny_linear(x, w, config=c)
    torch.cuda.synchronize()


def precompile(shapes: list[tuple[int, int, int]], workers: int) -> None:
    """Compile the whole grid in parallel first: one at a time, compiling takes most of a sweep."""
    jobs = [{} for _ in range(workers)]  # per worker: shape -> its configs (one weight allocation each)
    for i, (m, n, k, c) in enumerate((m, n, k, c) for m, n, k in shapes for c in sweep_configs(m, n, k)):
        jobs[i % workers].setdefault((m, n, k), []).append(c)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(_compile_shapes, [[(*shape, cs) for shape, cs in j.items()] for j in jobs if j])


def describe(cfg: SkinnyConfig, k: int) -> str:
    return f"n{cfg.block_n}/m{cfg.block_m}/k{cfg.block_k} x{-(-k // cfg.k_split)} s{cfg.num_stages} w{cfg.num_warps}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="rows (tokens) per call")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch plans per shape")
    parser.add_argument("--models", default="0.6b,8b", help="which models' shapes to time")
    parser.add_argument("--knobs", action="store_true", help="only time the heuristic plan under each KNOBS setting")
    parser.add_argument("--compile-workers", type=int, default=min(16, multiprocessing.cpu_count()),
                        help="processes that compile the sweep's kernels before it is timed")
    args = parser.parse_args()
    models = args.models.split(",")
    t0 = time.perf_counter()
    if args.knobs:
        knob_ab(models, args.m)
        return
    if args.sweep and args.compile_workers > 1:
        precompile([(m, n, k) for model, _, n, k in SHAPES if model in models for m in args.m], args.compile_workers)
        print(f"compiled the sweep's kernels in {time.perf_counter() - t0:.0f} s")
    sms = sm_count(torch.device("cuda"))
    rows, best_rows = [], []
    times: dict[tuple, tuple[float, float]] = {}
    for model, name, n, k in SHAPES:
        if model not in models:
            continue
        ws = weight_copies(n, k)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            ref = F.linear(x.float(), ws[0].float())
            err = ((skinny_linear(x, ws[0]).float() - ref).abs().max() / ref.abs().max()).item()
            cublas = graph_us([lambda w=w: F.linear(x, w) for w in ws])
            ours = graph_us([lambda w=w: skinny_linear(x, w) for w in ws])
            times[model, name, m] = (cublas, ours)
            cfg = plan(m, n, k, DTYPE, sms)
            tbs = n * k * DTYPE.itemsize / ours / 1e6
            rows.append((f"{model} {name}", f"{n}x{k}", str(m), f"{cublas:.1f}", f"{ours:.1f}", f"{tbs:.2f}",
                         f"{cublas / ours:.2f}x", describe(cfg, k), f"{err:.1e}"))
            if args.sweep:
                timed = [(graph_us([lambda w=w, c=c: skinny_linear(x, w, config=c) for w in ws]), c)
                         for c in sweep_configs(m, n, k)]
                us, c = min(timed, key=lambda t: t[0])
                best_rows.append((f"{model} {name}", str(m), f"{ours:.1f}", describe(cfg, k), f"{us:.1f}",
                                  describe(c, k), f"{n * k * DTYPE.itemsize / us / 1e6:.2f}"))
        del ws
        torch.cuda.empty_cache()

    print(f"\n{torch.cuda.get_device_name()} ({sms} SMs), {str(DTYPE)[6:]}, us per call in a graph of {REPS}, "
          "weights from HBM")
    table(("shape", "N x K", "M", "cuBLAS us", "skinny us", "TB/s", "speed-up", "plan (tile/split/stages)", "rel err"),
          rows)
    if best_rows:
        print("\nsweep: heuristic plan vs the best of the grid")
        table(("shape", "M", "heuristic us", "plan", "best us", "best plan", "TB/s"), best_rows)
    print("\ncrossover: rows where the skinny kernel beats cuBLAS")
    table(("shape", "wins at M", "loses at M"),
          [(f"{model} {name}", " ".join(str(m) for m in args.m if times[model, name, m][1] < times[model, name, m][0]),
            " ".join(str(m) for m in args.m if times[model, name, m][1] >= times[model, name, m][0]))
           for model, name, _, _ in SHAPES if model in models])
    print("\nper layer (4 projections summed)")
    layer_rows = []
    for model, m in itertools.product(models, args.m):
        pairs = [times[model, name, m] for mdl, name, _, _ in SHAPES if mdl == model and name in LAYER]
        cublas, ours, best = (sum(p[0] for p in pairs), sum(p[1] for p in pairs), sum(min(p) for p in pairs))
        layer_rows.append((model, str(m), f"{cublas:.1f}", f"{ours:.1f}", f"{best:.1f}", f"{cublas / best:.2f}x"))
    table(("model", "M", "cuBLAS us", "skinny us", "best-of us", "speed-up"), layer_rows)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


def table(header, rows) -> None:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


if __name__ == "__main__":
    main()
