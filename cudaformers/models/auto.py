"""``AutoModelForCausalLM``: picks the family from config.json's ``architectures``."""

from __future__ import annotations


class AutoModelForCausalLM:
    @staticmethod
    def from_pretrained(path_or_repo_id, **kwargs):
        from ..loading.pretrained import load_pretrained

        return load_pretrained(path_or_repo_id, **kwargs)

    @staticmethod
    def from_config(config, dtype=None, attn_implementation: str = "sdpa", device=None):
        """A randomly initialised model (transformers' init: normal(0, 0.02), norms at 1)."""
        import torch

        from ..loading.pretrained import resolve_dtype
        from .registry import model_class_for

        dtype = resolve_dtype(dtype or "float32", config)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device or "cpu"):
                model = model_class_for(config)(config)
        finally:
            torch.set_default_dtype(previous)
        std = getattr(config, "initializer_range", 0.02)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)
        model.tie_weights()
        from ..generation.config import GenerationConfig

        model.generation_config = GenerationConfig(bos_token_id=getattr(config, "bos_token_id", None),
                                                   eos_token_id=getattr(config, "eos_token_id", None),
                                                   pad_token_id=getattr(config, "pad_token_id", None))
        model.set_attn_implementation(attn_implementation)
        return model
