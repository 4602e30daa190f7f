"""``cudaformers plan``: where GPU memory goes for inference or training, and whether it fits.

Estimates per GPU, from the model's config alone (nothing is loaded):

* weights: parameters x bytes (quantized linear layers at their packed size plus scales);
* training: gradients and AdamW state (two fp32 moments) for what is trained — everything, or only
  the LoRA adapters; fp32 master weights under bf16/fp16 autocast;
* activations: what the backward pass keeps per token and layer with varlen flash attention (no
  ``S x S`` scores), or one residual per layer plus one recomputed layer with gradient checkpointing;
* logits: ``tokens x vocab`` in fp32 plus their gradient, unless the fused linear+cross-entropy keeps
  them to one chunk;
* inference: the KV cache for ``batch x seq`` tokens and a budget for CUDA-graph pools.

FSDP divides weights, gradients and optimizer state by the number of GPUs, tensor parallelism
divides the decoder layers' share; activations are per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnsupportedError

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
# Bytes per weight of a quantized linear layer, scales included (group size 64-128).
QUANT_BYTES = {"none": None, "int8": 1.0 + 2 / 128, "fp8": 1.0 + 4 / 128, "int4": 0.5 + 4 / 64, "nf4": 0.5 + 2 / 64,
               "fp4": 0.5 + 2 / 64}
CUDA_CONTEXT = 0.5 * GiB  # the CUDA context, cuBLAS workspaces and allocator slack
GRAPH_POOLS = 0.25 * GiB  # decode CUDA graphs: one pool shared by every captured batch size


@dataclass
class Shapes:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0
    expert_inter: int = 0
    top_k: int = 0
    qk_norm: bool = False

    @staticmethod
    def from_config(c) -> "Shapes":
        g = lambda k, d=None: getattr(c, k, d) if not isinstance(c, dict) else c.get(k, d)  # noqa: E731
        heads = g("num_attention_heads")
        return Shapes(hidden=g("hidden_size"), inter=g("intermediate_size") or 0, layers=g("num_hidden_layers"),
                      heads=heads, kv_heads=g("num_key_value_heads") or heads,
                      head_dim=g("head_dim") or g("hidden_size") // heads, vocab=g("vocab_size"),
                      tied=bool(g("tie_word_embeddings", False)), experts=g("num_experts", 0) or g("num_local_experts", 0) or 0,
                      expert_inter=g("moe_intermediate_size", 0) or g("intermediate_size") or 0,
                      top_k=g("num_experts_per_tok", 0) or 0,
                      qk_norm=g("model_type") in ("qwen3", "qwen3_moe"))

    def linear_params_per_layer(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h
        mlp = self.experts * 3 * h * self.expert_inter + h * self.experts if self.experts else 3 * h * self.inter
        return attn + mlp

    def counts(self) -> tuple[int, int]:
        """(parameters in decoder linear layers, all other parameters)."""
        linear = self.layers * self.linear_params_per_layer()
        other = self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * (2 * self.hidden + 2 * self.head_dim * self.qk_norm)
        return linear, other + self.hidden


@dataclass
class MemoryPlan:
    title: str
    rows: list[tuple[str, float]] = field(default_factory=list)  # (what, bytes per GPU)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(b for _, b in self.rows)

    def get(self, name: str) -> float:
        return sum(b for n, b in self.rows if n.startswith(name))

    def render(self, gpu_name: str | None = None, gpu_bytes: int | None = None) -> str:
        width = max(len(n) for n, _ in self.rows + [("total", 0)])
        lines = [self.title, f"{'':{width}}  GiB per GPU"]
        lines += [f"{n:{width}}  {b / GiB:10.2f}" for n, b in self.rows]
        lines.append(f"{'total':{width}}  {self.total / GiB:10.2f}")
        if gpu_bytes:
            verdict = "fits" if self.total <= gpu_bytes else "does NOT fit"
            lines.append(f"{verdict} on {gpu_name} ({gpu_bytes / GiB:.1f} GiB): {100 * self.total / gpu_bytes:.0f}% used")
        else:
            lines.append("no GPU visible: pass --gpu-mem GIB to check a fit")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def activation_bytes_per_token_layer(s: Shapes, dtype_bytes: int, recompute_mlp: bool = False) -> float:
    """What one decoder layer keeps for backward, per token (varlen flash attention, no scores).
    ``recompute_mlp``: the dense gated MLP rebuilds act(gate) * up in the backward (use_kernels)."""
    h, d = s.hidden, s.head_dim
    inter = s.top_k * s.expert_inter if s.experts else s.inter
    mlp_saved = 2 if (recompute_mlp and not s.experts) else 3
    elems = (4 * h                                # residual in, norm out, residual mid, norm out
             + (s.heads + 2 * s.kv_heads) * d     # q, k, v (after rotary)
             + s.heads * d                        # attention output
             + mlp_saved * inter)                 # gate, up (, act(gate) * up)
    return elems * dtype_bytes + s.heads * 4      # + the softmax log-sum-exp per head, fp32


def plan(config, *, task: str = "train", batch: int = 1, seq: int = 2048, gpus: int = 1, dtype: str = "bf16",
         quant: str = "none", lora_rank: int = 0, strategy: str = "fsdp", gradient_checkpointing: bool = False,
         fused_loss: bool = True, master_fp32: bool = True, recompute_mlp: bool | None = None) -> MemoryPlan:
    """``fused_loss`` and ``recompute_mlp`` are what ``use_kernels=True`` brings to training
    (``recompute_mlp`` follows ``fused_loss`` unless given)."""
    if task not in ("train", "infer"):
        raise UnsupportedError(f"task={task!r}; use 'train' or 'infer'")
    if dtype not in DTYPE_BYTES:
        raise UnsupportedError(f"dtype={dtype!r}; use one of bf16, fp16, fp32")
    if quant not in QUANT_BYTES:
        raise UnsupportedError(f"quant={quant!r}; use one of {sorted(QUANT_BYTES)}")
    if quant != "none" and task == "train" and not lora_rank:
        raise UnsupportedError("training quantized weights needs LoRA adapters: add --lora RANK (QLoRA)")
    if strategy not in ("ddp", "fsdp", "tp"):
        raise UnsupportedError(f"strategy={strategy!r}; use ddp, fsdp or tp")
    s = Shapes.from_config(config)
    b = DTYPE_BYTES[dtype]
    linear, other = s.counts()
    n_params = linear + other
    tokens = batch * seq
    weight_div = gpus if (task == "train" and strategy == "fsdp") else 1
    linear_div = gpus if strategy == "tp" else 1
    q = QUANT_BYTES[quant]
    full_train = task == "train" and not lora_rank
    wb = 4 if (full_train and master_fp32 and b < 4) else b
    weights = (linear * (q if q else wb) / linear_div + other * wb) / weight_div
    mode = f"{dtype}" + (" autocast + fp32 master weights" if wb == 4 and b < 4 else "")
    title = (f"{n_params / 1e9:.2f} B parameters; {task}, batch {batch} x seq {seq}, {mode}"
             f"{', ' + quant if q else ''}{f', LoRA r={lora_rank}' if lora_rank else ''}, {gpus} GPU(s)"
             f"{' ' + strategy if gpus > 1 else ''}")
    p = MemoryPlan(title)
    p.rows.append((f"weights ({'quantized linears' if q else 'fp32' if wb == 4 else dtype})", weights))
    if task == "infer":
        kv = 2 * s.layers * s.kv_heads * s.head_dim * b * tokens / linear_div
        p.rows.append(("KV cache", kv))
        work = tokens * max(2 * s.hidden + (s.heads + 2 * s.kv_heads) * s.head_dim, 2 * s.inter) * b
        p.rows.append(("activations (prefill, one layer)", work + batch * s.vocab * 4))
        p.rows.append(("CUDA graphs (decode)", GRAPH_POOLS))
    else:
        # LoRA on every linear of a layer: r x (in + out) for q, k, v, o, gate, up, down.
        lora = lora_rank * (7 * s.hidden + 2 * (s.heads + s.kv_heads) * s.head_dim + 3 * s.inter)
        trained = n_params if full_train else s.layers * lora
        if lora_rank:
            p.rows.append(("LoRA adapters (fp32)", trained * 4))
        p.rows.append(("gradients (fp32)" if full_train else "gradients (adapters)",
                       trained * 4 / (weight_div if full_train else 1)))
        p.rows.append(("optimizer (AdamW, 2 x fp32)", trained * 8 / (weight_div if full_train else 1)))
        if full_train and wb == 4 and b < 4:
            p.rows.append((f"{dtype} weight copies (autocast cache)", (linear / linear_div) * b))
        act_b = b if b < 4 else 4
        recompute = fused_loss if recompute_mlp is None else recompute_mlp
        per_layer = activation_bytes_per_token_layer(s, act_b, recompute) / linear_div
        if gradient_checkpointing:
            acts = tokens * (s.layers * s.hidden * 4 + per_layer)
            p.rows.append(("activations (checkpointed: residuals + 1 layer)", acts))
        else:
            p.rows.append(("activations", tokens * s.layers * per_layer + tokens * s.hidden * 4))
        if fused_loss:
            # One chunk of logits and the hidden-state gradient the loss computes in its forward. The
            # lm-head weight gradient it also computes there becomes that weight's .grad: counted once,
            # under gradients.
            from ..kernels.loss_chunks import chunk_rows

            chunk = chunk_rows(tokens, s.vocab, act_b)
            p.rows.append(("loss (fused linear+CE: a logits chunk + the hidden gradient)",
                           chunk * s.vocab * act_b + tokens * s.hidden * act_b))
        else:
            p.rows.append(("logits + fp32 loss + gradient", tokens * s.vocab * (act_b + 4 + 4)))
            p.notes.append("the full logits dominate; cudaformers' fused linear+cross-entropy (use_kernels=True) "
                           "avoids them")
    p.rows.append(("CUDA context and workspaces", CUDA_CONTEXT))
    return p


def add_arguments(parser) -> None:
    parser.add_argument("model", help="local folder or Hub id (only config.json is read)")
    parser.add_argument("--task", choices=("infer", "train"), default="train")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--gpus", type=int, default=None, help="default: the visible GPUs (1 without a GPU)")
    parser.add_argument("--quant", choices=sorted(QUANT_BYTES), default="none")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="train LoRA adapters of this rank")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "tp"), default="fsdp", help="with --gpus > 1")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--no-fused-loss", action="store_true", help="plan for the full logits")
    parser.add_argument("--pure", action="store_true", help="train in --dtype without fp32 master weights")
    parser.add_argument("--gpu-mem", type=float, default=None, metavar="GIB", help="check against this memory")


def run(args) -> int:
    import torch

    from ..config import AutoConfig

    config = AutoConfig.from_pretrained(args.model)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = args.gpus or max(1, visible)
    p = plan(config, task=args.task, batch=args.batch, seq=args.seq, gpus=gpus, dtype=args.dtype, quant=args.quant,
             lora_rank=args.lora, strategy=args.strategy, gradient_checkpointing=args.gradient_checkpointing,
             fused_loss=not args.no_fused_loss, master_fp32=not args.pure)
    if args.gpu_mem:
        name, total = f"a {args.gpu_mem:g} GiB GPU", int(args.gpu_mem * GiB)
    elif visible:
        props = torch.cuda.get_device_properties(0)
        name, total = props.name, props.total_memory
        if visible < gpus:
            p.notes.append(f"planned for {gpus} GPUs but {visible} are visible")
    else:
        name, total = None, None
    print(p.render(name, total))
    return 0 if total is None or p.total <= total else 1
