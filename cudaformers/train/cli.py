"""``cudaformers train MODEL --data FILE``: fine-tune on a text or JSONL file; run it under
``torchrun --nproc_per_node=N -m cudaformers.cli train ...`` for several GPUs.

A ``.txt`` file holds documents separated by blank lines; a ``.jsonl`` file holds one JSON object per
line with ``text`` (or ``input_ids``). The trained model (or LoRA adapter) is written to
``--output-dir`` with the tokenizer, ready for ``from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UnsupportedError


def read_dataset(path: str) -> list:
    p = Path(path)
    if not p.is_file():
        raise UnsupportedError(f"--data {path}: no such file")
    if p.suffix == ".jsonl":
        rows = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UnsupportedError(f"{path}:{i} is not valid JSON ({e})") from e
        return rows
    if p.suffix in (".txt", ".md"):
        docs = [d.strip() for d in p.read_text().split("\n\n")]
        return [d for d in docs if d]
    raise UnsupportedError(f"--data {path}: use a .txt (documents separated by blank lines) or .jsonl file")


def add_arguments(parser) -> None:
    parser.add_argument("model", help="local folder or Hub id")
    parser.add_argument("--data", required=True, help=".txt or .jsonl training file")
    parser.add_argument("--eval-data", help=".txt or .jsonl evaluation file")
    parser.add_argument("--output-dir", default="trainer_output")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--batch", type=int, default=8, help="per-GPU micro-batch size")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--warmup-steps", type=float, default=0)
    parser.add_argument("--scheduler", default="cosine")
    parser.add_argument("--seq", type=int, default=2048, help="max tokens per example (or per packed row)")
    parser.add_argument("--packing", action="store_true", help="pack documents into rows, no padding")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="bf16: autocast with fp32 master weights")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--use-kernels", action="store_true", help="Triton kernels incl. fused linear+CE")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="train LoRA adapters of this rank")
    parser.add_argument("--fsdp", default="", help="e.g. full_shard (FSDP2), under torchrun")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--save-steps", type=int, default=500)
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    parser.add_argument("--seed", type=int, default=42)


def run(args) -> int:
    import torch

    from ..models.auto import AutoModelForCausalLM
    from ..tokenizer import AutoTokenizer
    from .arguments import TrainingArguments
    from .trainer import Trainer

    targs = TrainingArguments(
        output_dir=args.output_dir, num_train_epochs=args.epochs, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch, per_device_eval_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, warmup_steps=args.warmup_steps,
        lr_scheduler_type=args.scheduler, max_seq_length=args.seq, packing=args.packing, bf16=args.dtype == "bf16",
        gradient_checkpointing=args.gradient_checkpointing, fsdp=args.fsdp, tp_size=args.tp_size,
        logging_steps=args.logging_steps, save_steps=args.save_steps, seed=args.seed,
        eval_strategy="epoch" if args.eval_data else "no")
    train, evaluation = read_dataset(args.data), read_dataset(args.eval_data) if args.eval_data else None
    rows = train + (evaluation or [])
    # Pre-tokenised data needs no tokenizer (and the checkpoint may have none).
    needs_text = any(not (isinstance(r, dict) and "input_ids" in r) for r in rows)
    tokenizer = AutoTokenizer.from_pretrained(args.model) if needs_text else None
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, use_kernels=args.use_kernels)
    if args.lora:
        from ..peft.lora import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    trainer = Trainer(model, targs, train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer)
    out = trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model()
    if trainer.dist.is_main:
        print(json.dumps({"global_step": out.global_step, **out.metrics, "saved_to": args.output_dir}))
    return 0
