"""generate()'s per-token bookkeeping for plain greedy decoding (``loop.advance``) in one launch.

Greedy ``advance`` is a dozen tiny torch kernels per token (eos masking before min_new_tokens, cast,
argmax, padding of finished rows, the output column, eos flags, ends, the next input and its
position, ``step += 1``); in the decode graph each costs a launch and a drain (by estimate 25-35 us
of an ~860 us step at batch 1; W1 rose 7% with this and the fused KV store together, bench/RESULTS.md
run 9). Here it is one launch, bit-exact, grid ``(B, splits)``:

- One row is up to 150k logits; a single program per row would stream it at one SM's rate (by
  estimate several us at batch 1), so the row is cut into ``splits`` chunks of whole ``BLOCK_V``
  tiles and each program leaves its chunk's (max, first index of the max, first NaN index) in a
  scratch buffer. Each lane keeps a running best in registers: one reduction per program, not per
  tile.
- Each program then counts its arrival (``arrivals.py``); the last to arrive combines the partials
  of every row and does the rest of ``advance``, then sets the counter back to zero. It reads
  ``step`` after every other program has (they read it for the eos mask before arriving) and bumps
  it last. That takes a grid of at most one program per SM (batch 1-3 at Qwen3's vocabulary); a
  larger one finishes in a second launch (``ONE_LAUNCH`` has the figures). At batch 1 each launch
  in the decode chain costs ~3.4 us (bench/RESULTS.md run 21).

argmax is torch's on the fp32 values (bf16/fp16 widen exactly): the first index of the maximum, and
a NaN counts as the maximum (the first NaN wins). Nothing is read back to the host: capturable, once
the arrival counters exist (a first call outside a capture makes them; inside a capture without
them the two-launch form runs). On Hopper the launch joins the decode chain's programmatic dependent
launch (``pdl.py``); it reads only activations and loop state, so it waits before its first load.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..device import triton_runs_on
from .arrivals import arrival_counters
from .grid import cdiv, next_power_of_2, sm_count
from .pdl import pdl_enabled, release_dependents, wait_for_producer

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_V = 4096  # logits one program loads per tile
MAX_SPLITS = 64  # programs per row at most (longer rows give each program several tiles)
# The last program to arrive finishes where the grid is at most one program per SM; False: a second
# launch always does (A/B runs). Every program counts its arrival on one counter, and at batch 32
# (~1,200 programs) those atomics cost more than the launch: W3 25,227 against 25,507 tok/s in two
# launches, while W1 gained 1,449-1,456 against 1,444-1,447 (H200, bench/RESULTS.md run 22).
ONE_LAUNCH = True
_NONE = tl.constexpr(2 ** 31 - 1)  # "no index": above every column


@triton.jit
def _partial_argmax(LOGITS, PVAL, PIDX, n_cols, stride_row, chunk, n_splits, EOS, STEP, MIN_NEW,
                    BLOCK: tl.constexpr, MASK_EOS: tl.constexpr, EOS_SLOTS: tl.constexpr):
    """This program's chunk of its row: (max, first index of the max, first NaN index) into the scratch."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * chunk
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], _NONE, tl.int32)
    nan_idx = tl.full([BLOCK], _NONE, tl.int32)
    if MASK_EOS:  # min_new_tokens: eos logits are -inf until then (a NaN there too, as masked_fill does)
        masking = tl.load(STEP) < tl.load(MIN_NEW)
    for off in range(0, chunk, BLOCK):
        cols = start + off + lanes
        ok = (cols < n_cols) & (off + lanes < chunk)
        x = tl.load(LOGITS + row * stride_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if MASK_EOS:
            is_eos = cols < 0
            for i in tl.static_range(EOS_SLOTS):  # -1 pads the list: never a column
                is_eos = is_eos | (cols == tl.load(EOS + i))
            x = tl.where(is_eos & masking, float("-inf"), x)
        is_nan = x != x
        # Tiles come in column order, so a strictly greater value (or a lane's first) keeps the first index.
        take = ok & (~is_nan) & ((x > best) | (best_idx == _NONE))
        best = tl.where(take, x, best)
        best_idx = tl.where(take, cols, best_idx)
        nan_idx = tl.minimum(nan_idx, tl.where(ok & is_nan, cols, _NONE))
    top = tl.max(best, 0)
    out = row * n_splits + split
    tl.store(PVAL + out, top)
    tl.store(PIDX + out, tl.min(tl.where((best == top) & (best_idx != _NONE), best_idx, _NONE), 0))
    tl.store(PIDX + tl.num_programs(0) * n_splits + out, tl.min(nan_idx, 0))


@triton.jit
def _finish_rows(PVAL, PIDX, n_rows, n_splits, TOKENS, POSITIONS, OUT, stride_out, capacity, FINISHED, ENDS, EOS,
                 n_eos, PAD, STEP, MAX_NEW, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    """Every row's token from the partials, and the rest of ``advance``; ``step`` bumped last. The
    partials come from other SMs: read from L2 (``.cg``)."""
    step = tl.load(STEP)
    pad = tl.load(PAD)
    max_new = tl.load(MAX_NEW)
    e = tl.arange(0, BLOCK_E)[None, :]
    eos = tl.load(EOS + e, mask=e < n_eos, other=-1)
    s = tl.arange(0, BLOCK_S)[None, :]
    for b0 in range(0, n_rows, BLOCK_B):
        rows = b0 + tl.arange(0, BLOCK_B)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & (s < n_splits)
        part = rows[:, None] * n_splits + s
        val = tl.load(PVAL + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
        idx = tl.load(PIDX + part, mask=ok, other=_NONE, cache_modifier=".cg")
        first_nan = tl.min(tl.load(PIDX + n_rows * n_splits + part, mask=ok, other=_NONE, cache_modifier=".cg"), 1)
        top = tl.max(val, 1)
        first_top = tl.min(tl.where(val == top[:, None], idx, _NONE), 1)
        token = tl.where(first_nan != _NONE, first_nan, first_top).to(tl.int64)
        done = tl.load(FINISHED + rows, mask=row_ok, other=0) != 0
        token = tl.where(done, pad, token)
        if step < capacity:  # the torch path's index_copy_ rejects a column past the buffer; skipped here
            tl.store(OUT + rows * stride_out + step, token, mask=row_ok)
        hit = tl.sum(((token[:, None] == eos) & (e < n_eos)).to(tl.int32), 1) > 0
        done = done | hit
        tl.store(FINISHED + rows, done, mask=row_ok)
        ends = tl.load(ENDS + rows, mask=row_ok)
        tl.store(ENDS + rows, tl.where(done & (ends == max_new), step + 1, ends), mask=row_ok)
        tl.store(TOKENS + rows, token, mask=row_ok)
        tl.store(POSITIONS + rows, tl.load(POSITIONS + rows, mask=row_ok) + 1, mask=row_ok)
    tl.store(STEP, step + 1)


@triton.jit
def _advance(LOGITS, PVAL, PIDX, ARRIVED, n_cols, stride_row, chunk, n_splits, EOS, STEP, MIN_NEW,
             TOKENS, POSITIONS, OUT, stride_out, capacity, FINISHED, ENDS, n_eos, PAD, MAX_NEW,
             BLOCK: tl.constexpr, MASK_EOS: tl.constexpr, EOS_SLOTS: tl.constexpr, BLOCK_B: tl.constexpr,
             BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, ONE_LAUNCH: tl.constexpr, USE_PDL: tl.constexpr):
    """The partials; with ONE_LAUNCH the last program to arrive also finishes (else ``_finish`` does)."""
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    _partial_argmax(LOGITS, PVAL, PIDX, n_cols, stride_row, chunk, n_splits, EOS, STEP, MIN_NEW, BLOCK, MASK_EOS,
                    EOS_SLOTS)
    if ONE_LAUNCH:
        # Every store of this program happens before its arrival is counted (barrier, then a release at
        # GPU scope); the last arrival acquires them all before it reads.
        tl.debug_barrier()
        n_rows = tl.num_programs(0)
        arrived = tl.atomic_add(ARRIVED, 1, sem="acq_rel", scope="gpu")
        if arrived == n_rows * n_splits - 1:
            _finish_rows(PVAL, PIDX, n_rows, n_splits, TOKENS, POSITIONS, OUT, stride_out, capacity, FINISHED, ENDS,
                         EOS, n_eos, PAD, STEP, MAX_NEW, BLOCK_B, BLOCK_S, BLOCK_E)
            tl.store(ARRIVED, 0)  # ready for the next launch, which stream order puts after this one


@triton.jit
def _finish(PVAL, PIDX, n_rows, n_splits, TOKENS, POSITIONS, OUT, stride_out, capacity, FINISHED, ENDS, EOS,
            n_eos, PAD, STEP, MAX_NEW, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
            USE_PDL: tl.constexpr):
    wait_for_producer(USE_PDL)
    release_dependents(USE_PDL)
    _finish_rows(PVAL, PIDX, n_rows, n_splits, TOKENS, POSITIONS, OUT, stride_out, capacity, FINISHED, ENDS, EOS,
                 n_eos, PAD, STEP, MAX_NEW, BLOCK_B, BLOCK_S, BLOCK_E)


def is_greedy(kind) -> bool:
    """Whether a ``LoopKind`` is plain greedy: argmax of the logits (top-k/p and min-p only act when
    sampling) with eos masked before min_new_tokens, no repetition penalty."""
    return not (kind.sampling or kind.penalty)


def supports(logits: torch.Tensor, state) -> bool:
    """Whether ``greedy_advance`` takes these (else: ``greedy_advance_reference``)."""
    flat = (state.tokens, state.positions, state.finished, state.ends, state.eos)
    return (triton_runs_on(logits.device) and is_greedy(state.kind) and logits.dim() == 2 and logits.dtype in LOGIT_DTYPES
            and logits.shape[0] == state.out.shape[0] and 0 < logits.shape[1] < 2 ** 31 - 1
            and logits.stride(1) == 1 and state.out.stride(1) == 1
            and all(t.is_contiguous() and t.device == logits.device for t in flat))


def greedy_advance(logits: torch.Tensor, state) -> None:
    """``loop.advance(logits, state)`` for a plain greedy ``state.kind``: the argmax of ``logits [B, V]``
    per row, padded where finished, into ``out[:, step]``, ``tokens``, ``finished``, ``ends``; ``positions``
    and ``step`` += 1."""
    if not is_greedy(state.kind):
        raise ValueError(f"greedy_advance: {state.kind} is not plain greedy decoding (no sampling or "
                         f"repetition penalty)")
    if not supports(logits, state):
        raise ValueError(f"greedy_advance: needs logits [B={state.out.shape[0]}, V] of {LOGIT_DTYPES} with a unit "
                         f"column stride on CUDA (or the interpreter), and contiguous loop buffers on its device; "
                         f"got {tuple(logits.shape)} {logits.dtype}, strides {logits.stride()}, on {logits.device}")
    rows, cols = logits.shape
    chunk = max(1, cdiv(cdiv(cols, MAX_SPLITS), BLOCK_V)) * BLOCK_V
    splits = cdiv(cols, chunk)
    pval = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    pidx = torch.empty(2, rows, splits, dtype=torch.int32, device=logits.device)
    pdl = pdl_enabled(logits.device)
    one = ONE_LAUNCH and rows * splits <= sm_count(logits.device, 4)
    arrived = arrival_counters(logits.device, 1) if one else None
    block_s = next_power_of_2(splits)
    block_b = min(next_power_of_2(rows), max(1, 2048 // block_s))
    block_e = next_power_of_2(max(state.eos.numel(), 1))
    _advance[(rows, splits)](logits, pval, pidx, pidx if arrived is None else arrived, cols, logits.stride(0), chunk,
                             splits, state.eos, state.step, state.min_new, state.tokens, state.positions, state.out,
                             state.out.stride(0), state.out.shape[1], state.finished, state.ends, state.eos.numel(),
                             state.pad, state.max_new, BLOCK=BLOCK_V, MASK_EOS=state.kind.min_new,
                             EOS_SLOTS=state.eos.numel(), BLOCK_B=block_b, BLOCK_S=block_s, BLOCK_E=block_e,
                             ONE_LAUNCH=arrived is not None, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    if arrived is None:
        _finish[(1,)](pval, pidx, rows, splits, state.tokens, state.positions, state.out, state.out.stride(0),
                      state.out.shape[1], state.finished, state.ends, state.eos, state.eos.numel(), state.pad,
                      state.step, state.max_new, BLOCK_B=block_b, BLOCK_S=block_s, BLOCK_E=block_e, USE_PDL=pdl,
                      num_warps=4, launch_pdl=pdl)


def greedy_advance_reference(logits: torch.Tensor, state) -> None:
    """The torch ops ``loop.advance`` runs for a plain greedy kind (``logits.float().argmax(-1)``, ...)."""
    from ..generation.loop import advance_torch

    if not is_greedy(state.kind):
        raise ValueError(f"greedy_advance_reference: {state.kind} is not plain greedy decoding")
    advance_torch(logits, state)


__all__ = ["greedy_advance", "greedy_advance_reference", "supports", "is_greedy"]
