"""Where a training step's copies, casts, gathers and concatenations come from, counted on the CPU.

W6's step (bench/train.py: Trainer, bf16 autocast over fp32 master weights, fused AdamW, kernels on)
on a tiny qwen3 config, with the Triton kernels interpreted. A dispatch mode sees every aten op of
the second step; each ``copy_``, ``_to_copy``, ``clone``, ``index*``, ``cat``, ``add``, ``fill_``/
``zero_`` is attributed to the innermost cudaformers source line that called it (forward) or to the
autograd node that ran it (backward). Ops issued by the Triton interpreter itself are left out. Counts
scale with the layer count: per-layer lines x 28 for qwen3-0.6b.

    python bench/train_ops.py [--layers 2] [--kernels on|off] [--top 60]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run on the CPU

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WATCHED = re.compile(r"^(copy_|_to_copy|clone|index\w*|cat|add_?|fill_|zero_)$")
KERNELS = ("RMSNorm", "rotary_pos_emb", "SiluAndMul", "GatedMLP", "ForCausalLMLoss")


def tiny_qwen3(layers: int) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=192, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300,
                                      max_position_embeddings=512, tie_word_embeddings=True)
    folder = Path(tempfile.mkdtemp(prefix="train-ops-"))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


class OpCounter(TorchDispatchMode):
    """Counts the watched ops while ``active``, keyed by (op, where, first input's shape and dtype)."""

    def __init__(self):
        super().__init__()
        self.active = False
        self.rows = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.active and WATCHED.match(name):
            loc = self._where()
            if loc is not None:
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                desc = "" if first is None else f"{tuple(first.shape)} {str(first.dtype).removeprefix('torch.')}"
                if name == "_to_copy" and "dtype" in (kwargs or {}):
                    desc += f"->{str(kwargs['dtype']).removeprefix('torch.')}"
                self.rows[(name, loc, desc)] += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _where() -> str | None:
        frame, inner = sys._getframe(2), None
        while frame is not None:
            file = frame.f_code.co_filename
            if "triton/runtime/interpreter" in file:
                return None  # the interpreter moving kernel arguments, not the model's work
            if inner is None and "cudaformers/" in file and "/kernels/hub.py" not in file:
                inner = f"{file[file.rindex('cudaformers/'):]}:{frame.f_lineno} {frame.f_code.co_name}"
            frame = frame.f_back
        node = torch._C._current_autograd_node()
        if node is not None:
            return f"backward of {node.name()}"
        return inner or "other (trainer / optimizer)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kernels", default="on", choices=["on", "off"])
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()

    from torch.optim.optimizer import register_optimizer_step_post_hook

    from cudaformers import AutoModelForCausalLM
    from cudaformers.kernels.hub import KernelConfig
    from cudaformers.train.arguments import TrainingArguments
    from cudaformers.train.trainer import Trainer

    folder = tiny_qwen3(a.layers)
    mapping = {name: {"cpu": ""} for name in KERNELS}
    if a.kernels == "on":
        mapping = {"RMSNorm": "cudaformers:rms_norm", "rotary_pos_emb": {"cpu": {"training": "cudaformers:rotary",
                                                                                  "inference": ""}},
                   "SiluAndMul": "cudaformers:act_and_mul", "GatedMLP": {"cpu": {"training":
                                                                                "cudaformers:gated_mlp_recompute"}},
                   "ForCausalLMLoss": "cudaformers:fused_linear_cross_entropy"}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa",
                                                 kernel_config=KernelConfig(kernel_mapping=mapping))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(3, 300, (128,), generator=g).tolist()} for _ in range(8)]
    out = tempfile.mkdtemp(prefix="train-ops-out-")
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=3, learning_rate=1e-5,
                             bf16=True, optim="adamw_torch_fused", logging_steps=1, save_strategy="no",
                             disable_tqdm=True, max_seq_length=128, lr_scheduler_type="constant")
    trainer = Trainer(model, args, train_dataset=data)
    counter, steps = OpCounter(), []

    def after_step(*_):  # record exactly the second step: its forward, backward and optimizer step
        steps.append(None)
        counter.active = len(steps) == 1

    hook = register_optimizer_step_post_hook(after_step)
    try:
        with counter:
            trainer.train()
    finally:
        hook.remove()

    totals = collections.Counter()
    for (name, _, _), n in counter.rows.items():
        totals[name] += n
    print(f"\none training step, tiny qwen3 ({a.layers} layers, hidden 64, batch 2 x 128), kernels {a.kernels}, "
          "bf16 autocast over fp32 weights")
    print("per step:", ", ".join(f"{k} {v}" for k, v in totals.most_common()))
    print(f"\n{'n':>4}  {'op':10} {'first input':34} where")
    for (name, loc, desc), n in sorted(counter.rows.items(), key=lambda kv: (-kv[1], kv[0]))[:a.top]:
        print(f"{n:4d}  {name:10} {desc:34} {loc}")


if __name__ == "__main__":
    main()
