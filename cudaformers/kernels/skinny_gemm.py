"""Skinny matmul ``y = x @ W.T + b`` for decode batches of a few dozen rows, on tensor cores.

At 5-64 rows a projection is still memory-bound (a few dozen flops per weight loaded): the whole
job is streaming W once at full bandwidth with enough programs in flight to cover every SM. Below
5 rows ``gemv.py`` does that with elementwise FMAs; here the rows are enough to need ``tl.dot``.

Each program owns ``BLOCK_N`` output features for ``BLOCK_M`` rows (all of them, up to 128) and
walks a range of K. The weights are the MMA's wide operand: ``acc[BLOCK_N, BLOCK_M] = W_tile @
x_tile.T``, so a 64-feature tile fills the tensor core's 64-row side while the batch (16, 32...)
sits on its narrow side. Small N gives too few tiles for the SMs, so K is split: every split stores
an fp32 partial and the last split of a tile to arrive (a per-tile counter, ``arrivals.py``) sums
all partials in split order. One launch, and bitwise the same result whichever split finishes last.

``skinny_linear`` is the entry (forward only; ``F.linear`` is the reference); ``skinny_applies``
says whether it should take a call, with the row range as a parameter (``ROWS`` by default).

An epilogue lets a decode layer drop a launch after the GEMM, bit for bit (on the interpreter) what
the separate kernel computes from the stored output: ``skinny_gated``, a packed gate/up projection
whose tiles pair gate rows with the same up rows, and write ``act(gate) * up`` (the act-and-mul
launch; +2.0% on W3, bench/RESULTS.md run 17).

Tried and measured no faster (run 20): each program asking L2 for all of its weights before its
first wait (inline ``prefetch.global.L2``), so that more bytes are in flight than the pipeline's
stages hold. W3 was unchanged (24,563 / 24,503 tok/s against 24,547 / 24,561), 1% slower on top of
the deeper pipelines below, and the vocabulary projection alone took 31% longer (103 against 79 us).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import UnsupportedError
from .activation import _act_and_grad, _code
from .arrivals import arrival_counters
from .gemv import _rows
from .grid import cdiv, next_power_of_2
from .pdl import pdl_enabled, release_dependents, wait_for_producer

logger = logging.getLogger("cudaformers")

# Rows (tokens) skinny_applies accepts by default; gemv.py takes 1-4. Measured on an H200
# (bench/skinny_gemm.py, bench/RESULTS.md runs 6 and 10): ahead of cuBLAS by 1-11% per layer at
# 8-16 rows; at 17-32 rows about level with it in isolation (qwen3-0.6b: 23.0 vs 24.6 us per layer on
# the sweep's best tiles, which ``plan`` follows) and ahead inside a decode step, where it joins the
# chain of programmatic dependent launches that cuBLAS breaks and merges split-K in the same launch
# (W3, batch 32: +4.6%); behind it from 64 rows on, so cuBLAS keeps those.
ROWS = (5, 32)
_MAX_BLOCK_M = 128
_SMEM_PER_PROGRAM = 100 << 10
WIDE_PROGRAMS_PER_SM = 1 / 3  # programs per SM that 17-32-row launches aim for (see plan)
# Software-pipeline depth at most, for programs that share an SM and for one alone on its SM (a grid of
# at most one program per SM, as 17-32-row layer projections are): alone, it may take most of the SM's
# shared memory for more tiles in flight. At 32 rows on an H200: qwen3-0.6b 22.3 us a layer with 5
# stages against 23.6 with 3 (6: 22.6, 8: 22.9), qwen3-8b 112.5 against 135.5; W3 25,640 / 25,603
# tok/s against 24,585 / 24,601 (bench/RESULTS.md run 20).
MAX_STAGES, ALONE_STAGES = 4, 5
_SMEM_ALONE = 200 << 10
_warned_capture: list[bool] = []  # the capture-without-counters note is logged once per process


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # The interpreter's half-precision tl.dot is broken (triton 3.9): fp32 operands there, which
    # is exact for half inputs and matches a tensor core accumulating in fp32.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _store_rows(acc, b_ptr, y_ptr, rows_w, n_ok, offs_m, m_ok, pid_n, n_out, stride_ym, HAS_BIAS: tl.constexpr,
                ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc ``[BLOCK_N, BLOCK_M]`` fp32 of weight rows ``rows_w`` (+ bias) -> y in y's dtype.

    Plain: ``y[m, rows_w]``. With ACT the first half of acc's rows are gate features, the second
    half the same features of up: ``y[m, f] = act(gate) * up``, both first rounded to y's dtype as
    the stored projection output is, then as act_and_mul computes it (fp32, one rounding)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_w, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = acc.to(y_ptr.dtype.element_ty)
    if ACT >= 0:
        pairs = tl.permute(tl.reshape(out.to(tl.float32), [2, BLOCK_N // 2, BLOCK_M]), [1, 2, 0])
        gate, up = tl.split(pairs)  # [BLOCK_N // 2, BLOCK_M] each
        a, _ = _act_and_grad(gate, ACT)
        feat = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        y = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + feat[:, None]
        tl.store(y, (a * up).to(y_ptr.dtype.element_ty), mask=(feat < n_out)[:, None] & m_ok[None, :])
    else:
        y = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + rows_w[:, None]
        tl.store(y, out, mask=n_ok[:, None] & m_ok[None, :])


# M (the rows) varies from call to call; specialised, it would compile a variant for rows divisible by 16
# and one for the rest, and a serving engine's first eager step with an unseen kind would stall
# every request while it compiles. The rows only bound masks and offsets, which lose nothing.
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT, NUM_SPLITS, stride_xm,
                   stride_wn, stride_ym, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                   UPCAST: tl.constexpr, USE_PDL: tl.constexpr, ACT: tl.constexpr):
    # ACT >= 0 (skinny_gated): W is [gate; up] (N = 2I rows); a tile holds BLOCK_N / 2 gate rows and
    # the same up rows, so its epilogue has both halves of its outputs. Each row's products are the
    # plain launch's (same tiles along K, same splits): only which rows share a program changes.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    if ACT >= 0:
        half = N // 2
        r = tl.arange(0, BLOCK_N)
        feat = pid_n * (BLOCK_N // 2) + r % (BLOCK_N // 2)
        n_ok = feat < half
        offs_n = tl.where(r < BLOCK_N // 2, feat, feat + half)
    else:
        half = N
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    k_begin = pid_k * K_SPLIT  # splits start on BLOCK_K boundaries, so only K itself needs a mask
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]

    # The first weight tile streams in before waiting on the previous kernel (weights are constant);
    # the activations come after the wait.
    k_ok = (k_begin + offs_k) < K
    if EVEN:
        w = tl.load(w_rows + k_begin)
    else:
        w = tl.load(w_rows + k_begin, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    wait_for_producer(USE_PDL)
    x = tl.load(x_rows + k_begin, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    acc = _dot(w, tl.trans(x), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), PREC, UPCAST)
    for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        if EVEN:
            w = tl.load(w_rows + k0)
        else:
            w = tl.load(w_rows + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(w, tl.trans(x), acc, PREC, UPCAST)
    release_dependents(USE_PDL)

    last = True  # this program finishes the tile: always, or with split-K the last split to arrive
    if SPLIT_K:
        # part: [NUM_SPLITS, M, N] fp32. The counter's acq_rel add publishes this partial (the
        # barrier first lets every thread's stores land) and, for the last arrival, makes all the
        # others visible; ".cg" reads them from L2, past this SM's L1.
        out_ok = n_ok[:, None] & m_ok[None, :]
        part = part_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(part + pid_k * M * N, acc, mask=out_ok)
        tl.debug_barrier()
        tile = count_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu")
        last = arrived == NUM_SPLITS - 1
        if last:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(0, NUM_SPLITS):  # fixed order: deterministic
                total += tl.load(part + s * M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
            tl.store(tile, 0)  # zero again for the next call (graph replays reuse the counters)
            acc = total
    if last:
        _store_rows(acc, b_ptr, y_ptr, offs_n, n_ok, offs_m, m_ok, pid_n, half, stride_ym, HAS_BIAS,
                    ACT, BLOCK_N, BLOCK_M)


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int     # rows per program (16..128, a power of two)
    block_n: int     # output features per program
    block_k: int     # K per step
    k_split: int     # K per program, a multiple of block_k; >= K: no split
    num_warps: int = 4
    num_stages: int = 3


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small grids, so tests on small shapes exercise split-K


def plan(m: int, n: int, k: int, dtype: torch.dtype, sms: int, split_ok: bool = True) -> SkinnyConfig:
    """The launch shape for ``[m, k] @ [n, k].T``: enough programs to cover the SMs twice, first
    through narrower output tiles, then by splitting K (bounded so the fp32 partials stay a small
    fraction of the weight bytes)."""
    block_m = min(max(16, next_power_of_2(m)), _MAX_BLOCK_M)
    elem = 4 if dtype == torch.float32 else 2
    # 256-byte weight rows per step; half that when a 128-row x tile shares the shared memory.
    block_k = (256 if block_m <= 64 else 128) // elem
    if interpreting():
        block_k = 32
    m_tiles = cdiv(m, block_m)
    # Enough programs for two per SM, except at 17-32 rows: there the sweep (bench/skinny_gemm.py
    # --sweep --m 32, RESULTS.md run 10) found 64-feature tiles and a third to a half as many programs as
    # SMs fastest on every qwen3-0.6b projection (fewer, longer programs: less ramp-up and tail).
    wide = block_m == 32
    block_n = 64 if wide or cdiv(n, 64) * m_tiles >= sms else 32
    if wide and cdiv(n, 64) * m_tiles >= 4 * sms:  # the vocabulary projection: 78.4 vs 83.3 us at n64
        block_n = 128
    if interpreting():
        block_n = 16
    target = max(1, int(sms * WIDE_PROGRAMS_PER_SM)) if wide else 2 * sms
    tiles = cdiv(n, block_n) * m_tiles
    steps = cdiv(k, block_k)
    # Per output feature a split writes block_m fp32 partials against 2k weight bytes read: keep the
    # partials (written once, read once from L2) at most half the weight bytes.
    max_split = max(1, k // (4 * block_m))
    split = 1
    while split_ok and tiles * split < target and split * 2 <= min(steps, max_split):
        split *= 2
    per_split = cdiv(steps, split)
    alone = tiles * cdiv(steps, per_split) <= sms
    return SkinnyConfig(block_m, block_n, block_k, per_split * block_k,
                        num_stages=pipeline_stages(block_m, block_n, block_k, elem, per_split, alone))


def pipeline_stages(block_m: int, block_n: int, block_k: int, elem: int, steps: int, alone: bool = False) -> int:
    """Software-pipeline depth: stages of a weight and an x tile each (plus one buffer) within
    _SMEM_PER_PROGRAM, so two or three programs share an SM, or within _SMEM_ALONE for a program
    ``alone`` on its SM; no deeper than the loop is long."""
    stage_bytes = (block_n + block_m) * block_k * elem
    cap, smem = (ALONE_STAGES, _SMEM_ALONE) if alone else (MAX_STAGES, _SMEM_PER_PROGRAM)
    return max(1, min(cap, steps, smem // stage_bytes - 1))


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input of {x.shape[-1]} features does not match the weight {tuple(weight.shape)} "
                         "([out_features, in_features])")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}] (the weight's out_features)")
    tensors = [x, weight] + ([bias] if bias is not None else [])
    if any(t.dtype != x.dtype for t in tensors) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise UnsupportedError(f"skinny_linear needs one dtype among float16, bfloat16, float32 for input, weight "
                               f"and bias, got {[t.dtype for t in tensors]}; cast them, or use F.linear")
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"input, weight and bias are on different devices: {[str(t.device) for t in tensors]}")
    if not _triton_ok(x):
        raise UnsupportedError(f"skinny_linear runs on CUDA (or with TRITON_INTERPRET=1), not {x.device}; "
                               "use F.linear there")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise UnsupportedError("skinny_linear has no backward; call it under torch.no_grad() / inference_mode, "
                               "or use F.linear where gradients are needed")


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x ``[..., K]`` (strided rows allowed), weight ``[N, K]`` -> ``[..., N]``
    in x's dtype, accumulated in fp32 (fp32 inputs: exact fp32 products, no tf32). ``config``
    overrides the heuristic launch shape (benchmarks)."""
    _check(x, weight, bias)
    x2 = _rows(x)
    return _launch(x2, weight, bias, config).view(*x.shape[:-1], weight.shape[0])


def skinny_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str = "silu", config: SkinnyConfig | None = None) -> torch.Tensor:
    """``act_and_mul(gate, up)`` for ``gate, up = skinny_linear(x, weight, bias).chunk(2, -1)``, bit for
    bit, in one launch: weight ``[2I, K]`` is a packed gate/up projection, the result ``[..., I]``.
    A decode step's gated MLP then has no act-and-mul launch and no ``[T, 2I]`` intermediate."""
    _check(x, weight, bias)
    act = _code(activation)
    if weight.shape[0] % 2:
        raise ValueError(f"skinny_gated: weight {tuple(weight.shape)} must stack gate and up ([2I, K], even rows)")
    x2 = _rows(x)
    return _launch(x2, weight, bias, config, act).view(*x.shape[:-1], weight.shape[0] // 2)


def _launch(x2, weight, bias, config, act: int = -1) -> torch.Tensor:
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    n_out = n if act < 0 else n // 2
    y = torch.empty(m, n_out, device=x2.device, dtype=x2.dtype)
    if m == 0 or n == 0:
        return y
    if k == 0:
        if act >= 0:
            raise ValueError("skinny_gated needs at least one input feature")
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    # A gated launch takes the plain launch's plan for all 2I rows, so each row's sums are the same.
    cfg = config or plan(m, n, k, x2.dtype, sm_count(x2.device))
    if cfg.block_k <= 0 or cfg.k_split % cfg.block_k:
        raise ValueError(f"{cfg}: k_split must be a positive multiple of block_k")

    def grid_of(c: SkinnyConfig) -> tuple[int, int, int]:  # (feature tiles, K splits, row tiles)
        tiles = cdiv(n, c.block_n) if act < 0 else cdiv(n_out, c.block_n // 2)
        return tiles, cdiv(k, c.k_split), cdiv(m, c.block_m)

    grid = grid_of(cfg)
    counters = arrival_counters(x2.device, grid[0] * grid[2]) if grid[1] > 1 else None
    if grid[1] > 1 and counters is None:
        if config is not None:
            raise ValueError(f"{cfg} splits K, which needs arrival counters that a CUDA-graph capture cannot "
                             "create: run one call outside the capture first")
        if not _warned_capture:
            _warned_capture.append(True)
            logger.info("skinny GEMM: first called inside a CUDA graph capture, so calls captured before one runs "
                        "outside a capture do without split-K; run one call before capturing for the faster launch")
        cfg = plan(m, n, k, x2.dtype, sm_count(x2.device), split_ok=False)
        grid = grid_of(cfg)
    splits = grid[1]
    split_k = splits > 1
    part = torch.empty(splits, m, n, device=x2.device, dtype=torch.float32) if split_k else y
    use_pdl = pdl_enabled(x2.device)
    extra = {"launch_pdl": True} if use_pdl else {}
    rows_even = n % cfg.block_n == 0 if act < 0 else n_out % (cfg.block_n // 2) == 0
    _skinny_kernel[grid](
        x2, weight, bias if bias is not None else y, y, part, counters if split_k else y, m, n, k, cfg.k_split,
        splits, x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=split_k, EVEN=(rows_even and k % cfg.block_k == 0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PREC="ieee" if x2.dtype == torch.float32 else "tf32", UPCAST=interpreting(), USE_PDL=use_pdl, ACT=act,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra)
    return y


def _triton_ok(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" or interpreting()


def skinny_applies(weight: torch.Tensor, x: torch.Tensor, rows: tuple[int, int] = ROWS) -> bool:
    """Whether ``skinny_linear`` should take ``F.linear(x, weight)``: ``rows[0] <= tokens <= rows[1]``,
    no autograd, one supported dtype, a dense weight contiguous along K, a device Triton runs on."""
    tokens = x.numel() // max(x.shape[-1], 1)
    needs_grad = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)
    return (rows[0] <= tokens <= rows[1] and not needs_grad and weight.dim() == 2
            and weight.shape[1] == x.shape[-1] and weight.stride(-1) == 1 and x.dtype == weight.dtype
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.device == weight.device
            and _triton_ok(x))
