"""fp8 (e4m3) weights with per-output-channel scales; activations quantized per token at run time.

The matmul runs on fp8 tensor cores through ``torch._scaled_mm``, which needs compute capability
8.9+ (Ada, Hopper, Blackwell). On anything else loading fails with the alternatives named. One row
of x (decode at batch 1) is memory bound instead: there a weight-only fp8 GEMV streams the weights
and keeps x in its dtype (``kernels/quant_gemv.py``), one launch and no activation quantization.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from .linear import QuantLinear, by_rows

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, C]`` -> (e4m3 ``[R, C]``, fp32 scales ``[R, 1]``): one scale per row, largest value -> 448."""
    t = t.float()
    scale = t.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return (t / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """What the fp8 path computes, in fp32: x rounded to e4m3 per token, times the dequantized weight."""
    xq, xs = quantize_fp8_rows(x)
    w = weight.float() * weight_scale[:, None]
    return ((xq.float() * xs) @ w.t()).to(x.dtype)


def fp8_unsupported_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"the model is being placed on {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"{device} is a {torch.cuda.get_device_name(device)} (compute capability {cap[0]}.{cap[1]})"
    return None


class FP8Linear(QuantLinear):
    method = "fp8"

    def packed_shapes(self):
        return {"weight": ((self.out_features, self.in_features), E4M3),
                "weight_scale": ((self.out_features,), torch.float32)}

    def check_device(self, device):
        why = fp8_unsupported_reason(device)
        if why:
            raise UnsupportedError(f"fp8 quantization (FP8Config) runs on fp8 tensor cores: an NVIDIA GPU of compute "
                                   f"capability 8.9+ (L4, L40, H100, H200, B200); {why}. Use Int8Config or "
                                   "Int4Config there (they run on any CUDA GPU, and on CPU through PyTorch); a "
                                   "checkpoint stored in fp8 blocks (weight_block_size) also loads with "
                                   "FP8Config(dequantize=True), in the model's dtype")
        if self.in_features % 16 or self.out_features % 16:
            raise UnsupportedError(f"fp8 matmuls need in/out features divisible by 16, this Linear is "
                                   f"{self.in_features} -> {self.out_features}; exclude it with "
                                   "modules_to_not_convert or use Int8Config")

    def quantize_(self, weight):
        q, s = by_rows(quantize_fp8_rows, weight)
        self.weight.copy_(q)
        self.weight_scale.copy_(s[:, 0])

    def dequantize(self, dtype=None):
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype or self.compute_dtype)

    def matmul(self, x, bias=None):
        if not x.is_cuda:
            y = fp8_matmul_reference(x, self.weight, self.weight_scale)
            return y if bias is None else y + bias
        m = x.shape[0]
        if m == 1:
            from ..kernels.quant_gemv import fp8_gemv

            return fp8_gemv(x, self.weight, self.weight_scale, bias)
        pad = -m % 16  # _scaled_mm wants every dimension a multiple of 16
        xq, xs = quantize_fp8_rows(torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x)
        if x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0):
            # Row-wise scales inside the GEMM epilogue (Hopper+): one launch.
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale[None, :],
                                 out_dtype=torch.bfloat16)
        else:
            one = torch.ones((), device=x.device, dtype=torch.float32)
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            y = (y * xs * self.weight_scale[None, :]).to(x.dtype)
        y = y[:m] if pad else y
        return y if bias is None else y + bias
