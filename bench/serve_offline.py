"""W4: offline continuous batching, transformers' generate_batch and cudaformers' engine in one run.

256 requests, prompt lengths uniform in [100, 1024] (random.Random(0)), token ids uniform in
[1000, 100000), 256 new tokens each, greedy, EOS ignored, qwen3-0.6b random bf16 weights.

    python bench/serve_offline.py [--requests 256] [--skip-hf] [--ablate] [--attn triton] [--check-generate 16]

Both stacks get one small warm-up call on other prompts, then one timed call (end to end: request
submission to the last token). --ablate also times ours without CUDA graphs and without async
batching. After the timed run, the first 16 requests also run through generate() alone: how often the
engine's bf16 tokens equal them (greedy exactness is tested in fp32 on the CPU; this is its bf16
GPU counterpart). Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, environment, random_checkpoint, triton_variants  # noqa: E402

NEW = 256


def requests(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(100, 1024) for _ in range(n)]
    return [[rng.randrange(1000, 100000) for _ in range(k)] for k in lens]


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def run_hf(folder, inputs) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda")
    gen = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(requests(4, seed=1), generation_config=gen, max_new_tokens=8)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = model.generate_batch(inputs, generation_config=gen)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = {int(k.split("_")[-1]): v.generated_tokens for k, v in out.items()}
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, out
    _free()
    return dict(seconds=seconds, tokens=tokens, peak_gib=peak, setting="generate_batch, default settings")


def agreement_with_generate(model, inputs, tokens, n: int) -> dict:
    """The engine's tokens against generate()'s, request by request (batch 1, same model, bf16): the
    share of requests equal end to end and the mean share of tokens before the first difference.
    In bf16 a batch's kernels round differently from batch 1's, so near-ties may flip."""
    equal, prefix, margins = 0, 0.0, []
    for i in range(min(n, len(inputs))):
        ids = torch.tensor([inputs[i]], device="cuda")
        ref = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             eos_token_id=None)[0, len(inputs[i]):].tolist()
        got = tokens[i]
        same = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        equal += got == ref
        prefix += same / max(len(ref), 1)
        if same < min(len(got), len(ref)):
            # How close the two choices were where they part: generate()'s logit for its own token
            # minus its logit for the engine's. A near-tie (a few bf16 roundings) is not a bug.
            with torch.no_grad():
                logits = model(torch.tensor([inputs[i] + ref[:same]], device="cuda")).logits[0, -1].float()
            margins.append((logits[ref[same]] - logits[got[same]]).item())
    n = min(n, len(inputs))
    out = dict(requests=n, equal_share=round(equal / n, 3), prefix_share=round(prefix / n, 3))
    if margins:
        margins.sort()
        out.update(margin_at_split_median=round(margins[len(margins) // 2], 4), margin_at_split_max=round(margins[-1], 4))
    return out


def run_ours(folder, inputs, attn: str, kernels: bool, check: int = 0, **engine_kw) -> dict:
    from cudaformers import AutoModelForCausalLM, GenerationConfig
    from cudaformers.engine.continuous_batching import destroy_cached_engine, generate_batch

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                 attn_implementation=attn, use_kernels=kernels)
    gen = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    t0 = time.perf_counter()
    generate_batch(model, requests(8, seed=1), gen, max_new_tokens=8, persistent_manager=True, **engine_kw)
    startup = time.perf_counter() - t0  # KV-cache sizing, graph capture, first compiles
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = triton_variants()
    start = time.perf_counter()
    out = generate_batch(model, inputs, gen, persistent_manager=True, **engine_kw)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = {k: keys - before.get(k, set()) for k, keys in triton_variants().items()}  # compiled in the timed run
    compiled = {k: len(keys) for k, keys in new.items() if keys}
    for name in compiled:
        for key in sorted(new[name]):
            print(f"  compiled in the run: {name} {key[:600]}")
    engine = model._cudaformers_engine[1]
    stats = engine.stats()
    tokens = {int(k.split("_")[-1]): v.generated_tokens for k, v in out.items()}
    peak = torch.cuda.max_memory_allocated() / 2**30
    setting = (f"attn={attn}, kernels={'on' if kernels else 'off'}, graphs={'on' if engine.runner.graphs else 'off'}, "
               f"async={'on' if engine.use_async_batching else 'off'}, blocks={stats['num_blocks']}")
    destroy_cached_engine(model)
    del engine, out
    _free()
    agreement = agreement_with_generate(model, inputs, tokens, check) if check else None
    del model
    _free()
    return dict(seconds=seconds, tokens=tokens, peak_gib=peak, startup_s=startup, setting=setting,
                preemptions=stats["preemptions"], agreement=agreement, compiled_in_run=compiled)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--kernels", default="on", choices=("on", "off"), help="use_kernels for our model")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--check-generate", type=int, default=16,
                    help="compare this many requests' engine tokens with generate()'s (0: skip)")
    ap.add_argument("--ablate", action="store_true", help="also time ours without graphs / without async")
    ap.add_argument("--json", default=None, help="append the JSON record to this file")
    ap.add_argument("--max-batch-tokens", default=None,
                    help="comma-separated engine max_batch_tokens to time ours at, in this order (A/B runs)")
    args = ap.parse_args(argv)

    inputs = requests(args.requests)
    folder = random_checkpoint("qwen3-0.6b")
    rows = {}
    kernels = args.kernels == "on"
    if args.max_batch_tokens:
        for i, tokens in enumerate(int(t) for t in args.max_batch_tokens.split(",")):
            rows[f"cudaformers, {tokens} tokens/step #{i}"] = run_ours(folder, inputs, args.attn, kernels,
                                                                       max_batch_tokens=tokens)
    else:
        rows["cudaformers"] = run_ours(folder, inputs, args.attn, kernels, check=args.check_generate)
    if args.ablate:
        rows["cudaformers, no graphs"] = run_ours(folder, inputs, args.attn, kernels, use_cuda_graph=False)
        rows["cudaformers, no async"] = run_ours(folder, inputs, args.attn, kernels, use_async_batching=False)
    if not args.skip_hf:
        rows["transformers"] = run_hf(folder, inputs)

    n_out = {k: sum(len(t) for t in r["tokens"].values()) for k, r in rows.items()}
    expected = NEW * len(inputs)
    hf = rows.get("transformers")
    print(f"\nW4 offline continuous batching: {len(inputs)} requests, "
          f"{sum(map(len, inputs))} prompt tokens, {NEW} new tokens each")
    print(f"{'stack':<26} {'out tok/s':>10} {'seconds':>8} {'peak GiB':>8} {'vs HF':>7}  setting")
    record = dict(workload="W4", env=environment(), requests=len(inputs))
    for k, r in rows.items():
        tps = n_out[k] / r["seconds"]
        ratio = f"{tps / (n_out['transformers'] / hf['seconds']):.1f}x" if hf else "-"
        print(f"{k:<26} {tps:>10.0f} {r['seconds']:>8.2f} {r['peak_gib']:>8.1f} {ratio:>7}  {r['setting']}")
        record[k] = dict(tok_s=round(tps, 1), seconds=round(r["seconds"], 3), peak_gib=round(r["peak_gib"], 2),
                         setting=r["setting"], output_tokens=n_out[k])
        if "startup_s" in r:
            record[k].update(startup_s=round(r["startup_s"], 2), preemptions=r["preemptions"],
                             compiled_in_run=r["compiled_in_run"])
            if r["compiled_in_run"]:  # each a stall of the whole batch (seconds on a cold cache)
                print(f"  Triton variants compiled inside the timed run: {r['compiled_in_run']}")
        if r.get("agreement"):
            a = r["agreement"]
            print(f"  engine vs generate(), {a['requests']} requests in bf16: {a['equal_share']:.0%} equal end to end, "
                  f"{a['prefix_share']:.0%} of tokens before the first difference")
            if "margin_at_split_max" in a:
                print(f"  where they part, generate()'s own logit margin over the engine's token: median "
                      f"{a['margin_at_split_median']:.3g}, max {a['margin_at_split_max']:.3g}")
            record[k]["agreement_with_generate"] = a
        if n_out[k] != expected:
            print(f"  ! {k} produced {n_out[k]} tokens, expected {expected}")
    if hf:
        ours = rows["cudaformers"]["tokens"]
        same = sum(ours[i] == hf["tokens"].get(i) for i in ours)
        # bf16: rows may diverge after a near-tie; the share that match end to end is a sanity figure.
        print(f"requests whose {NEW} tokens equal transformers' exactly: {same}/{len(ours)}")
        record["exact_match_share"] = round(same / len(ours), 3)
        record["ratio"] = round((n_out["cudaformers"] / rows["cudaformers"]["seconds"])
                                / (n_out["transformers"] / hf["seconds"]), 2)
    emit(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
