"""One decode step over a static (contiguous-blocks) KV cache, eager or replayed from a CUDA graph.

Everything a step needs (slots, key lengths) is derived on the device from the positions buffer,
inside the captured region, so a replay is one launch plus two small copies.
"""

from __future__ import annotations

import logging

import torch

from ..attention.kv_cache import KVCache
from ..attention.metadata import AttentionBatch

logger = logging.getLogger("cudaformers")


class DecodeRunner:
    """Owns the KV cache for ``rows`` sequences of up to ``capacity`` tokens, and the decode graph."""

    def __init__(self, model, rows: int, capacity: int, block_size: int, use_cuda_graph: bool):
        cfg, dev = model.config, model.device
        self.model, self.rows, self.capacity = model, rows, capacity
        devices = [layer.self_attn.q_proj.weight.device for layer in model.model.layers]
        kv_heads = model.model.layers[0].self_attn.k_proj.weight.shape[0] // cfg.head_dim
        blocks_per_row = -(-capacity // block_size)
        self.cache = KVCache(cfg.num_hidden_layers, rows * blocks_per_row, block_size, kv_heads, cfg.head_dim,
                             model.dtype, devices)
        self.block_table = self.cache.contiguous_block_table(rows, capacity, dev)
        self.block_size = block_size
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.cu_q = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self.graph = None
        self.logits = None
        if use_cuda_graph:
            self._capture()

    def prefill_batch(self, lens: list[int]) -> AttentionBatch:
        """The batch for the prompts: row r's tokens fill its own blocks from slot r * row_stride."""
        dev = self.block_table.device
        row_stride = self.block_table.shape[1] * self.block_size
        slots = torch.cat([torch.arange(n, device=dev) + r * row_stride for r, n in enumerate(lens)])
        return AttentionBatch.with_cache(lens, lens, self.cache, slots, self.block_table, dev)

    def _step(self) -> torch.Tensor:
        pos = self.positions
        seqlens = (pos + 1).to(torch.int32)
        bs = self.block_size
        rows = torch.arange(self.rows, device=pos.device)
        slots = self.block_table[rows, pos // bs].long() * bs + pos % bs
        cu_k = torch.zeros(self.rows + 1, dtype=torch.int32, device=pos.device)
        cu_k[1:] = seqlens.cumsum(0)
        batch = AttentionBatch(self.cu_q, cu_k, seqlens, 1, self.capacity, self.cache, slots, self.block_table,
                               has_context=True)
        hidden = self.model.model(self.tokens, pos, batch)
        return self.model.compute_logits(hidden)

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: autotuning, allocator, lazy init stay out of the graph
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, V]`` for one new token per row at ``positions``."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.logits


def get_runner(model, rows: int, total_len: int, use_cuda_graph: bool | None) -> DecodeRunner:
    """A cached runner big enough for this call; graphs are captured once per (rows, capacity)."""
    on_one_gpu = model.device.type == "cuda" and len({p.device for p in model.parameters()}) == 1
    graph_safe = all(getattr(layer.backend, "graph_safe", False) for layer in model.attention_layers())
    if use_cuda_graph is None:
        use_cuda_graph = on_one_gpu and graph_safe
        reason = "on" if use_cuda_graph else ("off (CPU or several devices)" if not on_one_gpu else
                                              "off (the attention backend cannot be captured)")
        model._choices["generate cuda graphs"] = reason
    elif use_cuda_graph and not on_one_gpu:
        raise ValueError("use_cuda_graph=True needs the whole model on one GPU")
    elif use_cuda_graph and not graph_safe:
        raise ValueError("use_cuda_graph=True: the attention backend cannot be captured in a CUDA graph; "
                         "use attn_implementation='sdpa' or 'triton'")
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
