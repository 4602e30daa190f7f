"""Integer helpers for sizing launches on the host.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in current Triton (callable
inside kernels as well), and a host call goes through their argument unwrapping: 4-7 us each,
against tens of nanoseconds for the arithmetic. An eager engine step sizes a few hundred launches
with them (about 700 calls in a qwen3-0.6b mixed step, bench/profile_engine.py --host-profile), and
such steps are bound by the host, so host code uses these instead; kernels keep ``tl.cdiv``.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, off_gpu: int) -> int:
    """The SMs of a CUDA ``device`` (cached: the property lookup costs host time per launch), else
    ``off_gpu``: what a caller sizes its grids by on the CPU (the interpreter's tests)."""
    if device.type != "cuda":
        return off_gpu
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The GPU model of a CUDA ``device`` (cached, as ``sm_count``), else ``""``: what launch rules
    measured per GPU model (``quant_gemv_plans.default_plan``) are chosen by."""
    if device.type != "cuda":
        return ""
    return _cuda_device_name(device.index if device.index is not None else torch.cuda.current_device())


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, as ``triton.cdiv``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as ``triton.next_power_of_2``."""
    n = int(n)  # numpy or torch integers too
    return 1 << (n - 1).bit_length() if n > 0 else 0
