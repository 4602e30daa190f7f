"""W6: a training step of qwen3-0.6b, batch 8 x 2048, bf16 autocast over fp32 master weights, fused AdamW.

transformers' model in a plain torch loop and cudaformers' Trainer, on the same saved random weights
and the same random token ids, in one run. Reports tokens/s (median of steps 3-12), peak GPU memory,
MFU, and `cudaformers plan`'s estimate beside the measured peak.

    python bench/train.py [--kernels off,on] [--attn sdpa] [--gradient-checkpointing] [--skip-hf]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, environment, matmul_tflops, random_checkpoint  # noqa: E402

SHAPE, BATCH, SEQ, STEPS = "qwen3-0.6b", 8, 2048, 12
MEASURED = slice(2, 12)  # steps 3-12


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1000, 100000, (BATCH, SEQ), generator=g) for _ in range(n)]


def reset_memory():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_hf(folder, attn: str, checkpointing: bool) -> dict:
    import transformers

    reset_memory()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cuda",
                                                              attn_implementation=attn)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    times = []
    for ids in batches(STEPS):
        ids = ids.cuda()
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    n_params = sum(p.numel() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    reset_memory()
    return dict(tok_s=BATCH * SEQ / statistics.median(times[MEASURED]), peak_gib=peak / 2**30, params=n_params,
                loss=float(loss))


def run_ours(folder, attn: str, kernels: bool, checkpointing: bool, packing: bool) -> dict:
    from cudaformers import AutoModelForCausalLM
    from cudaformers.train.arguments import TrainingArguments
    from cudaformers.train.trainer import Trainer

    reset_memory()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cuda",
                                                 attn_implementation=attn, use_kernels=kernels)
    data = [{"input_ids": row.tolist()} for ids in batches(STEPS) for row in ids]
    out = tempfile.mkdtemp(prefix="bench-train-")
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-5,
                             bf16=True, optim="adamw_torch_fused", logging_steps=1, save_strategy="no",
                             disable_tqdm=True, gradient_checkpointing=checkpointing, packing=packing,
                             max_seq_length=SEQ, lr_scheduler_type="constant")
    trainer = Trainer(model, args, train_dataset=data)
    trainer.train()
    rows = [json.loads(line) for line in open(Path(out) / "log.jsonl")]
    steps = [r for r in rows if "tokens_per_s" in r]
    explain = model.explain()
    n_params = model.num_parameters()
    peak = torch.cuda.max_memory_allocated()
    del model, trainer
    reset_memory()
    return dict(tok_s=statistics.median(r["tokens_per_s"] for r in steps[MEASURED]), peak_gib=peak / 2**30,
                params=n_params, loss=steps[-1]["loss"], explain=explain)


def planned_gib(folder, checkpointing: bool, fused: bool) -> float:
    from cudaformers.config import AutoConfig
    from cudaformers.train.memory import plan

    p = plan(AutoConfig.from_pretrained(folder), batch=BATCH, seq=SEQ, gradient_checkpointing=checkpointing,
             fused_loss=fused)
    return p.total / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="off,on", help="comma list of off/on")
    ap.add_argument("--attn", default="sdpa", help="comma list of attention backends for cudaformers")
    ap.add_argument("--hf-attn", default="sdpa")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--packing", action="store_true", help="feed cudaformers flat packed batches")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None, help="append JSON lines here")
    a = ap.parse_args()
    env = environment()
    peak_tflops = matmul_tflops()
    folder = random_checkpoint(SHAPE)
    results = []
    if not a.skip_hf:
        r = run_hf(folder, a.hf_attn, a.gradient_checkpointing)
        results.append(("transformers", f"{a.hf_attn}", r, planned_gib(folder, a.gradient_checkpointing, False)))
    for attn in a.attn.split(","):
        for k in a.kernels.split(","):
            try:
                r = run_ours(folder, attn, k == "on", a.gradient_checkpointing, a.packing)
            except Exception as e:  # noqa: BLE001 - one failing setting must not hide the others
                print(f"cudaformers attn={attn} kernels={k} failed: {type(e).__name__}: {e}")
                continue
            results.append(("cudaformers", f"{attn}, kernels {k}", r,
                            planned_gib(folder, a.gradient_checkpointing, k == "on")))
    base = results[0][2]["tok_s"] if results and results[0][0] == "transformers" else None
    print(f"\nW6 {SHAPE}, batch {BATCH} x {SEQ}, bf16 autocast + fp32 master, fused AdamW"
          f"{', gradient checkpointing' if a.gradient_checkpointing else ''} on {env['gpu']}"
          f" (matmul {peak_tflops:.0f} TFLOP/s measured)")
    print(f"{'stack':13} {'setting':22} {'tok/s':>9} {'x hf':>6} {'MFU':>6} {'peak GiB':>9} {'plan GiB':>9} {'loss':>7}")
    for stack, setting, r, plan_gib in results:
        mfu = 6 * r["params"] * r["tok_s"] / (peak_tflops * 1e12)
        ratio = f"{r['tok_s'] / base:.2f}" if base else "-"
        print(f"{stack:13} {setting:22} {r['tok_s']:9.0f} {ratio:>6} {100 * mfu:5.1f}% {r['peak_gib']:9.1f} "
              f"{plan_gib:9.1f} {r['loss']:7.3f}")
        emit(dict(workload="W6", stack=stack, setting=setting, tok_s=r["tok_s"], peak_gib=r["peak_gib"],
                  plan_gib=plan_gib, mfu=mfu, gradient_checkpointing=a.gradient_checkpointing, packing=a.packing,
                  **env), a.json)
    for stack, setting, r, _ in results:
        if "explain" in r:
            print(f"\n[{setting}]\n{r['explain']}")


if __name__ == "__main__":
    main()
