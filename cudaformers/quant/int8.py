"""int8 weight-only quantization: symmetric, one scale per output channel (``w = q * s[n]``).

Rows are padded with zeros to whole blocks of 64 and stored in the plane layout of
``kernels/quant_matmul.py`` (byte j of word w of a block holds element ``16 j + w``).
"""

from __future__ import annotations

import torch

from ..kernels.quant_matmul import INT8_BLOCK, PackedWeight, pack_planes
from .linear import QuantLinear, by_rows


def padded64(k: int) -> int:
    return -(-k // INT8_BLOCK) * INT8_BLOCK


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (packed ``int8 [N, K rounded up to 64]``, ``fp32 scales [N]``), round to nearest."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    q = torch.nn.functional.pad(q, (0, padded64(w.shape[1]) - w.shape[1]))
    return pack_planes(q, INT8_BLOCK, 8), scale


class Int8Linear(QuantLinear):
    method = "int8"

    def packed_shapes(self):
        return {"weight": ((self.out_features, padded64(self.in_features)), torch.int8),
                "weight_scale": ((self.out_features,), torch.float32)}

    def quantize_(self, weight):
        q, s = by_rows(quantize_int8, weight)
        self.weight.copy_(q)
        self.weight_scale.copy_(s)

    def packed(self) -> PackedWeight:
        return PackedWeight("int8", self.weight, self.weight_scale, self.in_features)
