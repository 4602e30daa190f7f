"""Group-wise int4 weight-only quantization (group 128 by default), and pre-quantized int4 checkpoints.

Symmetric: ``w = (q - 8) * s`` per group of ``group_size`` input features; asymmetric adds a float
zero point per group: ``w = (q - z) * s``. GPTQ and AWQ checkpoints are repacked into the same layout
as they load (``int4_checkpoints.py``).
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..kernels.quant_matmul import PackedWeight, pack_4bit
from . import int4_checkpoints
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


class Int4Linear(QuantLinear):
    method = "int4"

    # Not stacked when projections pack (quant/packing.py): one per input, shared by the packed rows.
    per_input = ("input_order",)

    def __init__(self, in_features, out_features, bias, compute_dtype, group_size: int = 128, sym: bool = True,
                 checkpoint_format: str | None = None, act_order: bool = False):
        self.group_size, self.sym, self.act_order = group_size, sym, act_order
        # A pre-quantized checkpoint (one of int4_checkpoints.FORMATS): its tensors arrive one by one
        # and are kept until the layer's last one is here.
        self._format, self._pending = checkpoint_format, {}
        super().__init__(in_features, out_features, bias, compute_dtype)

    def packed_shapes(self):
        kp, g = padded(self.in_features, self.group_size), self.group_size
        shapes = {"weight": ((self.out_features, kp // 2), torch.uint8),
                  "scales": ((self.out_features, kp // g), torch.float16)}
        if not self.sym:
            shapes["zeros"] = ((self.out_features, kp // g), torch.float16)
        if self.act_order:  # the stored features' places in x: x[:, input_order] meets the codes' columns
            shapes["input_order"] = ((self.in_features,), torch.int64)
        return shapes

    def quantize_(self, weight):
        if self.act_order:  # re-quantizing (a merged adapter): the columns in the stored order
            weight = weight[:, self.input_order]
        q, s, z = by_rows(quantize_int4, weight, self.group_size, self.sym)
        self.weight.copy_(q)
        self.scales.copy_(s)
        if z is not None:
            self.zeros.copy_(z)

    def packed(self) -> PackedWeight:
        return PackedWeight("int4", self.weight, self.scales, self.in_features, self.group_size,
                            zeros=None if self.sym else self.zeros)

    def ordered_input(self, x: torch.Tensor) -> torch.Tensor:
        if not self.act_order:
            return x
        if x.is_cuda:  # a link of the decode chain that keeps the GEMV after it starting early (PDL)
            from ..kernels.feature_gather import gather_features

            return gather_features(x, self.input_order)
        return x.index_select(-1, self.input_order)

    def matmul(self, x, bias=None):
        return super().matmul(self.ordered_input(x), bias)

    def dequantize(self, dtype=None):
        w = super().dequantize(dtype)
        if not self.act_order:
            return w
        out = torch.empty_like(w)
        out[:, self.input_order] = w  # back to the features' own order
        return out

    def _required(self) -> tuple[str, ...]:
        extra = (int4_checkpoints.G_IDX,) if self.act_order else ()  # act-order: g_idx says where each feature went
        return int4_checkpoints.REQUIRED + extra

    @torch.no_grad()
    def load_checkpoint_tensor(self, attr, tensor):
        if self.act_order and attr == "weight" and tensor.is_floating_point():
            raise CheckpointError("an act-order int4 layer (act_order=True) loads from a GPTQ act-order checkpoint or "
                                  "one saved from it; a float weight has no such order: use Int4Config() without "
                                  "act_order to quantize it")
        if self._format is None or attr == "bias":
            return super().load_checkpoint_tensor(attr, tensor)
        known = int4_checkpoints.REQUIRED + ((int4_checkpoints.G_IDX,) if self._format != "awq" else ())
        if attr not in known:
            raise CheckpointError(f"unexpected tensor {attr!r} in a {self._format.upper()} checkpoint layer (expected "
                                  f"{', '.join(known)}, bias)")
        if attr == "g_idx" and not self.act_order:
            return int4_checkpoints.check_g_idx(tensor, self.in_features, self.group_size)
        self._pending[attr] = tensor.to(self.weight.device)
        if set(self._required()) <= set(self._pending):
            g_idx = self._pending.pop("g_idx", None)
            codes, zeros, scales = int4_checkpoints.unpack(self._format, self.in_features, self.out_features,
                                                          self.group_size, **self._pending)
            if self.act_order:
                order = int4_checkpoints.group_order(g_idx, self.in_features, self.group_size)
                self.input_order.copy_(order)
                codes = codes[:, order]
            self._write_imported(codes, zeros, scales)
            self._pending = {}

    def finish_checkpoint(self) -> None:
        """Called once the checkpoint is read: a layer that got only some of its tensors is an error."""
        if self._pending:
            missing = sorted(set(self._required()) - set(self._pending))
            raise CheckpointError(f"a {self._format.upper()} checkpoint layer ({self.in_features} -> "
                                  f"{self.out_features}) lacks {missing}; the files are incomplete")

    def _write_imported(self, codes, zeros, scales):
        k, g = self.in_features, self.group_size
        codes = torch.nn.functional.pad(codes, (0, padded(k, g) - k), value=8)
        self.weight.copy_(pack_4bit(codes, g))
        self.scales.copy_(scales)
        if self.sym:
            if not torch.all(zeros == 8):
                raise CheckpointError(f"quantization_config says the {self._format.upper()} checkpoint is symmetric, "
                                      "but its zero points are not all 8")
        else:
            self.zeros.copy_(zeros.half())

