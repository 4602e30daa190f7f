"""Tiny random checkpoints written by transformers (the oracle), one per family and feature."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=211, max_position_embeddings=256, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)

# name -> (transformers config class, extra config keys)
VARIANTS = {
    "llama": ("LlamaConfig", {}),
    "llama_mha_untied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3_rope": ("LlamaConfig", dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=32))),
    "linear_rope": ("LlamaConfig", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "dynamic_rope": ("LlamaConfig", dict(max_position_embeddings=24, rope_scaling=dict(rope_type="dynamic",
                                                                                       factor=2.0))),
    "yarn_rope": ("LlamaConfig", dict(rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                        original_max_position_embeddings=64))),
    "llama_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3_tied": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "mistral_window": ("MistralConfig", dict(sliding_window=8)),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
}


def hf_config(name: str):
    import transformers

    cls_name, extra = VARIANTS[name]
    return getattr(transformers, cls_name)(**{**BASE, **extra})


@functools.lru_cache(maxsize=None)
def checkpoint(name: str, dtype: str = "float32", shard: bool = False) -> Path:
    """Folder of a tiny transformers-written checkpoint (cached for the test session)."""
    import transformers

    torch.manual_seed(0)
    config = hf_config(name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # transformers zero-inits some params; random values catch wiring bugs
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif n.endswith("bias"):
                p.normal_(0, 0.02)
    folder = Path(tempfile.mkdtemp(prefix=f"cf-{name}-"))
    model.save_pretrained(folder, max_shard_size="60KB" if shard else "5GB")
    return folder


def hf_model(folder: Path, dtype=torch.float32):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    return m.eval()
