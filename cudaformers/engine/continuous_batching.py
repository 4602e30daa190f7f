"""transformers' continuous-batching API on our engine: ``model.generate_batch(...)`` and
``model.init_continuous_batching(...)`` return what transformers' do (names, ids "req_0"...,
``GenerationOutput`` fields), so code written against transformers keeps working.

``generate_batch`` runs the engine in the calling thread. The manager runs it in a background
thread: ``add_request`` queues a request (checked at once, in the caller's thread),
``get_result`` / ``request_id_iter`` hand back outputs (every new token when ``streaming``),
``cancel_request`` frees a request's blocks, ``stop`` finishes what is queued and joins.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..errors import CudaformersError
from .llm_engine import OFFLINE_MAX_BATCH_TOKENS, LLMEngine
from .sampling_params import SamplingParams
from .sequence import PLACEHOLDER, Sequence

logger = logging.getLogger("cudaformers")


class RequestStatus(enum.IntEnum):
    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4


@dataclass
class GenerationOutput:
    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: str | None = None
    created_time: float = field(default_factory=time.perf_counter)

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    @staticmethod
    def from_sequence(seq: Sequence) -> "GenerationOutput":
        out = [t for t in seq.output_token_ids if t != PLACEHOLDER]
        if seq.is_finished:
            status = RequestStatus.FINISHED
        else:
            status = RequestStatus.DECODING if out else RequestStatus.PREFILLING
        lps = [lp.get(t, float("nan")) for lp, t in zip(seq.logprobs, out)]
        return GenerationOutput(seq.request_id, seq.prompt_token_ids, out, lps, None, status,
                                seq.finish_reason.value if seq.finish_reason else None)


ENGINE_DEFAULTS = dict(max_batch_tokens=OFFLINE_MAX_BATCH_TOKENS, max_num_seqs=256, num_blocks=None,
                       block_size=16, max_model_len=None, max_memory_percent=0.9, enable_prefix_caching=True,
                       use_cuda_graph=None, use_async_batching=None)


def _engine(model, engine_kwargs: dict, keep: bool) -> LLMEngine:
    """The engine cached on the model when its settings match, else a new one (kept if ``keep``)."""
    unknown = set(engine_kwargs) - set(ENGINE_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown continuous-batching arguments {sorted(unknown)}; known: {sorted(ENGINE_DEFAULTS)}")
    settings = {**ENGINE_DEFAULTS, **engine_kwargs}
    key = tuple(sorted(settings.items()))
    cached = getattr(model, "_cudaformers_engine", None)
    if cached is not None and cached[0] == key and not cached[1].has_unfinished_requests():
        return cached[1]
    if cached is not None:
        destroy_cached_engine(model)
    engine = LLMEngine(model, **settings)
    if keep:
        model._cudaformers_engine = (key, engine)
        logger.info("keeping the continuous-batching engine and its KV cache on the model for later calls; "
                    "cudaformers.engine.continuous_batching.destroy_cached_engine(model) frees them")
    return engine


def destroy_cached_engine(model) -> None:
    """Free the KV cache and CUDA graphs of the engine kept by ``persistent_manager=True``."""
    if getattr(model, "_cudaformers_engine", None) is not None:
        model._cudaformers_engine = None


def _sampling_params(model, generation_config, max_new_tokens) -> tuple[SamplingParams, list[int] | None]:
    gen = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    if gen is None:
        from ..generation.config import GenerationConfig

        gen = GenerationConfig()
    if hasattr(gen, "validate"):
        gen.validate()
    if getattr(gen, "num_return_sequences", 1) not in (None, 1):
        raise CudaformersError("num_return_sequences > 1 is not supported by continuous batching; "
                               "repeat the input instead")
    eos = getattr(gen, "eos_token_id", None)
    eos = None if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return SamplingParams.from_generation_config(gen, max_new_tokens), eos


def generate_batch(model, inputs: list[list[int]], generation_config=None, *, max_new_tokens: int | None = None,
                   progress_bar: bool = False, persistent_manager: bool = False, **engine_kwargs
                   ) -> dict[str, GenerationOutput]:
    """Generate for every input with continuous batching; ``{"req_0": GenerationOutput, ...}``.

    ``persistent_manager=True`` keeps the engine (KV cache, CUDA graphs) on the model so the next
    call with the same settings starts at once. Engine settings: see ``LLM``.
    """
    if not inputs:
        return {}
    params, eos = _sampling_params(model, generation_config, max_new_tokens)
    engine = _engine(model, engine_kwargs, keep=persistent_manager)
    seqs = [engine.make_sequence(ids, params, f"req_{i}", eos) for i, ids in enumerate(inputs)]
    for seq in seqs:
        engine.add_sequence(seq)
    bar = None
    if progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(seqs), desc=f"Solving {len(seqs)} requests", unit="request")
    try:
        while engine.has_unfinished_requests():
            done = sum(1 for s in engine.step() if s.is_finished)
            if bar is not None and done:
                bar.update(done)
    except BaseException:
        for seq in seqs:
            engine.abort_request(seq.request_id)
        raise
    finally:
        if bar is not None:
            bar.close()
        for seq in seqs:
            engine.release(seq.request_id)
    return {seq.request_id: GenerationOutput.from_sequence(seq) for seq in seqs}


def init_continuous_batching(model, generation_config=None, **engine_kwargs) -> "ContinuousBatchingManager":
    return ContinuousBatchingManager(model, generation_config, **engine_kwargs)


class ContinuousBatchingManager:
    def __init__(self, model, generation_config=None, **engine_kwargs):
        self.model = model
        self.generation_config = generation_config
        self.default_params, self.default_eos = _sampling_params(model, generation_config, None)
        self.engine = _engine(model, engine_kwargs, keep=False)
        self._inbox: queue.Queue = queue.Queue()
        self._cancels: queue.Queue = queue.Queue()
        self._results: list[GenerationOutput] = []
        self._cond = threading.Condition()
        self._lock = threading.Lock()  # request ids and sequence creation
        self._counter = 0
        self._streaming: set[str] = set()
        self._pending: set[str] = set()  # queued or running request ids
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._hard_stop = False
        self._thread: threading.Thread | None = None
        self.fatal_error: BaseException | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.is_running():
            logger.warning("the continuous-batching manager is already running")
            return
        self._stop.clear()
        self._hard_stop = False
        self._thread = threading.Thread(target=self._loop, name="cudaformers-engine", daemon=True)
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, hard_stop: bool = False) -> None:
        """Stop the loop once queued requests are done (``hard_stop``: cancel them instead)."""
        if self._thread is None:
            logger.warning("the continuous-batching manager was not started")
            return
        self._hard_stop = hard_stop
        self._stop.set()
        self._wake.set()
        if block:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the generation thread is still running %s s after stop()", timeout)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop(block=True)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, eos_token_id: int | list[int] | None = None,
                    sampling_params: SamplingParams | None = None) -> str:
        """Queue a request; returns its id. A request that can never run raises here."""
        if self.fatal_error is not None:
            raise CudaformersError(f"the generation loop stopped on an error: {self.fatal_error!r}")
        if self._stop.is_set():
            raise CudaformersError("the manager is stopping; start() it again before adding requests")
        params = sampling_params or self.default_params
        if max_new_tokens is not None:
            params = SamplingParams(**{**_fields(params), "max_tokens": max_new_tokens})
        eos = self.default_eos if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) \
            else list(eos_token_id)
        with self._lock:
            if request_id is None:
                request_id = f"req_{self._counter}"
                self._counter += 1
            if request_id in self._pending:
                raise CudaformersError(f"request id {request_id!r} is already in flight; use another id")
            seq = self.engine.make_sequence(input_ids, params, request_id, eos)
            self._pending.add(request_id)
        if streaming:
            self._streaming.add(request_id)
        self._inbox.put(seq)
        self._wake.set()
        return request_id

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None,
                     streaming: bool = False) -> list[str]:
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming) for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request: its blocks are freed and it ends with finish_reason "abort"."""
        self._cancels.put(request_id)
        self._wake.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of ``request_id`` if given); None after ``timeout`` s or once the loop is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                for i, out in enumerate(self._results):
                    if request_id is None or out.request_id == request_id:
                        return self._results.pop(i)
                if not self.is_running():
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(0.1 if left is None else min(left, 0.1))

    def __iter__(self):
        while self.is_running() or self._results:
            out = self.get_result(timeout=0.1)
            if out is not None:
                yield out

    def request_id_iter(self, request_id: str):
        """Outputs of one request until it finishes (every token when it was added with streaming)."""
        while True:
            out = self.get_result(request_id, timeout=0.1)
            if out is not None:
                yield out
                if out.is_finished():
                    return
            elif not self.is_running():
                return

    # -- the background loop ----------------------------------------------------------------------
    def _deliver(self, out: GenerationOutput) -> None:
        with self._cond:
            self._results.append(out)
            self._cond.notify_all()

    def _done(self, seq: Sequence) -> None:
        self._deliver(GenerationOutput.from_sequence(seq))
        self.engine.release(seq.request_id)
        with self._lock:
            self._pending.discard(seq.request_id)
        self._streaming.discard(seq.request_id)

    def _drain(self) -> None:
        while not self._inbox.empty():
            self.engine.add_sequence(self._inbox.get())
        while not self._cancels.empty():
            seq = self.engine.abort_request(self._cancels.get())
            if seq is not None and seq.request_id in self._pending:
                self._done(seq)

    def _loop(self) -> None:
        import torch

        try:
            with torch.inference_mode():
                while True:
                    self._drain()
                    if self._hard_stop:
                        for rid in list(self._pending):
                            self.cancel_request(rid)
                        self._hard_stop = False
                        continue
                    if self.engine.has_unfinished_requests():
                        for seq in self.engine.step():
                            if seq.is_finished:
                                self._done(seq)
                            elif seq.request_id in self._streaming:
                                self._deliver(GenerationOutput.from_sequence(seq))
                    elif self._stop.is_set() and self._inbox.empty():
                        return
                    else:
                        self._wake.wait(0.05)
                        self._wake.clear()
        except BaseException as e:  # fail every request loudly rather than leave callers waiting
            self.fatal_error = e
            logger.exception("the continuous-batching loop failed")
            for rid in list(self._pending):
                seq = self.engine.abort_request(rid)
                out = GenerationOutput.from_sequence(seq) if seq is not None else GenerationOutput(rid)
                out.status, out.error = RequestStatus.FAILED, repr(e)
                self._deliver(out)
            self._pending.clear()


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in params.__dataclass_fields__ if not k.startswith("_")}
