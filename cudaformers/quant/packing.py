"""q/k/v and gate/up of a quantized model packed into one quantized matmul each (decode: one launch
per packed projection instead of two or three).

Every format quantizes rows independently (int8 and fp8 per row, int4/NF4/FP4 per block of a row),
so the packed layer's rows are exactly the rows of its parts and stacking the packed tensors along
the output dimension is exact. As for float weights (``kernels/fused_projections.py``), the stacked
tensors own the storage and each projection's parameters become views of them: names, state_dict
and adapters see nothing new, and the packed path runs only while those views are intact, in
inference, without gradients.

Not packed: layers of different types or settings, double-quantized NF4/FP4 (each layer has its own
absmax offset and second-level blocks that need not align), act-order int4 layers whose feature orders
differ, and layers still on the meta device.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from .linear import QuantLinear

logger = logging.getLogger("cudaformers")


def _settings(layer: QuantLinear) -> tuple:
    return (type(layer), layer.method, layer.in_features, layer.compute_dtype, getattr(layer, "group_size", None),
            getattr(layer, "sym", None), getattr(layer, "double_quant", False), getattr(layer, "act_order", False),
            layer.bias is None, layer.weight.device)


def stackable(layers: list[nn.Module]) -> bool:
    if not all(type(m) is type(layers[0]) and isinstance(m, QuantLinear) for m in layers):
        return False
    first = layers[0]
    if getattr(first, "double_quant", False) or first.weight.device.type == "meta":
        return False
    if len({_settings(m) for m in layers}) != 1:
        return False
    # Tensors of the input (int4 act-order's feature order) must be the same for all: x is read once.
    return all(torch.equal(getattr(m, name), getattr(first, name)) for m in layers[1:]
               for name in first.per_input if name in first.packed_shapes())


class PackedQuantLinear(nn.Module):
    """The stacked quantized layer of several projections. It registers no tensors (the checkpoint
    names stay on the projections, whose parameters are views of the stacked ones): the stacked
    layer is held outside the module tree."""

    def __init__(self, layer: QuantLinear, sizes: list[int]):
        super().__init__()
        self.__dict__["layer"] = layer  # not a submodule: no duplicate parameters in state_dict
        self.sizes = sizes

    def forward(self, x):
        return self.layer(x)

    def usable_for(self, first: nn.Module) -> bool:
        """Whether the projections still are views of the stacked tensors (not replaced, wrapped by
        adapters or moved), with no gradient wanted."""
        return (not self.training and not torch.is_grad_enabled() and type(first) is type(self.layer)
                and first.weight.data_ptr() == self.layer.weight.data_ptr())

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, method={self.layer.method}"


@torch.no_grad()
def pack_quantized(layers: list[QuantLinear]) -> PackedQuantLinear:
    """Stacks ``layers`` (``stackable``) into one; their parameters become views of it."""
    stacked = copy.copy(layers[0])  # settings and cached state (e.g. the NF4 code table) of the first
    stacked._parameters = dict(stacked._parameters)
    sizes = [m.out_features for m in layers]
    stacked.out_features = sum(sizes)
    names = [n for n in layers[0].packed_shapes() if n not in layers[0].per_input]  # per-input: the first's
    names += ["bias"] if layers[0].bias is not None else []
    for name in names:
        whole = torch.cat([getattr(m, name).detach() for m in layers])
        stacked._parameters[name] = nn.Parameter(whole, requires_grad=False)
        start = 0
        for m, n in zip(layers, sizes):
            old = getattr(m, name)
            m._parameters[name] = nn.Parameter(whole[start:start + n], requires_grad=old.requires_grad)
            start += n
    logger.debug("packed %d %s layers into one of %d rows", len(layers), layers[0].method, stacked.out_features)
    return PackedQuantLinear(stacked, sizes)


@torch.no_grad()
def unpack_quantized(layers: list[QuantLinear]) -> None:
    """Gives each projection its own storage again (before a transform replaces the parameters)."""
    for m in layers:
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
