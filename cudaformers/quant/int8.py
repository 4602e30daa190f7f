"""int8 weight-only quantization: symmetric, one scale per output channel (``w = q * s[n]``).

Rows are padded with zeros to a multiple of 4 bytes so the GEMV kernel can read them as int32 words.
"""

from __future__ import annotations

import torch

from ..kernels.quant_matmul import PackedWeight
from .linear import QuantLinear


def padded4(k: int) -> int:
    return -(-k // 4) * 4


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (``int8 [N, K rounded up to 4]``, ``fp32 scales [N]``), round to nearest."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return torch.nn.functional.pad(q, (0, padded4(w.shape[1]) - w.shape[1])), scale


class Int8Linear(QuantLinear):
    method = "int8"

    def packed_shapes(self):
        return {"weight": ((self.out_features, padded4(self.in_features)), torch.int8),
                "weight_scale": ((self.out_features,), torch.float32)}

    def quantize_(self, weight):
        q, s = quantize_int8(weight)
        self.weight.copy_(q)
        self.weight_scale.copy_(s)

    def packed(self) -> PackedWeight:
        return PackedWeight("int8", self.weight, self.weight_scale, self.in_features)
