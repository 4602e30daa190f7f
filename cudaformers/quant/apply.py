"""Swap a model's Linear layers for quantized ones: ``prepare_model_for_quantization`` (the loader
calls it on the meta-device skeleton, before weights stream in) and ``quantize`` (an already
loaded model, quantized in place)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..errors import UnsupportedError
from .config import QuantizationConfig, quantization_config_from
from .fp8 import FP8Linear
from .int4 import Int4Linear
from .int8 import Int8Linear
from .linear import QuantLinear
from .nf4 import NF4Linear

logger = logging.getLogger("cudaformers")


def _factory(config: QuantizationConfig):
    method = config.method
    if config.quant_method in ("gptq", "awq"):
        fmt = "awq" if config.quant_method == "awq" else config.checkpoint_format  # int4_checkpoints.FORMATS
        return lambda i, o, b, dt: Int4Linear(i, o, b, dt, config.group_size, config.sym, checkpoint_format=fmt,
                                              act_order=config.act_order)
    if method == "int8":
        return lambda i, o, b, dt: Int8Linear(i, o, b, dt)
    if method == "int4":
        return lambda i, o, b, dt: Int4Linear(i, o, b, dt, config.group_size, config.sym, act_order=config.act_order)
    if method in ("nf4", "fp4"):
        return lambda i, o, b, dt: NF4Linear(i, o, b, dt, method, config.bnb_4bit_use_double_quant)
    if method == "fp8":
        return lambda i, o, b, dt: FP8Linear(i, o, b, dt)
    raise UnsupportedError(f"unknown quantization method {method!r}")


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) or name.startswith(s + ".") for s in skip)


def prepare_model_for_quantization(model: nn.Module, quantization_config) -> QuantizationConfig:
    """Replace every ``nn.Linear`` not listed in ``modules_to_not_convert`` (default: lm_head).

    On the meta device the new layers are empty and quantize their weights as the loader streams them
    in; on a real device the existing weights are quantized now.
    """
    config = quantization_config_from(quantization_config)
    if getattr(model, "_quantization", None) is not None:
        raise UnsupportedError("this model is already quantized; load it again to quantize with other settings")
    make = _factory(config)
    if getattr(config, "act_order", False) and any(p.device.type != "meta" for p in model.parameters()):
        raise UnsupportedError("act_order int4 layers come from GPTQ act-order checkpoints (their g_idx orders the "
                               "features); float weights have no such order: quantize with Int4Config() instead")
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and not _skipped(name, config.skip_modules)]
    if not targets:
        raise UnsupportedError(f"quantization_config found no Linear layers to quantize (skipped: "
                               f"{list(config.skip_modules)})")
    from ..kernels.fused_projections import fuse_projections, unpack_projections

    repack = unpack_projections(model) > 0  # a loaded model: its float q/k/v, gate/up packing goes first
    for name, linear in targets:
        dtype = getattr(config, "compute_dtype", None) or linear.weight.dtype
        device = linear.weight.device
        with torch.device(device):
            layer = make(linear.in_features, linear.out_features, linear.bias is not None, dtype)
        layer.checkpoint_packing = config.packing
        if device.type != "meta":
            with torch.no_grad():
                layer.check_device(device)
                layer.quantize_(linear.weight.detach())
                if linear.bias is not None:
                    layer.bias.copy_(linear.bias)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    if repack:
        fuse_projections(model)  # the quantized projections, packed again
    model._quantization = config
    if hasattr(model, "config"):
        model.config.quantization_config = config.saved().to_dict()
    hooks = model.__dict__.setdefault("_mode_hooks", [])
    hooks.append(_on_mode_change)
    if hasattr(model, "_choices"):
        model._choices["quantization"] = repr(config)
    logger.info("quantization: %d Linear layers -> %s", len(targets), repr(config))
    return config


def quantize(model: nn.Module, quantization_config) -> nn.Module:
    """Quantize a loaded model in place (its Linear weights are read, then dropped); returns it."""
    prepare_model_for_quantization(model, quantization_config)
    _on_mode_change(model, False)  # the explain() line; training is checked when train() is called
    return model


def quantized_layers(model: nn.Module) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def has_adapters(model: nn.Module) -> bool:
    return any(getattr(m, "is_adapter_layer", False) for m in model.modules())


def _on_mode_change(model: nn.Module, training: bool) -> None:
    layers = quantized_layers(model)
    if not layers:
        return
    if hasattr(model, "_choices"):
        model._choices["quantized matmul"] = _kernel_summary(layers)
    if training and not has_adapters(model):
        model.train(False)
        raise UnsupportedError(f"this model's Linear layers are quantized ({layers[0].method}); quantized weights "
                               "cannot be trained. Add LoRA adapters (cudaformers.get_peft_model(model, "
                               "LoraConfig(...)): QLoRA), or load without quantization_config to train all weights")


def _kernel_summary(layers: list[QuantLinear]) -> str:
    devices = sorted({str(layer.weight.device) for layer in layers})
    packed = sum(p.numel() * p.element_size() for layer in layers for n, p in layer.named_parameters() if n != "bias")
    params = sum(layer.in_features * layer.out_features for layer in layers)
    where = []
    for dev in devices:
        if dev.startswith("cuda"):
            kind = ("fp8 weight-only Triton GEMV at batch 1, torch._scaled_mm (fp8 tensor cores) above"
                    if layers[0].method == "fp8" else "Triton dequantize-matmul (one row of bf16 x against int4 in "
                    "groups of 128 or int8 on a GEMV decoding codes into tensor-core fragments; otherwise int4 in "
                    "groups of 128+ and int8 with fp16 x on tensor cores for 1-16 rows, except one row on a layer "
                    "too small to fill the GPU; one row otherwise on an FMA GEMV; a tl.dot GEMM for the rest)")
            where.append(f"{kind} on {dev}")
        else:
            where.append(f"PyTorch reference (dequantize, then matmul) on {dev}: correct but slow; use a CUDA GPU "
                         "for speed")
    return f"{len(layers)} layers, {packed / params:.3f} bytes/weight; " + "; ".join(where)
