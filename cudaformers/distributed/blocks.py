"""The repeated decoder blocks of a model, the unit of sharding and of activation checkpointing."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..binding import bind
from ..errors import UnsupportedError
from ..models import structure

logger = logging.getLogger("cudaformers")


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: ``model.model.layers`` in HF naming, else its largest ModuleList."""
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return inner.layers
    if isinstance(getattr(model, "layers", None), nn.ModuleList):
        return model.layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise UnsupportedError(f"{type(model).__name__} has no nn.ModuleList of decoder layers to shard or "
                               "checkpoint; expose them as model.model.layers (transformers naming)")
    return max(lists, key=len)


def _recomputed(block: nn.Module, *args, **kwargs):
    inner = block._cf_inner_forward or type(block).forward.__get__(block)
    return checkpoint(inner, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: nn.Module) -> int:
    """Recompute each decoder block in the backward pass instead of keeping its activations.

    Patches each block's ``forward`` (rather than wrapping the module) so parameter names and the
    hooks FSDP2 puts on the block are unchanged.
    """
    blocks = find_blocks(model)
    for block in blocks:
        if getattr(block, "_cf_checkpointed", False):
            continue
        block._cf_inner_forward = block.__dict__.get("forward")  # a kernel bound before, else the class's
        block.forward = bind(_recomputed, block)
        block._cf_checkpointed = True
    structure.changed()
    return len(blocks)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """The model's own ``gradient_checkpointing_enable()`` when it has one, else whole-block recompute."""
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()
        logger.info("gradient checkpointing: %s.gradient_checkpointing_enable()", type(model).__name__)
        return
    n = checkpoint_blocks(model)
    logger.info("gradient checkpointing: recomputing each of %d decoder blocks in backward", n)


def unique_parameter_count(model: nn.Module) -> int:
    """Parameters counted once (tied weights once; sharded DTensors at their full size)."""
    return sum(p.numel() for p in model.parameters())
