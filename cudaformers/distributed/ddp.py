"""Data parallelism with torch DistributedDataParallel: one full replica per process, gradients
averaged across processes in buckets that overlap with the backward pass."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def wrap_ddp(model: nn.Module, device: torch.device, *, find_unused_parameters: bool | None = None) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               find_unused_parameters=bool(find_unused_parameters), gradient_as_bucket_view=True)


def sync_context(wrapped: nn.Module, sync: bool):
    """Skip the gradient all-reduce on micro-batches that are not the last of an accumulation window."""
    if sync or not hasattr(wrapped, "no_sync"):
        return contextlib.nullcontext()
    return wrapped.no_sync()
