"""Scheduler: which sequences run in the next step, and how many of their tokens.

One step carries at most ``max_batch_tokens`` new tokens and ``max_num_seqs`` sequences. Running
sequences go first, oldest first: a decoding one needs one token, one still in its prompt takes
as much of it as the budget allows (chunked prefill), so decodes and prefill chunks share a step.
Waiting requests are then admitted first-come-first-served while budget and blocks last; the queue
is never reordered, so a large prompt cannot be starved by small ones behind it. When a running
sequence needs a block and none is free, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed (its full blocks usually
come back as prefix-cache hits). Pure Python: no tensors, no model.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from ..errors import CudaformersError
from .block_manager import BlockManager
from .sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus

logger = logging.getLogger("cudaformers")


class InvalidRequestError(CudaformersError, ValueError):
    """A request the engine can never run."""


class RequestTooLongError(InvalidRequestError):
    """A request can never fit in the context or the KV cache."""


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence, this step
    # Indices into ``seqs`` of the sequences whose last token goes through the model this step:
    # they sample one token each.
    sample_indices: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Counted as sequences are added, so the runner never walks the batch to classify it.
    num_tokens: int = 0
    num_decodes: int = 0  # sequences feeding one token with their context already in the cache

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds exactly one token and reads its context from the cache."""
        return self.num_decodes == len(self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_tokens: int, max_num_seqs: int, max_model_len: int):
        if max_batch_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"need max_batch_tokens >= 1 and max_num_seqs >= 1, got {max_batch_tokens}, {max_num_seqs}")
        self.bm = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.num_preemptions = 0

    # -- requests ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.bm.update_hashes(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """Raise RequestTooLongError for a request that could never run to its end."""
        n = seq.num_prompt_tokens
        if n == 0:
            raise InvalidRequestError(f"request {seq.request_id!r} has an empty prompt; give it at least one token")
        if n >= self.max_model_len:
            raise RequestTooLongError(
                f"request {seq.request_id!r}: its prompt has {n} tokens, the context holds {self.max_model_len} "
                f"(and at least one must be left to generate); shorten the prompt or raise max_model_len")
        total = seq.max_total_tokens(self.max_model_len)
        need = self.bm.blocks_for(total)
        if need > self.bm.num_blocks:
            raise RequestTooLongError(
                f"request {seq.request_id!r} can grow to {total} tokens ({need} blocks of {self.bm.block_size}) but the "
                f"KV cache has {self.bm.num_blocks} blocks in all; lower max_tokens or the prompt, or give the cache "
                f"more memory (num_blocks=, max_memory_percent=)")

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence wherever it is (running, or waiting after a preemption) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.bm.free(seq)

    def _done_by_length(self, seq: Sequence) -> bool:
        n, limit = len(seq.token_ids), seq.params.max_tokens
        return n >= self.max_model_len or (limit is not None and n - seq.num_prompt_tokens >= limit)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        budget = self.max_batch_tokens
        bm = self.bm

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._done_by_length(seq):  # its last token is in flight; nothing left to feed
                i += 1
                continue
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while bm.num_new_blocks(seq, n) > bm.num_free_blocks:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            bm.allocate(seq, n)
            self._add(out, seq, n)
            budget -= n
            i += 1

        # Admission stops at the first request that does not fit: strict FCFS. No admission
        # in a step that had to preempt, or the victim would be readmitted ahead of its turn.
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            hits = self.bm.prefix_hits(seq)
            n = min(len(seq) - len(hits) * self.bm.block_size, budget)
            if not self.bm.can_admit(seq, hits, n):
                break
            self.waiting.popleft()
            self.bm.admit(seq, hits)
            self.bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(out, seq, n)
            budget -= n
        return _decodes_first(out)

    def _add(self, out: ScheduledBatch, seq: Sequence, n: int) -> None:
        c = seq.num_computed_tokens
        if c + n == len(seq.token_ids):
            out.sample_indices.append(len(out.seqs))
        if n == 1 and c > 0:
            out.num_decodes += 1
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        out.num_tokens += n

    def _preempt(self, seq: Sequence, out: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        logger.debug("preempted %s (free blocks %d)", seq.request_id, self.bm.num_free_blocks)

    def on_launched(self, batch: ScheduledBatch) -> list[int]:
        """The step's tokens are on their way into the cache: advance, file full blocks, and give
        each sampling sequence a placeholder for its next token. Returns where each placeholder sits
        (index into its sequence's ``token_ids``), in ``sample_indices`` order."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.bm.register(seq)
        slots = []
        for i in batch.sample_indices:
            seq = batch.seqs[i]
            slots.append(len(seq.token_ids))
            seq.token_ids.append(PLACEHOLDER)
        return slots


def _decodes_first(out: ScheduledBatch) -> ScheduledBatch:
    """Puts single-token decodes ahead of prefill chunks (stable), so attention can run the decode
    rows of a mixed step through the decode kernel and only the chunks through the prefill kernel."""
    if out.num_decodes in (0, len(out.seqs)):
        return out
    is_decode = [n == 1 and seq.num_computed_tokens > 0 for seq, n in zip(out.seqs, out.num_new_tokens)]
    order = [i for i, d in enumerate(is_decode) if d] + [i for i, d in enumerate(is_decode) if not d]
    new_index = {old: new for new, old in enumerate(order)}
    out.seqs = [out.seqs[i] for i in order]
    out.num_new_tokens = [out.num_new_tokens[i] for i in order]
    out.sample_indices = sorted(new_index[i] for i in out.sample_indices)
    return out
