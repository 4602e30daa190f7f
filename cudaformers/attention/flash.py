"""The flash-attn packages: "flash_attention_2" (flash_attn), "_3" (flash_attn_interface), "_4" (flash_attn.cute).

When the package imports, its varlen and KV-cache functions are wrapped. When it does not, the name
resolves to the bundled Triton kernels (same semantics: varlen, GQA, sliding window, backward, paged
cache) and says so once at INFO; ``backend.resolved_from`` then names what was asked for.

Sliding window: transformers' "key j visible iff p - window < j <= p" is flash-attn's
``window_size=(window - 1, 0)`` with ``causal=True``.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from .kv_cache import gather_kv
from .registry import AttentionBackend, Capabilities, register
from .triton_backend import MAX_HEAD_DIM, TritonAttention

logger = logging.getLogger("cudaformers")

_PACKAGES = {
    2: ("flash_attn", "flash-attn"),
    3: ("flash_attn_interface", "flash-attn 3 (flash_attn_interface, built from flash-attention/hopper)"),
    4: ("flash_attn.cute", "flash-attn 4 (flash_attn.cute)"),
}
FA2_PAGE_MULTIPLE = 256  # flash-attn 2 reads a paged cache only in pages of a multiple of 256 tokens


@functools.lru_cache(maxsize=None)
def _import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _first(result):
    """Some flash-attn versions return ``(out, lse, ...)``, others ``out``."""
    return result[0] if isinstance(result, tuple) else result


def _pack_cached_kv(cache, batch) -> torch.Tensor:
    """Each sequence's cached keys back to back, ``[sum(seqlens_k), Hkv, D]`` (reads the total once)."""
    cu_k = batch.cu_seqlens_k
    total = int(cu_k[-1])
    t = torch.arange(total, device=cu_k.device)
    seq = torch.searchsorted(cu_k[1:].long(), t, right=True)
    pos = t - cu_k.long()[seq]
    page = cache.shape[1]
    slots = batch.block_table[seq, pos // page].long() * page + pos % page
    return cache.view(-1, *cache.shape[2:])[slots]


class FlashAttnBackend(AttentionBackend):
    graph_safe = True
    caps = Capabilities(devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}))

    def __init__(self, version: int):
        self.version = version
        self.name = f"flash_attention_{version}"
        self.module, self.package = _PACKAGES[version]
        self._fallback = TritonAttention()
        self._fallback.resolved_from = self.name
        self._logged = False

    def _lib(self):
        return _import(self.module)

    def resolve(self, *, device: torch.device) -> AttentionBackend:
        if device.type != "cuda" or self._lib() is not None:
            return self
        if not self._logged:
            self._logged = True
            logger.info("%s: %s is not installed; using cudaformers' bundled Triton kernel", self.name, self.package)
        return self._fallback

    def unsupported_reason(self, *, device, dtype, head_dim, sliding_window, training):
        if device.type != "cuda":
            return f"runs on CUDA GPUs only, not {device.type}"
        if self._lib() is None:  # resolve() stands the Triton kernels in
            return self._fallback.unsupported_reason(device=device, dtype=dtype, head_dim=head_dim,
                                                     sliding_window=sliding_window, training=training)
        why = super().unsupported_reason(device=device, dtype=dtype, head_dim=head_dim,
                                         sliding_window=sliding_window, training=training)
        if why is None and head_dim > MAX_HEAD_DIM:
            why = f"supports head_dim up to {MAX_HEAD_DIM}, not {head_dim}"
        return why

    def _window(self, window):
        if self.version == 4:
            return (window - 1, 0) if window else (None, None)
        return (window - 1, 0) if window else (-1, -1)

    def prefill(self, q, k, v, batch, scale, window):
        cu, m = batch.cu_seqlens_q, batch.max_seqlen_q
        lib = self._lib()
        if self.version == 4:
            return _first(lib.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                                     max_seqlen_k=m, softmax_scale=scale, causal=True,
                                                     window_size=self._window(window)))
        return _first(lib.flash_attn_varlen_func(q, k, v, cu, cu, m, m, softmax_scale=scale, causal=True,
                                                 window_size=self._window(window)))

    def with_cache(self, q, k_cache, v_cache, batch, scale, window):
        k_cache, v_cache = k_cache.to(q.dtype), v_cache.to(q.dtype)
        lib, ws = self._lib(), self._window(window)
        if self.version == 4:
            return _first(lib.flash_attn_varlen_func(
                q, k_cache, v_cache, cu_seqlens_q=batch.cu_seqlens_q, max_seqlen_q=batch.max_seqlen_q,
                seqused_k=batch.seqlens_k, page_table=batch.block_table, softmax_scale=scale, causal=True,
                window_size=ws))
        if self.version == 3:
            return _first(lib.flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=batch.seqlens_k, page_table=batch.block_table,
                cu_seqlens_q=batch.cu_seqlens_q, max_seqlen_q=batch.max_seqlen_q, softmax_scale=scale,
                causal=True, window_size=ws))
        paged = k_cache.shape[1] % FA2_PAGE_MULTIPLE == 0
        if batch.max_seqlen_q == 1:  # decode: no host reads, so CUDA graphs can capture it
            if paged:
                kc, vc, table = k_cache, v_cache, batch.block_table
            else:
                kc = gather_kv(k_cache, batch.block_table, batch.max_seqlen_k)
                vc = gather_kv(v_cache, batch.block_table, batch.max_seqlen_k)
                table = None
            out = lib.flash_attn_with_kvcache(q[:, None], kc, vc, cache_seqlens=batch.seqlens_k, block_table=table,
                                              softmax_scale=scale, causal=True, window_size=ws)
            return _first(out)[:, 0]
        if paged:
            return _first(lib.flash_attn_varlen_func(
                q, k_cache, v_cache, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k,
                softmax_scale=scale, causal=True, window_size=ws, block_table=batch.block_table))
        keys, values = _pack_cached_kv(k_cache, batch), _pack_cached_kv(v_cache, batch)
        return _first(lib.flash_attn_varlen_func(
            q, keys, values, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k,
            softmax_scale=scale, causal=True, window_size=ws))


for _version in _PACKAGES:
    register(FlashAttnBackend(_version))
