"""Pack q/k/v (and gate/up) weights into one matrix so decode runs one matmul instead of three.

At batch 1 each projection is a memory-bound GEMV plus a launch; packing removes two launches and
lets one kernel stream all the weights. The packed matrix owns the storage and the Hugging Face
parameters become views of it, so names, state_dict and optimizers see nothing new. The packed
path runs only in inference with the parameters still plain, unreplaced ``nn.Linear`` weights;
otherwise (training, LoRA, quantized or swapped weights) the separate projections run as before.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import Attention
from ..layers.mlp import GatedMLP


def _pack(owner: nn.Module, linears: list[nn.Linear], name: str) -> bool:
    if not all(type(m) is nn.Linear for m in linears):
        return False
    weights = [m.weight for m in linears]
    if len({(w.device, w.dtype) for w in weights}) != 1 or weights[0].device.type == "meta":
        return False
    packed = torch.cat([w.detach() for w in weights])
    sizes, start = [], 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(packed[start:start + n], requires_grad=m.weight.requires_grad)
        sizes.append(n)
        start += n
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([m.bias.detach() for m in linears])
        start = 0
        for m, n in zip(linears, sizes):
            m.bias = nn.Parameter(bias[start:start + n], requires_grad=m.bias.requires_grad)
            start += n
    owner.register_buffer(f"_{name}_weight", packed, persistent=False)
    owner.register_buffer(f"_{name}_bias", bias, persistent=False)
    setattr(owner, f"_{name}_sizes", sizes)
    return True


def _usable(owner: nn.Module, name: str, first: nn.Module) -> bool:
    packed = getattr(owner, f"_{name}_weight", None)
    return (packed is not None and not owner.training and not torch.is_grad_enabled() and type(first) is nn.Linear
            and first.weight.data_ptr() == packed.data_ptr())


def _qkv(self: Attention, hidden):
    if not _usable(self, "qkv", self.q_proj):
        return Attention.project_qkv(self, hidden)
    return F.linear(hidden, self._qkv_weight, self._qkv_bias).split(self._qkv_sizes, dim=-1)


def _gate_up(self: GatedMLP, x):
    if not _usable(self, "gate_up", self.gate_proj):
        return GatedMLP.project_gate_up(self, x)
    return F.linear(x, self._gate_up_weight, self._gate_up_bias).split(self._gate_up_sizes, dim=-1)


def fuse_projections(model: nn.Module) -> int:
    """Packs every attention and gated MLP of ``model``; returns how many modules were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, Attention) and _pack(module, [module.q_proj, module.k_proj, module.v_proj], "qkv"):
            module.project_qkv = types.MethodType(_qkv, module)
            count += 1
        elif isinstance(module, GatedMLP) and _pack(module, [module.gate_proj, module.up_proj], "gate_up"):
            module.project_gate_up = types.MethodType(_gate_up, module)
            count += 1
    if hasattr(model, "_choices") and count:
        model._choices["projections"] = f"q/k/v and gate/up packed into single matmuls ({count} modules)"
    return count
