"""Quantized inference and QLoRA on one GPU: kernels, W1/W2 decode per method, and a QLoRA step.

    python bench/quant.py [--parts kernels,tiles,mma,decode,qlora] [--shapes qwen3-0.6b,qwen3-8b]
                          [--methods bf16,int8,int4,nf4,fp8,int8_head,int4_head] [--json out.jsonl]

kernels: the quantized matmul of each qwen3-8b decode layer shape (q/k/v and gate/up packed) at
M = 1 and 16 against the bf16 path of use_kernels (GEMV / skinny GEMM): microseconds per call from
CUDA-graph replays cycling through weight copies larger than L2, GB/s of weight bytes (packed +
scales) and their share of the measured copy bandwidth. tiles: the M = 1 quantized GEMV at each
BLOCK_N (the default marked), to tune ``quant_gemv.gemv_tiles``. mma: the tensor-core kernel
(``quant_mma``) at M = 1 and 16 over its tilings, with and without its PTX unpack, beside the kernel it
replaces. Decode methods may end in switches: ``_fma`` (the FMA GEMV instead of the tensor-core kernel), ``_dot``
(batch 1 without the fragment GEMV), ``_gated`` / ``_nogated`` (``quant_gemv_plans.GATED`` for both formats or
none: gate/up's act-and-mul in the fragment GEMV; by default int4 only), ``_unmasked``
(``quant_gemv_mma.UNMASKED_EVEN``), ``_wide`` / ``_nowide`` (``WIDE_LOADS``, on by default), ``_lat`` (the
batch-1 paged decode's tiling before run 23: 32 KB K tiles), ``_plans`` (the fragment GEMV's plans per layer
from ``--plans``, as ``bench/quant_gemv_mma.py --best`` writes them), ``_actorder`` (int4 layers reading x in
an act-order GPTQ checkpoint's feature order: the gather's cost), e.g. ``int4_nogated_nowide``. decode: W1/W2 (generate, batch 1,
128-token prompt, 256 new tokens, greedy; triton attention and use_kernels=True for every method, bf16 too) per method
on the same saved random weights, with peak memory. qlora: one NF4 + LoRA (r 16, all linear layers)
training step on qwen3-8b shapes at batch 1 x 2048 with gradient checkpointing: peak memory (goal <= 12 GiB) and step time. Each case runs in its own
try/except: a failure is printed and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, emit, environment, graph_us, random_checkpoint, timed  # noqa: E402

PROMPT, NEW = 128, 256
GIB = 1 << 30


def method_config(name: str):
    from cudaformers import BitsAndBytesConfig, FP8Config, Int4Config, Int8Config

    # "_head": the vocabulary projection quantized too (by default it stays bf16: 1.25 GB a token at 8b).
    return {"bf16": None, "int8": Int8Config(), "int4": Int4Config(group_size=128),
            "int8_head": Int8Config(modules_to_not_convert=[]),
            "int4_head": Int4Config(group_size=128, modules_to_not_convert=[]),
            "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16"),
            "nf4_dq": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                         bnb_4bit_compute_dtype="bfloat16"),
            "fp8": FP8Config()}[name]


def _free():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _bf16_layer(linear):
    """The bf16 path of use_kernels: the GEMV up to 4 rows, the skinny GEMM for 5-32, cuBLAS above."""
    from cudaformers.kernels.gemv import linear as gemv_linear
    from cudaformers.kernels.skinny_gemm import skinny_applies, skinny_linear

    def run(x):
        if skinny_applies(linear.weight, x):
            return skinny_linear(x, linear.weight, None)
        return gemv_linear(x, linear.weight, None)
    return run


def _copies(layer, nbytes: int) -> list:
    """Enough copies of ``layer`` that cycling through them overflows L2 (every call reads HBM)."""
    import copy

    return [layer] + [copy.deepcopy(layer) for _ in range(max(0, -(-256 * 2 ** 20 // nbytes) - 1))]


def _layer_bytes(layer) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


# qwen3-8b decoder shapes with q/k/v and gate/up packed, as decode runs them
KERNEL_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def bench_kernels(methods, bw, env, json_path, ms=(1, 16)) -> list[dict]:
    """Per layer shape, method and M: microseconds per call (CUDA graph, weights cycled past L2), the
    weight bytes (packed + scales) streamed per second and the speedup over the bf16 path."""
    from cudaformers.quant.apply import quantize

    rows = []
    for label, (n, k) in KERNEL_SHAPES.items():
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        torch.nn.init.normal_(linear.weight, std=0.02)
        layers = {}
        for method in methods:
            try:
                if method == "bf16":
                    layers[method] = linear
                else:
                    holder = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
                    holder[0].weight.data.copy_(linear.weight)
                    layers[method] = quantize(holder, method_config(method))[0]
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"kernel {label} {method}: quantize FAILED {type(e).__name__}: {e}")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                expected = linear(x).float()
            base = None
            for method, layer in layers.items():
                try:
                    nbytes = _layer_bytes(layer)
                    copies = _copies(layer, nbytes)
                    fns = [(_bf16_layer(c) if method == "bf16" else c) for c in copies]
                    with torch.no_grad():
                        seconds = graph_us([lambda f=f: f(x) for f in fns]) / 1e6
                        err = ((fns[0](x).float() - expected).norm() / expected.norm()).item()
                    base = seconds if method == "bf16" else base
                    rec = dict(part="kernel", layer=label, n=n, k=k, m=m, method=method, us=round(seconds * 1e6, 2),
                               speedup_vs_bf16=None if base is None else round(base / seconds, 2),
                               gb_s=round(nbytes / seconds / 1e9, 1), bw_share=round(nbytes / seconds / bw, 3),
                               rel_err=round(err, 4), **env)
                    emit(rec, json_path)
                    rows.append(rec)
                    del copies, fns
                except Exception as e:  # noqa: BLE001
                    print(f"kernel {label} m={m} {method}: FAILED {type(e).__name__}: {e}")
                    traceback.print_exc(limit=3)
        del layers
        _free()
    return rows


def bench_gemv_tiles(methods, bw, env, json_path) -> list[dict]:
    """M = 1 quantized GEMV over its tile choices (BLOCK_N; the default marked), for tuning gemv_tiles."""
    from cudaformers.kernels.quant_gemv import gemv_tiles, quant_gemv
    from cudaformers.quant.apply import quantize

    rows = []
    for method in [m for m in methods if m in ("int8", "int4", "nf4")]:
        for label, (n, k) in KERNEL_SHAPES.items():
            try:
                holder = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
                torch.nn.init.normal_(holder[0].weight, std=0.02)
                layer = quantize(holder, method_config(method))[0]
                w = layer.packed()
                nbytes = _layer_bytes(layer)
                copies = [c.packed() for c in _copies(layer, nbytes)]
                x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
                n_blocks = w.n_blocks
                default = gemv_tiles(n, n_blocks, w.block * w.bits // 32, x.device, int4=w.fmt == "int4")
                blocks = sorted({max(1, default[1] // 2), default[1], min(default[1] * 2, n_blocks)})
                for tiles in itertools.product((1, 2, 4, 8, 16), blocks, sorted({default[2], 8})):
                    try:
                        seconds = graph_us([lambda c=c: quant_gemv(x, c, tiles=tiles) for c in copies]) / 1e6
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                        print(f"gemv tiles {label} {method} {tiles}: {type(e).__name__}")
                        continue
                    rec = dict(part="gemv_tiles", layer=label, method=method, block_n=tiles[0], blocks=tiles[1],
                               warps=tiles[2], default=tiles == default, us=round(seconds * 1e6, 2),
                               bw_share=round(nbytes / seconds / bw, 3), **env)
                    emit(rec, json_path)
                    rows.append(rec)
                del copies
            except Exception as e:  # noqa: BLE001
                print(f"gemv tiles {label} {method}: FAILED {type(e).__name__}: {e}")
                traceback.print_exc(limit=3)
            _free()
    return rows


# (BLOCK_N, GROUPS, SPLIT, num_warps, num_stages); None: the default for the layer
MMA_TILES = [None, (32, 2, 1, 2, 4), (32, 2, 2, 2, 4), (32, 2, 4, 2, 4), (32, 2, 8, 2, 4), (32, 4, 1, 2, 3),
             (32, 4, 2, 2, 3), (32, 4, 4, 2, 3), (16, 4, 2, 1, 3), (16, 4, 4, 1, 3), (64, 2, 1, 4, 4), (64, 2, 2, 4, 4),
             (64, 2, 4, 4, 4), (32, 2, 16, 2, 4)]


def bench_mma(methods, bw, env, json_path, tilings=None, ms=(1, 16)) -> list[dict]:
    """The tensor-core kernel (``quant_mma``) at each tiling, with and without its PTX unpack, beside the
    FMA GEMV (M = 1) or the tl.dot GEMM (M = 16) it replaces: us per call and share of copy bandwidth.
    x is bf16 (int8: fp16, the only x it serves)."""
    from cudaformers.kernels import quant_matmul as qm
    from cudaformers.kernels.quant_mma import default_tiles, quant_mma
    from cudaformers.quant.apply import quantize

    rows = []
    for method in [m for m in methods if m in ("int8", "int4")]:
        for label, (n, k) in KERNEL_SHAPES.items():
            holder = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
            torch.nn.init.normal_(holder[0].weight, std=0.02)
            layer = quantize(holder, method_config(method))[0]
            nbytes = _layer_bytes(layer)
            copies = [c.packed() for c in _copies(layer, nbytes)]
            n_blocks = copies[0].n_blocks
            for m in ms:
                # int8 runs on tensor cores for fp16 x only
                x = torch.randn(m, k, device="cuda", dtype=torch.float16 if method == "int8" else torch.bfloat16)
                ref = qm.quant_matmul_reference(x.float(), copies[0]).float()
                old = qm.USE_MMA
                qm.USE_MMA = False
                cases = {"fma" if m == 1 else "dot": lambda c, x=x: qm.quant_matmul_triton(x, c)}
                # every tiling at M = 1 (decode), the first few at M = 16; the plain-ops unpack at two
                sweep = tilings or MMA_TILES
                for i, tiles in enumerate(sweep if m == 1 else sweep[:5]):
                    for asm in (True, False) if i < 2 else (True,):
                        cases[f"mma{tiles or default_tiles(n, n_blocks, x.device, m)}{'' if asm else '-noasm'}"] = (
                            lambda c, x=x, t=tiles, a=asm: quant_mma(x, c, tiles=t, use_asm=a))
                for name, fn in cases.items():
                    try:
                        with torch.no_grad():
                            err = ((fn(copies[0]).float() - ref).norm() / ref.norm()).item()
                            seconds = graph_us([lambda c=c, fn=fn: fn(c) for c in copies]) / 1e6
                    except Exception as e:  # noqa: BLE001 - a tiling that does not compile is reported and skipped
                        print(f"mma {method} {label} m={m} {name}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    rec = dict(part="mma", method=method, layer=label, m=m, kernel=name, us=round(seconds * 1e6, 2),
                               bw_share=round(nbytes / seconds / bw, 3), rel_err=round(err, 5),
                               default=name == f"mma{default_tiles(n, n_blocks, x.device, m)}", **env)
                    emit(rec, json_path)
                    rows.append(rec)
                qm.USE_MMA = old
            del copies
            _free()
    return rows


SWITCHES = ("fma", "dot", "gated", "nogated", "unmasked", "lat", "wide", "nowide", "plans", "actorder")


def as_act_order(model) -> int:
    """Every int4 layer made to read x through a feature order, as an act-order GPTQ checkpoint's layers
    do: one random order per width, shared, so q/k/v and gate/up stay packed (GPTQ orders a layer's
    projections by the same Hessian). The tokens change (x meets other codes); the work is what an
    act-order model runs, the gather of x before each quantized matmul included."""
    from cudaformers.models import structure
    from cudaformers.quant.int4 import Int4Linear
    from cudaformers.quant.packing import PackedQuantLinear

    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    layers += [m.layer for m in model.modules() if isinstance(m, PackedQuantLinear)]
    orders = {}
    for layer in layers:
        k = layer.in_features
        if k not in orders:
            orders[k] = torch.randperm(k, generator=torch.Generator().manual_seed(k)).to(layer.weight.device)
        layer.act_order = True
        layer._parameters["input_order"] = torch.nn.Parameter(orders[k], requires_grad=False)
    structure.changed()
    return len(layers)


def method_switches(method: str) -> tuple[str, set[str]]:
    """``"int4_gated_lat"`` -> ``("int4", {"gated", "lat"})``: a method and the switches after it."""
    parts = method.split("_")
    switches = set()
    while len(parts) > 1 and parts[-1] in SWITCHES:
        switches.add(parts.pop())
    return "_".join(parts), switches


def bench_decode(shape, methods, bw, env, json_path, plans_path=None) -> list[dict]:
    from cudaformers import AutoModelForCausalLM

    folder = random_checkpoint(shape, Path(f"/tmp/bench-{shape}"))
    ids = torch.randint(1000, 100000, (1, PROMPT), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    rows, base = [], None
    from cudaformers.kernels import quant_gemv_mma as fragment
    from cudaformers.kernels import quant_gemv_plans
    from cudaformers.kernels import quant_matmul as qm
    from cudaformers.kernels import paged_decode

    # what a method without those switches runs
    defaults = quant_gemv_plans.GATED, fragment.WIDE_LOADS, fragment._launch
    # "_plans": the fragment GEMV's plan per (format, N, K) from --plans (bench/quant_gemv_mma.py --best)
    table = {(r["fmt"], r["n"], r["k"]): tuple(r["plan"]) for r in json.load(open(plans_path))} if plans_path else {}

    def planned(x, w, bias, plan, act=None):
        return defaults[2](x, w, bias, table.get((w.fmt, w.out_features, w.in_features), plan), act)
    for method in methods:
        try:
            _free()
            base_method, switches = method_switches(method)
            qm.USE_MMA = "fma" not in switches  # the FMA GEMV instead of the tensor-core kernel
            qm.USE_FRAGMENT_GEMV = "dot" not in switches  # batch 1 without the fragment GEMV
            # gate/up's act-and-mul in the fragment GEMV: both formats, none, or the default's
            quant_gemv_plans.GATED = (("int4", "int8") if "gated" in switches else () if "nogated" in switches
                                      else defaults[0])
            fragment.UNMASKED_EVEN = "unmasked" in switches  # its loads without masks
            fragment.WIDE_LOADS = "wide" in switches or ("nowide" not in switches and defaults[1])  # 16 bytes a load
            fragment._launch = planned if "plans" in switches else defaults[2]
            # the batch-1 paged decode in 4 warps of 32 KB K tiles, 2 stages: the tiling before run 23
            paged_decode.LATENCY_WARPS, paged_decode.LATENCY_KEYS, paged_decode.LATENCY_STAGES = (
                (4, 0, 2) if "lat" in switches else (4, 64, 2))
            paged_decode.default_tiling.cache_clear()
            model, load_s = timed(lambda: AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.bfloat16, device_map="cuda", quantization_config=method_config(base_method),
                attn_implementation="triton", use_kernels=True))  # every method in its fastest setting
            if "actorder" in switches:
                print(f"act-order: {as_act_order(model)} int4 layers read x through a feature order")
            weights = torch.cuda.memory_allocated()
            model.generate(ids, **kw)
            out, seconds = timed(lambda: model.generate(ids, **kw))
            tok_s = NEW / seconds
            base = tok_s if method == "bf16" else base
            linear_bytes = sum(p.numel() * p.element_size() for p in set(model.parameters()))
            rec = dict(part="decode", shape=shape, method=method, tok_s=round(tok_s, 1),
                       speedup_vs_bf16=None if base is None else round(tok_s / base, 2),
                       weights_gib=round(weights / GIB, 2), peak_gib=round(torch.cuda.max_memory_allocated() / GIB, 2),
                       bw_share=round(linear_bytes * tok_s / bw, 3), load_s=round(load_s, 1), **env)
            print(model.explain())
            emit(rec, json_path)
            rows.append(rec)
            del model, out
        except Exception as e:  # noqa: BLE001
            print(f"decode {shape} {method}: FAILED {type(e).__name__}: {e}")
            traceback.print_exc(limit=4)
    _free()
    return rows


def bench_qlora(env, json_path, seq: int = 2048) -> list[dict]:
    from cudaformers import AutoModelForCausalLM, LoraConfig, get_peft_model

    try:
        _free()
        folder = random_checkpoint("qwen3-8b", Path("/tmp/bench-qwen3-8b"))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                     quantization_config=method_config("nf4_dq"))
        model.gradient_checkpointing_enable()
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(1000, 100000, (1, seq), generator=torch.Generator().manual_seed(0)).cuda()
        loaded = torch.cuda.memory_allocated()
        times = []
        for _ in range(3):
            def step():
                loss = model(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss
            _, seconds = timed(step)
            times.append(seconds)
        rec = dict(part="qlora", shape="qwen3-8b", tokens=seq, loaded_gib=round(loaded / GIB, 2),
                   peak_gib=round(torch.cuda.max_memory_allocated() / GIB, 2), step_s=round(min(times[1:]), 3),
                   tok_s=round(seq / min(times[1:]), 1), goal_peak_gib=12, **env)
        emit(rec, json_path)
        del model, opt
        _free()
        return [rec]
    except Exception as e:  # noqa: BLE001
        print(f"qlora: FAILED {type(e).__name__}: {e}")
        traceback.print_exc(limit=4)
        return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="kernels,decode,qlora")
    ap.add_argument("--mma-tiles", default=None, help='mma: a JSON list of tilings to sweep (the default added), '
                    'e.g. "[[64, 2, 1, 2, 3]]"')
    ap.add_argument("--mma-m", default="1,16", help="mma: the rows of x to time")
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--methods", default="bf16,int8,int4,nf4,fp8")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plans", default=None, help="decode: the fragment plans of the _plans switch (a JSON file)")
    args = ap.parse_args()
    env = environment()
    bw = copy_bandwidth()
    methods = args.methods.split(",")
    print(f"{env['gpu']}: copy {bw / 1e12:.2f} TB/s; torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    parts = args.parts.split(",")
    kernels = bench_kernels(methods, bw, env, args.json) if "kernels" in parts else []
    tiles = bench_gemv_tiles(methods, bw, env, args.json) if "tiles" in parts else []
    tilings = [None] + [tuple(t) for t in json.loads(args.mma_tiles)] if args.mma_tiles else None
    mma = bench_mma(methods, bw, env, args.json, tilings, tuple(int(m) for m in args.mma_m.split(","))) \
        if "mma" in parts else []
    decode = [r for s in args.shapes.split(",") for r in bench_decode(s, methods, bw, env, args.json, args.plans)] \
        if "decode" in parts else []
    qlora = bench_qlora(env, args.json) if "qlora" in parts else []

    if kernels:
        print(f"\n{'layer':8} {'m':>4} {'method':7} {'us':>8} {'x bf16':>7} {'GB/s':>7} {'bw%':>5} {'rel err':>8}")
        for r in kernels:
            print(f"{r['layer']:8} {r['m']:>4} {r['method']:7} {r['us']:>8} {str(r['speedup_vs_bf16']):>7} "
                  f"{r['gb_s']:>7} {100 * r['bw_share']:>5.0f} {r['rel_err']:>8}")
    if tiles:
        print(f"\n{'method':7} {'layer':8} {'default us':>10} {'bw%':>5} {'best us':>8} {'bw%':>5}  best (BLOCK_N, BLOCKS, warps)")
        for key in dict.fromkeys((r["method"], r["layer"]) for r in tiles):
            mine = [r for r in tiles if (r["method"], r["layer"]) == key]
            best = min(mine, key=lambda r: r["us"])
            dflt = next((r for r in mine if r["default"]), best)
            print(f"{key[0]:7} {key[1]:8} {dflt['us']:>10} {100 * dflt['bw_share']:>5.0f} {best['us']:>8} "
                  f"{100 * best['bw_share']:>5.0f}  ({best['block_n']}, {best['blocks']}, {best['warps']})")
    if mma:
        print(f"\n{'method':7} {'layer':8} {'m':>3} {'kernel':28} {'us':>8} {'bw%':>5} {'rel err':>8}")
        for key in dict.fromkeys((r["method"], r["layer"], r["m"]) for r in mma):
            mine = sorted((r for r in mma if (r["method"], r["layer"], r["m"]) == key), key=lambda r: r["us"])
            for r in mine[:4] + [r for r in mine[4:] if r["default"] or r["kernel"] in ("fma", "dot")]:
                print(f"{key[0]:7} {key[1]:8} {key[2]:>3} {r['kernel'] + (' *' if r['default'] else ''):28} "
                      f"{r['us']:>8} {100 * r['bw_share']:>5.0f} {r['rel_err']:>8}")
    if decode:
        print(f"\n{'shape':11} {'method':7} {'tok/s':>8} {'x bf16':>7} {'bw%':>5} {'weights GiB':>11} {'peak GiB':>9}")
        for r in decode:
            print(f"{r['shape']:11} {r['method']:7} {r['tok_s']:>8} {str(r['speedup_vs_bf16']):>7} "
                  f"{100 * r['bw_share']:>5.0f} {r['weights_gib']:>11} {r['peak_gib']:>9}")
        print("goals (qwen3-8b): int8 >= 1.6x, int4 >= 2.5x the bf16 decode tok/s")
    for r in qlora:
        print(f"\nQLoRA qwen3-8b 1x{r['tokens']}: peak {r['peak_gib']} GiB (goal <= 12), loaded {r['loaded_gib']} GiB, "
              f"step {r['step_s']} s ({r['tok_s']} tok/s)")


if __name__ == "__main__":
    main()
