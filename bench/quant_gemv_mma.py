"""The fragment GEMV (``kernels/quant_gemv_mma.py``, int4 and int8) against the kernels it replaced, on
qwen3-8b's layers at batch 1 (q/k/v and gate/up packed), weights read from HBM (copies cycled past L2).

    python bench/quant_gemv_mma.py [--formats int4,int8] [--layers qkv,o,gate_up,down,lm_head]
        [--variants 8,2,1;8,2,2,s] [--unmasked] [--nowide] [--folds] [--compile-jobs 8]

us per call in a CUDA graph of 50 calls (PDL as in decode; best of five replays), and the packed bytes' rate;
at the end, per variant timed on layers of two or more sizes, a fit of its time as a fixed cost a launch
plus the bytes at a steady rate (``launch_cost_fit``), which tells a ramp-and-tail problem from a slow loop;
the bf16 GEMV of the same layer for scale; gate/up gated for the formats that run it so on this GPU
(``quant_gemv_plans.gated_formats``).
Fragment variants are (warps, tiles a warp, blocks in flight) and a letter for how the blocks load
(``quant_gemv_plans.LOADS``, described in ``quant_gemv_mma.py``): none in registers, "s" staged through
shared memory (``cp.async``), "w" their weights only, "p" in registers past a fence a block, "c" so on the
coherent path, "o" relaxed loads in order, no fence.
``--folds`` instead times gate/up with the act-and-mul in its epilogue against gate/up then the
act-and-mul kernel, at the default plans.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_us  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}  # the vocabulary projection, where it is quantized (modules_to_not_convert=[])
LAYERS = "qkv,o,gate_up,down"  # a decoder layer's four calls (the default)


def layer_shapes(text: str) -> dict[str, tuple[int, int]]:
    unknown = [name for name in text.split(",") if name not in SHAPES]
    if unknown:
        raise SystemExit(f"--layers: unknown {unknown}; choose from {list(SHAPES)}")
    return {name: SHAPES[name] for name in text.split(",")}
VARIANTS = ("8,1,1;16,1,1;4,2,1;8,2,1;8,1,2;16,1,2;4,2,2;8,2,2;8,1,3;16,1,3;4,2,3;8,2,3;"
            "8,1,1,s;16,1,1,s;8,2,1,s;8,1,2,s;16,1,2,s;4,2,2,s;8,2,2,s;16,1,3,s;8,2,3,s")


def parse_variants(text: str) -> list[tuple]:
    """``"8,2,1;8,2,2,s;8,2,2,w"`` -> ``[(8, 2, 1), (8, 2, 2, 1), (8, 2, 2, 2)]``: a letter names how the
    blocks load (``quant_gemv_plans.LOADS``, described in ``quant_gemv_mma.py``): ``s`` staged through
    shared memory, ``w`` their weights only (x loaded in place), ``p`` in registers past a fence, ``c`` so
    on the coherent path, ``o`` relaxed loads kept in order without a fence."""
    return [tuple(int(v) for v in item.split(",")[:3]) + LOAD_LETTERS.get(item.split(",")[-1], ())
            for item in text.split(";") if item]


LOAD_LETTERS = {"s": (1,), "w": (2,), "p": (3,), "c": (4,), "o": (5,)}
LOAD_NAMES = {1: " staged", 2: " staged weights", 3: " pinned", 4: " pinned coherent", 5: " ordered"}


def packed_copies(fmt: str, w32: torch.Tensor, copies: int | None = None):
    """(the packed weight and copies of it that together overflow L2, its bytes)."""
    from cudaformers.kernels import quant_matmul as qm
    from cudaformers.quant.int4 import quantize_int4
    from cudaformers.quant.int8 import quantize_int8

    n, k = w32.shape
    if fmt == "int8":
        q, s = quantize_int8(w32)
        make = lambda: qm.PackedWeight("int8", q.clone(), s.clone(), k)  # noqa: E731
        nbytes = q.numel() + s.numel() * 4
    else:
        q, s, _ = quantize_int4(w32, 128)
        make = lambda: qm.PackedWeight("int4", q.clone(), s.clone(), k, 128)  # noqa: E731
        nbytes = q.numel() + s.numel() * 2
    copies = copies or max(1, -(-256 * 2 ** 20 // nbytes))
    return [make() for _ in range(copies)], nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--layers", default=LAYERS, help=f"qwen3-8b's layers to time, of {list(SHAPES)}")
    ap.add_argument("--variants", default=VARIANTS, help="fragment plans: warps,tiles,depth[,s|w|p|c|o];...")
    ap.add_argument("--unmasked", action="store_true", help="loads without masks where the blocks divide evenly")
    ap.add_argument("--nowide", action="store_true", help="the weights as 8-byte loads (WIDE_LOADS off)")
    ap.add_argument("--best", default=None, help="write the fastest variant per format and layer (JSON) here")
    ap.add_argument("--folds", action="store_true", help="the gated GEMV against its two launches")
    ap.add_argument("--compile-jobs", type=int, default=8,
                    help="processes that compile the variants into the shared Triton cache before the timing")
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.folds:
        return folds(args.formats.split(","))
    if args.compile_only:
        return compile_variants(args)
    if args.compile_jobs > 1:
        compile_in_parallel(args)
    from cudaformers.kernels import quant_matmul as qm
    from cudaformers.kernels import quant_mma
    from cudaformers.kernels.gemv import gemv
    from cudaformers.kernels.quant_gemv import quant_gemv
    from cudaformers.kernels import quant_gemv_mma as module
    from cudaformers.kernels.quant_gemv_mma import quant_gemv_mma
    from cudaformers.kernels.quant_gemv_plans import default_plan, gated_formats

    _set_switches(module, args)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    total: dict[str, float] = {}
    timed: dict[str, list[tuple[int, float]]] = {}  # label -> (bytes, us) a layer, for launch_cost_fit
    best: dict[tuple, dict] = {}
    for name, (n, k) in layer_shapes(args.layers).items():
        w32 = torch.randn(n, k, device="cuda") * 0.02
        x = torch.randn(1, k, device="cuda").bfloat16()
        bf = [w32.bfloat16() for _ in range(max(1, -(-256 * 2 ** 20 // (n * k * 2))))]
        rows = {"bf16 GEMV": (graph_us([lambda w=w: gemv(x, w) for w in bf]), n * k * 2)}
        for fmt in args.formats.split(","):
            ws, nbytes = packed_copies(fmt, w32)
            rows[f"{fmt} FMA GEMV"] = (graph_us([lambda w=w: quant_gemv(x, w) for w in ws]), nbytes)
            if quant_mma.supports(x, ws[0]):
                rows[f"{fmt} tl.dot kernel"] = (graph_us([lambda w=w: quant_mma.quant_mma(x, w) for w in ws]), nbytes)
            ref = qm.quant_matmul_reference(x.float(), ws[0])
            errors = []
            # gate/up as the decode runs it: gated (the act-and-mul in the epilogue) where the format is
            act = "silu" if name == "gate_up" and fmt in gated_formats(x.device) else None
            for plan in parse_variants(args.variants):
                staged = LOAD_NAMES.get(plan[3] if len(plan) > 3 else 0, "")
                us = graph_us([lambda w=w, c=plan: quant_gemv_mma(x, w, plan=c, act=act) for w in ws])
                rows[f"{fmt} fragment {plan[0]}w {plan[1]}t d{plan[2]}{staged}{' gated' if act else ''}"] = (us, nbytes)
                if us < best.get((fmt, n, k), {}).get("us", float("inf")):
                    best[fmt, n, k] = dict(fmt=fmt, n=n, k=k, plan=list(plan), us=round(us, 2))
                errors.append((quant_gemv_mma(x, ws[0], plan=plan).float() - ref).abs().max().item())
            err = (quant_gemv_mma(x, ws[0]).float() - ref).abs().max().item()
            print(f"{name} {n}x{k} {fmt}: {nbytes / 1e6:.1f} MB; fragment GEMV max error {err:.2e}, over the "
                  f"variants at most {max(errors, default=0):.2e} (|ref| max {ref.abs().max():.2f}); default plan "
                  f"{default_plan(n, fmt, x.device)}")
        for label, (us, nbytes) in rows.items():
            print(f"  {label:30s} {us:7.2f} us  {nbytes / 1e6 / us:5.2f} TB/s")
            total[label] = total.get(label, 0.0) + us
            timed.setdefault(label, []).append((nbytes, us))
        if args.best:  # after every layer, so that a run cut short still leaves the layers it timed
            Path(args.best).write_text(json.dumps(list(best.values()), indent=1))
    print(f"the layers together ({args.layers}):", {k: round(v, 2) for k, v in total.items()})
    for label, points in timed.items():
        if len({nbytes for nbytes, _ in points}) >= 2:
            fixed_us, tb_s = launch_cost_fit(points)
            print(f"  {label:30s} {fixed_us:5.2f} us a launch + bytes at {tb_s:4.2f} TB/s (over the layers)")
    if args.best:
        print("fastest:", list(best.values()))


def launch_cost_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of ``us = fixed + bytes / rate`` over layers of different sizes: (fixed us a launch,
    rate in TB/s). A kernel that streams well but pays a ramp and tail each launch shows a large fixed
    part and a rate near the copy bandwidth; one limited by its loop shows a low rate."""
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    slope = (sum((b - mean_b) * (t - mean_t) for b, t in points)
             / sum((b - mean_b) ** 2 for b, _ in points))  # us a byte
    return mean_t - slope * mean_b, 1e-6 / slope


def _set_switches(module, args) -> None:
    module.UNMASKED_EVEN = args.unmasked
    module.WIDE_LOADS = not args.nowide


def _switches(args) -> list[str]:
    return ["--formats", args.formats, "--layers", args.layers] + ["--unmasked"] * args.unmasked + ["--nowide"] * args.nowide


def compile_in_parallel(args) -> None:
    """Each variant is its own compile (mostly ptxas, one after another in one process):
    split over processes that fill the Triton cache the timing process then reads."""
    import subprocess
    import time

    variants = [v for v in args.variants.split(";") if v]
    groups = [";".join(variants[i::args.compile_jobs]) for i in range(min(args.compile_jobs, len(variants)))]
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--compile-only", "--variants", g, *_switches(args)])
             for g in groups]
    failed = [p.args for p in procs if p.wait() != 0]
    print(f"compiled {len(variants)} variants in {len(groups)} processes: {time.perf_counter() - start:.1f} s"
          + (f"; failed: {failed}" if failed else ""))


def compile_variants(args) -> None:
    """One call of each variant (and of it ungated, as the error check runs it) on each layer's shape."""
    from cudaformers.kernels import quant_gemv_mma as module
    from cudaformers.kernels.quant_gemv_mma import quant_gemv_mma
    from cudaformers.kernels.quant_gemv_plans import gated_formats

    _set_switches(module, args)
    for name, (n, k) in layer_shapes(args.layers).items():
        x = torch.randn(1, k, device="cuda").bfloat16()
        for fmt in args.formats.split(","):
            w = packed_copies(fmt, torch.randn(n, k, device="cuda") * 0.02, copies=1)[0][0]
            act = "silu" if name == "gate_up" and fmt in gated_formats(x.device) else None
            for plan in parse_variants(args.variants):
                quant_gemv_mma(x, w, plan=plan, act=act)
                if act:
                    quant_gemv_mma(x, w, plan=plan)
    torch.cuda.synchronize()


def folds(formats: list[str]) -> None:
    """us per chain (each a CUDA graph of 50 over weight copies past L2): the gated GEMV and what it replaces."""
    from cudaformers.kernels.activation import act_and_mul_forward
    from cudaformers.kernels.quant_gemv_mma import quant_gemv_mma

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    n_gu, k = SHAPES["gate_up"]
    x = torch.randn(1, k, device="cuda").bfloat16()
    for fmt in formats:
        gus, _ = packed_copies(fmt, torch.randn(n_gu, k, device="cuda") * 0.02)
        half = n_gu // 2

        def two_launches(w):
            out = quant_gemv_mma(x, w)
            return act_and_mul_forward(out[:, :half], out[:, half:], "silu", pdl=True)

        for label, calls in (("gate/up, then act-and-mul", [lambda w=w: two_launches(w) for w in gus]),
                             ("gate/up gated", [lambda w=w: quant_gemv_mma(x, w, act="silu") for w in gus])):
            print(f"  {fmt} {label:32s} {graph_us(calls):7.2f} us")

if __name__ == "__main__":
    main()
