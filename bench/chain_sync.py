"""What a dependency between two kernels of a decode step costs, by how the consumer waits.

    python bench/chain_sync.py [--layers 28] [--reps 50]

A batch-1 decode step of qwen3-0.6b is a chain of ~170 launches, each a few microseconds long and
most of that latency. This script chains one-row GEMVs in the shapes of the step's projections (q/k/v,
o, gate/up, down per layer) in one CUDA graph and times a replay per link, with the consumer waiting
in one of four ways:

- ``plain``: no programmatic dependent launch; each grid starts when the previous one has ended;
- ``gdc``: PDL as the decode kernels use it (``pdl.py``): the grid is scheduled early, loads its
  weights, and ``griddepcontrol.wait`` blocks until the producer grid has completed;
- ``flag``: scheduled early as with ``gdc``, but each program polls an arrival counter that every
  producer program bumps (release, GPU scope) after its stores, so it may start as soon as the last
  producer program has stored, not when the producer grid has retired;
- ``flag-early``: as ``flag``, with the next grid released before the poll (up to three grids
  resident at once).

The weights are copies past L2 (cold, as in a real step) or one copy (hot, to see the sync alone).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = {"plain": 0, "gdc": 1, "flag": 2, "flag-early": 3, "flag-one": 4}

# One thread per program polls (acquire, GPU scope), the others wait at a barrier behind it: 1/128th
# of ``flag``'s polling traffic on the counter's line. Bounded as ``_poll`` is.
_SPIN_ONE = tl.constexpr("""{
.reg .pred %cs_p<3>;
.reg .b32 %cs_t, %cs_v, %cs_n;
mov.u32 %cs_t, %tid.x;
mov.u32 %cs_n, 0;
setp.ne.u32 %cs_p0, %cs_t, 0;
@%cs_p0 bra CS_DONE${:uid};
CS_SPIN${:uid}:
ld.acquire.gpu.global.b32 %cs_v, [$1];
add.u32 %cs_n, %cs_n, 1;
setp.lt.s32 %cs_p1, %cs_v, $2;
setp.lt.u32 %cs_p2, %cs_n, 65536;
and.pred %cs_p1, %cs_p1, %cs_p2;
@%cs_p1 bra CS_SPIN${:uid};
CS_DONE${:uid}:
mov.u32 $0, 0;
}""")


@triton.jit
def _poll(flag_ptr, expected):
    # A volatile spin (no read-modify-write traffic on the line), then one acquire to order the
    # loads that follow after the producers' released stores.
    # Bounded, so that a bug here shows as a wrong result rather than a hung GPU.
    spins = 0
    while (tl.load(flag_ptr, volatile=True) < expected) & (spins < 1 << 16):
        spins += 1
    tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _link(x_ptr, w_ptr, y_ptr, flags, wait_idx, expected, arrive_idx,
          K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    k_ok = cols < K
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=k_ok[None, :], other=0.0)
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 2:
        _poll(flags + wait_idx, expected)
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 3:
        tl.extra.cuda.gdc_launch_dependents()
        _poll(flags + wait_idx, expected)
    if MODE == 4:
        tl.inline_asm_elementwise(_SPIN_ONE, "=r,l,r", [flags + wait_idx, expected], dtype=tl.int32,
                                  is_pure=False, pack=1)
        tl.debug_barrier()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + cols, mask=k_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    y = tl.sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))
    if MODE >= 2:
        tl.debug_barrier()  # every thread's store lands before the one release below
        tl.atomic_add(flags + arrive_idx, 1, sem="release", scope="gpu")


def build_chain(layers: int, copies: int, device):
    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)] * layers
    weights = [[torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for (n, k) in shapes]
               for _ in range(copies)]
    acts = [torch.randn(max(n for n, _ in shapes), device=device, dtype=torch.bfloat16) for _ in range(2)]
    return shapes, weights, acts


def launch_chain(shapes, weights, acts, flags, mode: int):
    elements = 8192
    flags.zero_()
    # The first link follows the zeroing kernel, which ends before it starts: it waits for no arrival
    # (0 expected) but counts its own.
    expected = 0
    for i, ((n, k), w) in enumerate(zip(shapes, weights)):
        block_k = triton.next_power_of_2(k)
        block_n = max(1, elements // block_k)
        programs = triton.cdiv(n, block_n)
        _link[(programs,)](acts[i % 2], w, acts[(i + 1) % 2], flags, max(i - 1, 0), expected, i,
                           K=k, BLOCK_N=block_n, BLOCK_K=block_k, MODE=mode, num_warps=4, launch_pdl=mode > 0)
        expected = programs


def time_mode(shapes, weight_copies, acts, flags, mode: int, reps: int) -> float:
    torch.cuda.synchronize()
    for w in weight_copies:
        launch_chain(shapes, w, acts, flags, mode)  # compile, warm
    torch.cuda.synchronize()
    graphs = []
    for w in weight_copies:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            launch_chain(shapes, w, acts, flags, mode)
        graphs.append(g)
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for r in range(reps):
        graphs[r % len(graphs)].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3 / len(shapes)  # us per link


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    flags = torch.zeros(4 * args.layers + 8, dtype=torch.int32, device=device)
    rows = []
    for temp, copies in (("hot", 1), ("cold", 2)):
        shapes, weight_copies, acts = build_chain(args.layers, copies, device)
        mb = sum(n * k * 2 for n, k in shapes) / 1e6
        for name, mode in MODES.items():
            us = time_mode(shapes, weight_copies, acts, flags, mode, args.reps)
            steps = us * len(shapes)
            rows.append(dict(weights=temp, mode=name, us_per_link=round(us, 3), us_per_chain=round(steps, 1),
                             tb_s=round(mb / steps, 3)))
            print(f"{temp:4s} {name:10s} {us:7.3f} us/link  {steps:8.1f} us/chain  {mb / steps:5.2f} TB/s", flush=True)
        del weight_copies
    # Check the flag chain computes what the plain chain does (same inputs, same order of links).
    shapes, weight_copies, acts = build_chain(2, 1, device)
    outs = []
    for mode in (0, 2, 3, 4):
        acts[0].copy_(torch.linspace(-1, 1, acts[0].numel(), device=device))
        launch_chain(shapes, weight_copies[0], acts, flags, mode)
        torch.cuda.synchronize()
        outs.append(acts[len(shapes) % 2][:1024].clone())
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    print("flag chains equal the plain chain:", same)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(bench="chain_sync", gpu=torch.cuda.get_device_name(), **r)) + "\n")


if __name__ == "__main__":
    main()
