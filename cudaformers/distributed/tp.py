"""Tensor parallelism with DTensor: each decoder block's projections split across the ``tp`` processes.

Megatron layout: q/k/v and gate/up are split by output features (column-wise: each process owns
whole attention heads and a slice of the MLP), o and down by input features (row-wise: their partial
outputs are summed by an all-reduce). Everything else (embeddings, norms, head) is replicated. Usable
for training and inference alike: ``apply_tp(model, mesh)`` on a model built on every process.

Contract with the model: attention reshapes its projections with ``-1`` heads (or keeps its head
counts in ``num_heads`` / ``num_key_value_heads``-style attributes, which are divided here), so that
it works on the heads this process owns.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UnsupportedError
from .blocks import find_blocks

logger = logging.getLogger("cudaformers")

# Module paths inside one decoder block -> how they are split.
DENSE_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}
FAMILY_PLANS = {t: DENSE_PLAN for t in ("llama", "mistral", "qwen2", "qwen3")}
# Attributes that count heads (or their width) on an attention module; divided by the tp degree.
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads",
               "n_kv_heads", "q_size", "kv_size")
# Parts of a block that see sharded activations: their replicated weights get partial gradients.
_SHARDED_REGIONS = ("self_attn", "mlp")


def plan_for(model: nn.Module) -> dict[str, str]:
    """The model's own ``tp_plan`` attribute if it has one, else its family's plan."""
    own = getattr(model, "tp_plan", None)
    if isinstance(own, dict) and own:
        return dict(own)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILY_PLANS:
        return dict(FAMILY_PLANS[model_type])
    block = find_blocks(model)[0]
    names = {n for n, _ in block.named_modules()}
    if set(DENSE_PLAN) <= names:
        return dict(DENSE_PLAN)
    raise UnsupportedError(
        f"no tensor-parallel plan for {type(model).__name__} (model_type={model_type!r}); plans exist for "
        f"{sorted(FAMILY_PLANS)}. Give the model a `tp_plan` dict (block-relative module path -> "
        "'colwise' | 'rowwise') or use fsdp instead")


def _check_divisible(model: nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(config, key, None)
        if n is not None and n % tp:
            raise UnsupportedError(f"tp_size={tp} does not divide {key}={n}; pick a tp_size that divides "
                                   "the number of attention heads, KV heads and the MLP width")


def _styles(plan: dict[str, str]):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    bad = {k: v for k, v in plan.items() if v not in make}
    if bad:
        raise UnsupportedError(f"tp_plan styles {bad} are not supported; use 'colwise' or 'rowwise'")
    return {k: make[v]() for k, v in plan.items()}


def _reduce_partial_grads(block: nn.Module, plan: dict[str, str], group) -> int:
    """Replicated weights inside a sharded region (q/k norms over local heads) see only this process's
    heads; their gradients are summed across the tp group as they are produced."""
    planned = set(plan)

    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    n = 0
    for name, p in block.named_parameters():
        module = name.rsplit(".", 1)[0]
        if name.split(".")[0] in _SHARDED_REGIONS and module not in planned and p.requires_grad:
            p.register_hook(hook)
            n += 1
    return n


def _settled_output(module, args, output):
    """A sharded projection's output as a plain tensor whose collective has finished.

    torch's parallel styles return the output of their all-reduce as an ``AsyncCollectiveTensor``: a
    wrapper that waits for the collective only when a torch op touches it. Triton kernels read the
    memory behind a tensor directly, so they would read it before the all-reduce wrote it (or read
    no storage at all). A clone is a torch op: it waits, and autograd records it like any other."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def apply_tp(model: nn.Module, mesh, plan: dict[str, str] | None = None) -> nn.Module:
    """Split every decoder block of ``model`` across ``mesh`` (a 1-D DeviceMesh, or a mesh with a
    ``"tp"`` dimension) in place, per ``plan`` (default: the family's plan). Float projections become
    DTensor shards; quantized ones keep their share of the packed tensors (``tp_quant.py``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from ..kernels.fused_projections import fuse_projections, unpack_projections
    from ..quant.linear import QuantLinear
    from .tp_quant import shard_quantized

    unpack_projections(model)  # sharding replaces the parameters; the packed copy would stay whole
    if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names and mesh.ndim > 1:
        mesh = mesh["tp"]
    tp = mesh.size()
    if tp == 1:
        return model
    plan = plan or plan_for(model)
    _check_divisible(model, tp)
    styles = _styles(plan)
    hooked, quantized = 0, 0
    for b, block in enumerate(find_blocks(model)):
        names = {n for n, _ in block.named_modules()}
        missing = [k for k in plan if k not in names]
        if missing:
            raise UnsupportedError(f"tp plan names {missing} which this model's blocks do not have "
                                   f"(fused projections?); give the model a matching `tp_plan`")
        layers = {name: block.get_submodule(name) for name in plan}
        _check_splittable(layers, b)
        dense = {name: styles[name] for name, m in layers.items() if not isinstance(m, QuantLinear)}
        if dense:
            parallelize_module(block, mesh, dense)
        for name in dense:
            layers[name].register_forward_hook(_settled_output)
        for name, m in layers.items():
            if isinstance(m, QuantLinear):
                shard_quantized(m, plan[name], mesh.get_local_rank(), tp, mesh.get_group(), f"layers.{b}.{name}")
                quantized += 1
        for name, module in block.named_modules():
            if name.split(".")[0] == "self_attn" and name.count(".") == 0:
                for attr in _HEAD_ATTRS:
                    if isinstance(getattr(module, attr, None), int):
                        setattr(module, attr, getattr(module, attr) // tp)
        hooked += _reduce_partial_grads(block, plan, mesh.get_group())
    if quantized:
        from ..models import structure

        structure.changed()  # packed tensors swapped in place, rowwise layers given their reducing forward
        fuse_projections(model)  # each process's quantized q/k/v and gate/up shards, packed again
    model.tp_size = tp  # caches hold num_key_value_heads // tp_size heads per process
    logger.info("tensor parallel: %d-way over %d blocks (%d quantized layers split, %d replicated weights in "
                "sharded regions)", tp, len(find_blocks(model)), quantized, hooked)
    return model


def _check_splittable(layers: dict[str, nn.Module], block: int) -> None:
    from ..quant.linear import QuantLinear

    for name, m in layers.items():
        if type(m) is not nn.Linear and not isinstance(m, QuantLinear):
            hint = (" (LoRA adapters: tensor parallelism does not split adapters; train them with DDP or FSDP, or "
                    "merge_and_unload() first)" if hasattr(m, "base_layer") else "")
            raise UnsupportedError(f"tensor parallelism splits nn.Linear and quantized Linear layers; layers.{block}."
                                   f"{name} is a {type(m).__name__}{hint}")


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def apply_tp_plan(model: nn.Module, tp_plan="auto") -> nn.Module:
    """``from_pretrained(..., tp_plan="auto")`` under torchrun: split the model over all processes.

    ``tp_plan`` is "auto" (the family's plan) or a dict like ``DENSE_PLAN``. Each process must hold
    the whole model on its own GPU (``device_map`` = its local rank) before the split. Sets
    ``model.tp_size`` so caches can be sized for the heads each process owns
    (``num_key_value_heads // tp_size``).
    """
    from torch.distributed.device_mesh import init_device_mesh

    from .init import init_distributed

    if tp_plan != "auto" and not isinstance(tp_plan, dict):
        raise UnsupportedError(f"tp_plan={tp_plan!r}; use 'auto' or a dict of module path -> 'colwise'/'rowwise'")
    state = init_distributed()
    if state.world_size == 1:
        logger.warning("tp_plan=%r in a single process: nothing to split; launch with "
                       "`torchrun --nproc_per_node=N` to spread the model over N GPUs", tp_plan)
        return model
    devices = {p.device for p in model.parameters()}
    if devices != {state.device}:
        raise UnsupportedError(f"tensor parallelism needs the whole model on this process's device {state.device} "
                               f"first, found {sorted(map(str, devices))}; load with device_map={str(state.device)!r}")
    mesh = init_device_mesh(state.device.type, (state.world_size,), mesh_dim_names=("tp",))
    return apply_tp(model, mesh, None if tp_plan == "auto" else tp_plan)
