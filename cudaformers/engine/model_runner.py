"""ModelRunner: owns the paged KV cache and runs one scheduled step through the model.

A step is a flat batch of tokens (decodes and prefill chunks together). The runner turns the
scheduler's sequences into device tensors (ids, positions, slot mapping, block table, sequence
lengths) with one pinned copy per dtype, runs ``model.model(ids, positions, batch)``, computes logits
only for the rows that sample, and samples on the device. The sampled ids stay on the device so
the next step can read a decode input the host has not seen yet (async batching); a
non-blocking copy brings them to the host. Pure-decode steps replay a CUDA graph captured per
batch-size bucket (cuda_graph.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..attention.kv_cache import KVCache
from ..attention.metadata import AttentionBatch
from ..errors import UnsupportedError
from .cache_sizing import plan_num_blocks
from .cuda_graph import DecodeGraphs
from .sampler import Sampler, SamplingBatch
from .scheduler import ScheduledBatch
from .sequence import PLACEHOLDER, Sequence

logger = logging.getLogger("cudaformers")


@dataclass
class StepHandle:
    """A launched step: sampled ids on the device and, once ready, on the host."""

    tokens: torch.Tensor | None  # [N] on the device (None: no row samples this step)
    host_tokens: torch.Tensor | None
    host_logprobs: tuple | None
    ready: torch.cuda.Event | None

    def result(self):
        """(token ids, logprobs) as Python lists; blocks until the step is done."""
        if self.tokens is None:
            return [], None
        if self.ready is not None:
            self.ready.synchronize()
        lp = None
        if self.host_logprobs is not None:
            lp = tuple(t.tolist() for t in self.host_logprobs)
        return self.host_tokens.tolist(), lp


class ModelRunner:
    def __init__(self, model, *, block_size: int = 16, num_blocks: int | None = None,
                 max_memory_percent: float = 0.9, max_num_seqs: int = 256, max_batch_tokens: int = 8192,
                 max_model_len: int | None = None, use_cuda_graph: bool | None = None):
        self.model = model
        cfg = model.config
        self.device = model.device
        devices = {p.device for p in model.parameters()}
        if len(devices) > 1:
            raise UnsupportedError(
                f"the engine runs a model on one device; this one spans {sorted(map(str, devices))}. "
                "Load it with device_map='cuda' (one GPU) for LLM / generate_batch")
        self.block_size = block_size
        self.max_num_seqs, self.max_batch_tokens = max_num_seqs, max_batch_tokens
        self.max_model_len = max_model_len or int(getattr(cfg, "max_position_embeddings", 4096))
        self.vocab_size = cfg.vocab_size
        self.sampler = Sampler()
        self.is_cuda = self.device.type == "cuda"

        shape = (cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim, model.dtype)
        if num_blocks is None:
            num_blocks = plan_num_blocks(self, shape, max_memory_percent)
        elif num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: use a positive number of KV blocks, or None to size from memory")
        self.num_blocks = num_blocks
        # One extra block, never handed out: padded rows of a captured decode step write there.
        self.pad_block = num_blocks
        self.kv_cache = KVCache(cfg.num_hidden_layers, num_blocks + 1, block_size, cfg.num_key_value_heads,
                                cfg.head_dim, model.dtype, self.device)
        gib = num_blocks * KVCache.bytes_per_block(*shape) / 2**30
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)", num_blocks, block_size,
                    num_blocks * block_size, gib)

        self._last_tokens: torch.Tensor | None = None  # sampled ids of the last launched step
        self._last_rows: dict[int, int] = {}  # seq_id -> row in _last_tokens
        self.graphs: DecodeGraphs | None = None
        self.last_graph_size: int | None = None  # the graph bucket the last step replayed (None: eager)
        blockers = model.graph_blockers()
        if use_cuda_graph is None:
            use_cuda_graph = self.is_cuda and not blockers
            why = "on" if use_cuda_graph else (f"off on {self.device.type}" if not self.is_cuda else
                                                f"off: {', '.join(blockers)} cannot be captured")
            logger.info("CUDA graphs for decode steps: %s (automatic; pass use_cuda_graph= to choose)", why)
            model._choices["engine cuda graphs"] = why
        elif use_cuda_graph and blockers:
            raise UnsupportedError(f"use_cuda_graph=True: {', '.join(blockers)} cannot be captured in a CUDA graph; "
                                   "use attn_implementation='triton' or 'sdpa' and use_kernels=True")
        if use_cuda_graph:
            if not self.is_cuda:
                raise UnsupportedError(f"use_cuda_graph=True needs a CUDA model; this one is on {self.device}")
            self.graphs = DecodeGraphs(self)
            self.graphs.capture()
        if self.is_cuda:
            self.warm_up_mixed_step()

    @torch.inference_mode()
    def warm_up_mixed_step(self) -> None:
        """Run steps that mix a prefill chunk with decodes, as a busy engine does.

        Such a step reads keys through the block table, a kernel variant that neither the cache
        sizing (a plain prefill) nor graph capture (decode) compiles. Left to the first real mixed
        step, its compilation and autotuning (seconds) would stall every running request. The
        chunk is as large as a step allows, so the autotuner picks tiles for the shape that counts.
        Two steps: one whose token count is a multiple of 16 and one whose is not, since Triton
        compiles a variant per divisibility of integer arguments that follow the token count. A
        third samples a few dozen rows at most (a step where few prompts end), whose logits take
        the skinny GEMM rather than cuBLAS. Then chunks halving down to a few dozen tokens: kernels
        pick their tiles by row count (the RMSNorm shrinks its row block while its grid would
        leave SMs idle), and each tile is a variant to compile; an online server's steps are mostly
        small. Writes only into blocks no request holds yet (the cache is empty at start).
        """
        start = time.perf_counter()
        bs = self.block_size
        num_decodes = min(self.max_num_seqs - 1, 64)
        context = min(bs, self.num_blocks * bs // 2, self.max_model_len // 2)
        chunk = max(2, min(self.max_batch_tokens - num_decodes, (self.num_blocks - 1) * bs - context,
                           self.max_model_len - context))
        aligned = chunk - (chunk + num_decodes) % 16
        steps = [(aligned, num_decodes), (aligned - 1, num_decodes)] if aligned >= 3 else [(chunk, num_decodes)]
        few = min(num_decodes, 20)  # with the chunk's own row: a few dozen sampled rows at most
        steps += [(chunk >> i, few) for i in range(chunk.bit_length()) if i == 0 or chunk >> i >= 32]
        for n, decodes in steps:
            self._eager(*self._warm_up_batch(n, context, decodes))
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        logger.info("warmed up mixed prefill + decode steps (%s tokens + decodes) in %.1f s", steps,
                    time.perf_counter() - start)

    def _warm_up_batch(self, chunk: int, context: int, num_decodes: int):
        """A chunk of ``chunk`` tokens after ``context`` cached ones, beside decodes reading the same blocks."""
        from .sampling_params import SamplingParams

        bs, params = self.block_size, SamplingParams(temperature=0)
        blocks = list(range(-(-(context + chunk) // bs)))
        batch = ScheduledBatch()
        for i in range(1 + num_decodes):
            n = chunk if i == 0 else 1
            seq = Sequence(f"warm-up-{i}", [0] * (context + n), params)
            seq.block_table = blocks if i == 0 else blocks[:-(-(context + 1) // bs)]
            seq.num_computed_tokens = context
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.sample_indices.append(i)
            batch.num_tokens += n
            batch.num_decodes += n == 1
        return (batch, *self.prepare(batch))

    # -- host -> device ---------------------------------------------------------------------------
    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return self._tensor_to_device(torch.from_numpy(array))

    def _tensor_to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.is_cuda:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def block_table_array(self, seqs, width: int) -> np.ndarray:
        """``[len(seqs), width]`` int32 block ids, rows padded with the pad block."""
        tables = [s.block_table for s in seqs]
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        table = np.full((len(tables), width), self.pad_block, dtype=np.int32)
        # One C-level pass over every id instead of a numpy slice assignment per row.
        flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
        table[np.arange(width) < lens[:, None]] = flat
        return table

    def prepare(self, batch: ScheduledBatch):
        """Host lists for a step, plus where decode inputs still unknown to the host come from.

        Plain lists: a decode row is three scalars, and numpy per-element writes cost more than the
        list appends; prefill chunks are added with C-level ``extend``s, one per cache block.
        """
        bs = self.block_size
        ids, pos, slots, k_lens, fill_dst, fill_src = [], [], [], [], [], []
        last_rows = self._last_rows
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            c = seq.num_computed_tokens
            table = seq.block_table
            if n == 1:
                tok = seq.token_ids[c]
                if tok == PLACEHOLDER:
                    fill_dst.append(len(ids))
                    fill_src.append(last_rows[seq.seq_id])
                    tok = 0
                ids.append(tok)
                pos.append(c)
                slots.append(table[c // bs] * bs + c % bs)
            else:
                ids.extend(seq.token_ids[c:c + n])
                pos.extend(range(c, c + n))
                p, end = c, c + n
                while p < end:  # one run of consecutive slots per cache block
                    take = min(bs - p % bs, end - p)
                    first = table[p // bs] * bs + p % bs
                    slots.extend(range(first, first + take))
                    p += take
            k_lens.append(c + n)
        return ids, pos, slots, batch.num_new_tokens, k_lens, fill_dst, fill_src

    def _fill(self, input_ids: torch.Tensor, fill_dst, fill_src) -> None:
        if fill_dst:
            dst, src = self.pack_to_device(np.int64, fill_dst, fill_src)
            input_ids[dst] = self._last_tokens[src]

    # -- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepHandle:
        ids, pos, slots, q_lens, k_lens, fill_dst, fill_src = self.prepare(batch)
        graph_bs = self.graphs.bucket(batch, max(k_lens)) if self.graphs is not None else None
        self.last_graph_size = graph_bs
        if graph_bs is not None:
            logits = self.graphs.replay(graph_bs, batch, ids, pos, slots, k_lens, fill_dst, fill_src)
        else:
            logits = self._eager(batch, ids, pos, slots, q_lens, k_lens, fill_dst, fill_src)
        return self._sample(batch, logits)

    def _eager(self, batch, ids, pos, slots, q_lens, k_lens, fill_dst, fill_src):
        n = len(q_lens)
        # A multiple of 16 wide: Triton specializes integer arguments (the table's row stride) on
        # divisibility by 16, and a width that changed parity from step to step would recompile.
        width = -(-max(len(s.block_table) for s in batch.seqs) // 16) * 16
        cu_q = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        last = cu_q[1:][batch.sample_indices] - 1
        cu_k = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(k_lens, out=cu_k[1:])
        d64 = self.pack_to_device(np.int64, ids, pos, slots, last)
        d32 = self.pack_to_device(np.int32, cu_q, cu_k, k_lens, self.block_table_array(batch.seqs, width))
        input_ids, positions, slot_mapping, last_dev = d64
        cu_q_dev, cu_k_dev, seqlens_k, table = d32
        attn = AttentionBatch(
            cu_seqlens_q=cu_q_dev, cu_seqlens_k=cu_k_dev, seqlens_k=seqlens_k,
            max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), kv_cache=self.kv_cache,
            slot_mapping=slot_mapping, block_table=table.view(n, width), has_context=batch.num_tokens != cu_k[-1],
            num_decode_seqs=batch.num_decodes)
        self._fill(input_ids, fill_dst, fill_src)
        hidden = self.model.model(input_ids, positions, attn)
        if not batch.sample_indices:
            return None
        rows = hidden if len(last) == hidden.shape[0] else hidden[last_dev]
        return self.model.compute_logits(rows)

    def pack_to_device(self, dtype, *parts) -> list[torch.Tensor]:
        """Several host arrays or lists in one pinned buffer and one copy; returns the device views.

        Each part starts 16-byte aligned: Triton specializes pointer arguments on that alignment,
        and a view that lost it would compile (and run) a slower kernel variant.
        """
        align = 16 // np.dtype(dtype).itemsize
        sizes = [np.size(p) for p in parts]
        starts, total = [], 0
        for size in sizes:
            starts.append(total)
            total += -(-size // align) * align
        host = np.empty(max(total, 1), dtype=dtype)
        for start, size, part in zip(starts, sizes, parts):
            host[start:start + size] = np.ravel(part) if isinstance(part, np.ndarray) else part
        dev = self.to_device(host)
        return [dev[start:start + size] for start, size in zip(starts, sizes)]

    def _sample(self, batch: ScheduledBatch, logits) -> StepHandle:
        if logits is None:
            self._last_rows = {}  # nothing of this step can be a later step's input
            return StepHandle(None, None, None, None)
        seqs = [batch.seqs[i] for i in batch.sample_indices]
        params = [s.params for s in seqs]
        histories = None
        if any(p.needs_history for p in params):
            histories = [s.token_ids for s in seqs]
            assert all(PLACEHOLDER not in h for h in histories), "penalty rows need their tokens on the host"
        generators = [self._generator(s) for s in seqs]
        # Outputs so far (a token still in flight counts): min_tokens is checked against it.
        num_out = [s.num_output_tokens for s in seqs]
        sb = SamplingBatch.build(params, histories, num_out, generators, self._tensor_to_device)
        tokens, logprobs = self.sampler(logits, sb)
        self._last_tokens = tokens
        self._last_rows = {s.seq_id: r for r, s in enumerate(seqs)}
        if not self.is_cuda:
            return StepHandle(tokens, tokens, logprobs, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        host_lp = None
        if logprobs is not None:
            host_lp = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                            for t in logprobs)
        ready = torch.cuda.Event()
        ready.record()
        return StepHandle(tokens, host, host_lp, ready)

    def _generator(self, seq) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None
        g = getattr(seq, "generator", None)
        if g is None:
            g = seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed)
        return g
