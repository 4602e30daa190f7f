"""LLM: offline batched generation, vLLM-style.

    llm = LLM("Qwen/Qwen3-0.6B", dtype="bfloat16")
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

All prompts go to the engine at once; it keeps the device busy with as many as fit and returns
the outputs in prompt order.
"""

from __future__ import annotations

import logging
import os

import torch

from ..errors import CudaformersError
from .llm_engine import OFFLINE_MAX_BATCH_TOKENS, LLMEngine
from .sampling_params import SamplingParams
from .sequence import RequestOutput

logger = logging.getLogger("cudaformers")

PROGRESS_BAR_MIN_REQUESTS = 16  # below this a run is short: no bar unless asked for


def engine_attention(device: torch.device) -> str:
    """The attention backend the engine loads models with when none is named: on CUDA our Triton
    kernels (paged decode reads only each sequence's own keys; sdpa would gather the whole padded
    context of every row at every step), elsewhere sdpa. Logged, and any explicit choice wins."""
    choice = "sdpa"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
            choice = "triton"
        except ImportError:
            pass
    logger.info("engine: attn_implementation=%r (automatic; pass attn_implementation= to choose)", choice)
    return choice


class LLM:
    """Args: ``model`` is a loaded cudaformers model or a path / Hub id (loaded with ``dtype``,
    ``device`` and ``attn_implementation``, plus ``load_kwargs``). Engine knobs: ``max_batch_tokens``
    (tokens per step; 16384 by default, see ``llm_engine.OFFLINE_MAX_BATCH_TOKENS``), ``max_num_seqs``
    (running requests), ``num_blocks`` / ``block_size`` / ``max_memory_percent`` (KV cache),
    ``max_model_len``, ``enable_prefix_caching``, ``use_cuda_graph`` and ``use_async_batching`` (None:
    on for CUDA)."""

    def __init__(self, model, tokenizer=None, *, dtype="auto", device: str | None = None,
                 attn_implementation: str | None = None, max_batch_tokens: int = OFFLINE_MAX_BATCH_TOKENS,
                 max_num_seqs: int = 256, num_blocks: int | None = None, block_size: int = 16,
                 max_model_len: int | None = None, max_memory_percent: float = 0.9, enable_prefix_caching: bool = True,
                 use_cuda_graph: bool | None = None, use_async_batching: bool | None = None, **load_kwargs):
        if isinstance(model, (str, os.PathLike)):
            from ..models.auto import AutoModelForCausalLM
            from ..tokenizer import AutoTokenizer

            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
                logger.info("LLM: loading %s on %s (automatic; pass device= to choose)", model, device)
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(model)
            attn_implementation = attn_implementation or engine_attention(torch.device(device))
            if "use_kernels" not in load_kwargs and "kernel_config" not in load_kwargs:
                load_kwargs["use_kernels"] = torch.device(device).type == "cuda"
                logger.info("LLM: use_kernels=%s (automatic on %s; pass use_kernels= to choose)",
                            load_kwargs["use_kernels"], device)
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, device_map=device,
                                                         attn_implementation=attn_implementation, **load_kwargs)
        elif load_kwargs or device is not None or attn_implementation is not None or dtype != "auto":
            raise CudaformersError("dtype=, device=, attn_implementation= and loading options apply when LLM loads "
                                   "the model from a path; this model is already loaded")
        self.model, self.tokenizer = model, tokenizer
        self.engine = LLMEngine(model, tokenizer, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                                num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                                max_memory_percent=max_memory_percent, enable_prefix_caching=enable_prefix_caching,
                                use_cuda_graph=use_cuda_graph, use_async_batching=use_async_batching)

    def get_tokenizer(self):
        return self.tokenizer

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise CudaformersError("a text prompt needs a tokenizer: pass tokenizer= to LLM, or give token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise CudaformersError(f"a prompt must be a string, a list of token ids or {{'prompt_token_ids': [...]}}; "
                               f"got {type(prompt).__name__}")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. ``prompts``: a string, a list of strings, a list of token
        ids, or a list of those. ``use_tqdm``: None shows a progress bar from 16 prompts up."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise CudaformersError(f"got {len(prompts)} prompts and {len(sampling_params)} SamplingParams; "
                                   "pass one SamplingParams, or one per prompt")
        engine = self.engine
        # Check every request before queueing any, so a bad one leaves the engine untouched.
        seqs = [engine.make_sequence(self._encode(p), sp) for p, sp in zip(prompts, sampling_params)]
        for seq in seqs:
            engine.add_sequence(seq)
        show = use_tqdm if use_tqdm is not None else len(seqs) >= PROGRESS_BAR_MIN_REQUESTS
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                finished = sum(1 for s in engine.step() if s.is_finished)
                if bar is not None and finished:
                    bar.update(finished)
        except BaseException:
            for seq in seqs:  # leave the engine clean for the next call
                engine.abort_request(seq.request_id)
                engine.release(seq.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = [engine.output(seq) for seq in seqs]
        for seq in seqs:
            engine.release(seq.request_id)
        return outputs
