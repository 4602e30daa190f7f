"""Which plan the fragment GEMV (``quant_gemv_mma.py``) runs on each GPU, and which formats run their
gate/up gated there: rules measured per GPU model on qwen3-8b's layers (bench/quant_gemv_mma.py,
bench/RESULTS.md), kept apart from the kernel so that a new GPU's measurements change this file only.

A plan is (warps a program, 16-row tiles a warp, blocks in flight: one of ``DEPTHS``[, how they load:
one of ``LOADS``, described where the kernel does them, in ``quant_gemv_mma.py``])."""
from __future__ import annotations

import torch

from .grid import device_name, sm_count

DEPTHS = (1, 2, 3)  # blocks of weights a warp has in flight while it works on one
REGISTERS, STAGED, STAGED_WEIGHTS, PINNED, PINNED_COHERENT, ORDERED = 0, 1, 2, 3, 4, 5
LOADS = (REGISTERS, STAGED, STAGED_WEIGHTS, PINNED, PINNED_COHERENT, ORDERED)

# The formats whose packed gate/up at one row runs as one launch with the act-and-mul in its epilogue
# (``act`` of ``quant_gemv_mma.quant_gemv_mma``, through ``hub._gated_quant``): the same GEMV work and
# one launch fewer a layer, bit for bit the unfused result. None: per GPU (``gated_formats``); a tuple
# overrides it (benchmarks, tests).
GATED = None


def gated_formats(device: torch.device) -> tuple[str, ...]:
    """qwen3-8b decode: on an H200 (bench/RESULTS.md run 23) int4 406-411 -> 419-425 tok/s, int8 303 -> 296,
    so int8 keeps the two launches there; on an H100 at its own plans (run 26) int4 372 -> 387, int8 271 -> 279."""
    if GATED is not None:
        return GATED
    return ("int4", "int8") if _on_h100(device) else ("int4",)


def default_plan(n: int, fmt: str, device: torch.device) -> tuple:
    """The plan (warps, tiles, depth[, loads]) for ``n`` rows of ``fmt`` on ``device``: the rules measured
    on that GPU where there are some (``_H100_PLAN``), else the H200's (``_H200_PLAN``, also what the
    CPU tests launch)."""
    sms = sm_count(device, 8)
    few = n // 16 <= 2 * sms  # 16-row programs at most two an SM
    pairs = n % 32 == 0  # whole 32-row programs (two tiles a warp)
    pairs_many = pairs and n // 32 >= 4 * sms  # and four or more an SM
    return (_H100_PLAN if _on_h100(device) else _H200_PLAN)(fmt, few, pairs, pairs_many)


def _on_h100(device: torch.device) -> bool:
    return "H100" in device_name(device)


def _H200_PLAN(fmt: str, few: bool, pairs: bool, pairs_many: bool) -> tuple:
    """From qwen3-8b's layers on an H200 (us per call, bench/quant_gemv_mma.py, bench/RESULTS.md run 22),
    before the pinned load modes existed:

    - 16 warps where the 16-row programs are at most two per SM: more warps put more of a program's
      blocks in flight (int4: o 5.5 against 6.3 with 8 warps, down 12.0 against 15.1; int8: o 7.7
      against 8.9, down 16.9 against 22.0, two blocks deep);
    - int4: two tiles a warp where the 32-row programs are four or more per SM (gate/up, a quantized
      lm_head), which share x, its pairing and its sum over twice the rows (gate/up 20.0 against 21.3);
      else one tile, two blocks deep (q/k/v 6.8 against 7.6 one deep);
    - int8: one tile, three blocks deep (q/k/v 10.3 against 11.5 one deep, gate/up 31.6 against 35.9;
      two tiles measured slower on every layer)."""
    if fmt == "int8":
        return (16, 1, 2) if few else (8, 1, 3)
    return (16, 1, 1) if few else (8, 2, 1) if pairs_many else (8, 1, 2)


def _H100_PLAN(fmt: str, few: bool, pairs: bool, pairs_many: bool) -> tuple:
    """From qwen3-8b's layers on an H100 SXM (bench/RESULTS.md runs 25 and 26, which agree within 1.5%):
    the coherent pinned loads (``PINNED_COHERENT``) win 7 of 8 layers, us per call against the H200's
    rules on the same GPU:

    - int4 o and down (few programs): 8 warps, two deep, coherent: o 5.2 against 6.1 (16 warps), down
      12.4 against 12.3 (a tie, one rule for both);
    - int4 q/k/v and gate/up: two tiles a warp, coherent: q/k/v 7.2 against 8.0 (one tile two deep, which
      stays where the rows are not whole pairs of tiles: coherent it took 9.0), gate/up gated 22.4 against
      22.4;
    - int8 few: 16 warps, one deep, coherent: o 7.9 against 9.3, down 19.4 against 21.1;
    - int8 gate/up: two tiles, coherent, 36.7 against 38.6; q/k/v three deep, coherent, 11.2 against 11.9.
    The W2 decode at these plans: int4 2.10-2.13x bf16 (2.06x at the H200's rules), int8 1.47x (1.43x)."""
    if fmt == "int8":
        return (16, 1, 1, PINNED_COHERENT) if few else (8, 2, 1, PINNED_COHERENT) if pairs_many \
            else (8, 1, 3, PINNED_COHERENT)
    if few:
        return 8, 1, 2, PINNED_COHERENT
    return (8, 2, 1, PINNED_COHERENT) if pairs else (8, 1, 2)
