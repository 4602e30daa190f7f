"""Logits processing and sampling on the device, with per-row parameters.

transformers' order: repetition penalty and min-new-tokens first, then (when sampling) temperature,
top-k, top-p, min-p. Every operation has fixed shapes and no host reads, so a decode step that
includes it can be captured in a CUDA graph. Rows with temperature 0 are greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    repetition_penalty: torch.Tensor  # [B] float32, 1 = off
    # Which stages any row uses: skipped entirely when no row does (decided on the host, once).
    use_penalty: bool = False
    use_sampling: bool = False
    use_top_k: bool = False
    use_top_p: bool = False
    use_min_p: bool = False

    @staticmethod
    def build(rows: list[dict], device) -> "SamplingTensors":
        """rows: dicts with temperature, top_k, top_p, min_p, repetition_penalty (None = off)."""
        def col(key, off, dtype):
            return torch.tensor([off if r.get(key) is None else r[key] for r in rows], dtype=dtype, device=device)

        t = col("temperature", 0.0, torch.float32)
        k = col("top_k", 0, torch.int64)
        p = col("top_p", 1.0, torch.float32)
        m = col("min_p", 0.0, torch.float32)
        r = col("repetition_penalty", 1.0, torch.float32)
        vals = rows
        return SamplingTensors(
            t, k, p, m, r,
            use_penalty=any((x.get("repetition_penalty") or 1.0) != 1.0 for x in vals),
            use_sampling=any((x.get("temperature") or 0.0) > 0 for x in vals),
            use_top_k=any((x.get("top_k") or 0) > 0 for x in vals),
            use_top_p=any((x.get("top_p") or 1.0) < 1.0 for x in vals),
            use_min_p=any((x.get("min_p") or 0.0) > 0 for x in vals),
        )


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' rule: seen tokens' logits divided by the penalty when positive, multiplied when
    negative. ``seen`` is a ``[B, V]`` bool mask of tokens in the prompt or output so far."""
    pen = penalty[:, None]
    scaled = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(seen, scaled, logits)


def warp(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on fp32 logits ``[B, V]``; masked entries become -inf."""
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    logits = logits / temp[:, None]
    if st.use_top_k or st.use_top_p:
        sorted_logits, _ = torch.sort(logits, dim=-1, descending=True)
        if st.use_top_k:
            k = st.top_k.clamp(min=1, max=logits.shape[-1])
            kth = sorted_logits.gather(1, (k - 1)[:, None])
            kth = torch.where(st.top_k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
            logits = logits.masked_fill(logits < kth, float("-inf"))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if st.use_top_p:
            probs = sorted_logits.softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            mass_before = probs.cumsum(-1) - probs
            keep = mass_before < st.top_p[:, None]
            cutoff = sorted_logits.masked_fill(~keep, float("inf")).min(-1, keepdim=True).values
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
    if st.use_min_p:
        probs = logits.softmax(-1)
        threshold = st.min_p[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(logits: torch.Tensor, st: SamplingTensors, seen: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row ``[B]`` from logits ``[B, V]``."""
    logits = logits.float()
    if st.use_penalty and seen is not None:
        logits = apply_repetition_penalty(logits, seen, st.repetition_penalty)
    greedy = logits.argmax(-1)
    if not st.use_sampling:
        return greedy
    probs = warp(logits, st).softmax(-1)
    # probs / Exp(1) noise, argmax: an exact categorical draw with no host sync (unlike multinomial).
    noise = torch.empty_like(probs).exponential_(generator=generator)
    sampled = (probs / noise).argmax(-1)
    return torch.where(st.temperature > 0, sampled, greedy)
