"""Capturing a CUDA graph with the garbage collector kept out of it.

torch no longer collects garbage before a capture (``torch.cuda.graph`` does so only under
``torch.compiler.config.force_cudagraph_gc``), so a dead reference cycle may be collected by the
automatic collector in the middle of one. When that cycle holds an earlier graph (a dropped model's
decode runners, a dropped engine), the earlier graph is destroyed and its memory pool released while
CUDA is recording this one, in the same thread and under the default global capture mode; a capture
of generate()'s decode loop was seen invalidated once, intermittently, in the GPU suite
(bench/RESULTS.md runs 32-33). So a capture first collects what is already dead, outside it, which
also returns that memory before the graph allocates its own, and keeps the collector off until it
ends.
"""

from __future__ import annotations

import contextlib
import gc

import torch


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None):
    """``torch.cuda.graph(graph, pool=pool)`` after a full collection, with no collection inside it."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()
