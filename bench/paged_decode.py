"""Paged decode attention at qwen3-0.6b shapes (Hq=16, Hkv=8, D=128, bf16): before vs after, in CUDA graphs.

    python bench/paged_decode.py [--sweep] [--hot] [--batches 1,32] [--contexts 130,260,1024,8192] [--pages 16,256]

"before" is the kernel as of commit e48641e (bench/baselines/: a split kernel plus a combine
launch), "after" is cudaformers.kernels.paged_decode (one launch), timed without and with
programmatic dependent launch (PDL only overlaps a launch with the previous kernel's tail, so it
shows in a chain of kernels such as the graph of repeated calls timed here, or a decode step).

Cases: batch 1 and 32 at 130, 260, 1,024 and 8,192 keys, in grids sized for a 16k-token capacity
(the engine's decode graphs), with page 16 and shuffled blocks (the engine) and page 256 with each
row's blocks contiguous (generate()'s static cache). Every call reads its own copy of the context,
with enough copies to overflow L2 twice (``--hot``: one copy), because in a model step the other
layers' caches and weights pass through L2 between two calls of one layer. Columns: µs per call
(graph replay, best of 10), the KV bytes read per µs in TB/s, the speed-up, and the largest
difference between the before and after outputs. ``--sweep`` also times a few other tilings.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_us  # noqa: E402
import cudaformers.kernels  # noqa: E402,F401  (the baseline's relative imports resolve against it)
from cudaformers.kernels.paged_decode import DecodeTiling, default_tiling, paged_decode  # noqa: E402

HQ, HKV, D, DTYPE, DEV = 16, 8, 128, torch.bfloat16, "cuda"
CAPACITY = 16384
BATCHES, CONTEXTS, PAGES = (1, 32), (130, 260, 1024, 8192), (16, 256)
SWEEP = [DecodeTiling(64, 4, 3, 512, 2), DecodeTiling(64, 4, 4, 256, 3), DecodeTiling(64, 4, 4, 1024, 3),
         DecodeTiling(128, 4, 2, 512, 1), DecodeTiling(128, 8, 3, 512, 2), DecodeTiling(32, 4, 4, 256, 3),
         DecodeTiling(32, 2, 6, 2048, 5), DecodeTiling(64, 8, 4, 2048, 3), DecodeTiling(16, 2, 8, 2048, 7),
         DecodeTiling(64, 4, 2, 64, 1), DecodeTiling(64, 4, 3, 128, 2), DecodeTiling(32, 4, 3, 64, 2),
         DecodeTiling(64, 4, 4, 128, 1)]


def load_baseline():
    path = ROOT / "bench" / "baselines" / "paged_decode_e48641e.py"
    spec = importlib.util.spec_from_file_location("cudaformers.kernels._paged_decode_e48641e", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kv_bytes(batch: int, context: int) -> int:
    return 2 * batch * context * HKV * D * torch.empty((), dtype=DTYPE).element_size()


def make_case(batch: int, context: int, page: int, copies: int, gen: torch.Generator):
    """One paged cache holding ``copies`` disjoint contexts, and a ``CAPACITY``-wide table per copy."""
    per_seq = -(-context // page)
    spare = copies * batch * per_seq  # the block that table entries past a context name
    k_cache = torch.randn(spare + 1, page, HKV, D, device=DEV, dtype=DTYPE, generator=gen)
    v_cache = torch.randn(spare + 1, page, HKV, D, device=DEV, dtype=DTYPE, generator=gen)
    order = (torch.randperm(spare, device=DEV, generator=gen) if page == 16
             else torch.arange(spare, device=DEV)).to(torch.int32)
    tables = []
    for c in range(copies):
        table = torch.full((batch, CAPACITY // page), spare, dtype=torch.int32, device=DEV)
        table[:, :per_seq] = order[c * batch * per_seq:(c + 1) * batch * per_seq].view(batch, per_seq)
        tables.append(table)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=DTYPE, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
    return q, k_cache, v_cache, lens, tables


def with_pdl(enabled: bool, fn):
    def call():
        os.environ["CUDAFORMERS_PDL"] = "1" if enabled else "0"  # read at each launch
        return fn()
    return call


def print_table(title: str, header, rows) -> None:
    table = [header] + rows
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print(f"\n{title}")
    for r in table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def run_case(before, batch: int, context: int, page: int, copies: int, reps: int, pdl: bool, sweep: bool, gen):
    q, k_cache, v_cache, lens, tables = make_case(batch, context, page, copies, gen)
    scale = D ** -0.5

    def calls(fn, use_pdl=None):
        wrap = (lambda c: c) if use_pdl is None else (lambda c: with_pdl(use_pdl, c))
        return [wrap(lambda t=t: fn(t)) for t in tables]

    old = calls(lambda t: before.paged_decode(q, k_cache, v_cache, lens, t, CAPACITY, scale))
    def new(use_pdl):
        return calls(lambda t: paged_decode(q, k_cache, v_cache, lens, t, CAPACITY, scale), use_pdl)

    diff = (old[0]().float() - new(False)[0]().float()).abs().max().item()
    t_old = graph_us(old, reps, replays=10)
    t_new = graph_us(new(False), reps, replays=10)
    t_pdl = graph_us(new(True), reps, replays=10) if pdl else float("nan")
    best = min(t_new, t_pdl) if pdl else t_new
    nbytes = kv_bytes(batch, context)
    name = f"B={batch} keys={context} page={page}"
    row = (name, f"{nbytes / 1e6:.1f}", str(copies), f"{t_old:.2f}", f"{t_new:.2f}", f"{t_pdl:.2f}",
           f"{nbytes / t_old / 1e6:.2f}", f"{nbytes / best / 1e6:.2f}", f"{t_old / best:.2f}x", f"{diff:.1e}")
    sweep_row = None
    if sweep:
        times = [graph_us(calls(lambda t, s=s: paged_decode(q, k_cache, v_cache, lens, t, CAPACITY, scale, tiling=s),
                                pdl), reps) for s in SWEEP]
        sweep_row = (name, f"{best:.2f}", *[f"{x:.2f}" for x in times])
    return row, sweep_row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time the tilings in SWEEP")
    ap.add_argument("--hot", action="store_true", help="one copy of each context (L2-resident when small)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="e.g. 128,256 for engine decode batches")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--pages", default=",".join(map(str, PAGES)))
    args = ap.parse_args()
    batches, contexts, pages = ([int(x) for x in v.split(",")] for v in (args.batches, args.contexts, args.pages))
    if not torch.cuda.is_available():
        raise SystemExit("paged_decode.py needs a CUDA GPU")
    began = time.perf_counter()
    before = load_baseline()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    pdl = torch.cuda.get_device_capability()[0] >= 9
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows, sweep_rows = [], []
    with torch.inference_mode():
        for batch in batches:
            for context in contexts:
                copies = 1 if args.hot else min(128, max(1, math.ceil(2 * l2 / kv_bytes(batch, context))))
                reps = copies * max(1, math.ceil(16 / copies))
                for page in pages:
                    row, sweep_row = run_case(before, batch, context, page, copies, reps, pdl, args.sweep, gen)
                    rows.append(row)
                    sweep_rows.append(sweep_row)
                    torch.cuda.empty_cache()
    os.environ.pop("CUDAFORMERS_PDL", None)
    dev = torch.device(DEV)
    print(f"\n{torch.cuda.get_device_name()}  Hq={HQ} Hkv={HKV} D={D} bf16, grid capacity {CAPACITY} keys, "
          f"L2 {l2 >> 20} MiB, us per call in a CUDA graph")
    for batch in batches:
        print(f"default tiling at B={batch}: {default_tiling(batch, HKV, D, DTYPE, dev)}")
    print_table("paged decode, before (e48641e) vs after",
                ("case", "KV MB", "copies", "before us", "after us", "+PDL us", "before TB/s", "after TB/s",
                 "speed-up", "max |diff|"), rows)
    if args.sweep:
        labels = [f"n{s.block_n}/w{s.num_warps}/s{s.num_stages}/>{s.split_above}/t{s.split_tiles}" for s in SWEEP]
        print_table("tilings (us per call, PDL on where supported)", ("case", "default", *labels), sweep_rows)
    print(f"\n{time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
