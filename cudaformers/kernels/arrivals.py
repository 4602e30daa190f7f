"""Arrival counters: how programs that each compute a part of one result find out which of them
finishes it, inside one launch.

The split-K skinny GEMM (``skinny_gemm.py``), the split quantized tensor-core matmul
(``quant_mma.py``), the split paged decode (``paged_decode.py``) and greedy decoding's argmax
(``greedy_advance.py``) all end the same way: each program
stores its partial, counts its arrival on its tile's counter (``atomic_add`` with acq_rel at GPU
scope), and the one that arrives last merges the partials in a fixed order and sets the counter back
to zero. So the counters are zero between launches, and a launch needs nothing zeroed before it:
one buffer per device serves every launch of every kernel, CUDA-graph replays included.

Two rules keep that sound:

* A kernel touches its counters only after it has waited for the kernel before it (with
  programmatic dependent launch, ``pdl.py``, the early part of a launch overlaps its predecessor),
  so in one stream no two launches use them at once. Kernels on two streams must not run
  concurrently with split launches.
* A buffer is created (zeroed, then synchronised) outside CUDA-graph captures only: one made inside
  a capture would not be zeroed until the graph first runs. ``arrival_counters`` answers None there,
  and the caller launches unsplit (each says so once). A buffer outgrown later is kept alive, since
  captured graphs may still point at it.
"""

from __future__ import annotations

import torch

MIN_COUNTERS = 16384  # the smallest buffer made: one counter per (sequence, kv head) or output tile
_BUFFERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers that captured graphs may still point at: never freed


def arrival_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """At least ``n`` zeroed int32 counters on ``device``, or None inside a CUDA-graph capture that
    would have to create or grow them."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _BUFFERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # zeroed before any stream uses them
        _BUFFERS[device] = buf
    return buf
