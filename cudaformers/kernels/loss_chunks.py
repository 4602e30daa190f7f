"""How many rows of logits the fused linear + cross-entropy computes at once (pure Python: the memory
planner uses the same rule without importing Triton)."""

from __future__ import annotations

LOGITS_BUDGET = 512 << 20  # bytes of logits one chunk may hold


def chunk_rows(n: int, vocab: int, itemsize: int, budget: int = LOGITS_BUDGET) -> int:
    """Rows per chunk: as many as ``budget`` bytes of logits allow (at least 128, so the matmuls keep
    their efficiency on huge vocabularies), spread evenly over the chunks and rounded up to a
    multiple of 64."""
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    most = max(128, budget // (vocab * itemsize))
    return max(1, min(n, cdiv(cdiv(n, cdiv(n, most)), 64) * 64))
