"""Weights fetched into L2 ahead of the kernel that will read them, by a kernel already running.

In a batch-1 decode step HBM idles while attention runs: q/k norm + rope and the paged decode are a
few microseconds of latency each, with little to read. The q/k/v GEMV before them can spend that
time: after streaming its own weights, each of its programs asks L2 for a share of the weights the
next projections will stream (o and gate/up), so those GEMVs find them in L2. A prefetch moves no
data into registers and changes no result; it only pays if the lines are still in L2 when read,
so the weights prefetched at once are bounded by a fraction of the L2 size (``budget``).

``prefetch_share`` is the device side, called from a kernel's programs; the inline PTX has no
interpreter form, so callers compile it only for a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LINE_BYTES = 128  # an L2 line


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines holding ``ptrs``; nothing comes back to registers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_share(ptr, n_lines, program, programs, LINE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``program`` of ``programs`` asks L2 for its share of the ``n_lines`` lines from ``ptr``
    (``LINE_ELEMS`` elements a line), ``BLOCK`` lines a step (128: one per thread at 4 warps)."""
    for base in range(program * BLOCK, n_lines, programs * BLOCK):
        line = tl.minimum(base + tl.arange(0, BLOCK), n_lines - 1)
        prefetch_l2(ptr + line.to(tl.int64) * LINE_ELEMS)


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    return getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0)


def budget(device: torch.device, fraction: float) -> int:
    """Bytes of weights worth prefetching at once on ``device``: ``fraction`` of its L2, or 0 where
    there is nothing to prefetch into (not a GPU, or the interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return 0
    return int(_l2_bytes(device.index if device.index is not None else torch.cuda.current_device()) * fraction)


def regions(weights, limit: int) -> tuple[torch.Tensor, ...]:
    """The contiguous ``weights`` worth prefetching, in order, while their bytes stay within ``limit``."""
    out, total = [], 0
    for w in weights:
        nbytes = w.numel() * w.element_size()
        if not w.is_contiguous() or total + nbytes > limit:
            break
        out.append(w)
        total += nbytes
    return tuple(out)


def launch_args(regions_: tuple[torch.Tensor, ...], dummy: torch.Tensor) -> tuple[list, dict]:
    """Kernel arguments for up to two regions: ``([ptr0, lines0, ptr1, lines1], constexprs)``."""
    if len(regions_) > 2:
        raise ValueError(f"at most two prefetch regions per launch, got {len(regions_)}")
    args, consts = [], {"PREFETCH": len(regions_)}
    for i in range(2):
        w = regions_[i] if i < len(regions_) else dummy
        elems = LINE_BYTES // w.element_size()
        args += [w, triton.cdiv(w.numel(), elems) if i < len(regions_) else 0]
        consts[f"PF_LINE{i}"] = elems
    return args, consts
