"""The "DecoderLayer" kernel: a dense decoder layer whose two RMSNorms run inside the GEMVs that
consume them (``gemv.gemv_rms_norm``), at decode sizes.

A layer normally runs ``input_layernorm`` -> packed q/k/v GEMV and ``post_attention_layernorm`` ->
packed gate/up GEMV: two norm launches, and two normed rows written and read back. Folded, each
norm is a first pass over the input row inside the GEMV, and one program of the GEMV writes the
residual sum. Of a decode step's 2L + 1 norm launches only the final one (before the lm_head) is
left.

Each half of the layer folds on its own, only where the result is the unfused path's: the norm is a
plain ``RMSNorm`` (PyTorch or the hub's kernel, which round alike), the projections it feeds are the
packed, plain ``nn.Linear`` weights (no adapter, quantization, sharding or hooks the fold would
bypass), the rows are few enough for the GEMV (``gemv_applies``: no autograd, one dtype) and
autocast is off (under autocast the hub's norm writes another dtype). Otherwise that half runs as
``DecoderLayer.forward`` does.

The fold pays where a layer is a few microseconds of GEMV: every program of the GEMV re-reads the
whole input row for its sum of squares, which costs little against a launch at hidden size 1024 and
more than a launch at 4096. Measured on an H200 (bench/RESULTS.md run 8): qwen3-0.6b decode 1,095 ->
1,156 tok/s with the fold, qwen3-8b 220 -> 206. So it applies up to ``FOLD_MAX_HIDDEN`` features.

Past the folded q/k/v GEMV, a pure decode step's attention can be one launch where that is what
would run anyway (``_attention_fuses``): the triton backend's paged decode with qk_norm_rope's
per-head norm, rotary and KV-cache store as its prologue (``paged_decode_fused.py``), one launch
fewer per layer. It pays only without programmatic dependent launch (``pdl.py``). qwen3-0.6b decode
at batch 1 on an H200 (bench/generate.py W1): with PDL off, 1,117 -> 1,138 tok/s fused; with PDL on,
1,418 unfused against 1,290 fused. Under PDL the unfused decode kernel starts early and overlaps
qk_norm_rope, while the fused prologue's loads, norm and rotary all wait for the GEMV and sit on the
critical path. So it applies where PDL is off (``FUSE_ATTENTION_WITH_PDL`` overrides that), and
``FUSE_ATTENTION = False`` turns it off entirely (bench/generate.py's ``+nofuseattn``).

At 5-32 rows the norms stay separate launches. Folded into the skinny GEMMs (each program summing
the squares of whole rows first, then normalising every x tile it loads), W3 on an H200 fell from
24,409 / 24,443 to 19,167 / 19,178 tok/s: the normalised tiles no longer stream straight into the
tensor-core loop, which costs far more than the 2 x 28 norm launches (whose removal would be worth
at most 24,287 -> 25,813, ``bench/ceilings.py``).
At 1-4 rows the folded q/k/v GEMV finishing each head itself (the last of a head's programs to
arrive, by an arrival counter, norming, rotating and storing it: qk_norm_rope's launch gone) was built
and measured slower on an H200: W1 1,342-1,345 against 1,395-1,409 tok/s with qk_norm_rope's launch
(bench/RESULTS.md run 15). The arrival, the read-back of the head and its arithmetic sit on the chain's
critical path after the GEMV's last program, while qk_norm_rope's own launch overlaps the paged
decode's early start. Removed.
In quantized layers at one row, the norms folded around the fragment GEMVs (the output projection
ending in the residual add, ``gamma * h`` and shares of ``sum(h^2)``; gate/up and the next layer's
q/k/v scaling their dots by ``1 / rms``) were built and measured slower on an H200: int4 419 -> 409
tok/s, int8 303 -> 294 (bench/RESULTS.md run 23), the normed epilogues costing the GEMVs more than
the two launches saved. Removed.
At 5-32 rows the q/k/v skinny GEMM finishing each head itself (qk_norm_rope's norm, rotary and cache
store in its epilogue, one head per tile) was built and measured on an H200 at W3: 23,134 against
24,671 tok/s, because one-head tiles cost the projection more than the launch saved; removed.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.attention import Attention
from ..layers.mlp import GatedMLP
from ..layers.norm import RMSNorm
from .fused_projections import PackedLinear
from .gemv import gemv_applies, gemv_rms_norm
from .pdl import pdl_enabled

FOLD_MAX_HIDDEN = 2048  # widest input row the norm is folded for (see the module docstring)
# Decode attention past the folded GEMV as one launch (see the module docstring); off for A/B runs.
FUSE_ATTENTION = True
FUSE_ATTENTION_WITH_PDL = False  # measured slower under PDL on an H200 (module docstring)


def describe() -> str:
    """What the "DecoderLayer" kernel does at 1-4 rows with the switches as they are now (``explain()``)."""
    from . import quant_gemv_plans

    parts = [f"norms folded into the packed q/k/v and gate/up GEMVs up to {FOLD_MAX_HIDDEN} features"]
    if FUSE_ATTENTION:
        parts.append("qk_norm_rope inside the triton paged decode" + (
            "" if FUSE_ATTENTION_WITH_PDL else " where programmatic dependent launch is off"))
    gated = quant_gemv_plans.gated_formats(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if gated:
        parts.append(f"{'/'.join(gated)} gate/up at one row: act(gate) * up in the GEMV")
    return "; ".join(parts)


def _unhooked(module: nn.Module) -> bool:
    return not module._forward_hooks and not module._forward_pre_hooks


def _plain_norm(norm: nn.Module) -> bool:
    from .hub import _rms_norm

    bound = norm.__dict__.get("forward")
    return (type(norm) is RMSNorm and _unhooked(norm)
            and (bound is None or getattr(bound, "__func__", None) is _rms_norm))


def _packed(owner: nn.Module, name: str, linears) -> PackedLinear | None:
    """``owner``'s packed projection where the unfused layer would run it and it stands for plain
    Linear layers only (no adapter, quantization, sharding or hook that the fold would bypass)."""
    from .fused_projections import _usable
    from .hub import _streams_plainly

    packed = getattr(owner, name, None)
    if type(packed) is not PackedLinear or not _unhooked(packed) or not _usable(packed, linears[0]):
        return None
    return packed if all(_streams_plainly(m) for m in linears) else None


def _fold(norm: RMSNorm, packed: PackedLinear | None, hidden, residual):
    """``(packed(norm(hidden + residual)), hidden + residual)`` in one launch, or None where it
    would not match the unfused path."""
    if packed is None or not _plain_norm(norm) or torch.is_autocast_enabled(hidden.device.type):
        return None
    if hidden.shape[-1] > FOLD_MAX_HIDDEN:
        return None
    inputs = (hidden, norm.weight) if residual is None else (hidden, residual, norm.weight)
    if not gemv_applies(packed.weight, *inputs):
        return None
    if residual is None:  # the first layer: the embedding is the residual
        return gemv_rms_norm(hidden, packed.weight, norm.weight, norm.variance_epsilon, bias=packed.bias), hidden
    return gemv_rms_norm(hidden, packed.weight, norm.weight, norm.variance_epsilon, residual, packed.bias)


def _attention_fuses(attn: Attention, q, k, v, cos, sin, batch) -> bool:
    return _attention_declines(attn, q, k, v, cos, sin, batch) is None


def _attention_declines(attn: Attention, q, k, v, cos, sin, batch) -> str | None:
    """Why ``paged_decode_fused`` would not compute what ``attn.attend`` runs for these heads
    (``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]``), or None where it does: the same cache contents (bit
    for bit on the interpreter) and the same attention up to where the new key joins the softmax sum. Each
    condition is a way the unfused path could run something else, or the launch would be slower:

    - the switches: ``FUSE_ATTENTION``, and PDL off unless ``FUSE_ATTENTION_WITH_PDL`` (measured
      slower under PDL, see the module docstring);
    - the backend is exactly the triton one, and the step a pure decode with a cache (one query
      per sequence, keys in the cache): then ``with_cache`` is the ``paged_decode`` the launch holds;
      other backends, prefill and mixed steps run their own kernels;
    - the rotary module runs the hub's qk_norm_rope kernel (no other forward, no hooks), whose q/k
      norms are plain RMSNorms or absent: the prologue is that kernel's arithmetic on their weights;
    - no autograd: qk_norm_rope would switch to the differentiable kernels, and with_cache raises;
    - one row of cos/sin, slot, length and block table per query, as the kernels index them;
    - qk_norm_rope would fuse its cache store (``_fusable``: its casts are then store_kv's) and
      round q and k to one dtype, the only rounding the fused kernel has.
    """
    from ..attention.triton_backend import TritonAttention
    from ..layers.attention import ApplyRotary
    from .hub import _qk_norm_rope
    from .qk_norm_rope import _fusable, output_dtypes

    cache, rotary = batch.kv_cache, attn.rotary
    if not FUSE_ATTENTION:
        return "FUSE_ATTENTION is off"
    if pdl_enabled(q.device) and not FUSE_ATTENTION_WITH_PDL:
        return "PDL is on and FUSE_ATTENTION_WITH_PDL off"
    if type(attn.backend) is not TritonAttention:
        return f"the {type(attn.backend).__name__} backend, not exactly the triton one"
    if cache is None or not batch.has_context or batch.max_seqlen_q != 1:
        return "not a pure decode step with a KV cache"
    if type(rotary) is not ApplyRotary or not _unhooked(rotary) or getattr(
            rotary.__dict__.get("forward"), "__func__", None) is not _qk_norm_rope:
        return "the rotary module does not run the hub's qk_norm_rope kernel alone"
    norms = (attn.q_norm, attn.k_norm)  # both absent, or both plain RMSNorms
    if any(n is not None for n in norms) and not all(n is not None and _plain_norm(n) for n in norms):
        return "the q/k norms are not both plain RMSNorms"
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return "autograd is on"
    t, hkv, d = k.shape
    tables = (batch.seqlens_k, batch.block_table, batch.slot_mapping)
    if any(x is None or x.shape[0] != t for x in tables) or batch.slot_mapping.dim() != 1:
        return "no one length, block-table row and slot per query"
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != t or cos.shape[1] > d or cos.shape[1] % 2:
        return f"cos/sin {tuple(cos.shape)} are not one even row per query"
    q_dtype, k_dtype = output_dtypes(q, k, cos, None if attn.q_norm is None else attn.q_norm.weight)
    if q_dtype != k_dtype:
        return f"q and k would round to {q_dtype} and {k_dtype}"
    store = (v, cache.k[attn.layer_idx], cache.v[attn.layer_idx], batch.slot_mapping)
    if not _fusable(store, k_dtype, (t, hkv, d), q.device):
        return "qk_norm_rope would not fuse this cache store"
    return None


def _attention_past_projections(attn: Attention, qkv: torch.Tensor, cos, sin, batch) -> torch.Tensor:
    q, k, v = qkv.split(attn.packed_qkv.sizes, dim=-1)
    t, d = qkv.shape[0], attn.head_dim
    heads = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
    if not _attention_fuses(attn, *heads, cos, sin, batch):
        return attn.attend(q, k, v, cos, sin, batch)
    from .paged_decode_fused import paged_decode_fused
    from .qk_norm_rope import _norm_params

    i, norms = attn.layer_idx, ()
    if attn.q_norm is not None:
        (qw, q_eps), (kw, k_eps) = _norm_params(attn.q_norm, "q_norm"), _norm_params(attn.k_norm, "k_norm")
        norms = (qw, kw, q_eps, k_eps)
    out = paged_decode_fused(*heads, batch.kv_cache.k[i], batch.kv_cache.v[i], batch.seqlens_k, batch.block_table,
                             batch.slot_mapping, batch.max_seqlen_k, attn.scaling, cos, sin, *norms,
                             window=attn.sliding_window)
    return attn.o_proj(out.reshape(t, -1))  # Attention.attend, past the attention


def _mlp_past_projections(mlp: GatedMLP, gate_up: torch.Tensor) -> torch.Tensor:
    from .hub import _fused_mlp_decode, gated_mlp_down

    gate, up = gate_up.split(mlp.packed_gate_up.sizes, dim=-1)
    if getattr(mlp.__dict__.get("forward"), "__func__", None) is _fused_mlp_decode:
        return gated_mlp_down(mlp, gate, up)  # the act-and-mul inside the down GEMV
    return mlp.down_proj(mlp.act_fn(gate, up))  # GatedMLP.forward, past the projections


def _qkv_packed(attn) -> PackedLinear | None:
    # The fold replaces project_qkv inside Attention.forward: only for that exact forward.
    if type(attn) is not Attention or "forward" in attn.__dict__ or not _unhooked(attn):
        return None
    return _packed(attn, "packed_qkv", (attn.q_proj, attn.k_proj, attn.v_proj))


def _gate_up_packed(mlp) -> PackedLinear | None:
    from .hub import _fused_mlp_decode

    bound = mlp.__dict__.get("forward")
    if type(mlp) is not GatedMLP or not _unhooked(mlp) or (
            bound is not None and getattr(bound, "__func__", None) is not _fused_mlp_decode):
        return None
    return _packed(mlp, "packed_gate_up", (mlp.gate_proj, mlp.up_proj))


def fused_norm_decode_forward(self, hidden, residual, cos, sin, batch):
    """``DecoderLayer.forward`` with each norm folded into the GEMV after it where that is exact."""
    attn, mlp = self.self_attn, self.mlp
    folded = _fold(self.input_layernorm, _qkv_packed(attn), hidden, residual)
    if folded is not None:
        qkv, residual = folded
        hidden = _attention_past_projections(attn, qkv, cos, sin, batch)
    else:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = attn(hidden, cos, sin, batch)

    # The exact class is DecoderLayer (the hub's predicate), so feed_forward is the MLP itself.
    folded = _fold(self.post_attention_layernorm, _gate_up_packed(mlp), hidden, residual)
    if folded is not None:
        gate_up, residual = folded
        return _mlp_past_projections(mlp, gate_up), residual
    hidden, residual = self.post_attention_layernorm(hidden, residual)
    return self.feed_forward(hidden), residual
