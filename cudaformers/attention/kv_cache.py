"""The paged KV cache, shared by generate() (one contiguous run of blocks per row) and the engine.

Per layer, keys and values are ``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's slot
is ``block * block_size + offset``. generate()'s "static" cache is the same structure with a block
table that gives each row its own contiguous blocks, so one set of attention kernels serves both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        devices: list[torch.device] | torch.device,
    ):
        if not isinstance(devices, (list, tuple)):
            devices = [devices] * num_layers
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        self.v = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def contiguous_block_table(self, num_rows: int, max_len: int, device) -> torch.Tensor:
        """Row r owns blocks [r * n, (r + 1) * n): the layout of a static cache."""
        n = -(-max_len // self.block_size)
        if num_rows * n > self.num_blocks:
            raise ValueError(f"KV cache holds {self.num_blocks} blocks; {num_rows} rows of {max_len} tokens need {num_rows * n}")
        return torch.arange(num_rows * n, dtype=torch.int32, device=device).view(num_rows, n)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' k, v ``[T, Hkv, D]`` into the cache at ``slot_mapping`` ``[T]``.

    On CUDA one Triton launch writes both, reading strided k/v views as they are (kernels/kv_store.py).
    """
    if k.is_cuda and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)):
        from ..kernels.kv_store import store_kv_triton, supports

        if supports(k_cache, v_cache):
            store_kv_triton(k_cache, v_cache, k, v, slot_mapping)
            return
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class KVStore(NamedTuple):
    """Where one layer's new keys and values go: v ``[T, Hkv, D]`` and the cache slots to write.

    The attention layer hands this to its rotary module together with q and k, so that a kernel
    which produces the rotated keys can write them (and v) into the cache in the same launch; the
    plain module calls ``store`` once k is final. Either way the store is done when it returns.
    """

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor

    def store(self, k: torch.Tensor) -> None:
        store_kv(self.k_cache, self.v_cache, k, self.v, self.slot_mapping)


def gather_slots(block_table: torch.Tensor, block_size: int, max_len: int) -> torch.Tensor:
    """Cache slot of every position ``< max_len`` of each sequence: ``[B, max_len]`` int64."""
    pos = torch.arange(max_len, device=block_table.device)
    blocks = block_table[:, (pos // block_size).clamp(max=block_table.shape[1] - 1)].long()
    return blocks * block_size + (pos % block_size)[None]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, max_len: int, slots: torch.Tensor | None = None):
    """Keys of each sequence, padded: ``[B, max_len, Hkv, D]`` read through ``block_table``
    (or through precomputed ``slots`` from ``gather_slots``).

    Fixed shapes and no host reads, so decode steps that use it can be captured in a CUDA graph.
    """
    if slots is None:
        slots = gather_slots(block_table, cache.shape[1], max_len)
    return cache.view(-1, *cache.shape[2:])[slots]
