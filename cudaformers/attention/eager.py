"""The reference backend: plain matmul-softmax-matmul per sequence, as transformers' eager path."""

from __future__ import annotations

import torch

from .kv_cache import gather_kv
from .registry import AttentionBackend, register


def causal_mask(q_len: int, k_len: int, window: int | None, device) -> torch.Tensor:
    """Bool ``[q_len, k_len]``, True where query i (the last q_len positions) may see key j."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    return mask


def attend(q, k, v, scale: float, window: int | None) -> torch.Tensor:
    """One sequence: q ``[Sq, Hq, D]``, k/v ``[Sk, Hkv, D]`` -> ``[Sq, Hq, D]``."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = causal_mask(q.shape[0], k.shape[0], window, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


class EagerAttention(AttentionBackend):
    name = "eager"

    def prefill(self, q, k, v, batch, scale, window):
        cu = batch.cu_seqlens_q.tolist()
        out = torch.empty_like(q)
        for s, e in zip(cu[:-1], cu[1:]):
            out[s:e] = attend(q[s:e], k[s:e], v[s:e], scale, window)
        return out

    def with_cache(self, q, k_cache, v_cache, batch, scale, window):
        cu = batch.cu_seqlens_q.tolist()
        k_lens = batch.seqlens_k.tolist()
        keys = gather_kv(k_cache, batch.block_table, max(k_lens))
        values = gather_kv(v_cache, batch.block_table, max(k_lens))
        out = torch.empty_like(q)
        for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
            n = k_lens[i]
            out[s:e] = attend(q[s:e], keys[i, :n].to(q.dtype), values[i, :n].to(q.dtype), scale, window)
        return out


register(EagerAttention())
