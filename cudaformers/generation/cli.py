"""`cudaformers generate [MODEL] "prompt"`: one completion, streamed to stdout."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch


def add_model_arguments(parser) -> None:
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPUs that have it, fp16 on older GPUs, "
                        "the checkpoint's dtype or fp32 on CPU), bfloat16, float16, float32")
    parser.add_argument("--device-map", default=None, help="cpu, cuda, cuda:N or auto (default: the GPU when one "
                        "is visible, else the CPU)")
    parser.add_argument("--attn", default=None, help="attention backend (eager, sdpa, triton, flash_attention_2...)")
    add_kernels_argument(parser)
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside MODEL's folder")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: "
                        "the model's generation_config)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--greedy", action="store_true", help="greedy decoding, whatever generation_config says")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("-v", "--verbose", action="store_true", help="log automatic choices (attention, graphs)")


def add_arguments(parser) -> None:
    parser.add_argument("args", nargs="+", metavar="[MODEL] PROMPT",
                        help="model folder, .gguf file or Hub repo id (default: the embedded SmolLM2), then the prompt")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_model_arguments(parser)


def add_kernels_argument(parser) -> None:
    parser.add_argument("--kernels", default="auto", choices=("auto", "on", "off"),
                        help="the bundled Triton kernels (use_kernels=True); auto: on when the model runs on a GPU")


def use_kernels(choice: str, device_map: str) -> bool:
    """``--kernels`` resolved for a model placed by ``device_map``; the automatic choice is logged."""
    if choice != "auto":
        return choice == "on"
    on = torch.cuda.is_available() if device_map == "auto" else torch.device(device_map).type == "cuda"
    logging.getLogger("cudaformers").info("kernels: %s (automatic on %s; --kernels on|off to choose)",
                                          "on" if on else "off", device_map)
    return on


def load(model_arg: str | None, args, with_tokenizer: bool = True):
    """Model and tokenizer (None without ``with_tokenizer``) for the CLI; the embedded model when none
    is named."""
    from ..device import default_device, supports_bf16
    from ..embedded import default_model
    from ..models.auto import AutoModelForCausalLM
    from ..tokenizer import AutoTokenizer

    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    gguf = args.gguf_file
    if model_arg is None:
        model_arg, gguf = default_model()
    elif model_arg.endswith(".gguf") and Path(model_arg).is_file():
        model_arg, gguf = str(Path(model_arg).parent), Path(model_arg).name
    device_map = args.device_map or str(default_device())
    dtype = args.dtype
    if dtype == "auto" and device_map != "auto" and (gguf or torch.device(device_map).type == "cuda"):
        dev = torch.device(device_map)
        dtype = (torch.bfloat16 if supports_bf16(dev) else torch.float16) if dev.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_arg, gguf_file=gguf, dtype=dtype, device_map=device_map,
                                                 attn_implementation=args.attn,
                                                 use_kernels=use_kernels(args.kernels, device_map))
    tokenizer = AutoTokenizer.from_pretrained(model_arg, gguf_file=gguf) if with_tokenizer else None
    return model, tokenizer


def generation_kwargs(args) -> dict:
    kw = dict(max_new_tokens=args.max_new_tokens)
    if args.greedy:
        kw["do_sample"] = False
    elif args.temperature is not None:
        kw.update(do_sample=args.temperature > 0, temperature=args.temperature)
    for name in ("top_p", "top_k", "min_p", "repetition_penalty", "seed"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    return kw


def run(args) -> int:
    from .streamer import TextStreamer

    model_arg, prompt = (None, args.args[0]) if len(args.args) == 1 else (args.args[0], " ".join(args.args[1:]))
    model, tok = load(model_arg, args)
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tok(prompt, return_tensors="pt")
    streamer = TextStreamer(tok, skip_prompt=args.chat)
    model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], streamer=streamer,
                   **generation_kwargs(args))
    if args.verbose:
        print(model.explain(), file=sys.stderr)
    return 0
