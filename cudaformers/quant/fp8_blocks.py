"""Block-scaled fp8 checkpoints: the "-FP8" releases of DeepSeek-V3, Qwen3 and others (transformers'
``FineGrainedFP8Config``). A layer stores e4m3 ``weight [N, K]`` and ``weight_scale_inv [N/bn, K/bk]``
(rounded up), one fp32 multiplier per block of ``weight_block_size = [bn, bk]`` (usually 128 x 128):
``w = weight * weight_scale_inv[i // bn, j // bk]``.

They load as float weights, a layer at a time (``dequantized_stream`` pairs each weight with its
multipliers as the checkpoint is read), and from there as any float checkpoint: quantized again with
one scale per output channel for the fp8 kernels (``FP8Config()``, on GPUs with fp8), or kept in the
model's dtype (``FP8Config(dequantize=True)``, on any device).
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"  # "<layer>.weight" -> "<layer>.weight_scale_inv"


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 ``weight [N, K]`` times its per-block multipliers -> fp32 ``[N, K]``."""
    n, k = weight.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for an fp8 weight {n} x {k} in "
                              f"blocks of {bn} x {bk}: expected {want}; weight_block_size in config.json does not "
                              "match the weights")
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * scale


def dequantized_stream(source, block: tuple[int, int]):
    """``(name, tensor, file)`` triples of a block-scaled fp8 checkpoint, with each e4m3 weight and its
    ``weight_scale_inv`` replaced by the fp32 weight they stand for (yielded once both have been read;
    every other tensor passes through)."""
    weights, scales = {}, {}  # read, waiting for their other half (clones: a streamed tensor's buffer is reused)
    for name, tensor, file in source:
        if name.endswith(".weight" + SCALE_SUFFIX):
            key = name.removesuffix(SCALE_SUFFIX)
            if key in weights:
                yield key, dequantize_blocks(weights.pop(key), tensor, block), file
            else:
                scales[key] = tensor.clone()
        elif name.endswith(".weight") and tensor.dtype == torch.float8_e4m3fn:
            if name in scales:
                yield name, dequantize_blocks(tensor, scales.pop(name), block), file
            else:
                weights[name] = tensor.clone()
        else:
            yield name, tensor, file
    unpaired = sorted(weights) + sorted(k + SCALE_SUFFIX for k in scales)
    if unpaired:
        raise CheckpointError(f"this block-scaled fp8 checkpoint has {len(unpaired)} weights or multipliers without "
                              f"their other half, e.g. {unpaired[:3]}; the files are incomplete")
