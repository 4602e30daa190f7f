"""A quantized decoder layer's RMSNorms folded into the GEMVs on either side of them, at one row (decode
at batch 1).

At batch 1 each launch of the decode chain costs ~3.4 us whatever its bytes (bench/RESULTS.md run 21),
and a quantized qwen3-8b layer streams only 50-100 MB: its launches, not its bytes, set much of a
step. The norms are two of them. Folded, the GEMV before a norm (the output projection; the down
projection, for the next layer's input norm) ends with the residual add, writes the residual stream
``h`` and ``gamma * h``, and leaves each program's share of ``sum(h^2)``; the GEMV after it (packed
gate/up; the next layer's packed q/k/v) reads ``gamma * h`` as its x and scales its dots by
``1 / rms(h)`` from the shares (``quant_gemv_epilogues.py``). For the formats in ``quant_gemv_mma.GATED``
gate/up also applies the activation. A layer then runs q/k/v, q/k norm + rotary, attention, o, gate/up, down.

Across layers the handoff keeps the layer contract: the down projection returns ``(h, None)``, which
any next layer reads as the whole residual stream (as the first layer reads the embeddings), and
leaves ``gamma * h`` and the shares in the batch's memo under the next layer; only a next layer that
finds them there, for that very ``h``, skips its input norm. Layers know their successor from
``link_layers`` (run where the kernels are bound), checked against the current layer list at use.

Unlike the bf16 fold (``fused_norm_decode.py``), the result is not bit for bit the unfused path's:
``1 / rms`` scales the dots instead of the normalised row, so bf16 rounds elsewhere (well inside the
quantization's own error). Graphs and eager runs take the same path, so they give the same tokens. A
fold applies where the unfused layer would run exactly these pieces: the exact ``Attention`` and
``DecoderLayer`` forwards, plain RMSNorms, quantized projections (q/k/v and gate/up packed) the
fragment GEMV takes, one bf16 row, no autograd, autocast or hooks; otherwise
``fused_norm_decode_forward`` goes on as before. Off (``NORM_FOLD``): measured slower on an H200
(bench/RESULTS.md run 23, qwen3-8b decode: int4 with the gated GEMV 419 -> 409 tok/s, int8 303 -> 294),
although its launches are fewer: the normed epilogues and the 1 / rms scaling cost the GEMVs more.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..layers.attention import Attention
from ..layers.mlp import GatedMLP
from ..quant.linear import QuantLinear
from ..quant.packing import PackedQuantLinear

NORM_FOLD = False


class _Link:
    """A decoder layer's list and place in it: a weak reference, which copies and pickles of the model
    drop (the layer then has no successor until its kernels are bound again)."""

    __slots__ = ("layers", "index")

    def __init__(self, layers: nn.ModuleList, index: int):
        self.layers, self.index = weakref.ref(layers), index

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return type(None), ()


def link_layers(model: nn.Module) -> None:
    """Each decoder layer of ``model`` learns its list and place, to find its successor."""
    from ..models.llama import DecoderLayer

    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for i, layer in enumerate(module):
                if isinstance(layer, DecoderLayer):
                    layer.__dict__["_layer_list"] = _Link(module, i)


def _next_layer(layer: nn.Module) -> nn.Module | None:
    """The layer after ``layer`` in the list it was linked in, while it still sits there."""
    link = layer.__dict__.get("_layer_list")
    layers = None if link is None else link.layers()
    if layers is None or link.index + 1 >= len(layers) or layers[link.index] is not layer:
        return None
    return layers[link.index + 1]


def _plain_quant(linear) -> bool:
    from .fused_norm_decode import _unhooked

    return isinstance(linear, QuantLinear) and type(linear).forward is QuantLinear.forward and _unhooked(linear)


def _packed_quant(owner, name: str, first) -> PackedQuantLinear | None:
    from .fused_norm_decode import _unhooked

    packed = getattr(owner, name, None)
    if isinstance(packed, PackedQuantLinear) and packed.usable_for(first) and _unhooked(packed):
        return packed
    return None


def _declines(layer, hidden: torch.Tensor, residual: torch.Tensor | None) -> str | None:
    """Why the post-attention fold would not compute what the unfused layer runs (up to rounding)."""
    from . import quant_gemv_mma, quant_matmul
    from .fused_norm_decode import _plain_norm, _unhooked
    from .hub import _fused_mlp_decode

    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    if not (NORM_FOLD and quant_matmul.USE_MMA and quant_matmul.USE_FRAGMENT_GEMV):
        return "switched off"
    if type(attn) is not Attention or "forward" in attn.__dict__ or "attend" in attn.__dict__ or not _unhooked(attn):
        return "not the plain attention forward"
    if not _plain_quant(attn.o_proj):
        return "the output projection is not a plain quantized Linear"
    if not _plain_norm(norm):
        return "the post-attention norm is not a plain RMSNorm"
    bound = mlp.__dict__.get("forward")
    if type(mlp) is not GatedMLP or not _unhooked(mlp) or (
            bound is not None and getattr(bound, "__func__", None) is not _fused_mlp_decode):
        return "not the plain gated MLP"
    packed = _packed_quant(mlp, "packed_gate_up", mlp.gate_proj)
    if packed is None:
        return "gate/up are not a packed quantized projection in use"
    if residual is None or hidden.dim() != 2 or hidden.shape[0] != 1 or residual.shape != hidden.shape:
        return "not one row with its residual"
    if torch.is_autocast_enabled(hidden.device.type) or (torch.is_grad_enabled() and hidden.requires_grad):
        return "autocast or autograd"
    dtypes = {hidden.dtype, residual.dtype, norm.weight.dtype, attn.o_proj.compute_dtype, packed.layer.compute_dtype}
    if dtypes != {torch.bfloat16}:
        return "not all bf16"
    tensors = (residual, norm.weight, attn.o_proj.weight, packed.layer.weight, mlp.down_proj.weight)
    if any(t.device != hidden.device for t in tensors):
        return "not all on the row's device"
    if not quant_gemv_mma.supports(hidden, packed.layer.packed()):
        return "the fragment GEMV does not take gate/up"
    return None


def _takes_prenormed(layer, hidden: torch.Tensor) -> bool:
    """Whether ``layer`` (the next one) folds its input norm too: its own forward the fused decoder
    layer's, unhooked, a plain input norm, q/k/v packed and taken by the fragment GEMV, and the
    post-attention fold applying."""
    from . import quant_gemv_mma
    from .fused_norm_decode import _plain_norm, _unhooked
    from .hub import _fused_norm_decode, _is_dense_decoder_layer

    bound = layer.__dict__.get("forward")
    if (not _is_dense_decoder_layer(layer) or getattr(bound, "__func__", None) is not _fused_norm_decode
            or not _unhooked(layer) or not _plain_norm(layer.input_layernorm)
            or layer.input_layernorm.weight.dtype != torch.bfloat16):
        return False
    attn = layer.self_attn
    packed = _packed_quant(attn, "packed_qkv", attn.q_proj)
    if packed is None or {layer.input_layernorm.weight.device, packed.layer.weight.device} != {hidden.device}:
        return False  # (device_map may place the next layer on another GPU)
    return (packed.layer.compute_dtype == torch.bfloat16
            and quant_gemv_mma.supports(hidden, packed.layer.packed()) and _declines(layer, hidden, hidden) is None)


def prenormed_input(layer, hidden: torch.Tensor, residual: torch.Tensor | None, batch):
    """``(gamma * h, shares)`` the previous layer left for this one's input norm, where ``hidden`` is its
    ``h`` (residual None: the whole stream); None otherwise."""
    if residual is not None or batch is None:
        return None
    left = batch.__dict__.get("_memo", {}).get(("prenormed", id(layer)))
    if left is None or left[0] is not hidden:
        return None
    return left[1], left[2]


def quant_post_norm_forward(layer, hidden: torch.Tensor, residual: torch.Tensor | None, cos, sin, batch,
                            shares: torch.Tensor | None = None):
    """``DecoderLayer.forward``'s result past its input norm (``hidden`` normed, ``residual`` the
    stream), or None where the fold does not apply. With ``shares``, ``hidden`` is ``gamma * h`` and
    ``residual`` h from ``prenormed_input``: q/k/v scale by ``1 / rms(h)`` instead."""
    if not NORM_FOLD and shares is None:  # the common case, before any other check
        return None
    if _declines(layer, hidden, residual) is not None:
        if shares is not None:
            raise RuntimeError("a decoder layer declined the input its predecessor normed for it")
        return None
    from .hub import _runs_act_kernel
    from .quant_gemv_mma import GATED, quant_gemv_mma, quant_gemv_mma_normed, supports

    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    if shares is None:
        q, k, v = attn.project_qkv(hidden)
    else:
        qkv = attn.packed_qkv
        rms = (shares, layer.input_layernorm.variance_epsilon)
        q, k, v = quant_gemv_mma(hidden, qkv.layer.packed(), qkv.layer.bias, rms=rms).split(qkv.sizes, dim=-1)
    heads = attn.attend_heads(q, k, v, cos, sin, batch)  # [1, N*D]
    o = attn.o_proj
    w_o = o.packed()
    if not supports(heads, w_o):  # the attention's output in a layout the GEMV does not read
        hidden, residual = norm(o(heads), residual)
        return layer.feed_forward(hidden), residual
    h, gamma_h, shares = quant_gemv_mma_normed(heads, w_o, o.bias, residual.contiguous(), norm.weight)
    packed, act = mlp.packed_gate_up, mlp.act_fn
    gu = packed.layer
    rms = (shares, norm.variance_epsilon)
    fused_act = gu.packed().fmt in GATED and _runs_act_kernel(act) and packed.sizes[0] * 2 == gu.out_features
    if fused_act:
        inner = quant_gemv_mma(gamma_h, gu.packed(), gu.bias, act=act.name, rms=rms)
    else:
        inner = act(*quant_gemv_mma(gamma_h, gu.packed(), gu.bias, rms=rms).split(packed.sizes, dim=-1))
    down, nxt = mlp.down_proj, _next_layer(layer)
    if (nxt is None or batch is None or not _plain_quant(down) or not supports(inner, down.packed())
            or not _takes_prenormed(nxt, h)):
        return down(inner), h
    h_next, gamma_h, shares = quant_gemv_mma_normed(inner, down.packed(), down.bias, h,
                                                    nxt.input_layernorm.weight)
    batch.memo(("prenormed", id(nxt)), lambda: (h_next, gamma_h, shares))
    return h_next, None  # the whole stream, as any next layer reads it

