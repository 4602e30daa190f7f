"""Pack q/k/v (and gate/up) weights into one matrix so decode runs one matmul instead of three.

At batch 1 each projection is a memory-bound GEMV plus a launch; packing removes two launches and
lets one kernel stream all the weights. The packed matrix owns the storage and the Hugging Face
parameters become views of it, so names, state_dict and optimizers see nothing new. The packed
path runs only in inference with the parameters still plain, unreplaced ``nn.Linear`` weights;
otherwise (training, LoRA, quantized or swapped weights) the separate projections run as before.
Quantized projections pack the same way, through ``quant/packing.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..binding import bind
from ..layers.attention import Attention
from ..layers.mlp import GatedMLP


class PackedLinear(nn.Module):
    """The packed matrix of several projections. Its tensors are non-persistent buffers: the
    checkpoint names stay on the original Linear layers, whose parameters are views of these."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.sizes = sizes

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


def _pack(owner: nn.Module, linears: list[nn.Linear], name: str) -> bool:
    from ..quant.packing import pack_quantized, stackable

    if hasattr(owner, name):
        return False
    if stackable(linears):  # quantized projections: one stacked quantized matmul
        setattr(owner, name, pack_quantized(linears).train(owner.training))
        return True
    # Plain weights only: a DTensor shard (tensor parallelism) is an nn.Parameter too, of its own type.
    if not all(type(m) is nn.Linear and type(m.weight) in (nn.Parameter, torch.Tensor) for m in linears):
        return False
    weights = [m.weight for m in linears]
    if len({(w.device, w.dtype) for w in weights}) != 1 or weights[0].device.type == "meta":
        return False
    packed = torch.cat([w.detach() for w in weights])
    sizes = [w.shape[0] for w in weights]
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    start = 0
    for m, n in zip(linears, sizes):
        m.weight = nn.Parameter(packed[start:start + n], requires_grad=m.weight.requires_grad)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:start + n], requires_grad=m.bias.requires_grad)
        start += n
    # In the owner's mode: a model packed after .eval() must not get packed layers that think they
    # train (the packed matmul, and every fold past it, runs only outside training).
    setattr(owner, name, PackedLinear(packed, bias, sizes).train(owner.training))
    return True


def _usable(packed: PackedLinear, first: nn.Module) -> bool:
    # Only while the separate weights are still views of the packed matrix (not replaced, wrapped
    # by adapters, quantized or sharded) and no gradient is wanted.
    if not isinstance(packed, PackedLinear):
        return packed.usable_for(first)  # quant.packing.PackedQuantLinear
    return (not packed.training and not torch.is_grad_enabled() and type(first) is nn.Linear
            and first.weight.data_ptr() == packed.weight.data_ptr())


def _qkv(self: Attention, hidden):
    if not _usable(self.packed_qkv, self.q_proj):
        return Attention.project_qkv(self, hidden)
    return self.packed_qkv(hidden).split(self.packed_qkv.sizes, dim=-1)


def _gate_up(self: GatedMLP, x):
    if not _usable(self.packed_gate_up, self.gate_proj):
        return GatedMLP.project_gate_up(self, x)
    return self.packed_gate_up(x).split(self.packed_gate_up.sizes, dim=-1)


def fuse_projections(model: nn.Module) -> int:
    """Packs every attention and gated MLP of ``model``; returns how many modules were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, Attention) and _pack(module, [module.q_proj, module.k_proj, module.v_proj],
                                                   "packed_qkv"):
            module.project_qkv = bind(_qkv, module)
            count += 1
        elif isinstance(module, GatedMLP) and _pack(module, [module.gate_proj, module.up_proj], "packed_gate_up"):
            module.project_gate_up = bind(_gate_up, module)
            count += 1
    if hasattr(model, "_choices") and count:
        model._choices["projections"] = f"q/k/v and gate/up packed into single matmuls ({count} modules)"
    return count


# (packed attribute, the projections it packs, the bound method that runs it)
_PACKS = (("packed_qkv", ("q_proj", "k_proj", "v_proj"), "project_qkv"),
          ("packed_gate_up", ("gate_proj", "up_proj"), "project_gate_up"))


def release_packed(model: nn.Module) -> list:
    """Drops the packed matrices (float packs whose projections are still their views) before
    ``model.to()`` / ``.half()`` / ``.cuda()``: the move then carries the projections alone, and
    ``relink_projections`` stacks each packed matrix again from them, one layer at a time. Moved
    along, every tensor on its own, the packed matrices would hold the q/k/v and gate/up weights a
    second time on the target, and the projections would no longer be their views (the packed matmul,
    and every fold past it, would quietly stop running)."""
    released = []
    for module in model.modules():
        for name, attrs, method in _PACKS:
            packed = getattr(module, name, None)
            # an adapter's wrapped layer counts: its base weights are still the views
            linears = [getattr(m, "base_layer", m) for m in (getattr(module, attr, None) for attr in attrs)]
            if (type(packed) is PackedLinear and all(type(m) is nn.Linear for m in linears)
                    and linears[0].weight.data_ptr() == packed.weight.data_ptr()):
                released.append((module, name, method, linears, (packed.weight, packed.bias)))
                packed.weight, packed.bias = None, None
    return released


def relink_projections(model: nn.Module, released: list, fn=None) -> None:
    """After a move: stacks each released packed matrix from its moved projections (``fn``, the
    move, applied to it too where given: ``share_memory()`` must reach it) and makes them its views
    again; where nothing moved, the old matrix is kept. A pack whose projections no longer agree on
    device and dtype (a move that failed half way) is dropped, as ``unpack_projections`` would.
    Quantized packs, whose stacked layer sits outside the module tree and so stayed behind, are
    stacked again from the moved projections."""
    from ..quant.packing import PackedQuantLinear, pack_quantized, stackable

    for module, name, method, linears, before in released:
        packed = getattr(module, name)
        attrs = ("weight", "bias") if before[1] is not None else ("weight",)
        parts = {attr: [getattr(m, attr) for m in linears] for attr in attrs}
        if len({(p.device, p.dtype) for ps in parts.values() for p in ps}) != 1:
            delattr(module, name)
            module.__dict__.pop(method, None)
            continue
        for (attr, ps), old in zip(parts.items(), before):
            if all(p.untyped_storage().data_ptr() == old.untyped_storage().data_ptr() for p in ps):
                setattr(packed, attr, old)  # nothing moved (.cuda() on the GPU): the same storage
                continue
            whole = torch.cat([p.detach() for p in ps])
            whole = whole if fn is None else fn(whole)
            setattr(packed, attr, whole)
            start = 0
            for p in ps:
                p.data = whole[start:start + p.shape[0]]
                start += p.shape[0]
    for module in list(model.modules()):
        for name, attrs, _ in _PACKS:
            packed = getattr(module, name, None)
            linears = [getattr(module, attr, None) for attr in attrs]
            if (isinstance(packed, PackedQuantLinear) and stackable(linears)
                    and linears[0].weight.data_ptr() != packed.layer.weight.data_ptr()):
                setattr(module, name, pack_quantized(linears).train(packed.training))


def unpack_projections(model: nn.Module) -> int:
    """Undoes ``fuse_projections``: each projection gets its own storage again. Needed before a
    transform replaces the parameters (FSDP, tensor parallelism, DeepSpeed), which would otherwise
    leave the packed matrix holding a second, full copy of the weights."""
    count = 0
    for module in model.modules():
        for name, linears, method in _PACKS:
            from ..quant.packing import PackedQuantLinear, unpack_quantized

            if isinstance(getattr(module, name, None), PackedQuantLinear):
                unpack_quantized([getattr(module, attr) for attr in linears])
                delattr(module, name)
                module.__dict__.pop(method, None)
                count += 1
                continue
            if not isinstance(getattr(module, name, None), PackedLinear):
                continue
            for attr in linears:
                lin = getattr(module, attr)
                lin.weight = nn.Parameter(lin.weight.detach().clone(), requires_grad=lin.weight.requires_grad)
                if lin.bias is not None:
                    lin.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=lin.bias.requires_grad)
            delattr(module, name)
            module.__dict__.pop(method, None)
            count += 1
    if count and hasattr(model, "_choices"):
        model._choices.pop("projections", None)
    return count
