"""AsyncEngine: the engine stepped in a background thread, its tokens handed to an asyncio loop.

HTTP handlers run on the server's event loop and must never wait on the device. They check a
request there (``LLMEngine.make_sequence`` raises for one that can never run), hand the sequences
to the engine thread through a queue, and await a ``RequestStream``. The thread steps the engine
while anything is unfinished (requests arriving at any time join the running batch at the next
step) and, once per step, posts every sequence's new tokens to the loop in one thread-safe call.
A cancelled request (client gone) is aborted at the next step boundary, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from .llm_engine import LLMEngine
from .sampling_params import SamplingParams
from .sequence import PLACEHOLDER, Sequence

logger = logging.getLogger("cudaformers")


@dataclass
class Update:
    """New tokens of one sequence (``index``: which prompt of its HTTP request)."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    error: str | None = None


class RequestStream:
    """The sequences of one HTTP request; ``updates()`` yields what arrived since the last yield."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = seqs
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.num_unfinished = len(seqs)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    async def updates(self):
        """Lists of updates; several per list when the client reads slower than tokens arrive."""
        while not self.finished:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            self.num_unfinished -= sum(u.finish_reason is not None or u.error is not None for u in batch)
            yield batch


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (stream, seqs)
        self._cancels: queue.SimpleQueue = queue.SimpleQueue()  # request ids
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._live: dict[str, list] = {}  # request id -> [stream, index, tokens sent]; engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_in_flight = 0  # sequences submitted and not finished; event-loop thread only
        self.error: BaseException | None = None

    # -- lifecycle (event loop) --------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="cudaformers-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and join the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- requests (event loop) ---------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue one sequence per prompt; raises (and queues nothing) if any can never run."""
        seqs = [self.engine.make_sequence(p, params, f"{request_id}-{i}") for i, p in enumerate(prompts)]
        stream = RequestStream(seqs)
        self.num_in_flight += len(seqs)
        self._inbox.put(stream)
        self._wake.set()
        return stream

    def release(self, stream: RequestStream) -> None:
        """The handler is done with ``stream``: cancel what has not finished (client gone)."""
        self.num_in_flight -= len(stream.seqs)
        if not stream.finished:
            for seq in stream.seqs:
                self._cancels.put(seq.request_id)
            self._wake.set()

    def _dispatch(self, updates: list[tuple[RequestStream, Update]]) -> None:
        for stream, update in updates:
            stream.queue.put_nowait(update)

    # -- the loop (engine thread) ------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    self._admit()
                    if self.engine.has_unfinished_requests():
                        self._publish(self.engine.step())
                    else:
                        self._wake.wait(0.5)
                        self._wake.clear()
                for rid in list(self._live):
                    self.engine.abort_request(rid)
                    self.engine.release(rid)
        except BaseException as e:  # fail every request loudly rather than leave clients waiting
            self.error = e
            logger.exception("the serving engine loop failed; every request in flight gets an error")
            self._post([(s, Update(i, [], None, error=f"the engine failed: {e!r}")) for s, i, _ in self._live.values()])
            self._live.clear()

    def _admit(self) -> None:
        while not self._inbox.empty():
            stream = self._inbox.get()
            for i, seq in enumerate(stream.seqs):
                self.engine.add_sequence(seq)
                self._live[seq.request_id] = [stream, i, 0]
        while not self._cancels.empty():
            rid = self._cancels.get()
            if self._live.pop(rid, None) is not None:
                seq = self.engine.abort_request(rid)
                self.engine.release(rid)
                if self.metrics is not None and seq is not None:
                    self.metrics.on_finished(seq, time.monotonic())

    def _publish(self, seqs: list[Sequence]) -> None:
        out, now, n_new = [], time.monotonic(), 0
        for seq in seqs:
            entry = self._live.get(seq.request_id)
            if entry is None:
                continue
            stream, index, sent = entry
            new = seq.token_ids[seq.num_prompt_tokens + sent:]
            if PLACEHOLDER in new:  # async batching: the next token is still on the device
                new = new[:new.index(PLACEHOLDER)]
            lps = seq.logprobs[sent:sent + len(new)] if seq.params.logprobs is not None else None
            entry[2] += len(new)
            n_new += len(new)
            reason = seq.finish_reason.value if seq.is_finished else None
            if new or reason:
                out.append((stream, Update(index, new, lps, reason)))
            if seq.is_finished:
                del self._live[seq.request_id]
                self.engine.release(seq.request_id)
                if self.metrics is not None:
                    self.metrics.on_finished(seq, now)
        if self.metrics is not None:
            self.metrics.on_step(n_new, now)
        self._post(out)

    def _post(self, updates) -> None:
        if updates:
            try:
                self._loop.call_soon_threadsafe(self._dispatch, updates)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    # -- state for /metrics and /health ------------------------------------------------------------
    def counts(self) -> dict:
        """Approximate, read without stopping the engine thread (good enough for gauges)."""
        s = self.engine.scheduler
        bm = self.engine.block_manager
        return dict(waiting=len(s.waiting) + self._inbox.qsize(), running=len(s.running),
                    blocks_total=bm.num_blocks, blocks_used=bm.num_blocks - bm.num_free_blocks,
                    preemptions=s.num_preemptions)
