"""Tensor parallelism of weight-quantized layers: their packed tensors split by hand, since DTensor's
parallel styles shard only ``nn.Linear`` and ``nn.Embedding`` weights.

Column-wise (q/k/v, gate/up): each process keeps its slice of the output rows. Every method quantizes
rows independently (int8 and fp8 one scale a row, int4 and NF4/FP4 per block of a row), so the slice
of the packed tensors is exactly the quantized slice of the weight. Row-wise (o, down): each process
keeps its slice of the input features in whole packing blocks (int4's groups, int8's and NF4's blocks
of 64), whose codes and per-block scales are contiguous columns of the packed tensors; per-row scales
stay whole, since a row's partial sums share its scale. The partial outputs are summed by an
all-reduce and the bias is added once, after it.

Inference only: the sharded layers run the forward of their quantized kernels, not autograd's. A
double-quantized NF4/FP4 layer keeps its block scales in fp32 once split (exactly the values it had;
the second-level blocks of 256 scales need not fall on a shard's edge): 0.37 more bits a weight.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UnsupportedError
from ..kernels.quant_matmul import group_scales
from ..quant.linear import QuantLinear


def shard_quantized(layer: QuantLinear, style: str, rank: int, tp: int, group, name: str = "") -> None:
    """Keep this process's share of ``layer`` (``style``: "colwise" or "rowwise"), in place."""
    where = f"{name} ({layer.method}, {layer.in_features} -> {layer.out_features})"
    if getattr(layer, "double_quant", False):
        _undo_double_quant(layer)
    if style == "colwise":
        _keep_rows(layer, rank, tp, where)
    elif style == "rowwise":
        if getattr(layer, "act_order", False):
            raise UnsupportedError(f"tensor parallelism: {where} is an act-order GPTQ layer, whose input features are "
                                   "stored in another order than x's, so it cannot be split by input features. Keep "
                                   "the model whole on one GPU (device_map='cuda') or spread it by layers "
                                   "(device_map='auto')")
        _keep_inputs(layer, rank, tp, where)
        layer.__class__ = _rowwise_class(type(layer))
        layer.tp_group = group
    else:
        raise UnsupportedError(f"tp_plan style {style!r} for {where}; use 'colwise' or 'rowwise'")


def _tensors(layer: QuantLinear):
    """(name, tensor) of the packed tensors and bias indexed by output row."""
    for name, p in layer._parameters.items():
        if p is not None and name not in layer.per_input and p.ndim >= 1:
            yield name, p


def _keep_rows(layer: QuantLinear, rank: int, tp: int, where: str) -> None:
    n = layer.out_features
    if n % tp:
        raise UnsupportedError(f"tensor parallelism: {tp} processes do not divide the {n} output rows of {where}; "
                               "pick a tp size that divides it")
    rows = n // tp
    for name, p in list(_tensors(layer)):
        layer._parameters[name] = nn.Parameter(p.detach()[rank * rows:(rank + 1) * rows].clone(),
                                               requires_grad=False)
    layer.out_features = rows


def _packing_block(layer: QuantLinear) -> int:
    """Input features a packing block of ``layer`` holds (fp8 stores plain e4m3 bytes: any split)."""
    return 1 if layer.method == "fp8" else layer.packed().block


def _keep_inputs(layer: QuantLinear, rank: int, tp: int, where: str) -> None:
    k, block = layer.in_features, _packing_block(layer)
    if k % (tp * block):
        raise UnsupportedError(f"tensor parallelism: {where} splits by input features in whole blocks of {block} "
                               f"(its packing), and {k} features are not {tp} shards of whole blocks; pick a tp size "
                               f"for which {k} / tp is a multiple of {block}")
    local = k // tp
    for name, p in list(_tensors(layer)):
        if p.ndim == 2:  # codes and per-block scales: columns in proportion to the features
            per = p.shape[1] * local // k
            layer._parameters[name] = nn.Parameter(p.detach()[:, rank * per:(rank + 1) * per].clone(),
                                                   requires_grad=False)
    layer.in_features = local


def _undo_double_quant(layer: QuantLinear) -> None:
    absmax = group_scales(layer.packed())  # [N, Kp/64] fp32: int8 codes times their scale, plus the offset
    for name in ("absmax_scale", "absmax_offset"):
        del layer._parameters[name]
    layer._parameters["absmax"] = nn.Parameter(absmax, requires_grad=False)
    layer.double_quant, layer._offset = False, 0.0


class _RowwiseShard:
    """A quantized layer holding a slice of the input features: its partial outputs are summed across
    the tensor-parallel group, then the bias is added, once. In ``matmul``, which every path to the
    layer's kernels goes through, so none can skip the sum."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise UnsupportedError("a tensor-parallel quantized model runs inference only; to fine-tune a quantized "
                                   "model use LoRA adapters (QLoRA) with DDP or FSDP instead of tp_size")
        return super().forward(x)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = super().matmul(x)
        dist.all_reduce(y, group=self.tp_group)
        return y if bias is None else y + bias


@functools.cache
def _rowwise_class(cls: type) -> type:
    # A subclass, not a wrapper: names, state_dict and isinstance checks see the layer they saw before.
    return type(f"Rowwise{cls.__name__}", (_RowwiseShard, cls), {"__module__": __name__})
