"""Where a W6 training step's GPU time goes: kernels grouped by kind, and the top kernels.

    python bench/profile_train.py [--attn sdpa] [--kernels on] [--steps 6] [--gradient-checkpointing]

Runs the Trainer on the bench's random qwen3-0.6b weights (batch 8 x 2048, bf16 autocast over fp32
master weights, fused AdamW) under torch.profiler and reports per-step CUDA time. The first step
(allocator warm-up, Triton compiles) runs before the profiler starts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_checkpoint  # noqa: E402
from train import BATCH, SEQ, SHAPE, batches  # noqa: E402

GROUPS = [  # first match wins; substrings of kernel names
    ("matmul (cuBLAS)", ("nvjet", "gemm", "sm90_xmma", "cutlass", "splitKreduce")),
    ("attention", ("flash", "fmha", "attn", "_attn_")),
    ("cross-entropy / lm head (Triton)", ("cross_entropy", "_ce_", "lce")),
    ("norm (Triton)", ("rms_norm",)),
    ("rotary (Triton)", ("rotary", "rope")),
    ("act-and-mul (Triton)", ("act_mul",)),
    ("optimizer", ("multi_tensor", "adam", "fused_adam")),
    ("reductions", ("reduce_kernel", "norm_kernel")),
    ("copies / casts", ("copy", "cast", "Memcpy", "Memset", "fill")),
    ("elementwise", ("elementwise",)),
]


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k.lower() in low for k in keys):
            return group
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--kernels", default="on", choices=("on", "off"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()

    from cudaformers import AutoModelForCausalLM
    from cudaformers.train.arguments import TrainingArguments
    from cudaformers.train.trainer import Trainer

    folder = random_checkpoint(SHAPE)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cuda",
                                                 attn_implementation=a.attn, use_kernels=a.kernels == "on")

    def trainer(steps):
        data = [{"input_ids": row.tolist()} for ids in batches(steps) for row in ids]
        args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="bench-prof-"), per_device_train_batch_size=BATCH,
                                 max_steps=steps, learning_rate=1e-5, bf16=True, optim="adamw_torch_fused",
                                 logging_steps=1, save_strategy="no", disable_tqdm=True, max_seq_length=SEQ,
                                 gradient_checkpointing=a.gradient_checkpointing, lr_scheduler_type="constant")
        return Trainer(model, args, train_dataset=data)

    trainer(2).train()  # warm-up: compiles and allocator growth stay out of the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        trainer(a.steps).train()
        torch.cuda.synchronize()
    per_kernel = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name][0] += ev.device_time / 1000 / a.steps  # ms per step
            per_kernel[ev.name][1] += 1
    total = sum(ms for ms, _ in per_kernel.values())
    groups = defaultdict(float)
    for name, (ms, _) in per_kernel.items():
        groups[group_of(name)] += ms
    print(f"{SHAPE} batch {BATCH}x{SEQ} attn={a.attn} kernels={a.kernels} "
          f"checkpointing={a.gradient_checkpointing}: GPU busy {total:.1f} ms/step "
          f"({BATCH * SEQ / total * 1000:.0f} tok/s if nothing else ran)")
    for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:8.2f} ms  {100 * ms / total:5.1f}%  {group}")
    print("top kernels (ms per step, launches per step):")
    for name, (ms, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"  {ms:8.3f} ms {n / a.steps:6.0f}x  {name[:110]}")


if __name__ == "__main__":
    main()
