"""Quantized inference and QLoRA on one GPU: kernels, W1/W2 decode per method, and a QLoRA step.

    python bench/quant.py [--parts kernels,decode,qlora] [--shapes qwen3-0.6b,qwen3-8b]
                          [--methods bf16,int8,int4,nf4,fp8] [--json out.jsonl]

kernels: the dequantize-matmul on qwen3-8b layer shapes at M = 1, 16, 256 against the bf16 cuBLAS
matmul (CUDA-graph replays, so launch overhead is not measured), with the packed bytes streamed per
second as a share of the measured copy bandwidth. decode: W1/W2 (generate, batch 1, 128-token prompt,
256 new tokens, greedy; triton attention and use_kernels=True for every method, bf16 too) per method
on the same saved random weights, with peak memory. qlora: one NF4 + LoRA (r 16, all linear layers)
training step on qwen3-8b shapes at batch 1 x 2048 with gradient checkpointing: peak memory (goal <= 12 GiB) and step time. Each case runs in its own
try/except: a failure is printed and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
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

    return {"bf16": None, "int8": Int8Config(), "int4": Int4Config(group_size=128),
            "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16"),
            "nf4_dq": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                         bnb_4bit_compute_dtype="bfloat16"),
            "fp8": FP8Config()}[name]


def _free():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def bench_kernels(methods, bw, env, json_path) -> list[dict]:
    from cudaformers.quant.apply import quantize

    rows = []
    shapes = {"qkv-q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (12288, 4096), "down": (4096, 12288)}
    for label, (n, k) in shapes.items():
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        torch.nn.init.normal_(linear.weight, std=0.02)
        for m in (1, 16, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = None
            for method in methods:
                try:
                    if method == "bf16":
                        layer = linear
                    else:
                        holder = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device="cuda",
                                                                     dtype=torch.bfloat16))
                        holder[0].weight.data.copy_(linear.weight)
                        layer = quantize(holder, method_config(method))[0]
                    with torch.no_grad():
                        seconds = graph_us(lambda: layer(x)) / 1e6
                        err = ((layer(x).float() - linear(x).float()).norm() / linear(x).float().norm()).item()
                    nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
                    base = seconds if method == "bf16" else base
                    rec = dict(part="kernel", layer=label, n=n, k=k, m=m, method=method, us=round(seconds * 1e6, 2),
                               speedup_vs_bf16=None if base is None else round(base / seconds, 2),
                               bw_share=round(nbytes / seconds / bw, 3), rel_err=round(err, 4), **env)
                    emit(rec, json_path)
                    rows.append(rec)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"kernel {label} m={m} {method}: FAILED {type(e).__name__}: {e}")
                    traceback.print_exc(limit=3)
                finally:
                    _free()
    return rows


def bench_decode(shape, methods, bw, env, json_path) -> list[dict]:
    from cudaformers import AutoModelForCausalLM

    folder = random_checkpoint(shape, Path(f"/tmp/bench-{shape}"))
    ids = torch.randint(1000, 100000, (1, PROMPT), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    rows, base = [], None
    for method in methods:
        try:
            _free()
            model, load_s = timed(lambda: AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.bfloat16, device_map="cuda", quantization_config=method_config(method),
                attn_implementation="triton", use_kernels=True))  # every method in its fastest setting
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
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--methods", default="bf16,int8,int4,nf4,fp8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    env = environment()
    bw = copy_bandwidth()
    methods = args.methods.split(",")
    print(f"{env['gpu']}: copy {bw / 1e12:.2f} TB/s; torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    parts = args.parts.split(",")
    kernels = bench_kernels(methods, bw, env, args.json) if "kernels" in parts else []
    decode = [r for s in args.shapes.split(",") for r in bench_decode(s, methods, bw, env, args.json)] \
        if "decode" in parts else []
    qlora = bench_qlora(env, args.json) if "qlora" in parts else []

    if kernels:
        print(f"\n{'layer':8} {'m':>4} {'method':7} {'us':>8} {'x bf16':>7} {'bw%':>5} {'rel err':>8}")
        for r in kernels:
            print(f"{r['layer']:8} {r['m']:>4} {r['method']:7} {r['us']:>8} {str(r['speedup_vs_bf16']):>7} "
                  f"{100 * r['bw_share']:>5.0f} {r['rel_err']:>8}")
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
