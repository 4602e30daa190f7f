"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded
across processes, each decoder block all-gathered just before it runs.

``fsdp`` options as in transformers map onto FSDP2: ``full_shard`` reshards parameters after the
forward (ZeRO-3), ``shard_grad_op`` keeps them gathered until the backward (ZeRO-2-like, more memory,
less communication), ``hybrid_shard`` shards within a node and replicates across nodes, ``offload``
keeps parameters and optimizer state in CPU memory. ``auto_wrap`` is implied: every decoder block is
its own unit.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from ..errors import UnsupportedError
from .blocks import find_blocks

logger = logging.getLogger("cudaformers")


def fsdp_mesh(device: torch.device, options: list[str], world_size: int):
    """A 1-D mesh (shard over all processes) or, for hybrid_shard, (replicate across nodes, shard in node)."""
    from torch.distributed.device_mesh import init_device_mesh

    if "hybrid_shard" not in options:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % per_node:
        raise UnsupportedError(f"hybrid_shard: {world_size} processes do not split into nodes of {per_node}")
    return init_device_mesh(device.type, (world_size // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: nn.Module, mesh, *, options: list[str] | None = None, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = torch.float32) -> nn.Module:
    """Shard ``model`` in place: each decoder block, then the root (embeddings, final norm, head).

    ``param_dtype`` is the dtype blocks compute in (bf16 for mixed precision: the sharded fp32 master
    weights are cast when gathered); gradients are reduced in ``reduce_dtype``.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from ..kernels.fused_projections import unpack_projections

    unpack_projections(model)  # sharding replaces the parameters; the packed copy would stay whole

    options = options or ["full_shard"]
    reshard = "shard_grad_op" not in options
    kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if "offload" in options:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    blocks = find_blocks(model)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first in backward: keeping them saves a gather.
        fully_shard(block, reshard_after_forward=reshard and i < len(blocks) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=reshard, **kwargs)
    logger.info("FSDP2: %d blocks + root sharded over %s (%s, compute dtype %s)", len(blocks),
                tuple(mesh.shape), " ".join(options), str(param_dtype or "model's").removeprefix("torch."))
    return model


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Skip the reduce-scatter on micro-batches before the last of an accumulation window."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)


def full_state_dict(model: nn.Module) -> dict:
    """The whole model's weights on the CPU of rank 0 (empty elsewhere); a collective call."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded(folder, model: nn.Module, optimizer) -> None:
    """Each process writes its own shards of the model and optimizer (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))


def load_sharded(folder, model: nn.Module, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
