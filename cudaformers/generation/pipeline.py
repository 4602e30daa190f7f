"""``pipeline("text-generation", model=...)``: prompts or chats in, generated text out."""

from __future__ import annotations

import torch

from ..errors import UnsupportedError


def _is_chat(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and isinstance(x[0], dict) and "role" in x[0]


class TextGenerationPipeline:
    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @property
    def device(self) -> torch.device:
        return self.model.device

    def __call__(self, inputs, return_full_text: bool = True, **generate_kwargs):
        single = isinstance(inputs, str) or _is_chat(inputs)
        items = [inputs] if single else list(inputs)
        results = [self._one(x, return_full_text, generate_kwargs) for x in items]
        return results[0] if single else results

    def _one(self, item, return_full_text, generate_kwargs):
        tok = self.tokenizer
        if _is_chat(item):
            prompt = tok.apply_chat_template(list(item), add_generation_prompt=True, tokenize=False)
            enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
        else:
            prompt = item
            enc = tok(item, return_tensors="pt")
        kwargs = dict(generate_kwargs)
        if "max_new_tokens" not in kwargs and self.model.generation_config.max_new_tokens is None:
            kwargs["max_new_tokens"] = 256  # transformers' pipeline default
        out = self.model.generate(enc["input_ids"].to(self.device), attention_mask=enc["attention_mask"].to(self.device),
                                  tokenizer=tok, **kwargs)
        n = enc["input_ids"].shape[1]
        rows = []
        for seq in out:
            text = tok.decode(seq[n:], skip_special_tokens=True)
            if _is_chat(item):
                full = list(item) + [{"role": "assistant", "content": text}]
                rows.append({"generated_text": full if return_full_text else text})
            else:
                rows.append({"generated_text": prompt + text if return_full_text else text})
        return rows


def pipeline(task: str = "text-generation", model=None, tokenizer=None, device=None, device_map=None,
             dtype="auto", attn_implementation=None, **model_kwargs):
    """Builds the pipeline; the model goes to the GPU when one is visible unless told otherwise."""
    from ..device import default_device
    from ..models.auto import AutoModelForCausalLM
    from ..tokenizer import AutoTokenizer

    if task != "text-generation":
        raise UnsupportedError(f"pipeline task {task!r} is not supported; cudaformers provides 'text-generation'")
    if model is None:
        from ..embedded import default_model

        folder, gguf = default_model()
        model, model_kwargs = folder, {**model_kwargs, "gguf_file": gguf}
    if device is not None and device_map is not None:
        raise ValueError("pass device= or device_map=, not both")
    if isinstance(model, str):
        placement = device_map if device_map is not None else (device if device is not None else default_device())
        if dtype == "auto" and model_kwargs.get("gguf_file"):
            dtype = _default_dtype(placement)
        model_obj = AutoModelForCausalLM.from_pretrained(model, device_map=placement, dtype=dtype,
                                                         attn_implementation=attn_implementation, **model_kwargs)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(model, gguf_file=model_kwargs.get("gguf_file"))
        model = model_obj
    elif tokenizer is None:
        raise ValueError("pipeline(model=<model object>) also needs tokenizer=")
    elif isinstance(tokenizer, str):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return TextGenerationPipeline(model, tokenizer)


def _default_dtype(placement) -> torch.dtype:
    """bf16 on GPUs that have it, fp16 on older GPUs, fp32 on the CPU."""
    from ..device import resolve_device, supports_bf16

    dev = resolve_device(placement) if not isinstance(placement, (dict,)) and placement not in ("auto",) else None
    if dev is None:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dev.type != "cuda":
        return torch.float32
    return torch.bfloat16 if supports_bf16(dev) else torch.float16
