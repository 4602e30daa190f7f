"""Model outputs that read like transformers': attribute, key and index access."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def _present(self):
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return [v for _, v in self._present()][key]

    def keys(self):
        return [k for k, _ in self._present()]

    def to_tuple(self):
        return tuple(v for _, v in self._present())
