"""PyTorch scaled_dot_product_attention, the default backend.

Prefill of equal-length sequences is one batched call; ragged batches are padded with a mask. The
cached path gathers keys through the block table into fixed-shape padded tensors and makes no host
reads, so decode steps through it can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_cache import gather_kv, gather_slots
from .registry import AttentionBackend, register


def _padded_mask(q_lens, k_lens, max_q, max_k, window):
    """Bool ``[B, 1, max_q, max_k]``: causal (bottom-right), windowed, padding masked out.

    Padded query rows see key 0 so softmax stays finite; their outputs are discarded.
    """
    dev = k_lens.device
    qi = torch.arange(max_q, device=dev)[None, :, None]
    kj = torch.arange(max_k, device=dev)[None, None, :]
    q_pos = k_lens[:, None, None] - q_lens[:, None, None] + qi  # absolute position of each query
    mask = (kj <= q_pos) & (kj < k_lens[:, None, None])
    if window:
        mask &= kj > q_pos - window
    mask |= (qi >= q_lens[:, None, None]) & (kj == 0)
    return mask[:, None]


def _scatter_rows(flat, cu, max_len):
    """Flat ``[T, H, D]`` -> padded ``[B, H, max_len, D]`` plus the index that undoes it."""
    lens = cu[1:] - cu[:-1]
    b = lens.numel()
    pos = torch.arange(max_len, device=flat.device)[None, :]
    valid = pos < lens[:, None]
    idx = (cu[:-1, None] + pos).clamp(max=flat.shape[0] - 1)
    padded = flat[idx.long()]  # [B, max_len, H, D]
    return padded.transpose(1, 2), valid


class SdpaAttention(AttentionBackend):
    name = "sdpa"
    graph_safe = True

    def _run(self, q, k, v, mask, scale, is_causal=False):
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and mask is None:  # flash handles GQA itself; with a mask, kernels may not
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, enable_gqa=True)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal)

    def prefill(self, q, k, v, batch, scale, window):
        b, max_q = batch.num_seqs, batch.max_seqlen_q
        if b * max_q == q.shape[0]:
            # Every sequence has max_q tokens (known on the host: no sync), so the flat rows are a
            # [B, S, H, D] view. No gather, no padding mask, no GQA copies: sdpa's fused kernels
            # take the causal case as is (a window needs one [S, S] mask shared by the batch).
            def batched(t):  # [T, H, D] -> [B, H, S, D] view
                return t.view(b, max_q, *t.shape[1:]).transpose(1, 2)

            mask = None
            if window and max_q > 1:
                pos = torch.arange(max_q, device=q.device)
                mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
            out = self._run(batched(q), batched(k), batched(v), mask, scale, is_causal=mask is None and max_q > 1)
            return out.transpose(1, 2).reshape(q.shape)
        cu = batch.cu_seqlens_q
        qp, valid = _scatter_rows(q, cu, max_q)
        kp, _ = _scatter_rows(k, cu, max_q)
        vp, _ = _scatter_rows(v, cu, max_q)
        lens = cu[1:] - cu[:-1]
        mask = _padded_mask(lens, lens, max_q, max_q, window)
        out = self._run(qp, kp, vp, mask, scale).transpose(1, 2)  # [B, max_q, H, D]
        return out[valid]

    def with_cache(self, q, k_cache, v_cache, batch, scale, window):
        max_k = batch.max_seqlen_k
        cu, max_q = batch.cu_seqlens_q, batch.max_seqlen_q
        slots = batch.memo(("sdpa slots", max_k, k_cache.shape[1]),
                           lambda: gather_slots(batch.block_table, k_cache.shape[1], max_k))
        kp = gather_kv(k_cache, batch.block_table, max_k, slots).to(q.dtype).transpose(1, 2)
        vp = gather_kv(v_cache, batch.block_table, max_k, slots).to(q.dtype).transpose(1, 2)
        mask = batch.memo(("sdpa mask", max_q, max_k, window),
                          lambda: _padded_mask(cu[1:] - cu[:-1], batch.seqlens_k, max_q, max_k, window))
        if max_q == 1:
            out = self._run(q[:, None].transpose(1, 2), kp, vp, mask, scale)  # [B, H, 1, D]
            return out[:, :, 0]
        qp, valid = _scatter_rows(q, cu, max_q)
        out = self._run(qp, kp, vp, mask, scale).transpose(1, 2)
        return out[valid]


register(SdpaAttention())
