"""A quantized decoder layer's post-attention RMSNorm folded into the GEMVs on either side of it, at one
row (decode at batch 1).

At batch 1 each launch of the decode chain costs ~3.4 us whatever its bytes (bench/RESULTS.md run 21),
and a quantized qwen3-8b layer streams only 50-100 MB: its launches, not its bytes, set much of a
step. The norm between the attention's output projection and the packed gate/up projection is one of
them. Folded, the output projection's fragment GEMV ends with the residual add, writes the residual
stream and ``gamma * h``, and leaves each program's share of ``sum(h^2)``; the gate/up GEMV reads
``gamma * h`` as its x and scales its dots by ``1 / rms(h)`` from the shares
(``quant_gemv_epilogues.py``). With ``quant_gemv_mma.GATED`` it also applies the activation, so the
MLP's input is one launch past the attention: the layer runs norm, q/k/v, q/k norm + rotary,
attention, o, gate/up, down.

Unlike the bf16 fold (``fused_norm_decode.py``), the result is not bit for bit the unfused path's:
``1 / rms`` scales the dots instead of the normalised row, so bf16 rounds elsewhere (within the
quantization's own error by orders of magnitude). Graphs and eager runs take the same path, so they
give the same tokens. It applies where the unfused layer would run exactly these pieces: the exact
``Attention`` and ``DecoderLayer`` forwards, a plain RMSNorm, a quantized output projection and a
packed quantized gate/up the fragment GEMV takes, one bf16 row, no autograd or autocast; otherwise
``fused_norm_decode_forward`` goes on as before. Off (``NORM_FOLD``) until it has run on a GPU.
"""

from __future__ import annotations

import torch

from ..layers.attention import Attention
from ..layers.mlp import GatedMLP
from ..quant.linear import QuantLinear
from ..quant.packing import PackedQuantLinear

NORM_FOLD = False


def _declines(layer, hidden: torch.Tensor, residual: torch.Tensor | None) -> str | None:
    """Why the fold would not compute what the unfused layer runs (up to rounding), or None."""
    from . import quant_gemv_mma, quant_matmul
    from .fused_norm_decode import _plain_norm, _unhooked
    from .hub import _fused_mlp_decode

    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    if not (NORM_FOLD and quant_matmul.USE_MMA and quant_matmul.USE_FRAGMENT_GEMV):
        return "switched off"
    if type(attn) is not Attention or "forward" in attn.__dict__ or "attend" in attn.__dict__ or not _unhooked(attn):
        return "not the plain attention forward"
    o = attn.o_proj
    if not isinstance(o, QuantLinear) or type(o).forward is not QuantLinear.forward or not _unhooked(o):
        return "the output projection is not a plain quantized Linear"
    if not _plain_norm(norm):
        return "the post-attention norm is not a plain RMSNorm"
    bound = mlp.__dict__.get("forward")
    if type(mlp) is not GatedMLP or not _unhooked(mlp) or (
            bound is not None and getattr(bound, "__func__", None) is not _fused_mlp_decode):
        return "not the plain gated MLP"
    packed = getattr(mlp, "packed_gate_up", None)
    if not isinstance(packed, PackedQuantLinear) or not packed.usable_for(mlp.gate_proj) or not _unhooked(packed):
        return "gate/up are not a packed quantized projection in use"
    if residual is None or hidden.dim() != 2 or hidden.shape[0] != 1 or residual.shape != hidden.shape:
        return "not one row with its residual"
    if torch.is_autocast_enabled(hidden.device.type) or (torch.is_grad_enabled() and hidden.requires_grad):
        return "autocast or autograd"
    dtypes = {hidden.dtype, residual.dtype, norm.weight.dtype, o.compute_dtype, packed.layer.compute_dtype}
    if dtypes != {torch.bfloat16}:
        return "not all bf16"
    if not quant_gemv_mma.supports(hidden, packed.layer.packed()):
        return "the fragment GEMV does not take gate/up"
    return None


def quant_post_norm_forward(layer, hidden: torch.Tensor, residual: torch.Tensor | None, cos, sin, batch):
    """``(mlp_out, residual)`` of ``DecoderLayer.forward`` past its input norm (``hidden`` normed, and
    the residual stream), or None where the fold does not apply."""
    if _declines(layer, hidden, residual) is not None:
        return None
    from .hub import _act_and_mul
    from .quant_gemv_mma import GATED, quant_gemv_mma, quant_gemv_mma_normed, supports

    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    heads = attn.attend_heads(*attn.project_qkv(hidden), cos, sin, batch)  # [1, N*D]
    o = attn.o_proj
    w_o = o.packed()
    if not supports(heads, w_o):  # the attention's output in a layout the GEMV does not read
        hidden, residual = norm(o(heads), residual)
        return layer.feed_forward(hidden), residual
    bias = None if o.bias is None else o.bias.to(heads.dtype)
    h, gamma_h, shares = quant_gemv_mma_normed(heads, w_o, bias, residual.contiguous(), norm.weight)
    packed, act = mlp.packed_gate_up, mlp.act_fn
    gu = packed.layer
    rms = (shares, norm.variance_epsilon)
    fused_act = (GATED and getattr(act.__dict__.get("forward"), "__func__", None) is _act_and_mul
                 and not act._forward_hooks and packed.sizes[0] * 2 == gu.out_features)
    if fused_act:
        inner = quant_gemv_mma(gamma_h, gu.packed(), gu.bias, act=act.name, rms=rms)
    else:
        inner = act(*quant_gemv_mma(gamma_h, gu.packed(), gu.bias, rms=rms).split(packed.sizes, dim=-1))
    return mlp.down_proj(inner), h
