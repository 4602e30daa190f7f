"""A decode layer's attention from its raw projections in one launch: qk_norm_rope (per-head q/k
RMSNorm and rotary, the KV-cache store of the new token) fused into the paged flash-decoding kernel.

At batch 1 a small model's decode step is a chain of launches: per layer of qwen3-0.6b on an H200,
qk_norm_rope took 2.1 us and the paged decode 6.8 us of a 0.672 ms step, each with a gap before the
next kernel. Here the decode kernel (``paged_decode.py``, its ``FUSED`` prologue) does both.

- Each program (sequence, kv head, split) norms and rotates the query heads of its GQA group, and
  its kv head's new key, with qk_norm_rope's own arithmetic (``qk_norm_rope.norm_rope``) and
  rounding: q to qk_norm_rope's output dtype (the attention output's), k to that dtype and then to
  the cache's, as the fused store writes it. A few hundred bytes per program, read from L2.
- The new token is its sequence's last key, and this launch writes its cache row, so no program
  reads that row: the tiles stop short of it. The split whose range holds it (the last one the
  sequence uses, whatever its sliding window) adds it to its online softmax from registers after
  its tiles, as one more tile of one key (p rounded as the tiles round it). Swapping the key into
  the last tile instead gives the unfused path's bits, but a select on every tile of the main loop
  made the launch a third slower than the two it replaces at batch 1 and twice as slow at batch 32
  (H200). So the output differs from the unfused path's by the order of the softmax sum only.
- That program also writes the key and value to the cache slot (one writer per sequence and kv
  head; a negative slot is padding: nothing is written, and the row, whose output nobody reads,
  still attends to its new key).
- The cache casts are Triton's, as in qk_norm_rope's fused store. Callers take this path only where
  qk_norm_rope would fuse its store (``qk_norm_rope._fusable``), so the cache bits are the unfused
  path's; and only where q and k round to one dtype (always so for a packed projection), which
  lets the kernel round both to its output's dtype.
- PDL (``pdl.py``): the norm weights are requested before the wait; the raw q/k/v (the GEMV's
  output), cos/sin and slots are read after it, and the lengths and block table as before.

Measured on an H200 (qwen3-0.6b shapes, 28 layers in one CUDA graph): the fused launch takes 6.1 us
a layer at batch 1 against 6.9 us for the two launches (129 keys), and about the same at batch 32.
In the model, though, it pays only with PDL off (``fused_norm_decode``'s docstring has the figures):
under PDL the plain decode kernel starts early behind qk_norm_rope, while this prologue's work all
waits for the q/k/v GEMV.

On the GPU the compiler may sum a head's squares in another order in this kernel than in
qk_norm_rope's (their tiles differ), so a q or k can be one rounding step off the unfused path's;
on the interpreter (numpy) the bits are the same.
"""

from __future__ import annotations

import torch

from .flash_attention_fwd import check_inputs
from .kv_store import CACHE_DTYPES
from .kv_store import supports as store_supported
from .paged_decode import DecodeTiling, NewToken, launch
from .qk_norm_rope import output_dtypes


def check_new_token(q, k, v, k_cache, v_cache, cos, sin, q_weight, k_weight, slot_mapping) -> None:
    """Raises ValueError naming what the fused launch cannot take."""
    check_inputs(q, k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"paged_decode_fused: q must be [B, Hq, D], got {tuple(q.shape)}")
    b, _, d = q.shape
    if k.shape != v.shape or k.dim() != 3 or k.shape[0] != b or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"paged_decode_fused: k {tuple(k.shape)} and v {tuple(v.shape)} must be [B={b}, Hkv, D] "
                         f"matching the cache's [blocks, page, Hkv, D] = {tuple(k_cache.shape)}")
    rot = cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != b or rot > d or rot % 2:
        raise ValueError(f"paged_decode_fused: cos/sin must be [B={b}, R] with an even R <= head_dim ({d}), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("paged_decode_fused: pass both q and k norm weights, or neither")
    if q_weight is not None and (q_weight.shape != (d,) or k_weight.shape != (d,)):
        raise ValueError(f"paged_decode_fused: norm weights must be [head_dim={d}], got {tuple(q_weight.shape)} "
                         f"and {tuple(k_weight.shape)}")
    if slot_mapping.shape != (b,):
        raise ValueError(f"paged_decode_fused: slot_mapping must be [B={b}], got {tuple(slot_mapping.shape)}")
    if not store_supported(k_cache, v_cache):
        raise ValueError(f"paged_decode_fused: the cache store needs contiguous caches of one dtype among "
                         f"{CACHE_DTYPES}, got {k_cache.dtype} / {v_cache.dtype}")
    q_dtype, k_dtype = output_dtypes(q, k, cos, q_weight)
    if q_dtype != k_dtype:
        raise ValueError(f"paged_decode_fused: q and k would round to different dtypes ({q_dtype}, {k_dtype}); "
                         "give them one dtype")
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError("paged_decode_fused has no backward; call it under torch.no_grad()")


def paged_decode_fused(q, k, v, k_cache, v_cache, seqlens_k, block_table, slot_mapping, max_seqlen_k: int,
                       scale: float, cos, sin, q_weight=None, k_weight=None, q_eps: float = 1e-6,
                       k_eps: float = 1e-6, window: int | None = None, num_splits: int | None = None,
                       tiling: DecodeTiling | None = None) -> torch.Tensor:
    """``qk_norm_rope_forward(q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, KVStore(v, k_cache, v_cache,
    slot_mapping))`` and then ``paged_decode`` of its q, in one launch: returns the attention output
    ``[B, Hq, D]`` (in the dtype qk_norm_rope's q would have) and leaves the new keys and values in the cache.

    ``q [B, Hq, D]``, ``k``/``v [B, Hkv, D]`` as projected (strided views of a packed projection are
    fine); ``cos``/``sin [B, R]`` rotate the first R channels; ``slot_mapping [B]`` is where each new key
    goes, which must be position ``seqlens_k[b] - 1`` of its sequence. The rest as for ``paged_decode``.
    """
    check_new_token(q, k, v, k_cache, v_cache, cos, sin, q_weight, k_weight, slot_mapping)
    q_dtype, _ = output_dtypes(q, k, cos, q_weight)
    q, k, v, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, cos, sin))
    slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    out = torch.empty(q.shape, dtype=q_dtype, device=q.device)
    new = NewToken(k, v, cos, sin, q_weight, k_weight, float(q_eps), float(k_eps), slots)
    return launch(q, out, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k, scale, window, num_splits, tiling,
                  new)


__all__ = ["paged_decode_fused", "check_new_token"]
