"""LLMEngine: the continuous-batching loop that LLM, generate_batch and the server share.

Each ``step()`` schedules a batch, launches it on the device and reads back sampled tokens. With
async batching the read-back of step N happens after step N+1 is launched: the host schedules and
prepares N+1 while the device still runs N, and N+1's decode inputs (N's samples) are fed on the
device. A request that finished at step N (EOS, stop) was then also part of N+1; that extra token
is dropped. Requests whose sampling reads their history (repetition penalty) make the loop wait
for the read-back first, since their inputs must be on the host.

``step_observer`` (None by default, then nothing is timed) sees each step's phases, for profiling
(bench/profile_engine.py): ``begin()``, ``scheduled(batch)`` before launch, ``launched(batch,
graph_size)`` once the step is queued on the device (``graph_size`` None: it ran eagerly),
``waited(seconds)`` for each blocking read-back, ``end(num_outputs)``.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from ..errors import CudaformersError
from .block_manager import BlockManager
from .model_runner import ModelRunner, StepHandle
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import PLACEHOLDER, FinishReason, RequestOutput, Sequence

logger = logging.getLogger("cudaformers")


def _eos_ids(model) -> frozenset:
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            ids |= set(eos if isinstance(eos, (list, tuple)) else [eos])
            break
    return frozenset(int(i) for i in ids if i is not None and i >= 0)


# Tokens per step for the offline APIs (LLM, generate_batch, the continuous-batching manager); the
# OpenAI server keeps 8192, where a longer step would stall every running request's next token. A
# step that carries prompt chunks runs eagerly and is bound by the host (~60 ms for a qwen3-0.6b step
# whatever its size, against ~18 ms of GPU work at 8192 tokens, bench/profile_engine.py), so fewer,
# larger steps finish a batch sooner: W4 on an H200 23,651 / 24,654 tok/s at 8192, 28,482 / 28,183 at
# 16384, 31,501 / 31,725 at 32768 (bench/serve_offline.py --max-batch-tokens). 16384 as vLLM's
# offline default; the activation peak it adds is taken from the KV cache (cache_sizing.py).
OFFLINE_MAX_BATCH_TOKENS = 16384


class LLMEngine:
    def __init__(self, model, tokenizer=None, *, max_batch_tokens: int = 8192, max_num_seqs: int = 256,
                 num_blocks: int | None = None, block_size: int = 16, max_model_len: int | None = None,
                 max_memory_percent: float = 0.9, enable_prefix_caching: bool = True,
                 use_cuda_graph: bool | None = None, use_async_batching: bool | None = None,
                 eos_token_id: int | list[int] | None = None):
        model.eval()
        self.model, self.tokenizer = model, tokenizer
        self.runner = ModelRunner(model, block_size=block_size, num_blocks=num_blocks,
                                  max_memory_percent=max_memory_percent, max_num_seqs=max_num_seqs,
                                  max_batch_tokens=max_batch_tokens, max_model_len=max_model_len,
                                  use_cuda_graph=use_cuda_graph)
        self.block_manager = BlockManager(self.runner.num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_batch_tokens, max_num_seqs, self.runner.max_model_len)
        if eos_token_id is None:
            self.eos_token_ids = _eos_ids(model)
        else:
            self.eos_token_ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        if use_async_batching is None:
            use_async_batching = self.runner.is_cuda
            logger.info("async batching (host schedules step N+1 while the device runs step N): %s "
                        "(automatic; pass use_async_batching= to choose)", "on" if use_async_batching else "off")
        self.use_async_batching = use_async_batching
        self.requests: dict[str, Sequence] = {}
        self._inflight: tuple[ScheduledBatch, list[int], StepHandle] | None = None
        self._num_needs_history = 0
        self._next_id = 0
        self.step_observer = None

    # -- requests ---------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        rid = str(self._next_id)
        self._next_id += 1
        return rid

    def make_sequence(self, prompt_token_ids: list[int], params: SamplingParams | None,
                      request_id: str | None = None, eos_token_ids=None) -> Sequence:
        """A checked, not yet queued, sequence (raises for a request that can never run).
        ``eos_token_ids`` replaces the model's EOS ids for this request."""
        eos = self.eos_token_ids if eos_token_ids is None else frozenset(eos_token_ids)
        params = dataclasses.replace(params or SamplingParams(), _eos_token_ids=eos)
        if request_id is None:
            request_id = self.new_request_id()
        if request_id in self.requests:
            raise CudaformersError(f"request id {request_id!r} is already in use; give each request its own id")
        ids = [int(t) for t in prompt_token_ids]
        bad = [t for t in ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise CudaformersError(f"request {request_id!r} has token ids outside the vocabulary "
                                   f"[0, {self.runner.vocab_size}): {bad[:5]}")
        seq = Sequence(request_id, ids, params)
        self.scheduler.check(seq)
        return seq

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        seq = self.make_sequence(prompt_token_ids, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence from ``make_sequence`` (raises if it can never fit)."""
        self.scheduler.add(seq)
        self.requests[seq.request_id] = seq
        self._num_needs_history += seq.params.needs_history

    def abort_request(self, request_id: str) -> Sequence | None:
        """Cancel a request; returns its sequence (finished, reason "abort") or None if unknown."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return seq
        self.scheduler.finish(seq, FinishReason.ABORT)
        while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
            seq.token_ids.pop()
        self._retire(seq)
        return seq

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    # -- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got a token (finished ones are marked so)."""
        obs = self.step_observer
        if obs is not None:
            obs.begin()
        out: list[Sequence] = []
        if self._inflight is not None and (not self.use_async_batching or self._num_needs_history):
            out += self._read_back(*self._inflight)
            self._inflight = None
        batch = self.scheduler.schedule()
        launched = None
        if batch:
            if obs is not None:
                obs.scheduled(batch)
            handle = self.runner.execute(batch)
            launched = (batch, self.scheduler.on_launched(batch), handle)
            if obs is not None:
                obs.launched(batch, self.runner.last_graph_size)
        if self._inflight is not None:
            out += self._read_back(*self._inflight)
        self._inflight = launched
        if self._inflight is not None and not self.use_async_batching:
            out += self._read_back(*self._inflight)
            self._inflight = None
        if obs is not None:
            obs.end(len(out))
        return out

    def _read_back(self, batch: ScheduledBatch, slots: list[int], handle: StepHandle) -> list[Sequence]:
        if self.step_observer is None:
            tokens, logprobs = handle.result()
        else:
            start = time.perf_counter()
            tokens, logprobs = handle.result()
            self.step_observer.waited(time.perf_counter() - start)
        out = []
        for row, (i, slot) in enumerate(zip(batch.sample_indices, slots)):
            seq = batch.seqs[i]
            if seq.is_finished:  # finished or cancelled while this step was in flight
                continue
            tok = tokens[row]
            seq.token_ids[slot] = tok
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            if logprobs is not None and seq.params.logprobs is not None:
                chosen, top_ids, top_lp = logprobs
                k = seq.params.logprobs
                entry = dict(zip(top_ids[row][:k], top_lp[row][:k]))
                entry[tok] = chosen[row]
                seq.logprobs.append(entry)
            reason = self._finish_reason(seq, slot)
            if reason is not None:
                del seq.token_ids[slot + 1:]  # a token sampled after the end, if any
                self.scheduler.finish(seq, reason)
                self._retire(seq)
            out.append(seq)
        return out

    def _finish_reason(self, seq: Sequence, slot: int) -> FinishReason | None:
        p = seq.params
        tok, n_out = seq.token_ids[slot], slot + 1 - seq.num_prompt_tokens
        if n_out >= p.min_tokens and tok in seq.finish_token_ids:
            return FinishReason.STOP
        if p.stop and self._hit_stop_string(seq, slot):
            return FinishReason.STOP
        if (p.max_tokens is not None and n_out >= p.max_tokens) or slot + 1 >= self.scheduler.max_model_len:
            return FinishReason.LENGTH
        return None

    def _hit_stop_string(self, seq: Sequence, slot: int) -> bool:
        if self.tokenizer is None:
            raise CudaformersError("SamplingParams.stop (stop strings) needs a tokenizer; pass one to the engine/LLM")
        text = self.tokenizer.decode(seq.token_ids[seq.num_prompt_tokens:slot + 1], skip_special_tokens=True)
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, len(seq.text) - longest)  # a stop string may straddle the previous tail
        seq.text = text
        hits = [i for i in (text.find(s, start) for s in seq.params.stop) if i >= 0]
        if hits:
            seq.text = text[:min(hits)]
            return True
        return False

    def _retire(self, seq: Sequence) -> None:
        self._num_needs_history -= seq.params.needs_history

    # -- conveniences -----------------------------------------------------------------------------
    def output(self, seq: Sequence) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = seq.text if seq.params.stop and seq.is_finished else self.tokenizer.decode(
                seq.output_token_ids, skip_special_tokens=True)
        return RequestOutput.from_sequence(seq, text)

    def release(self, request_id: str) -> None:
        """Forget a finished request (its output has been handed over)."""
        seq = self.requests.get(request_id)
        if seq is not None and seq.is_finished:
            del self.requests[request_id]

    def stats(self) -> dict:
        bm = self.block_manager
        return {"num_blocks": bm.num_blocks, "free_blocks": bm.num_free_blocks,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "preemptions": self.scheduler.num_preemptions,
                "prefix_hit_rate": bm.num_hit_tokens / max(1, bm.num_queried_tokens)}
