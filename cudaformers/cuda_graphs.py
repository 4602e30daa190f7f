"""Capturing a CUDA graph with the garbage collector kept out of it.

torch no longer collects garbage before a capture (``torch.cuda.graph`` does so only under
``torch.compiler.config.force_cudagraph_gc``), so a dead reference cycle may be collected by the
automatic collector in the middle of one. When that cycle holds an earlier graph (a dropped model's
decode runners, a dropped engine), the earlier graph would be destroyed and its memory pool released
while CUDA records this one, in the same thread and under the default global capture mode: the
suspected cause (not proven) of a capture of generate()'s decode loop seen invalidated once,
intermittently, in the GPU suite (bench/RESULTS.md runs 32-33). So the collector is off while a
capture runs. It does not collect first: a full collection costs ~140 ms in a process that has
imported transformers (370k objects, measured on the CPU), against captures that come by the dozen
(one per engine bucket, per generate() shape), and the decode runners and engine graphs hold no
reference cycles, so reference counting frees them.

Warm-ups before a capture run on one side stream per device (``warmup_stream``), never a new one: torch
keeps a cuBLAS workspace for every stream cuBLAS has run on until the process ends, so a stream made per
capture kept ~64 MiB per capture on an H100 (bench/RESULTS.md run 34).
"""

from __future__ import annotations

import contextlib
import functools
import gc

import torch


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that eager warm-ups before a capture run on, one per GPU for the process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _side_stream(index)


@functools.cache
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index))


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None):
    """``torch.cuda.graph(graph, pool=pool)`` with no garbage collection inside it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()
