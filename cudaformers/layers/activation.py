"""Gated MLP activations: ``act(gate) * up``, by the config's ``hidden_act`` name."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError

_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedError(f"hidden_act={name!r} is not supported; supported: {sorted(_ACTIVATIONS)}") from None


def act_and_mul_reference(gate: torch.Tensor, up: torch.Tensor, name: str = "silu") -> torch.Tensor:
    return activation(name)(gate) * up
