"""Next-token cross-entropy on a flat batch, with per-sequence shifting for packed documents."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels_flat(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """labels ``[T]`` aligned with the inputs -> targets ``[T]``: each token predicts the next one of
    its own sequence; the last token of every sequence predicts nothing."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:-1] = labels[1:]
    targets[(cu_seqlens[1:] - 1).long()] = IGNORE_INDEX
    return targets


def cross_entropy_from_logits(logits: torch.Tensor, targets: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Mean over non-ignored targets, or sum / ``num_items_in_batch`` (exact gradient accumulation)."""
    if num_items_in_batch is None:
        return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)
    loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / num_items_in_batch
