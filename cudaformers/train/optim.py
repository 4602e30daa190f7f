"""AdamW with decoupled weight decay, and gradient-norm clipping that works on sharded parameters."""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("cudaformers")


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only (not biases or norm scales); DTensor and plain parameters in separate
    groups, because the multi-tensor kernels take one kind at a time."""
    groups: dict[tuple[bool, bool], list] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault((p.ndim >= 2, _is_dtensor(p)), []).append(p)
    return [{"params": ps, "weight_decay": weight_decay if decay else 0.0}
            for (decay, _), ps in sorted(groups.items())]


def build_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    fused = args.optim == "adamw_torch_fused"
    groups = param_groups(model, args.weight_decay)
    if not groups:
        raise ValueError("the model has no parameter that requires grad; nothing to train")
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, fused=fused, foreach=None if fused else True)


@torch.no_grad()
def clip_grad_norm(params, max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of all gradients (sharded ones included), clipped to ``max_norm`` if set.

    Returns a tensor and never synchronises with the host, so it can run every step.
    """
    grads = [p.grad for p in params if p.grad is not None]
    plain = [g for g in grads if not _is_dtensor(g)]
    sharded = [g for g in grads if _is_dtensor(g)]
    parts = []
    if plain:
        parts.append(torch.nn.utils.get_total_norm(plain).float())
    if sharded:
        # A DTensor norm is itself a DTensor (partial over shards); full_tensor() sums the shards.
        norm = torch.nn.utils.get_total_norm(sharded)
        parts.append(norm.full_tensor().float() if _is_dtensor(norm) else norm.float())
    if not parts:
        return torch.zeros(())
    total = torch.stack([p.to(parts[0].device) for p in parts]).square().sum().sqrt()
    if max_norm:
        for group in (plain, sharded):
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].device) if not
                                                     _is_dtensor(group[0]) else total)
    return total
