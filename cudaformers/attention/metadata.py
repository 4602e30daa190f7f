"""AttentionBatch: how the tokens of one forward step group into sequences and where their K/V live.

Every model forward works on a flat batch of T tokens (no padding). Sequence i owns the query tokens
``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and has ``seqlens_k[i]`` keys in all: keys already in the cache
(its context) followed by its new tokens. Queries are therefore the *last* q_len positions of their
sequence, and the causal mask is aligned bottom-right. Built on the host once per step, read by every
layer; for CUDA-graph capture the tensors live in fixed buffers and only their contents change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCache


@dataclass
class AttentionBatch:
    cu_seqlens_q: torch.Tensor  # [B+1] int32, query offsets into the flat token axis
    cu_seqlens_k: torch.Tensor  # [B+1] int32, prefix sums of seqlens_k
    seqlens_k: torch.Tensor  # [B] int32, total keys per sequence (context + new tokens)
    max_seqlen_q: int
    max_seqlen_k: int
    # Where the new tokens' keys/values go and where each sequence's keys live (None: no cache).
    kv_cache: KVCache | None = None
    slot_mapping: torch.Tensor | None = None  # [T] int64 flat slot = block * block_size + offset
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32
    # True when some sequence has keys in the cache beyond its new tokens (decode, chunked prefill,
    # prefix-cache hits): attention must read the cache instead of the step's own k/v.
    has_context: bool = False
    # The first ``num_decode_seqs`` sequences have one query each with their context in the cache
    # (the engine orders decodes first), so a backend can run them through its decode kernel.
    num_decode_seqs: int = 0
    # The rotary (cos, sin) ``[T, rotary dim]`` of the step's positions where the caller has them
    # already (generate()'s decode step gathers them from a table in its metadata launch); None: the
    # model computes them from the positions.
    rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    @property
    def is_decode(self) -> bool:
        return self.has_context and self.max_seqlen_q == 1

    @staticmethod
    def from_seqlens(seqlens: list[int], device) -> "AttentionBatch":
        """A cache-free batch of independent causal sequences (plain forward, training, packing)."""
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int32), 0)
        cu = cu.to(device)
        lens = torch.tensor(seqlens, dtype=torch.int32).to(device)
        m = max(seqlens) if seqlens else 0
        return AttentionBatch(cu, cu, lens, m, m)

    @staticmethod
    def with_cache(
        q_lens: list[int],
        k_lens: list[int],
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        device,
        max_seqlen_k: int | None = None,
    ) -> "AttentionBatch":
        """A step whose new tokens are written to ``kv_cache`` and attend to everything cached."""
        cu_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu_q[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
        cu_k = torch.zeros(len(k_lens) + 1, dtype=torch.int32)
        cu_k[1:] = torch.cumsum(torch.tensor(k_lens, dtype=torch.int32), 0)
        return AttentionBatch(
            cu_seqlens_q=cu_q.to(device, non_blocking=True),
            cu_seqlens_k=cu_k.to(device, non_blocking=True),
            seqlens_k=torch.tensor(k_lens, dtype=torch.int32).to(device, non_blocking=True),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max_seqlen_k if max_seqlen_k is not None else max(k_lens),
            kv_cache=kv_cache,
            slot_mapping=slot_mapping,
            block_table=block_table,
            has_context=any(k != q for q, k in zip(q_lens, k_lens)),
        )

    def memo(self, key, build):
        """A value derived from this batch (slots, masks), built once per forward and shared by every
        layer. The model clears it at the start of each forward, so a batch whose buffers are
        refilled in place (warm-up, then CUDA-graph capture) never sees a stale value."""
        store = self.__dict__.setdefault("_memo", {})
        if key not in store:
            store[key] = build()
        return store[key]

    def clear_memo(self) -> None:
        self.__dict__.pop("_memo", None)

    def to(self, device) -> "AttentionBatch":
        """This batch with its tensors on ``device`` (layers spread over several devices)."""
        device = torch.device(device)
        if self.cu_seqlens_q.device == device:
            return self
        cache = self.__dict__.setdefault("_copies", {})
        if device not in cache:
            move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
            cache[device] = AttentionBatch(
                move(self.cu_seqlens_q), move(self.cu_seqlens_k), move(self.seqlens_k), self.max_seqlen_q,
                self.max_seqlen_k, self.kv_cache, move(self.slot_mapping), move(self.block_table), self.has_context,
                self.num_decode_seqs, None if self.rope is None else (move(self.rope[0]), move(self.rope[1])))
        return cache[device]
