"""The "flex_attention" backend: PyTorch's ``torch.nn.attention.flex_attention`` with a block mask.

Every query and key gets a (document, position) pair; a key is visible iff it belongs to the same
sequence, is not after the query and (with a sliding window) lies within the window. Prefill packs
all sequences into one ``[1, H, T, D]`` call; the cached path gathers each sequence's keys into a
padded ``[B * max_k]`` axis first (padding keys belong to no document). GQA uses ``enable_gqa``, so
K/V are never repeated. Backward comes from autograd through flex_attention (CUDA only: PyTorch has
no flex backward on CPU).

On CUDA flex_attention runs compiled (a fused Triton kernel); on CPU it runs eagerly, which
materialises the score matrix and suits small inputs only. The block mask is built once per step and
reused by every layer; it is rebuilt whenever the batch's tensors are modified in place.
"""

from __future__ import annotations

import logging
import warnings

import torch

from .kv_cache import gather_kv
from .registry import AttentionBackend, Capabilities, register

logger = logging.getLogger("cudaformers")


def _doc_positions(cu_seqlens: torch.Tensor, total: int, k_lens: torch.Tensor | None = None):
    """Per packed token: its sequence index and absolute position (bottom-right aligned to ``k_lens``)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    doc = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=total)
    pos = torch.arange(total, device=lens.device) - cu_seqlens[doc]
    if k_lens is not None:
        pos = pos + (k_lens - lens)[doc]
    return doc, pos


class FlexAttention(AttentionBackend):
    name = "flex_attention"
    caps = Capabilities(notes=["backward on CUDA only", "eager (unfused) on CPU"])

    def __init__(self):
        self._compiled = None
        self._mask_key = None
        self._mask = None

    def available(self) -> str | None:
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError:
            return "needs torch >= 2.5 (torch.nn.attention.flex_attention)"
        return None

    def unsupported_reason(self, *, device, dtype, head_dim, sliding_window, training):
        why = super().unsupported_reason(device=device, dtype=dtype, head_dim=head_dim,
                                         sliding_window=sliding_window, training=training)
        if why is None and training and device.type == "cpu":
            why = "has no backward pass on CPU (PyTorch's flex_attention supports training on CUDA only)"
        return why

    def _flex(self, device):
        from torch.nn.attention.flex_attention import flex_attention

        if device.type != "cuda":
            return flex_attention
        if self._compiled is None:
            logger.info("flex_attention: compiling the fused kernel with torch.compile (first call only)")
            self._compiled = torch.compile(flex_attention)
        return self._compiled

    def _block_mask(self, batch, window, cached: bool, total_q: int, kv_len: int, device):
        # One mask per step serves every layer. The key holds the batch itself (so its id cannot be
        # reused) and the version counters of its tensors (so in-place updates rebuild the mask).
        tensors = (batch.cu_seqlens_q, batch.cu_seqlens_k, batch.seqlens_k)
        key = (batch, tuple(t._version for t in tensors), window, cached, total_q, kv_len)
        if self._mask_key is not None and self._mask_key[0] is batch and self._mask_key[1:] == key[1:]:
            return self._mask
        from torch.nn.attention.flex_attention import create_block_mask

        if cached:
            doc_q, pos_q = _doc_positions(batch.cu_seqlens_q, total_q, batch.seqlens_k)
            max_k = kv_len // batch.num_seqs
            j = torch.arange(kv_len, device=device)
            doc_k, pos_k = j // max_k, j % max_k
            doc_k = torch.where(pos_k < batch.seqlens_k[doc_k], doc_k, -1)  # padding keys: no document
        else:
            doc_q, pos_q = _doc_positions(batch.cu_seqlens_q, total_q)
            doc_k, pos_k = doc_q, pos_q

        def mask_mod(b, h, qi, kj):
            visible = (doc_q[qi] == doc_k[kj]) & (pos_k[kj] <= pos_q[qi])
            if window:
                visible = visible & (pos_k[kj] > pos_q[qi] - window)
            return visible

        mask = create_block_mask(mask_mod, None, None, total_q, kv_len, device=device,
                                 _compile=device.type == "cuda")
        self._mask_key, self._mask = key, mask
        return mask

    def _run(self, q, k, v, block_mask, scale):
        # [T, H, D] -> [1, H, T, D]
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
        enable_gqa = q.shape[1] != k.shape[1]
        flex = self._flex(q.device)
        with warnings.catch_warnings():
            # On CPU the unfused path is the intended one; its performance warning is not news.
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
        return out[0].transpose(0, 1)

    def prefill(self, q, k, v, batch, scale, window):
        mask = self._block_mask(batch, window, False, q.shape[0], q.shape[0], q.device)
        return self._run(q, k, v, mask, scale)

    def with_cache(self, q, k_cache, v_cache, batch, scale, window):
        max_k = batch.max_seqlen_k
        keys = gather_kv(k_cache, batch.block_table, max_k).to(q.dtype).flatten(0, 1)  # [B * max_k, Hkv, D]
        values = gather_kv(v_cache, batch.block_table, max_k).to(q.dtype).flatten(0, 1)
        mask = self._block_mask(batch, window, True, q.shape[0], keys.shape[0], q.device)
        return self._run(q, keys, values, mask, scale)


register(FlexAttention())
