"""``QuantLinear``: the base of every weight-quantized replacement for ``nn.Linear``.

A subclass declares its packed tensors (``packed_shapes``), how to quantize a float weight into them
(``quantize_``) and how to view them as a ``PackedWeight`` for the dequantize-matmul kernels. The
loader hands each checkpoint tensor to ``load_checkpoint_tensor`` on the layer's own device, so a
float weight is quantized as it arrives and the full-precision model never exists on the GPU; a
checkpoint saved quantized is copied as is.

Packed tensors are frozen ``nn.Parameter``s (not buffers) so device maps, memory plans and
``state_dict`` see them. The packed weight keeps the name ``weight`` with ``weight.shape[0] ==
out_features``, like bitsandbytes' layers, for code that reads a Linear's size or device from it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import CheckpointError
from ..kernels.quant_matmul import PackedWeight, dequantize, quant_matmul_reference, quant_matmul_triton
from .config import PACKING


# Elements of a weight quantized at once: every method quantizes rows independently, and its fp32
# temporaries (the weight in fp32, its scaled and rounded copies) take several times a whole weight's
# float size. qwen3-8b's lm_head (151936 x 4096) quantized in one piece held ~6 GiB more than its codes
# at the peak; in pieces of 2**25 elements (8192 of its rows) the temporaries stay under ~0.6 GiB.
ROWS_ELEMENTS = 1 << 25


def by_rows(quantize, weight: torch.Tensor, *args):
    """``quantize(weight, *args)`` for a row-wise quantizer (every output indexed by the weight's rows,
    ``None`` for one it does not produce), run over pieces of rows and joined: the same result, with
    temporaries the size of a piece."""
    rows = max(1, ROWS_ELEMENTS // max(1, weight.shape[1]))
    if weight.shape[0] <= rows:
        return quantize(weight, *args)
    parts = [quantize(weight[r:r + rows], *args) for r in range(0, weight.shape[0], rows)]
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))


class _DequantMatmul(torch.autograd.Function):
    """Gradients flow to x only (the weights are frozen): ``dx = dy @ dequant(W)``."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return layer.matmul(x)

    @staticmethod
    def backward(ctx, dy):
        w = ctx.layer.dequantize(dy.dtype)
        return dy @ w, None


class QuantLinear(nn.Module):
    method = ""  # "int8", "int4", "nf4", "fp4", "fp8"
    # The packing a quantized checkpoint was saved with (set from its config); fp8 has only one layout.
    checkpoint_packing: str | None = PACKING
    # Packed tensors indexed by input feature rather than by output row (shared, not stacked, when
    # projections pack: quant/packing.py).
    per_input: tuple[str, ...] = ()

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        for name, (shape, dtype) in self.packed_shapes().items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype)) if bias else None

    # -- what a method defines ----------------------------------------------------------------------
    def packed_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def quantize_(self, weight: torch.Tensor) -> None:
        """Quantize a float ``[out, in]`` weight (already on this layer's device) into the parameters."""
        raise NotImplementedError

    def packed(self) -> PackedWeight:
        raise NotImplementedError

    def check_device(self, device: torch.device) -> None:
        """Raise if this method cannot run on ``device`` (fp8 needs sm_89+)."""

    def ordered_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the kernels read it (int4 act-order: its features in the stored order)."""
        return x

    # -- shared ------------------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.packed(), dtype or self.compute_dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, in]`` in the compute dtype -> ``[M, out]`` in that dtype, plus ``bias`` (same dtype)."""
        if x.is_cuda:
            return quant_matmul_triton(x, self.packed(), bias)
        return quant_matmul_reference(x, self.packed(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)
        if torch.is_grad_enabled() and (x2.requires_grad or (self.bias is not None and self.bias.requires_grad)):
            y = _DequantMatmul.apply(x2, self)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        else:  # inference: the bias is added inside the kernel
            y = self.matmul(x2, None if self.bias is None else self.bias.to(x2.dtype))
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    @torch.no_grad()
    def load_checkpoint_tensor(self, attr: str, tensor: torch.Tensor) -> None:
        device = self.weight.device
        if attr == "bias" and self.bias is not None:
            self._copy(self.bias, tensor, attr)
        elif attr == "weight" and tensor.dtype in (torch.float32, torch.float16, torch.bfloat16):
            self.check_device(device)
            if tuple(tensor.shape) != (self.out_features, self.in_features):
                raise CheckpointError(f"weight of shape {tuple(tensor.shape)} for a {self.in_features} -> "
                                      f"{self.out_features} Linear; config.json does not match the weights")
            self.quantize_(tensor.to(device))
        elif attr in self.packed_shapes():
            self.check_device(device)
            if self.checkpoint_packing != PACKING and self.method != "fp8":
                raise CheckpointError(f"this {self.method} checkpoint was saved by an earlier cudaformers whose packed "
                                      "layout the kernels no longer read (its config.json quantization_config has no "
                                      f"'packing': {PACKING!r}); quantize the original float checkpoint again")
            self._copy(getattr(self, attr), tensor, attr)
            self.on_packed_loaded(attr)
        else:
            raise CheckpointError(f"checkpoint tensor {attr!r} does not belong to a {self.method} quantized Linear "
                                  f"(expected weight, bias or {sorted(self.packed_shapes())}); the checkpoint was "
                                  "quantized with other settings than quantization_config says")

    def on_packed_loaded(self, attr: str) -> None:
        """Hook for state kept outside parameters (e.g. a Python float copied from a scalar tensor)."""

    @staticmethod
    def _copy(param: nn.Parameter, tensor: torch.Tensor, attr: str) -> None:
        if tuple(param.shape) != tuple(tensor.shape) or (not param.is_floating_point() and param.dtype != tensor.dtype):
            raise CheckpointError(f"quantized tensor {attr!r} is {tuple(tensor.shape)} {tensor.dtype}, the layer "
                                  f"expects {tuple(param.shape)} {param.dtype}; the checkpoint's quantization "
                                  "settings differ from quantization_config")
        param.copy_(tensor)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"method={self.method}, compute_dtype={str(self.compute_dtype).removeprefix('torch.')}")
