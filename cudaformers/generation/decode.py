"""Decode steps over a static (contiguous-blocks) KV cache, eager or replayed from CUDA graphs.

Everything a step needs (slots, key lengths) is derived on the device from the positions buffer,
inside the captured region. generate()'s graphs hold the model step and the sampling that follows
it (``loop``), so a token costs one replay.
"""

from __future__ import annotations

import logging
import weakref

import torch

from ..attention.kv_cache import KVCache
from ..attention.metadata import AttentionBatch
from ..cuda_graphs import capturing, warmup_stream
from ..device import triton_runs_on
from ..layers.rotary import RotaryEmbedding
from ..models import structure
from .loop import LoopKind, LoopState, advance
from .prefill import PromptPass

logger = logging.getLogger("cudaformers")
# The step's inputs in one Triton launch where Triton runs; off, the torch ops and the model's own
# rotary (bench/generate.py's "+torchinputs" variant, for an A/B of the launch it saves).
STEP_INPUTS_KERNEL = True
# One greedy step a graph replay: graphs of 4 and 8 steps back to back were built and measured worth
# nothing on an H200 (W1 +0.1-0.3%, bench/RESULTS.md run 23), so the gaps between replays do not
# explain a replayed step's 0.67 ms against ~0.68 ms a step inside W1; removed.


def step_inputs_torch(positions: torch.Tensor, block_table: torch.Tensor, block_size: int,
                      rope_table: tuple[torch.Tensor, torch.Tensor] | None = None):
    """A decode step's inputs from its positions ``[B]`` (int64): ``(seqlens [B] int32, slots [B] int64,
    cu_seqlens_k [B+1] int32, (cos, sin) [B, rotary dim] or None)``; ``block_table [B, W]`` int32,
    ``rope_table`` ``(cos, sin)`` ``[capacity, rotary dim]`` (``kernels/step_inputs.py``'s reference)."""
    seqlens = (positions + 1).to(torch.int32)
    rows = torch.arange(positions.numel(), device=positions.device)
    slots = block_table[rows, positions // block_size].long() * block_size + positions % block_size
    cu_k = torch.zeros(positions.numel() + 1, dtype=torch.int32, device=positions.device)
    cu_k[1:] = seqlens.cumsum(0)
    rope = None if rope_table is None else (rope_table[0][positions], rope_table[1][positions])
    return seqlens, slots, cu_k, rope


def _rope_table(model, capacity: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(cos, sin)`` ``[capacity, rotary dim]`` for every position a decode step can reach, from the
    model's own rotary module, in the dtype its forward would use; None where the model computes
    its rotary otherwise (no ``RotaryEmbedding``, a dynamic one that depends on the longest position,
    an embedding that is not a plain table)."""
    inner = getattr(model, "model", None)
    rotary, embed = getattr(inner, "rotary_emb", None), getattr(inner, "embed_tokens", None)
    if type(rotary) is not RotaryEmbedding or rotary.rope_type == "dynamic" or type(embed) is not torch.nn.Embedding:
        return None
    positions = torch.arange(capacity, device=rotary.inv_freq.device)
    with torch.no_grad():
        cos, sin = rotary(positions, embed.weight.dtype)
    return cos.contiguous(), sin.contiguous()


class DecodeRunner:
    """Owns the KV cache for ``rows`` sequences of up to ``capacity`` tokens, and the decode graph."""

    def __init__(self, model, rows: int, capacity: int, block_size: int, use_cuda_graph: bool):
        cfg, dev = model.config, model.device
        # The model holds its runners (``get_runner``), so a strong reference back would make a cycle that
        # only the garbage collector frees, at a time of its choosing, with the KV cache and graphs in it:
        # ``runners.clear()`` would not release the old cache, nor ``del model`` the GPU memory.
        self._model = weakref.ref(model)
        self.rows, self.capacity = rows, capacity
        devices = [layer.self_attn.q_proj.weight.device for layer in model.model.layers]
        # The heads this process holds: tensor parallelism divides them (and k_proj's DTensor weight
        # would report the global shape).
        kv_heads = model.model.layers[0].self_attn.num_kv_heads
        blocks_per_row = -(-capacity // block_size)
        self.cache = KVCache(cfg.num_hidden_layers, rows * blocks_per_row, block_size, kv_heads, cfg.head_dim,
                             model.dtype, devices)
        self.block_table = self.cache.contiguous_block_table(rows, capacity, dev)
        self.block_size = block_size
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.cu_q = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self.rope_table = _rope_table(model, capacity)
        self.use_cuda_graph = use_cuda_graph
        self.graph = None  # the model step alone, captured at its first use
        self.logits = None
        self.loops: dict[LoopKind, LoopState] = {}
        self.loop_graphs: dict[LoopKind, torch.cuda.CUDAGraph] = {}
        self.prompt = PromptPass(self, use_cuda_graph)  # runner.prompt(rows) -> first logits

    @property
    def model(self):
        return self._model()

    def _step(self) -> torch.Tensor:
        # One launch where Triton runs (kernels/step_inputs.py): lengths, slots, key offsets, rotary rows.
        # Switched off, the torch ops and the model's own rotary, as before the launch existed.
        inputs, table = step_inputs_torch, self.rope_table if STEP_INPUTS_KERNEL else None
        if STEP_INPUTS_KERNEL and triton_runs_on(self.positions.device):
            from ..kernels.step_inputs import step_inputs as inputs  # Triton is imported only where it runs
        seqlens, slots, cu_k, rope = inputs(self.positions, self.block_table, self.block_size, table)
        batch = AttentionBatch(self.cu_q, cu_k, seqlens, 1, self.capacity, self.cache, slots, self.block_table,
                               has_context=True, rope=rope)
        hidden = self.model.model(self.tokens, self.positions, batch)
        return self.model.compute_logits(hidden).to(self.tokens.device)  # see PromptPass._forward

    def capture(self, body, warmups: int = 2):
        """A CUDA graph of ``body()`` and its output; eager warm-up runs first (autotuning,
        allocator, lazy init stay out of the graph)."""
        stream = warmup_stream(self.tokens.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            out = body()
        return graph, out

    def current_logits(self) -> torch.Tensor:
        """Logits ``[rows, V]`` for ``self.tokens`` at ``self.positions`` (a replay once captured).

        Capturing here is safe mid-generation: the warm-up runs write the same keys and values at
        the same positions as the step itself."""
        if not self.use_cuda_graph:
            return self._step()
        if self.graph is None:
            self.graph, self.logits = self.capture(self._step)
        self.graph.replay()
        return self.logits

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, V]`` for one new token per row at ``positions``."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        return self.current_logits()

    def loop(self, kind: LoopKind, generator: torch.Generator | None):
        """(the loop state for ``kind``, a function running one decode step: model + ``advance``).

        With graphs on and greedy decoding, model and ``advance`` are one captured graph per kind
        (captured at the first call, before the prompt is written to the cache: the warm-up steps
        write position 0). Sampling replays the model step alone and runs ``advance`` eagerly."""
        state = self.loops.get(kind)
        if state is None:
            state = LoopState(kind, self.rows, self.capacity, self.model.config.vocab_size, self.tokens.device,
                              tokens=self.tokens, positions=self.positions)
            self.loops[kind] = state

        def body():
            advance(self._step(), state)  # advance also moves positions on: no launch of its own

        # Sampling kinds keep advance eager (after a replay of the model step): capturing the
        # sampler failed on the H200 (torch 2.11), and its host cost is small beside a sampled step.
        if not self.use_cuda_graph or generator is not None or kind.sampling:
            def step():
                advance(self.current_logits(), state, generator)
            return state, step
        if kind not in self.loop_graphs:
            self.positions.zero_()
            state.step.zero_()
            self.loop_graphs[kind], _ = self.capture(body)
        return state, self.loop_graphs[kind].replay


def graph_plan(model) -> tuple[bool, list[str]]:
    """(whether the model sits on one GPU, what keeps it out of CUDA graphs), kept until its structure
    changes (``models/structure.py``), which also drops the runners and graphs made before: walking
    the module tree costs ~1.5 ms of host time a call, and a stale graph would replay old modules."""
    stamp = structure.epoch()
    plan = model.__dict__.get("_graph_plan")
    if plan is None or plan[0] != stamp:
        on_one_gpu = model.device.type == "cuda" and len({p.device for p in model.parameters()}) == 1
        plan = (stamp, on_one_gpu, model.graph_blockers())
        model.__dict__["_graph_plan"] = plan
        model.__dict__.pop("_decode_runners", None)
    return plan[1], plan[2]


def get_runner(model, rows: int, total_len: int, use_cuda_graph: bool | None) -> DecodeRunner:
    """A cached runner big enough for this call; graphs are captured once per (rows, capacity)."""
    on_one_gpu, blockers = graph_plan(model)
    if use_cuda_graph is None:
        use_cuda_graph = on_one_gpu and not blockers
        reason = "on" if use_cuda_graph else ("off (CPU or several devices)" if not on_one_gpu else
                                              f"off ({', '.join(blockers)} cannot be captured)")
        model._choices["generate cuda graphs"] = reason
    elif use_cuda_graph and not on_one_gpu:
        raise ValueError("use_cuda_graph=True needs the whole model on one GPU")
    elif use_cuda_graph and blockers:
        raise ValueError(f"use_cuda_graph=True: {', '.join(blockers)} cannot be captured in a CUDA graph; use "
                         "attn_implementation='sdpa' or 'triton' and use_kernels=True, or use_cuda_graph=False")
    block_size = 256 if total_len > 256 else 16
    capacity = -(-total_len // block_size) * block_size
    runners = model.__dict__.setdefault("_decode_runners", {})
    key = (rows, capacity, model.dtype, bool(use_cuda_graph))
    if key not in runners:
        runners.clear()  # one cache at a time: KV memory is not hoarded across shapes
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
        runners[key] = DecodeRunner(model, rows, capacity, block_size, bool(use_cuda_graph))
    return runners[key]
