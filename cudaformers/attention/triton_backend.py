"""The "triton" backend: cudaformers' own FlashAttention kernels (kernels/flash_attention*.py, paged_decode.py).

* prefill: varlen causal forward, with the Triton backward when gradients are needed (training).
* with_cache, one query per sequence (decode): flash-decoding over the paged cache, capturable in CUDA
  graphs.
* with_cache, longer queries (chunked prefill, prefix-cache hits, mixed steps): the varlen forward
  reading keys straight through the block table.

Runs on CUDA; on CPU only under ``TRITON_INTERPRET=1`` (slow, meant for tests).
"""

from __future__ import annotations

import os

import torch

from ..errors import UnsupportedError
from .registry import AttentionBackend, Capabilities, register

MAX_HEAD_DIM = 256


def _interpreting() -> bool:
    # Read here rather than from the kernels module so that asking about capabilities never imports triton.
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonAttention(AttentionBackend):
    name = "triton"
    graph_safe = True
    # Set when this instance stands in for a flash-attn package that is not installed.
    resolved_from: str | None = None

    @property
    def caps(self) -> Capabilities:
        devices = {"cuda", "cpu"} if _interpreting() else {"cuda"}
        return Capabilities(devices=frozenset(devices), notes=[
            f"head_dim up to {MAX_HEAD_DIM}", "CPU only under TRITON_INTERPRET=1 (tests)"])

    def available(self) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "needs the `triton` package (pip install triton)"
        return None

    def unsupported_reason(self, *, device, dtype, head_dim, sliding_window, training):
        why = super().unsupported_reason(device=device, dtype=dtype, head_dim=head_dim,
                                         sliding_window=sliding_window, training=training)
        if why is None and head_dim > MAX_HEAD_DIM:
            why = f"supports head_dim up to {MAX_HEAD_DIM}, not {head_dim}"
        return why

    def prefill(self, q, k, v, batch, scale, window):
        from ..kernels.flash_attention import flash_attn_varlen

        cu, m = batch.cu_seqlens_q, batch.max_seqlen_q
        return flash_attn_varlen(q, k, v, cu, cu, m, m, scale, window)

    def with_cache(self, q, k_cache, v_cache, batch, scale, window):
        if torch.is_grad_enabled() and q.requires_grad:
            raise UnsupportedError(
                "the triton backend has no backward through the KV cache; run training forwards "
                "without a cache (or under torch.no_grad() for generation)")
        from ..kernels.paged_decode import paged_decode

        if batch.max_seqlen_q == 1:
            return paged_decode(q, k_cache, v_cache, batch.seqlens_k, batch.block_table, batch.max_seqlen_k,
                                scale, window)
        from ..kernels.flash_attention_fwd import attention_fwd

        d = batch.num_decode_seqs
        if d == 0:
            out, _ = attention_fwd(q, k_cache, v_cache, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q,
                                   scale, window, block_table=batch.block_table)
            return out
        # A mixed step: the leading single-query rows through the decode kernel (one program per KV
        # head, not a mostly-empty query tile per head), the prefill chunks through the prefill kernel,
        # each writing its rows of one output. The step is bound by the host, so the two halves'
        # metadata is cut once per step (``memo``), not in every layer.
        lens_k, decode_table, cu_q, cu_k, prefill_table = batch.memo(("triton mixed split", d),
                                                                     lambda: _split(batch, d))
        out = torch.empty_like(q)
        paged_decode(q[:d], k_cache, v_cache, lens_k, decode_table, batch.max_seqlen_k, scale, window, out=out[:d])
        attention_fwd(q[d:], k_cache, v_cache, cu_q, cu_k, batch.max_seqlen_q, scale, window,
                      block_table=prefill_table, out=out[d:])
        return out


def _split(batch, d: int):
    """A mixed step's first ``d`` (decode) sequences' lengths and block table, and the prefill
    sequences' offsets (rebased to their own first token and key) and block table."""
    cu_k = batch.cu_seqlens_k[d:]
    return (batch.seqlens_k[:d], batch.block_table[:d], batch.cu_seqlens_q[d:] - d, cu_k - cu_k[0],
            batch.block_table[d:])


register(TritonAttention())
