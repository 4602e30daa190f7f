"""The next projection's weights requested into L2 while the current one runs (decode on CUDA).

At decode sizes a projection is a few microseconds of streaming weights, and each one starts with
DRAM idle while its grid ramps up and its first loads travel; between kernels the memory pipe
drains. A decode step runs the same projections in the same order every time, so the order is
recorded once, on the eager warm-up step before a CUDA graph is captured (``recording``), and from
then on each projection's kernel also issues L2 prefetches for the first ``WINDOW`` bytes of the
weights that come next. DRAM then keeps streaming across kernel boundaries, and the next kernel
finds its first tiles in L2. The GEMVs issue the prefetches themselves, before waiting for their
input; larger matmuls (cuBLAS) get a small prefetch kernel launched just before them.

A prefetch is only a hint: it changes no result, and a wrong plan costs bandwidth, never
correctness. The plan lives per weight tensor (weak references: it keeps no model alive) and only
ever links tensors recorded in one step of one model.

Off by default: on an H200 prefetching up to 24 MB of the next weights made decode slower (W1
1,141 -> 1,046 tok/s, W2 204 -> 185, W3 19,374 -> 17,801; bench/RESULTS.md run 8): the requests
queue in front of the current kernel's own loads. ``CUDAFORMERS_L2_PREFETCH=1`` turns it on, and
``CUDAFORMERS_L2_PREFETCH_BYTES`` sets how much of the next weights is requested.
"""

from __future__ import annotations

import functools
import os
import weakref
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from .pdl import pdl_enabled, release_dependents, wait_for_producer

WINDOW = 24 << 20  # most bytes of the next weight ever requested: well inside the L2 of the GPUs that run this
MAX_ROWS = 256     # matmuls up to this many rows are decode-sized (bound by their weights)
LINE = 128         # bytes per L2 line

_recorded: list[torch.Tensor] | None = None
_plan: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def enabled(device: torch.device) -> bool:
    """Prefetches run on CUDA with compiled kernels (the interpreter has no inline PTX)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return os.environ.get("CUDAFORMERS_L2_PREFETCH", "0") == "1"


@contextmanager
def recording():
    """Records the weights projection kernels stream, in order, while the body runs (one decode
    step), and plans each one's successor: the next recorded, the first after the last."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield
        plan(_recorded)
    finally:
        _recorded = outer


def plan(order: list[torch.Tensor]) -> None:
    """Each tensor of ``order`` is followed by the next (cyclically: the step repeats)."""
    for key in [k for k, (a, b) in _plan.items() if a() is None or b() is None]:
        del _plan[key]
    if len(order) < 2:
        return
    for a, b in zip(order, order[1:] + order[:1]):
        if a is not b:
            _plan[a.data_ptr()] = (weakref.ref(a), weakref.ref(b))


def after(weight: torch.Tensor) -> torch.Tensor | None:
    """Notes ``weight`` (while recording) and returns the tensor planned to stream after it, if any."""
    if _recorded is not None:
        _recorded.append(weight)
    entry = _plan.get(weight.data_ptr())
    if entry is None or entry[0]() is not weight:
        return None
    return entry[1]()


def lines(t: torch.Tensor | None) -> int:
    """L2 lines to request from the start of ``t``: all of it, up to ``WINDOW`` bytes."""
    if t is None:
        return 0
    window = min(int(os.environ.get("CUDAFORMERS_L2_PREFETCH_BYTES", WINDOW)), WINDOW)
    return triton.cdiv(min(t.numel() * t.element_size(), window), LINE)


@triton.jit
def prefetch_share(ptr, n_lines, pid, programs, LINE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``pid`` of ``programs`` requests its share of the first ``n_lines`` lines at ``ptr``
    into L2 (no registers wait on them: the program goes on at once)."""
    per = tl.cdiv(n_lines, programs)
    start = pid * per
    end = tl.minimum(start + per, n_lines)
    for first in range(start, end, BLOCK):
        line = first + tl.arange(0, BLOCK)
        line = tl.where(line < end, line, first)  # lanes past the end repeat a line: harmless
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [ptr + line.to(tl.int64) * LINE_ELEMS], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(ptr, n_lines, LINE_ELEMS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    prefetch_share(ptr, n_lines, tl.program_id(0), tl.num_programs(0), LINE_ELEMS, BLOCK)
    wait_for_producer(USE_PDL)  # the chain's order (pdl.py) holds through this launch
    release_dependents(USE_PDL)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs(device: torch.device) -> int:
    return 2 * (_sm_count(device.index or 0) if device.type == "cuda" else 4)


def prefetch_next(weight: torch.Tensor, rows: int) -> None:
    """Before a decode-sized matmul that is not ours (cuBLAS): one small launch that requests the
    weights planned after ``weight`` into L2, so they stream while this matmul runs."""
    if rows > MAX_ROWS or not enabled(weight.device):
        return
    nxt = after(weight)
    n = lines(nxt)
    if n == 0:
        return
    pdl = pdl_enabled(weight.device)
    grid = (min(triton.cdiv(n, 256), _programs(weight.device)),)
    nxt = _as_bytes(nxt)
    if nxt is None:
        return
    _prefetch_kernel[grid](nxt, n, LINE_ELEMS=LINE, BLOCK=256, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)


def _as_bytes(t: torch.Tensor) -> torch.Tensor | None:
    return t.reshape(-1).view(torch.uint8) if t.is_contiguous() else None


def kernel_args(weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(bytes, lines, bytes per line)`` for a projection kernel that prefetches in-kernel: the
    weight planned after ``weight`` as bytes, or no lines (and any byte tensor as a placeholder)."""
    nxt = after(weight) if enabled(weight.device) else None
    nxt = _as_bytes(nxt) if nxt is not None else None
    if nxt is None:
        if weight.device not in _PLACEHOLDER:
            _PLACEHOLDER[weight.device] = torch.empty(16, dtype=torch.uint8, device=weight.device)
        return _PLACEHOLDER[weight.device], 0, LINE
    return nxt, lines(nxt), LINE


_PLACEHOLDER: dict[torch.device, torch.Tensor] = {}
