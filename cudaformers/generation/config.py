"""GenerationConfig: transformers' names and defaults, read from generation_config.json."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ..errors import UnsupportedError

_DEFAULTS = dict(
    max_new_tokens=None, max_length=20, min_new_tokens=0, do_sample=False, temperature=1.0, top_k=50, top_p=1.0,
    min_p=None, repetition_penalty=1.0, num_return_sequences=1, eos_token_id=None, pad_token_id=None,
    bos_token_id=None, stop_strings=None, seed=None, use_cache=True, num_beams=1,
)
# Keys transformers writes that do not change what generate() computes here.
_IGNORED = {"transformers_version", "_from_model_config", "cache_implementation", "output_scores",
            "return_dict_in_generate", "output_logits", "output_attentions", "output_hidden_states"}


class GenerationConfig:
    def __init__(self, **kwargs):
        for key, value in _DEFAULTS.items():
            setattr(self, key, copy.deepcopy(value))
        self._extra = {}
        self.update(**kwargs)

    def update(self, **kwargs) -> dict:
        """Set known fields; unknown ones are kept (and written back) but have no effect."""
        for key, value in kwargs.items():
            if key in _DEFAULTS:
                setattr(self, key, value)
            elif key not in _IGNORED:
                self._extra[key] = value
        return {}

    def validate(self) -> None:
        if self.num_beams != 1:
            raise UnsupportedError(f"num_beams={self.num_beams}: beam search is not supported; use greedy or sampling")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be >= 1, got {self.num_return_sequences}")

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in _DEFAULTS}
        out.update(self._extra)
        return out

    def __repr__(self) -> str:
        return f"GenerationConfig {json.dumps({k: v for k, v in self.to_dict().items() if v != _DEFAULTS.get(k)})}"

    def copy(self) -> "GenerationConfig":
        return copy.deepcopy(self)

    @classmethod
    def from_pretrained(cls, folder, **kwargs) -> "GenerationConfig":
        file = Path(folder) / "generation_config.json"
        data = json.loads(file.read_text()) if file.is_file() else {}
        return cls(**{**data, **kwargs})

    @classmethod
    def from_model_folder(cls, folder, config) -> "GenerationConfig":
        """generation_config.json when present, else the token ids from config.json (transformers' rule)."""
        file = Path(folder) / "generation_config.json"
        if file.is_file():
            return cls.from_pretrained(folder)
        return cls(bos_token_id=getattr(config, "bos_token_id", None), eos_token_id=getattr(config, "eos_token_id", None),
                   pad_token_id=getattr(config, "pad_token_id", None))

    def save_pretrained(self, folder) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "generation_config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
