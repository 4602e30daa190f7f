"""Group-wise int4 weight-only quantization (group 128 by default), and GPTQ checkpoint import.

Symmetric: ``w = (q - 8) * s`` per group of ``group_size`` input features; asymmetric adds a float
zero point per group: ``w = (q - z) * s``. GPTQ checkpoints (``qweight``/``qzeros``/``scales``/
``g_idx``, 8 values per int32) are repacked into the same layout as they load.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError, UnsupportedError
from ..kernels.quant_matmul import PackedWeight, pack_4bit
from .linear import QuantLinear, by_rows


def padded(k: int, group: int) -> int:
    return -(-k // group) * group


def quantize_int4(weight: torch.Tensor, group: int, sym: bool = True):
    """``[N, K]`` float -> (``uint8 [N, Kp/2]``, ``fp16 scales [N, Kp/G]``, fp16 zeros or None)."""
    n, k = weight.shape
    w = torch.nn.functional.pad(weight.float(), (0, padded(k, group) - k)).view(n, -1, group)
    # Scales are stored in fp16: round them first, so the codes are the best ones for the stored scale.
    if sym:
        scale = (w.abs().amax(-1).clamp_min(1e-8) / 7.0).half().float()
        q = torch.round(w / scale[..., None]).clamp_(-8, 7) + 8
        zeros = None
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15.0).clamp_min(1e-8).half().float()
        zeros = torch.round(-lo / scale).clamp_(0, 15)
        q = (torch.round(w / scale[..., None]) + zeros[..., None]).clamp_(0, 15)
        zeros = zeros.half()
    return pack_4bit(q.view(n, -1), group), scale.half(), zeros


def unpack_gptq_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 tensors holding 8 int4 values each, value i in bits 4i..4i+3, unpacked along ``dim``."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    if dim == 0:  # qweight [K/8, N] -> [K, N]
        vals = (packed[:, None, :] >> shifts[None, :, None]) & 15
        return vals.reshape(-1, packed.shape[1])
    vals = (packed[:, :, None] >> shifts[None, None, :]) & 15  # qzeros [G, N/8] -> [G, N]
    return vals.reshape(packed.shape[0], -1)


class Int4Linear(QuantLinear):
    method = "int4"

    def __init__(self, in_features, out_features, bias, compute_dtype, group_size: int = 128, sym: bool = True,
                 gptq: dict | None = None):
        self.group_size, self.sym = group_size, sym
        # GPTQ import: the checkpoint's tensors arrive one by one; kept until all four are here.
        self._gptq, self._pending = gptq, {}
        super().__init__(in_features, out_features, bias, compute_dtype)

    def packed_shapes(self):
        kp, g = padded(self.in_features, self.group_size), self.group_size
        shapes = {"weight": ((self.out_features, kp // 2), torch.uint8),
                  "scales": ((self.out_features, kp // g), torch.float16)}
        if not self.sym:
            shapes["zeros"] = ((self.out_features, kp // g), torch.float16)
        return shapes

    def quantize_(self, weight):
        q, s, z = by_rows(quantize_int4, weight, self.group_size, self.sym)
        self.weight.copy_(q)
        self.scales.copy_(s)
        if z is not None:
            self.zeros.copy_(z)

    def packed(self) -> PackedWeight:
        return PackedWeight("int4", self.weight, self.scales, self.in_features, self.group_size,
                            zeros=None if self.sym else self.zeros)

    @torch.no_grad()
    def load_checkpoint_tensor(self, attr, tensor):
        if self._gptq is None or attr == "bias":
            return super().load_checkpoint_tensor(attr, tensor)
        if attr not in ("qweight", "qzeros", "scales", "g_idx"):
            raise CheckpointError(f"unexpected tensor {attr!r} in a GPTQ checkpoint layer (expected qweight, qzeros, "
                                  "scales, g_idx, bias)")
        self._pending[attr] = tensor.to(self.weight.device)
        if {"qweight", "qzeros", "scales"} <= set(self._pending) and \
                ("g_idx" in self._pending or not self._gptq.get("has_g_idx", True)):
            self._load_gptq(**self._pending)
            self._pending = {}

    def _load_gptq(self, qweight, qzeros, scales, g_idx=None):
        k, n, g = self.in_features, self.out_features, self.group_size
        if tuple(qweight.shape) != (k // 8, n) or tuple(scales.shape) != (-(-k // g), n):
            raise CheckpointError(f"GPTQ tensors qweight {tuple(qweight.shape)} / scales {tuple(scales.shape)} do not "
                                  f"fit a {k} -> {n} layer with group_size {g}")
        if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(k) // g):
            raise UnsupportedError("this GPTQ checkpoint was quantized with desc_act=True (act-order g_idx); "
                                   "only desc_act=False checkpoints load; re-quantize with desc_act=False")
        codes = unpack_gptq_int32(qweight.int(), 0).t()  # [N, K]
        # The classic GPTQ format stores zero points minus one ("gptq_v2" stores them as they are).
        zeros = unpack_gptq_int32(qzeros.int(), 1)[:, :n].t().float() + self._gptq.get("zero_offset", 1)
        kp = padded(k, g)
        codes = torch.nn.functional.pad(codes, (0, kp - k), value=8)
        self.weight.copy_(pack_4bit(codes, g))
        self.scales.copy_(scales.t().half())
        if self.sym:
            if not torch.all(zeros == 8):
                raise CheckpointError("quantization_config says sym=True but the GPTQ zero points are not all 8")
        else:
            self.zeros.copy_(zeros.half())
