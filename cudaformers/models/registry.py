"""``architectures`` string in config.json -> model class."""

from __future__ import annotations

from importlib import import_module

from ..errors import UnsupportedError

_ARCHITECTURES = {
    "LlamaForCausalLM": "cudaformers.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "cudaformers.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "cudaformers.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "cudaformers.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "cudaformers.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "cudaformers.models.mixtral:MixtralForCausalLM",
    "MambaForCausalLM": "cudaformers.models.mamba:MambaForCausalLM",
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "mamba": "MambaForCausalLM"}


def register_architecture(name: str, target: str, model_type: str | None = None) -> None:
    _ARCHITECTURES[name] = target
    if model_type:
        _MODEL_TYPES[model_type] = name


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class_for(config):
    name = config.architecture or _MODEL_TYPES.get(getattr(config, "model_type", None), "")
    target = _ARCHITECTURES.get(name)
    if target is None:
        shown = name or f"model_type={getattr(config, 'model_type', None)!r}"
        raise UnsupportedError(f"architecture {shown} is not supported; supported architectures: "
                               f"{', '.join(supported_architectures())}")
    module, cls = target.split(":")
    return getattr(import_module(module), cls)
