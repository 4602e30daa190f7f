"""Rotary position embeddings with the rope scaling types transformers knows.

cos/sin are computed once per forward from the token positions (``[T]``), in fp32, and shared by
every layer: no position table to outgrow, and the same code serves prefill, decode and packing.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import UnsupportedError


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq, p):
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(base, dim, p, max_pos):
    factor = p.get("factor") or max_pos / p["original_max_position_embeddings"]
    original = p.get("original_max_position_embeddings", max_pos)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Produces ``(cos, sin)`` of shape ``[T, head_dim]`` for positions ``[T]``."""

    def __init__(self, config):
        super().__init__()
        p = config.rope
        self.rope_type = p["rope_type"]
        self.base = float(p["rope_theta"])
        self.dim = int(config.head_dim * p.get("partial_rotary_factor", 1.0))
        self.max_position = config.max_position_embeddings
        self.params = p
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        t, p, base, dim = self.rope_type, self.params, self.base, self.dim
        if t in ("default", "dynamic"):
            return _default_inv_freq(base, dim)
        if t == "linear":
            return _default_inv_freq(base, dim) / p["factor"]
        if t == "llama3":
            return _llama3(_default_inv_freq(base, dim), p)
        if t == "yarn":
            inv_freq, self.attention_scaling = _yarn(base, dim, p, self.max_position)
            return inv_freq
        raise UnsupportedError(f"rope_type={t!r} is not supported; supported: default, linear, dynamic, llama3, yarn")

    def reset_parameters(self) -> None:
        """Recompute the buffer after the model was materialised from the meta device."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        # NTK-aware base that grows once the batch runs past the trained context; computed on the
        # device from the largest position so decode steps need no host read.
        seq_len = (positions.max() + 1).clamp(min=self.max_position).float()
        factor, dim = self.params["factor"], self.dim
        base = self.base * ((factor * seq_len / self.max_position) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, device=positions.device, dtype=torch.int64).float() / dim
        return 1.0 / (base ** exponents)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        inv_freq = self._dynamic_inv_freq(positions) if self.rope_type == "dynamic" else self.inv_freq
        freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # a decode step runs this once: two launches fewer when unscaled
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q ``[T, Hq, D]``, k ``[T, Hkv, D]``, cos/sin ``[T, D_rot]`` -> rotated (q, k)."""
    cos, sin = cos[:, None], sin[:, None]
    rot = cos.shape[-1]
    if rot == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q_rot, q_pass = q[..., :rot], q[..., rot:]
    k_rot, k_pass = k[..., :rot], k[..., rot:]
    q = torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), -1)
    k = torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), -1)
    return q, k
