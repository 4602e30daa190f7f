"""How many KV blocks fit: what is free after the weights and one measured worst-case step.

On CUDA the runner runs the largest step it will ever schedule (``max_batch_tokens`` prefill
tokens, logits and a full-vocabulary sort for ``max_num_seqs`` rows) and records the activation
peak; the cache gets ``max_memory_percent`` of the free memory minus that peak. On the CPU there
is nothing to measure against, so the cache gets a fixed budget, at most what ``max_num_seqs``
full-length sequences need (logged; pass ``num_blocks``).
"""

from __future__ import annotations

import logging

import torch

from ..attention.kv_cache import KVCache
from ..attention.metadata import AttentionBatch
from ..errors import CudaformersError

logger = logging.getLogger("cudaformers")

CPU_CACHE_BYTES = 512 * 2**20


class OutOfCacheMemoryError(CudaformersError, RuntimeError):
    """No room for the KV cache after the weights and activations."""


@torch.inference_mode()
def profile_peak_activation_bytes(runner) -> int:
    """Peak extra memory of the largest step (prefill of max_batch_tokens + sampling)."""
    dev = runner.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    total = runner.max_batch_tokens
    chunk = min(total, runner.max_model_len)
    lens = [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    ids = torch.zeros(total, dtype=torch.long, device=dev)
    hidden = runner.model.model(ids, positions, AttentionBatch.from_seqlens(lens, dev))
    rows = min(runner.max_num_seqs, total)
    logits = runner.model.compute_logits(hidden[:rows]).float()
    logits.log_softmax(-1).sort(-1, descending=True)
    del hidden, logits
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - before


def plan_num_blocks(runner, shape, max_memory_percent: float) -> int:
    """``shape``: (num_layers, block_size, num_kv_heads, head_dim, dtype) of one cache block."""
    if not 0 < max_memory_percent <= 1:
        raise ValueError(f"max_memory_percent={max_memory_percent}: use a fraction in (0, 1] of the free memory")
    per_block = KVCache.bytes_per_block(*shape)
    min_blocks = -(-runner.max_batch_tokens // runner.block_size) + 1
    if runner.device.type != "cuda":
        # No more than every running sequence at full context could use.
        most = runner.max_num_seqs * -(-runner.max_model_len // runner.block_size)
        n = max(min_blocks, min(most, CPU_CACHE_BYTES // per_block))
        logger.info("KV cache on %s: %d blocks (%d MiB, the CPU default; pass num_blocks= to change it)",
                    runner.device.type, n, n * per_block // 2**20)
        return n
    peak = profile_peak_activation_bytes(runner)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(runner.device)
    budget = int(free * max_memory_percent) - peak
    n = budget // per_block
    if n < min_blocks:
        raise OutOfCacheMemoryError(
            f"only {max(budget, 0) / 2**30:.2f} GiB left for the KV cache ({free / 2**30:.2f} GiB free x "
            f"{max_memory_percent} minus a {peak / 2**30:.2f} GiB activation peak at max_batch_tokens="
            f"{runner.max_batch_tokens}); {min_blocks} blocks are needed. Lower max_batch_tokens or max_num_seqs, "
            "raise max_memory_percent, or free GPU memory")
    logger.info("KV cache sized automatically: %.2f GiB free x %.2f - %.2f GiB activation peak -> %d blocks "
                "(pass num_blocks= or max_memory_percent= to change it)",
                free / 2**30, max_memory_percent, peak / 2**30, n)
    return int(n)
