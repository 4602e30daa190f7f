"""Model outputs that read like transformers': attribute, key and index access."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch.utils import _pytree


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


# A pytree node, as transformers registers its outputs: FSDP2 finds the tensors a module returns with
# tree_flatten (before torch 2.13) and hooks the gradient-requiring ones to gather the module's
# parameters again before its backward. As a leaf, the loss went unhooked: a resharded root's
# weights (final norm, lm_head) were read freed in backward (an illegal address on CUDA).
_pytree.register_pytree_node(
    CausalLMOutput,
    lambda out: ([out.loss, out.logits], None),
    lambda children, _: CausalLMOutput(*children),
    serialized_type_name=f"{CausalLMOutput.__module__}.{CausalLMOutput.__qualname__}",
)
