"""The gated MLP of Llama-family decoders: ``down(act(gate(x)) * up(x))``."""

from __future__ import annotations

from torch import nn

from .activation import act_and_mul_reference, activation


class GatedActivation(nn.Module):
    """``act(gate) * up``; a module so fused kernels can be swapped in from outside."""

    def __init__(self, name: str):
        super().__init__()
        activation(name)  # fail early on an unknown name
        self.name = name

    def forward(self, gate, up):
        return act_and_mul_reference(gate, up, self.name)

    def extra_repr(self) -> str:
        return self.name


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = GatedActivation(hidden_act)

    def project_gate_up(self, x):
        """gate and up projections; one fused matmul when a transform packed the weights."""
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x):
        return self.down_proj(self.act_fn(*self.project_gate_up(x)))
