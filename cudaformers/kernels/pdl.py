"""Programmatic dependent launch (PDL) for the decode path's Triton kernels, on Hopper and newer.

A decode step is a chain of a few hundred small kernels, each a few microseconds long; between two
of them the GPU drains one grid and ramps up the next. With PDL a kernel may be scheduled while its
predecessor is still finishing: it does the work that needs nothing from earlier kernels (streaming
its weights in) and then waits at ``wait_for_producer`` until the predecessor's writes are visible.

The contract every kernel launched with ``launch_pdl=True`` keeps:
- before ``wait_for_producer`` it only *reads* memory no earlier kernel of the step writes
  (weights, constants), asks L2 to prefetch (which returns nothing and cannot read stale data), or
  reads what only kernels two or more launches back wrote (a step's lengths and block tables): by
  the time this grid may start, its predecessor has waited for those kernels to finish. Such reads
  bypass L1 (``.cg``). Every other load and every store comes after the wait;
- every program calls ``wait_for_producer`` exactly once, before any branch that could skip it: a
  grid then cannot complete before its predecessor has, so a chain of early-scheduled kernels stays
  ordered transitively (kernel N+2 waiting on N+1 also waits on N);
- ``release_dependents`` comes after ``wait_for_producer``, so at most two grids overlap.

Kernels that skip PDL (torch's own) are ordinary stream dependencies and break no chain: a
PDL-launched kernel after them simply starts when they end. Training and backward launches stay
plain; only the inference forward kernels of the decode chain take part.

``CUDAFORMERS_PDL=0`` turns it off (to measure it, or to rule it out).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` should launch with ``launch_pdl=True`` and wait in-kernel."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if os.environ.get("CUDAFORMERS_PDL", "1") == "0":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_for_producer(USE_PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel in the stream be scheduled (it still waits for this one to end)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
