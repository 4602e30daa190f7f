"""Sampling for an engine step, where every row is a request with its own SamplingParams.

The logits processing itself (repetition penalty, temperature, top-k, top-p, min-p, per row) is
generation/logits.py's, shared with generate(). What the engine adds: a min-tokens mask per row,
a random generator per seeded request (so a seed gives the same tokens whatever the request is
batched with) and logprobs. Draws are ``argmax(p / q)`` with ``q ~ Exp(1)``: exact, no host sync.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..generation.logits import SamplingTensors, apply_repetition_penalty, warp
from .sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """One step's per-row sampling state, on the logits' device."""

    tensors: SamplingTensors | None  # None: every row is greedy (argmax only, nothing to send)
    history: torch.Tensor | None  # [N, L] int64 prompt + output ids, padded by repetition (penalty rows)
    ban_rows: torch.Tensor | None  # [M] rows still under min_tokens ...
    ban_tokens: torch.Tensor | None  # [M] ... and a finish token each must not produce yet
    generators: list[torch.Generator | None]  # per row; None draws from the default generator
    num_logprobs: int  # most top logprobs a row asked for; -1: no row wants logprobs

    @staticmethod
    def build(params: list[SamplingParams], histories: list[list[int]] | None, num_outputs: list[int],
              generators: list[torch.Generator | None], to_device) -> "SamplingBatch":
        """``histories`` (token ids per row) is read only when some row has a repetition penalty.
        ``to_device`` moves a CPU tensor without blocking the host (pinned, non-blocking copy): a
        blocking copy here would wait for the step in flight and undo async batching."""
        if all(p.temperature == 0 and p.repetition_penalty == 1.0 and p.logprobs is None and n >= p.min_tokens
               for p, n in zip(params, num_outputs)):
            return SamplingBatch(None, None, None, None, [], -1)  # the common offline case
        rows = [dict(temperature=p.temperature, top_k=max(p.top_k, 0), top_p=p.top_p, min_p=p.min_p,
                     repetition_penalty=p.repetition_penalty) for p in params]
        cpu = SamplingTensors.build(rows, "cpu")
        tensors = dataclasses.replace(cpu, **{f: to_device(getattr(cpu, f)) for f in _TENSOR_FIELDS})
        history = None
        if tensors.use_penalty:
            width = max(len(h) for h in histories)
            history = to_device(torch.tensor([h + h[:1] * (width - len(h)) for h in histories], dtype=torch.int64))
        ban_rows, ban_tokens = [], []
        for r, (p, n) in enumerate(zip(params, num_outputs)):
            if n < p.min_tokens:
                for t in sorted(p.finish_token_ids()):
                    ban_rows.append(r)
                    ban_tokens.append(t)
        lp = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingBatch(
            tensors, history,
            to_device(torch.tensor(ban_rows, dtype=torch.int64)) if ban_rows else None,
            to_device(torch.tensor(ban_tokens, dtype=torch.int64)) if ban_rows else None,
            generators if any(g is not None for g in generators) else [],
            max(lp) if lp else -1)


_TENSOR_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One categorical draw per row of ``probs`` ``[N, V]``: argmax(p / q), q ~ Exp(1)."""
    q = torch.empty_like(probs).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return (probs / q).argmax(-1)


class Sampler:
    def __call__(self, logits: torch.Tensor, sb: SamplingBatch):
        """logits ``[N, V]`` -> (tokens ``[N]`` int64, logprobs or None).

        logprobs, when a row asked: (the sampled token's ``[N]``, top ids ``[N, k]``, top logprobs
        ``[N, k]``), from the model's distribution before any processing (as vLLM reports them).
        """
        st = sb.tensors
        if st is None:  # argmax of the model's own dtype: exact, and no fp32 copy of [N, V]
            return logits.argmax(-1), None
        logits = logits.float()
        raw = logits.log_softmax(-1) if sb.num_logprobs >= 0 else None
        if sb.history is not None:
            seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, sb.history, True)
            logits = apply_repetition_penalty(logits, seen, st.repetition_penalty)
        if sb.ban_rows is not None:
            logits = logits.clone()  # may be a CUDA graph's output buffer
            logits[sb.ban_rows, sb.ban_tokens] = float("-inf")
        tokens = logits.argmax(-1)
        if st.use_sampling:
            sampled = draw(warp(logits, st).softmax(-1), sb.generators)
            tokens = torch.where(st.temperature > 0, sampled, tokens)
        logprobs = None
        if raw is not None:
            k = sb.num_logprobs
            top_lp, top_ids = raw.topk(k, dim=-1) if k > 0 else (raw[:, :0], tokens[:, None][:, :0])
            logprobs = (raw.gather(1, tokens[:, None])[:, 0], top_ids, top_lp)
        return tokens, logprobs
