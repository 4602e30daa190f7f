"""W1-W3: generate() throughput, transformers and cudaformers on the same saved random weights.

    python bench/generate.py [--workloads W1,W2,W3] [--variants sdpa,triton+kernels] [--skip-hf] [--check-eager]

A variant is an attention backend, optionally with ``+kernels`` (use_kernels=True), ``+cublas``
(kernels, but matmuls left on cuBLAS instead of the decode GEMV and skinny GEMM), ``+nofold`` (kernels,
but the decode norms not folded into the GEMVs after them), ``+nomlp`` (kernels, but the gated MLP's
activation left out of the down projection's GEMV), ``+torchinputs`` (the decode step's inputs as
torch ops and the model's own rotary instead of one launch: ``generation.decode.STEP_INPUTS_KERNEL``)
and ``+nofuseattn`` (decode attention as qk_norm_rope then the paged decode, two launches, instead of
the one fused launch: ``kernels.fused_norm_decode.FUSE_ATTENTION``).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, emit, environment, matmul_tflops, random_checkpoint, timed  # noqa: E402

WORKLOADS = {"W1": ("qwen3-0.6b", 1), "W2": ("qwen3-8b", 1), "W3": ("qwen3-0.6b", 32)}
PROMPT, NEW = 128, 256
# Our timed calls per variant (after the warm-up); the median counts. One call of a W3 variant is a
# third of a second, and one slow call (a host hiccup) moved a single-call figure by 15% (RESULTS run 11).
REPEATS = 3


def prompt_ids(batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(1000, 100000, (batch, PROMPT), generator=g).cuda()


def run_hf(folder, batch, cache: str) -> dict:
    import transformers

    (model, load_s) = timed(lambda: transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, device_map="cuda", attn_implementation="eager"))
    ids = prompt_ids(batch)
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    if cache == "static":
        kw["cache_implementation"] = "static"
    try:
        model.generate(ids, **kw)
        setting = f"eager + {cache} cache"
    except Exception as e:  # noqa: BLE001 - report and fall back to the dynamic cache
        if cache != "static":
            raise
        print(f"transformers static cache failed ({type(e).__name__}: {e}); using the dynamic cache")
        kw.pop("cache_implementation")
        model.generate(ids, **kw)
        setting = "eager + dynamic cache"
    out, seconds = timed(lambda: model.generate(ids, **kw))
    tokens = out[:, PROMPT:]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return dict(tok_s=batch * NEW / seconds, seconds=seconds, load_s=load_s, setting=setting, tokens=tokens.cpu())


def run_ours(folder, batch, variant, check_eager) -> dict:
    from cudaformers import AutoModelForCausalLM, KernelConfig

    attn, *flags = variant.split("+")
    kernels = "kernels" in flags
    mapping = {**({"Linear": ""} if "cublas" in flags else {}), **({"DecoderLayer": ""} if "nofold" in flags else {}),
               **({"GatedMLP": ""} if "nomlp" in flags else {})}
    config = KernelConfig(kernel_mapping=mapping) if mapping else None
    (model, load_s) = timed(lambda: AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, device_map="cuda", attn_implementation=attn, use_kernels=kernels,
        kernel_config=config))
    ids = prompt_ids(batch)
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    from cudaformers.generation import decode
    from cudaformers.kernels import fused_norm_decode

    decode.STEP_INPUTS_KERNEL = "torchinputs" not in flags
    fused_norm_decode.FUSE_ATTENTION = "nofuseattn" not in flags
    fused_norm_decode.FUSE_ATTENTION_WITH_PDL = "fuseattnpdl" in flags
    # skinnyN: 17-32-row skinny launches aim for N/100 programs per SM; splitA.T.S: busy paged-decode
    # grids split past A keys into pieces of >= T tiles with S stages
    from cudaformers.kernels import paged_decode, skinny_gemm

    for f in flags:
        if f.startswith("skinny") and f[6:].isdigit():
            skinny_gemm.WIDE_PROGRAMS_PER_SM = int(f[6:]) / 100
        if f.startswith("lat") and f.count(".") == 2:  # latW.N.S: batch-1 paged-decode tiles
            paged_decode.LATENCY_WARPS, paged_decode.LATENCY_KEYS, paged_decode.LATENCY_STAGES = map(
                int, f[3:].split("."))
        if f.startswith("split") and f.count(".") == 2:
            paged_decode.BUSY_SPLIT_ABOVE, paged_decode.BUSY_SPLIT_TILES, paged_decode.BUSY_STAGES = map(
                int, f[5:].split("."))
    paged_decode.default_tiling.cache_clear()
    from cudaformers.kernels import hub

    hub.GATED_SKINNY = "nogated" not in flags  # nogated: gate/up, then a separate act-and-mul launch
    from cudaformers.kernels import greedy_advance

    greedy_advance.ONE_LAUNCH = "twoadvance" not in flags  # twoadvance: greedy advance in two launches
    # aloneN: skinny GEMM programs alone on their SM pipeline up to N stages deep (alone3: as before run 20)
    alone_stages = skinny_gemm.ALONE_STAGES
    for f in flags:
        if f.startswith("alone") and f[5:].isdigit():
            skinny_gemm.ALONE_STAGES = int(f[5:])
    from cudaformers.generation import loop

    if "drainstop" in flags:  # the stop check before StopCheck: every 16 steps, draining the queue
        loop.LAGGED_STOP_CHECK, loop.SYNC_EVERY = False, 16
    if "lag16" in flags:  # the non-draining check every 16 steps
        loop.SYNC_EVERY = 16
    try:
        model.generate(ids, **kw)
        runs = sorted((timed(lambda: model.generate(ids, **kw)) for _ in range(REPEATS)), key=lambda r: r[1])
        out, seconds = runs[len(runs) // 2]
        eager = model.generate(ids, use_cuda_graph=False, **kw) if check_eager else None
    finally:
        decode.STEP_INPUTS_KERNEL = True
        fused_norm_decode.FUSE_ATTENTION = True
        fused_norm_decode.FUSE_ATTENTION_WITH_PDL = False
        skinny_gemm.WIDE_PROGRAMS_PER_SM = 1 / 3
        hub.GATED_SKINNY = True
        skinny_gemm.ALONE_STAGES = alone_stages
        loop.LAGGED_STOP_CHECK, loop.SYNC_EVERY = True, 8
        paged_decode.BUSY_SPLIT_ABOVE, paged_decode.BUSY_SPLIT_TILES, paged_decode.BUSY_STAGES = 2048, 3, 4
        paged_decode.LATENCY_WARPS, paged_decode.LATENCY_KEYS, paged_decode.LATENCY_STAGES = 4, 64, 2
        greedy_advance.ONE_LAUNCH = True
        paged_decode.default_tiling.cache_clear()
    weight_bytes = sum(p.numel() * p.element_size() for p in set(model.parameters()))
    explain = model.explain()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return dict(tok_s=batch * NEW / seconds, seconds=seconds, load_s=load_s, tokens=out[:, PROMPT:].cpu(),
                tok_s_all=[round(batch * NEW / t, 1) for _, t in runs],
                graph_equals_eager=None if eager is None else bool(torch.equal(out, eager)),
                weight_bytes=weight_bytes, explain=explain)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument("--variants", default="sdpa,triton+kernels")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--check-eager", action="store_true", help="also decode without graphs and compare tokens")
    ap.add_argument("--hf-cache", default="static",
                    help="transformers' cache: static (its fastest here; compiles the forward on the first call, "
                         "minutes at batch 32 or 8B) or dynamic (no compile)")
    ap.add_argument("--json", default=None, help="append JSON lines here")
    args = ap.parse_args()
    env = environment()
    bw, tflops = copy_bandwidth(), matmul_tflops()
    print(f"{env['gpu']}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {tflops:.0f} TFLOP/s; torch {env['torch']}, "
          f"transformers {env['transformers']}, commit {env['commit']}")
    rows = []
    for wl in args.workloads.split(","):
        shape, batch = WORKLOADS[wl]
        folder = random_checkpoint(shape, Path(f"/tmp/bench-{shape}"))
        # Ours first: transformers' first call compiles for minutes at large shapes, and a time
        # limit hit there should not cost our figures.
        results = []
        for variant in args.variants.split(","):
            try:
                results.append((variant, run_ours(folder, batch, variant, args.check_eager)))
                print(f"{wl} {variant}: {results[-1][1]['tok_s']:.1f} tok/s (median of {results[-1][1]['tok_s_all']})",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - one failing setting must not hide the others
                print(f"{wl} {variant}: FAILED {type(e).__name__}: {e}")
        hf = None if args.skip_hf else run_hf(folder, batch, args.hf_cache)
        for variant, ours in results:
            share = ours["weight_bytes"] / (ours["seconds"] / NEW) / bw if batch == 1 else None
            agree = None if hf is None else float((ours["tokens"] == hf["tokens"]).float().mean())
            rec = dict(workload=wl, shape=shape, batch=batch, variant=variant,
                       ours_tok_s=round(ours["tok_s"], 1), ours_tok_s_runs=ours["tok_s_all"], hf_tok_s=None if hf is None else round(hf["tok_s"], 1),
                       ratio=None if hf is None else round(ours["tok_s"] / hf["tok_s"], 1),
                       bandwidth_share=None if share is None else round(share, 3),
                       ours_load_s=round(ours["load_s"], 2), hf_load_s=None if hf is None else round(hf["load_s"], 2),
                       hf_setting=None if hf is None else hf["setting"], graph_equals_eager=ours["graph_equals_eager"],
                       token_agreement_with_hf=agree, copy_tb_s=round(bw / 1e12, 2), **env)
            emit(rec, args.json)
            rows.append(rec)
            print(ours["explain"])
    print(f"\n{'wl':3} {'variant':24} {'ours tok/s':>10} {'hf tok/s':>9} {'ratio':>6} {'bw%':>5} "
          f"{'load ours/hf s':>14} {'graph=eager':>11} {'agree':>6}")
    for r in rows:
        bwp = f"{100 * r['bandwidth_share']:.0f}" if r["bandwidth_share"] else "-"
        print(f"{r['workload']:3} {r['variant']:24} {r['ours_tok_s']:>10} "
              f"{str(r['hf_tok_s']):>9} {str(r['ratio']):>6} {bwp:>5} "
              f"{r['ours_load_s']:>6}/{str(r['hf_load_s']):>7} {str(r['graph_equals_eager']):>11} "
              f"{'-' if r['token_agreement_with_hf'] is None else round(r['token_agreement_with_hf'], 3):>6}")


if __name__ == "__main__":
    main()
