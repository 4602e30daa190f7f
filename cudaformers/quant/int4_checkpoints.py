"""Pre-quantized int4 checkpoints, read into cudaformers' int4 layout as they load.

Both public formats store ``w = (q - z) * s`` per group of ``G`` input features, 8 codes to an int32
(code i at bits 4i), with fp16 scales; they differ in which way the codes are packed:

- GPTQ: ``qweight [K/8, N]`` packed along K, ``qzeros [K/G, N/8]`` along N, ``scales [K/G, N]``, and
  ``g_idx [K]`` (each input feature's group; act-order checkpoints permute it). The classic format
  stores the zero points minus one, ``gptq_v2`` as they are.
- AWQ (AutoAWQ's "gemm" version): ``qweight [K, N/8]`` and ``qzeros [K/G, N/8]`` packed along N,
  ``scales [K/G, N]``. Within a word the 8 output columns sit in the order 0, 2, 4, 6, 1, 3, 5, 7
  (``AWQ_ORDER``), which its CUDA kernels unpack cheaply.

``unpack`` turns either into codes ``[N, K]``, zero points and scales ``[N, K/G]``: what ``Int4Linear``
packs for its kernels. Act-order GPTQ quantized the features in its own order and stores in g_idx
which group each belongs to; the layer keeps them sorted by group (``group_order``) and reads x in
that order.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError

FORMATS = ("gptq", "gptq_v2", "awq")
# The tensors of one layer in every format, and the one GPTQ may add (needed for act-order, else checked).
REQUIRED = ("qweight", "qzeros", "scales")
G_IDX = "g_idx"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output column AWQ_ORDER[i] of its 8


def nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 ``packed``, 8 int4 values each (value i at bits 4i), unpacked along ``dim`` (0 or 1):
    ``[R, C]`` -> ``[8R, C]`` or ``[R, 8C]``, value i of a word at position 8 * word + i."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    packed = packed.int()
    if dim == 0:
        return ((packed[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, packed.shape[1])
    return ((packed[:, :, None] >> shifts[None, None, :]) & 15).reshape(packed.shape[0], -1)


def _awq_columns(values: torch.Tensor) -> torch.Tensor:
    """Nibbles unpacked along N (``nibbles(.., 1)``) put back in column order."""
    rows, cols = values.shape
    logical = torch.empty_like(values).view(rows, cols // 8, 8)
    logical[:, :, list(AWQ_ORDER)] = values.view(rows, cols // 8, 8)
    return logical.view(rows, cols)


def _check_shapes(fmt: str, got: dict, want: dict, k: int, n: int, group: int) -> None:
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise CheckpointError(f"{fmt.upper()} tensor {name} has shape {tuple(got[name].shape)}, expected {shape} "
                                  f"for a {k} -> {n} layer with group_size {group}; config.json does not match "
                                  "the weights")


def unpack(fmt: str, k: int, n: int, group: int, qweight: torch.Tensor, qzeros: torch.Tensor,
           scales: torch.Tensor):
    """One layer's checkpoint tensors in format ``fmt`` (one of ``FORMATS``) -> (codes ``[N, K]`` int,
    zero points ``[N, G]`` float, scales ``[N, G]`` fp16) of ``w = (codes - zeros) * scales``."""
    groups = -(-k // group)
    if fmt == "awq":
        _check_shapes(fmt, dict(qweight=qweight, qzeros=qzeros, scales=scales),
                      dict(qweight=(k, n // 8), qzeros=(groups, n // 8), scales=(groups, n)), k, n, group)
        codes = _awq_columns(nibbles(qweight, 1)).t()
        zeros = _awq_columns(nibbles(qzeros, 1)).t().float()
        return codes, zeros, scales.t().half()
    _check_shapes(fmt, dict(qweight=qweight, scales=scales), dict(qweight=(k // 8, n), scales=(groups, n)),
                  k, n, group)
    codes = nibbles(qweight, 0).t()
    # The classic GPTQ format stores zero points minus one; gptq_v2 stores them as they are.
    zeros = nibbles(qzeros, 1)[:, :n].t().float() + (0 if fmt == "gptq_v2" else 1)
    return codes, zeros, scales.t().half()


def check_g_idx(g_idx: torch.Tensor, k: int, group: int) -> None:
    """Without act-order, GPTQ's g_idx must be the plain one (feature i in group i // G)."""
    if not torch.equal(g_idx.long().cpu(), torch.arange(k) // group):
        raise CheckpointError("this GPTQ checkpoint's g_idx is not in order (an act-order checkpoint) but its "
                              "quantization_config says desc_act=false; set desc_act to true in its config.json")


def group_order(g_idx: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """Act-order GPTQ (desc_act): the input features sorted by their group, ``[K]`` int64, such that
    features ``order[gG .. gG + G - 1]`` make group g (each group has G members, the last one the rest)."""
    if tuple(g_idx.shape) != (k,):
        raise CheckpointError(f"GPTQ g_idx of shape {tuple(g_idx.shape)} for a layer of {k} input features")
    order = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[order].cpu(), torch.arange(k) // group):
        raise CheckpointError(f"GPTQ g_idx does not give every group {group} input features; the checkpoint's "
                              "group_size does not match its g_idx")
    return order
