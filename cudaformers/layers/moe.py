"""Sparse mixture-of-experts block: a top-k router (``gate``) and stacked experts (``experts``).

Expert weights are stored stacked, as transformers 5 holds them in memory: ``gate_up_proj``
``[E, 2I, H]`` (gate rows first) and ``down_proj`` ``[E, H, I]``, so one grouped GEMM can run every
expert. Checkpoints on the Hub (and transformers' ``save_pretrained``) store one matrix per expert
(``experts.{e}.gate_proj.weight`` or Mixtral's ``w1``/``w3``/``w2``); ``load_checkpoint_tensor``
accepts both layouts and ``checkpoint_tensors`` writes the per-expert one back.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from .activation import act_and_mul_reference, activation


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool):
    """logits ``[T, E]`` -> (weights ``[T, k]`` fp32, expert index ``[T, k]`` int64): softmax in fp32,
    top-k, optionally renormalised to sum to one (Mixtral always; Qwen3-MoE when norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, index = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, index


class TopKRouter(nn.Module):
    kernel_layer_name = "MoeRouter"

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k, self.renormalize = top_k, renormalize

    def route(self, logits):
        return route_reference(logits, self.top_k, self.renormalize)

    def forward(self, hidden):
        """hidden ``[T, H]`` -> (weights ``[T, k]`` fp32, index ``[T, k]``)."""
        return self.route(F.linear(hidden, self.weight))

    def extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]}, top_k={self.top_k}, renormalize={self.renormalize}"


def moe_experts_reference(hidden, gate_up_proj, down_proj, top_k_index, top_k_weights, act: str = "silu"):
    """Loop over the experts that received tokens (what transformers does); returns ``[T, H]``.

    Each token's expert outputs are weighted in the weights' dtype and summed in the hidden dtype."""
    out = torch.zeros_like(hidden)
    for e in top_k_index.unique().tolist():
        token, slot = torch.where(top_k_index == e)
        gate, up = F.linear(hidden[token], gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(act_and_mul_reference(gate, up, act), down_proj[e])
        out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out


_PER_EXPERT = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class MoeExperts(nn.Module):
    kernel_layer_name = "MoeExperts"
    graph_safe = False  # the plain loop asks the host which experts received tokens

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        activation(act)
        self.num_experts, self.intermediate_size, self.act = num_experts, intermediate_size, act
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.checkpoint_names = names  # per-expert names written on save (Mixtral: w1, w3, w2)

    def forward(self, hidden, top_k_index, top_k_weights):
        return moe_experts_reference(hidden, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights, self.act)

    @torch.no_grad()
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """``name`` relative to this module: the stacked layout or one expert's matrix."""
        if name in ("gate_up_proj", "down_proj"):
            target = getattr(self, name)
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"experts.{name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            return
        m = _PER_EXPERT.match(name)
        if m is None:
            raise CheckpointError(f"unexpected MoE expert tensor {name!r}")
        e, role, i = int(m.group(1)), _ROLE[m.group(2)], self.intermediate_size
        if e >= self.num_experts:
            raise CheckpointError(f"checkpoint has expert {e} but config.json says {self.num_experts} experts")
        target = {"gate": self.gate_up_proj[e, :i], "up": self.gate_up_proj[e, i:], "down": self.down_proj[e]}[role]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"experts.{name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)

    def checkpoint_tensors(self, prefix: str) -> dict:
        """The per-expert tensors Hugging Face checkpoints hold, under ``prefix`` (``...experts.``)."""
        g, u, d = self.checkpoint_names
        i, out = self.intermediate_size, {}
        for e in range(self.num_experts):
            out[f"{prefix}{e}.{g}.weight"] = self.gate_up_proj[e, :i]
            out[f"{prefix}{e}.{u}.weight"] = self.gate_up_proj[e, i:]
            out[f"{prefix}{e}.{d}.weight"] = self.down_proj[e]
        return out

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"experts={e}, hidden={h}, intermediate={two_i // 2}, act={self.act}"


class SparseMoeBlock(nn.Module):
    """``[T, H]`` -> ``[T, H]``: route each token to its top-k experts and sum their weighted outputs."""

    def __init__(self, config, num_experts: int, intermediate_size: int, renormalize: bool,
                 weights_in_hidden_dtype: bool, expert_names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.gate = TopKRouter(config.hidden_size, num_experts, config.num_experts_per_tok, renormalize)
        self.experts = MoeExperts(num_experts, config.hidden_size, intermediate_size, config.hidden_act, expert_names)
        # Qwen3-MoE rounds the routing weights to the activation dtype; Mixtral keeps them in fp32.
        self.weights_in_hidden_dtype = weights_in_hidden_dtype

    def forward(self, hidden):
        weights, index = self.gate(hidden)
        if self.weights_in_hidden_dtype:
            weights = weights.to(hidden.dtype)
        return self.experts(hidden, index, weights)


def per_expert_state_dict(model) -> dict:
    """``model.state_dict()`` with every stacked expert tensor written as Hugging Face's per-expert
    matrices, the layout transformers (any version) and other tools read."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, MoeExperts):
            state.pop(f"{name}.gate_up_proj")
            state.pop(f"{name}.down_proj")
            state.update(module.checkpoint_tensors(f"{name}."))
    return state
