"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of B sequences runs the graph of the smallest bucket >= B (1, 2, 4, 8, ... up to
``max_num_seqs``). Inputs live in fixed buffers sized for the largest bucket; the rows past B are
padding that writes its keys to the runner's reserved pad block and reads one key from it, so
real blocks are never touched. The attention metadata's shapes must not change between replays:
the block table is ``max_len / block_size`` wide and ``max_seqlen_k`` is ``max_len``; a step whose
context is longer runs eagerly.
"""

from __future__ import annotations

import logging
import time
import weakref

import numpy as np
import torch

from ..attention.metadata import AttentionBatch
from ..cuda_graphs import capturing

logger = logging.getLogger("cudaformers")

MAX_GRAPH_LEN = 16384  # longest context a captured step serves; longer ones run eagerly


class DecodeGraphs:
    def __init__(self, runner):
        self._runner = weakref.ref(runner)  # the runner owns these graphs: no cycle for the collector to free
        top = runner.max_num_seqs
        self.sizes = sorted({min(1 << i, top) for i in range(top.bit_length() + 1)})
        bs = runner.block_size
        self.max_len = -(-min(runner.max_model_len, MAX_GRAPH_LEN) // bs) * bs
        self.width = self.max_len // bs
        self.pad_slot = runner.pad_block * bs
        dev, n = runner.device, top
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), self.pad_slot, dtype=torch.long, device=dev)
        self.seqlens_k = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev)  # one query per row, always
        self.cu_k = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_table = torch.full((n, self.width), runner.pad_block, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def runner(self):
        return self._runner()

    def _batch(self, b: int) -> AttentionBatch:
        return AttentionBatch(
            cu_seqlens_q=self.cu_q[:b + 1], cu_seqlens_k=self.cu_k[:b + 1], seqlens_k=self.seqlens_k[:b],
            max_seqlen_q=1, max_seqlen_k=self.max_len, kv_cache=self.runner.kv_cache,
            slot_mapping=self.slots[:b], block_table=self.block_table[:b], has_context=True)

    def _forward(self, b: int) -> torch.Tensor:
        model = self.runner.model
        return model.compute_logits(model.model(self.ids[:b], self.pos[:b], self._batch(b)))

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        for b in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
            self._forward(b)  # warm-up: lazy initialisation and kernel autotuning stay out of the graph
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s, context up to %d tokens) in %.1f s",
                    len(self.graphs), self.sizes, self.max_len, time.perf_counter() - start)

    def bucket(self, batch, max_k: int) -> int | None:
        """The graph size that serves this step, or None when it must run eagerly."""
        n = len(batch.seqs)
        if n > self.sizes[-1] or max_k > self.max_len or len(batch.sample_indices) != n or not batch.is_decode:
            return None
        return next(b for b in self.sizes if b >= n)

    def replay(self, b: int, batch, ids, pos, slots, k_lens, fill_dst, fill_src) -> torch.Tensor:
        n = len(batch.seqs)
        run = self.runner
        pad = b - n
        # Only the block-table columns some row uses are sent: the kernels read a row's ids up to
        # its length and no further, so what older steps left in the other columns is never seen.
        width = max(len(s.block_table) for s in batch.seqs)
        table = run.block_table_array(batch.seqs + [_PAD] * pad, width)
        lens = k_lens + [1] * pad
        cu_k = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(lens, out=cu_k[1:])
        d_ids, d_pos, d_slots = run.pack_to_device(np.int64, ids + [0] * pad, pos + [0] * pad,
                                                   slots + [self.pad_slot] * pad)
        d_lens, d_cu_k, d_table = run.pack_to_device(np.int32, lens, cu_k, table)
        self.ids[:b].copy_(d_ids)
        self.pos[:b].copy_(d_pos)
        self.slots[:b].copy_(d_slots)
        self.seqlens_k[:b].copy_(d_lens)
        self.cu_k[:b + 1].copy_(d_cu_k)
        self.block_table[:b, :width].copy_(d_table.view(b, width))
        if fill_dst:
            run._fill(self.ids, fill_dst, fill_src)
        self.graphs[b].replay()
        return self.outputs[b][:n]


class _PadSeq:
    block_table: list[int] = []


_PAD = _PadSeq()
