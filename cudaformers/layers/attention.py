"""Self-attention with Hugging Face parameter names; the attention math itself is the backend's."""

from __future__ import annotations

import torch
from torch import nn

from ..attention.kv_cache import KVStore
from .norm import RMSNorm
from .rotary import apply_rotary_reference


class ApplyRotary(nn.Module):
    """Per-head RMSNorm of q and k (when the family has it), then rotary embeddings.

    One module for both steps so that a kernel swapped in from outside can fuse them; the norm
    modules stay on the attention layer under their Hugging Face names and are passed in. With a
    ``kv_store`` (a ``KVStore``) the rotated k and the given v are also written to the KV cache
    before returning: the kernel that produces k can store it itself, one launch fewer per layer.
    """

    def forward(self, q, k, cos, sin, q_norm=None, k_norm=None, kv_store: KVStore | None = None):
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = apply_rotary_reference(q, k, cos, sin)
        if kv_store is not None:
            kv_store.store(k)
        return q, k


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.sliding_window = config.sliding_window_for(layer_idx)
        h, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(d, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(d, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = ApplyRotary()
        self.backend = None  # set by PreTrainedModel.set_attn_implementation

    def project_qkv(self, hidden: torch.Tensor):
        """q, k, v projections ``[T, N*D]``; one fused matmul when a transform packed the weights."""
        return self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch) -> torch.Tensor:
        return self.attend(*self.project_qkv(hidden), cos, sin, batch)

    def attend(self, q, k, v, cos: torch.Tensor, sin: torch.Tensor, batch) -> torch.Tensor:
        """Everything after the projections: q, k, v ``[T, N*D]`` (views are fine) -> ``[T, hidden]``."""
        return self.o_proj(self.attend_heads(q, k, v, cos, sin, batch))

    def attend_heads(self, q, k, v, cos: torch.Tensor, sin: torch.Tensor, batch) -> torch.Tensor:
        """``attend`` up to the output projection: the heads' outputs ``[T, N*D]``."""
        t, d = q.shape[0], self.head_dim
        # -1 head counts: under tensor parallelism each rank holds a slice of the heads.
        q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
        cache, i = batch.kv_cache, self.layer_idx
        # The cache write belongs to the rotary module (see ApplyRotary), so the backend skips its own.
        store = None if cache is None else KVStore(v, cache.k[i], cache.v[i], batch.slot_mapping)
        q, k = self.rotary(q, k, cos, sin, self.q_norm, self.k_norm, kv_store=store)
        out = self.backend(q, k, v, batch, i, self.scaling, self.sliding_window, kv_stored=store is not None)
        return out.reshape(t, -1)
