"""New tokens' keys and values into the paged KV cache, both in one Triton launch.

k, v ``[T, Hkv, D]`` may be strided views (slices of a packed projection: any token and head
strides, last dim contiguous), so no ``.contiguous()`` copy precedes the store. Caches are
``[num_blocks, block_size, Hkv, D]``, contiguous; token t goes to flat slot ``slot_mapping[t]``, and
negative slots (padding rows) are skipped. A copy with at most a dtype cast: bit-exact against
``index_copy_`` wherever the cast rounds like PyTorch (always on the GPU).

The grid depends only on shapes, nothing is read back to the host: capturable in a CUDA graph. On
Hopper it launches as part of the decode chain's programmatic dependent launch (``pdl.py``); with
nothing but activations to read, it waits before its first load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid import next_power_of_2
from .pdl import pdl_enabled, release_dependents, wait_for_producer

# Casts Triton and PyTorch round alike; other cache dtypes (fp8) keep the PyTorch store.
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _store_kv_kernel(K, V, K_CACHE, V_CACHE, slot_mapping, n_heads,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     USE_PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    wait_for_producer(USE_PDL)  # every program, padding rows included
    release_dependents(USE_PDL)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, BLOCK_D)[None, :]
        # The cache is contiguous: one slot is n_heads * HEAD_DIM elements in a row.
        dst = slot * n_heads * HEAD_DIM
        for h0 in range(0, n_heads, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)[:, None]
            mask = (heads < n_heads) & (cols < HEAD_DIM)
            k = tl.load(K + t * stride_kt + heads * stride_kh + cols, mask=mask)
            v = tl.load(V + t * stride_vt + heads * stride_vh + cols, mask=mask)
            tl.store(K_CACHE + dst + heads * HEAD_DIM + cols, k.to(K_CACHE.dtype.element_ty), mask=mask)
            tl.store(V_CACHE + dst + heads * HEAD_DIM + cols, v.to(V_CACHE.dtype.element_ty), mask=mask)


def supports(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these caches can take the Triton store (else: ``store_kv_reference``)."""
    return (k_cache.dtype in CACHE_DTYPES and v_cache.dtype == k_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def store_kv_triton(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Writes ``k, v [T, Hkv, D]`` into ``k_cache, v_cache [blocks, page, Hkv, D]`` at ``slot_mapping [T]``."""
    t, h, d = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (h, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kv: k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, Hkv, D] matching the "
                         f"caches' [blocks, page, Hkv, D] = {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if slot_mapping.shape != (t,):
        raise ValueError(f"store_kv: slot_mapping must be [T={t}], got {tuple(slot_mapping.shape)}")
    if not supports(k_cache, v_cache):
        raise ValueError(f"store_kv: the Triton store needs contiguous caches of one dtype among {CACHE_DTYPES}, "
                         f"got {k_cache.dtype} / {v_cache.dtype}")
    if t == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    block_d = next_power_of_2(d)
    block_h = min(next_power_of_2(h), max(1, 4096 // block_d))
    pdl = pdl_enabled(k.device)
    _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, h, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, USE_PDL=pdl,
                           num_warps=4 if block_h * block_d >= 2048 else 2, launch_pdl=pdl)


def store_kv_reference(k_cache, v_cache, k, v, slot_mapping) -> None:
    """``index_copy_`` of each token's heads into its flat slot; negative slots are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


__all__ = ["store_kv_triton", "store_kv_reference", "supports"]
