"""Model configuration read from config.json (or GGUF metadata), with the family defaults that
transformers applies when a key is absent, and typed accessors the models use."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from .errors import CheckpointError

# Defaults transformers uses when config.json omits a key, by model_type.
_FAMILY_DEFAULTS = {
    "llama": dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
                  attention_bias=False, mlp_bias=False, tie_word_embeddings=False),
    "mistral": dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096 * 32,
                    sliding_window=4096, tie_word_embeddings=False),
    "qwen2": dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28, tie_word_embeddings=False),
    "qwen3": dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                  attention_bias=False, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                  tie_word_embeddings=False),
}
_FAMILY_DEFAULTS["qwen3_moe"] = dict(_FAMILY_DEFAULTS["qwen3"])
_FAMILY_DEFAULTS["mixtral"] = dict(_FAMILY_DEFAULTS["mistral"], sliding_window=None)


class PretrainedConfig:
    """Attribute access to every key of config.json, plus derived fields (head_dim, layer types, rope)."""

    def __init__(self, **kwargs):
        model_type = kwargs.get("model_type")
        for key, value in _FAMILY_DEFAULTS.get(model_type, {}).items():
            setattr(self, key, value)
        self.torch_dtype = None
        for key, value in kwargs.items():
            setattr(self, key, value)
        if getattr(self, "num_key_value_heads", None) is None and hasattr(self, "num_attention_heads"):
            self.num_key_value_heads = self.num_attention_heads
        if getattr(self, "head_dim", None) is None and hasattr(self, "hidden_size") \
                and hasattr(self, "num_attention_heads"):
            self.head_dim = self.hidden_size // self.num_attention_heads

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict, **overrides) -> "PretrainedConfig":
        data = {**data, **overrides}
        if "dtype" in data and "torch_dtype" not in data:
            data["torch_dtype"] = data["dtype"]
        return cls(**data)

    @classmethod
    def from_pretrained(cls, path_or_repo_id, *, gguf_file: str | None = None, **kwargs) -> "PretrainedConfig":
        from .hub import resolve_folder

        hub_keys = {k: kwargs.pop(k) for k in ("revision", "cache_dir", "token", "local_files_only") if k in kwargs}
        folder = resolve_folder(path_or_repo_id, gguf_file=gguf_file, weights=bool(gguf_file), **hub_keys)
        if gguf_file:
            from .loading.gguf import read_gguf_config

            return cls.from_dict(read_gguf_config(folder / gguf_file), **kwargs)
        file = folder / "config.json"
        if not file.is_file():
            raise CheckpointError(f"{folder} has no config.json; a Hugging Face checkpoint folder needs one "
                                  "(or pass gguf_file= for a GGUF model)")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{file} is not valid JSON ({e}); re-download or fix the file") from e
        return cls.from_dict(data, **kwargs)

    def to_dict(self) -> dict:
        return {k: copy.deepcopy(v) for k, v in self.__dict__.items() if not k.startswith("_")}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(self.to_json_string() + "\n")

    def __repr__(self) -> str:
        return f"{type(self).__name__} {self.to_json_string()}"

    def __eq__(self, other) -> bool:
        return isinstance(other, PretrainedConfig) and self.to_dict() == other.to_dict()

    def get(self, key, default=None):
        return getattr(self, key, default)

    # -- derived fields ---------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        archs = getattr(self, "architectures", None) or []
        return archs[0] if archs else ""

    @property
    def rope(self) -> dict:
        """The rope parameters in transformers-5 form: rope_type, rope_theta and the type's keys."""
        params = getattr(self, "rope_parameters", None)
        if params and "rope_theta" in params:
            out = dict(params)
        else:
            out = dict(getattr(self, "rope_scaling", None) or {})
            out["rope_theta"] = getattr(self, "rope_theta", 10000.0)
        out["rope_type"] = out.get("rope_type", out.pop("type", "default")) or "default"
        return out

    def attention_types(self) -> list[str]:
        """'full_attention' or 'sliding_attention' for each decoder layer."""
        n = self.num_hidden_layers
        types = getattr(self, "layer_types", None)
        if types:
            return list(types)
        window = getattr(self, "sliding_window", None)
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            if getattr(self, "use_sliding_window", False) and window:
                first = getattr(self, "max_window_layers", n)
                return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
            return ["full_attention"] * n
        if window and self.model_type in ("mistral", "mixtral"):
            return ["sliding_attention"] * n
        return ["full_attention"] * n

    def sliding_window_for(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.attention_types()[layer_idx] == "sliding_attention" else None


class AutoConfig:
    """``AutoConfig.from_pretrained(path_or_repo_id)`` as in transformers."""

    @staticmethod
    def from_pretrained(path_or_repo_id, **kwargs) -> PretrainedConfig:
        return PretrainedConfig.from_pretrained(path_or_repo_id, **kwargs)

    @staticmethod
    def for_model(model_type: str, **kwargs) -> PretrainedConfig:
        return PretrainedConfig(model_type=model_type, **kwargs)
