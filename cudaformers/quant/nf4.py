"""4-bit NF4 / FP4 weight-only quantization in blocks of 64 (as bitsandbytes), with optional double
quantization of the block scales.

Each block of 64 input features of a row is scaled by its absolute maximum and every value rounded
to the nearest of 16 codes: NF4's are the quantiles of a normal distribution (QLoRA), FP4's the
e2m1 floats. Double quantization stores the fp32 absmax values as int8 around their mean, with one
fp32 scale per 256 of them: 0.127 instead of 0.5 extra bits per weight.
"""

from __future__ import annotations

import torch

from ..kernels.quant_matmul import DQ_BLOCK, PackedWeight, pack_4bit
from .int4 import padded
from .linear import QuantLinear, by_rows

NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)
# e2m1 magnitudes over 6 (so the largest is 1); codes 8..15 are the negatives of 0..7.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_CODE = tuple(v / 6 for v in _E2M1) + tuple(-v / 6 for v in _E2M1)
CODES = {"nf4": NF4_CODE, "fp4": FP4_CODE}
BLOCK = 64


def nearest_code(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the code value nearest to each element of ``x`` (values in [-1, 1])."""
    values, order = torch.sort(code)
    mids = (values[1:] + values[:-1]) / 2
    return order[torch.bucketize(x.contiguous(), mids)]


def double_quantize(absmax: torch.Tensor):
    """fp32 absmax ``[N, G]`` -> (int8 ``[N, G]``, fp32 scales ``[ceil(N*G/256)]``, fp32 offset)."""
    flat = absmax.reshape(-1)
    offset = flat.mean()
    centered = flat - offset
    pad = -flat.numel() % DQ_BLOCK
    blocks = torch.nn.functional.pad(centered, (0, pad)).view(-1, DQ_BLOCK)
    scale2 = blocks.abs().amax(1).clamp_min(1e-12) / 127.0
    q = torch.round(blocks / scale2[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[: flat.numel()]
    return q.view_as(absmax), scale2, offset


def quantize_4bit(weight: torch.Tensor, quant_type: str):
    """``[N, K]`` float -> (``uint8 [N, Kp/2]``, fp32 absmax ``[N, Kp/64]``)."""
    n, k = weight.shape
    code = torch.tensor(CODES[quant_type], device=weight.device)
    w = torch.nn.functional.pad(weight.float(), (0, padded(k, BLOCK) - k)).view(n, -1, BLOCK)
    absmax = w.abs().amax(-1).clamp_min(1e-12)
    idx = nearest_code(w / absmax[..., None], code)
    return pack_4bit(idx.view(n, -1), BLOCK), absmax


class NF4Linear(QuantLinear):
    method = "nf4"

    def __init__(self, in_features, out_features, bias, compute_dtype, quant_type: str = "nf4",
                 double_quant: bool = False):
        self.method, self.double_quant = quant_type, double_quant
        self._offset = 0.0
        self._codes: dict[torch.device, torch.Tensor] = {}
        super().__init__(in_features, out_features, bias, compute_dtype)

    def packed_shapes(self):
        n, kp = self.out_features, padded(self.in_features, BLOCK)
        shapes = {"weight": ((n, kp // 2), torch.uint8)}
        if self.double_quant:
            blocks = -(-(n * kp // BLOCK) // DQ_BLOCK)
            shapes.update(absmax=((n, kp // BLOCK), torch.int8), absmax_scale=((blocks,), torch.float32),
                          absmax_offset=((), torch.float32))
        else:
            shapes["absmax"] = ((n, kp // BLOCK), torch.float32)
        return shapes

    def quantize_(self, weight):
        q, absmax = by_rows(quantize_4bit, weight, self.method)
        self.weight.copy_(q)
        if self.double_quant:
            q2, s2, offset = double_quantize(absmax)
            self.absmax.copy_(q2)
            self.absmax_scale.copy_(s2)
            self.absmax_offset.copy_(offset)
            self._offset = float(offset)
        else:
            self.absmax.copy_(absmax)

    def on_packed_loaded(self, attr):
        if attr == "absmax_offset":
            self._offset = float(self.absmax_offset)  # read once here, not per forward (CUDA graphs)

    def _code(self, device) -> torch.Tensor:
        if device not in self._codes:
            self._codes[device] = torch.tensor(CODES[self.method], dtype=torch.float32, device=device)
        return self._codes[device]

    def packed(self) -> PackedWeight:
        return PackedWeight("lut4", self.weight, self.absmax, self.in_features, BLOCK, code=self._code(self.weight.device),
                            scales2=self.absmax_scale if self.double_quant else None, offset=self._offset)
