"""Mixture-of-experts in Triton: top-k softmax routing and a dropless grouped GEMM over all experts.

The (token, expert) pairs are sorted by expert, so each expert owns a contiguous run of rows. One
launch covers every expert's row tiles (MegaBlocks-style): a tile table built on the device maps
program ids to (expert, first row), sized for the worst case so nothing is read back to the host
and the launch is CUDA-graph safe. No token is dropped, whatever the load imbalance. The weight
gradient is a second grouped kernel that reduces over each expert's rows.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..layers.moe import moe_experts_reference, route_reference
from .activation import act_and_mul_packed
from .grid import cdiv, next_power_of_2


# -- routing ----------------------------------------------------------------------------------------

@triton.jit
def _routing_probs(logits_ptr, t, n_experts, BLOCK_E: tl.constexpr):
    """(expert ids, fp32 softmax over the experts) of token ``t``; padded experts get probability 0."""
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * n_experts + e, mask=e < n_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    return e, p / tl.sum(p, axis=0)


@triton.jit
def _topk_softmax(logits_ptr, w_ptr, idx_ptr, n_experts, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e, p = _routing_probs(logits_ptr, t, n_experts, BLOCK_E)
    total = 0.0
    # k rounds of argmax: k is small (1-8) and the expert axis fits in one block.
    for i in tl.static_range(TOP_K):
        best = tl.argmax(p, axis=0)
        val = tl.max(p, axis=0)
        tl.store(w_ptr + t * TOP_K + i, val)
        tl.store(idx_ptr + t * TOP_K + i, best.to(tl.int64))
        total += val
        p = tl.where(e == best, -1.0, p)
    if RENORM:
        for i in tl.static_range(TOP_K):
            tl.store(w_ptr + t * TOP_K + i, tl.load(w_ptr + t * TOP_K + i) / total)


@triton.jit
def _topk_softmax_bwd(logits_ptr, idx_ptr, dw_ptr, dlogits_ptr, n_experts, TOP_K: tl.constexpr,
                      RENORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """d logits of one token from d weights: through the renormalisation, the gather and the softmax."""
    t = tl.program_id(0).to(tl.int64)
    e, p = _routing_probs(logits_ptr, t, n_experts, BLOCK_E)
    total = 0.0
    dw_dot_w = 0.0
    if RENORM:  # w_k = p_k / S: dp_k = (dw_k - sum_j dw_j w_j) / S
        for i in tl.static_range(TOP_K):
            v = tl.sum(tl.where(e == tl.load(idx_ptr + t * TOP_K + i), p, 0.0), axis=0)
            total += v
            dw_dot_w += tl.load(dw_ptr + t * TOP_K + i) * v
        dw_dot_w = dw_dot_w / total
    dp = tl.zeros([BLOCK_E], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        g = tl.load(dw_ptr + t * TOP_K + i)
        if RENORM:
            g = (g - dw_dot_w) / total
        dp += tl.where(e == tl.load(idx_ptr + t * TOP_K + i), g, 0.0)
    dx = p * (dp - tl.sum(dp * p, axis=0))
    tl.store(dlogits_ptr + t * n_experts + e, dx.to(dlogits_ptr.dtype.element_ty), mask=e < n_experts)


def _route_forward(logits, top_k, renormalize):
    t, e = logits.shape
    weights = torch.empty(t, top_k, device=logits.device, dtype=torch.float32)
    index = torch.empty(t, top_k, device=logits.device, dtype=torch.int64)
    if t:
        _topk_softmax[(t,)](logits, weights, index, e, TOP_K=top_k, RENORM=renormalize,
                            BLOCK_E=next_power_of_2(e))
    return weights, index


class _RouteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, renormalize):
        weights, index = _route_forward(logits, top_k, renormalize)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(logits, index)
        ctx.renormalize = renormalize
        return weights, index

    @staticmethod
    def backward(ctx, dweights, _dindex):
        logits, index = ctx.saved_tensors
        t, e = logits.shape
        dlogits = torch.empty_like(logits)
        if t:
            _topk_softmax_bwd[(t,)](logits, index, dweights.float().contiguous(), dlogits, e,
                                    TOP_K=index.shape[1], RENORM=ctx.renormalize, BLOCK_E=next_power_of_2(e))
        return dlogits, None, None


def route(logits: torch.Tensor, top_k: int, renormalize: bool):
    """Same contract as ``route_reference``; differentiable in the logits (not in the discrete choice)."""
    logits = logits.contiguous()
    if torch.is_grad_enabled() and logits.requires_grad:
        return _RouteFn.apply(logits, top_k, renormalize)
    return _route_forward(logits, top_k, renormalize)


# -- grouped GEMM ---------------------------------------------------------------------------------

# The Triton interpreter's bf16 tl.dot returns garbage (triton 3.9): there the operands go in as fp32
# (they are already rounded to their dtype, so the numbers match an fp32-accumulating tensor core).
_UPCAST = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST or a.dtype == tl.float32:
        # fp32 models get full fp32 products, as torch.matmul gives them (no TF32).
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _grouped_mm(x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr, n_experts, N, K,
                stride_we, stride_wn, stride_wk, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                UPCAST: tl.constexpr):
    """y[r, :] = x[r, :] @ W[e]^T for the rows r of expert e; W[e] is read through strides as [N, K]."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < n_experts:
        row0 = tl.load(tile_row_ptr + tile)
        row_end = tl.load(expert_end_ptr + e)
        rows = row0 + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + (k0 + ks)[None, :],
                        mask=(rows[:, None] < row_end) & (k0 + ks[None, :] < K), other=0.0)
            b = tl.load(w_base + (k0 + ks)[:, None] * stride_wk + cols[None, :] * stride_wn,
                        mask=(k0 + ks[:, None] < K) & (cols[None, :] < N), other=0.0)
            acc = _dot(a, b, acc, UPCAST)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < row_end) & (cols[None, :] < N))


@triton.jit
def _grouped_wgrad(dy_ptr, x_ptr, dw_ptr, expert_start_ptr, expert_end_ptr, N, K,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    """dW[e] = dy[rows of e]^T @ x[rows of e]  ([N, K]), fp32 accumulation; zero for idle experts."""
    e = tl.program_id(0)
    ns = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.program_id(2) * BK + tl.arange(0, BK)
    start = tl.load(expert_start_ptr + e)
    end = tl.load(expert_end_ptr + e)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for r0 in range(start, end, BM):
        rows = r0 + tl.arange(0, BM)
        dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * N + ns[None, :],
                     mask=(rows[:, None] < end) & (ns[None, :] < N), other=0.0)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                    mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0)
        acc = _dot(tl.trans(dy), x, acc, UPCAST)
    tl.store(dw_ptr + e.to(tl.int64) * N * K + ns[:, None] * K + ks[None, :], acc.to(dw_ptr.dtype.element_ty),
             mask=(ns[:, None] < N) & (ks[None, :] < K))


class Schedule:
    """Rows sorted by expert and the tile table of one routing decision (all on the device)."""

    def __init__(self, top_k_index: torch.Tensor, n_experts: int, block_m: int):
        flat = top_k_index.reshape(-1)
        self.order = torch.sort(flat, stable=True).indices  # sorted row -> (token * k + slot)
        counts = torch.bincount(flat, minlength=n_experts)
        self.expert_end = torch.cumsum(counts, 0)
        self.expert_start = self.expert_end - counts
        tiles = (counts + block_m - 1) // block_m
        tile_end = torch.cumsum(tiles, 0)
        max_tiles = cdiv(flat.numel(), block_m) + n_experts  # worst case, known on the host
        ids = torch.arange(max_tiles, device=flat.device)
        self.tile_expert = torch.searchsorted(tile_end, ids, right=True)  # == n_experts: unused tile
        e = self.tile_expert.clamp(max=n_experts - 1)
        self.tile_row = self.expert_start[e] + (ids - (tile_end[e] - tiles[e])) * block_m
        self.n_experts, self.block_m = n_experts, block_m


def _blocks(device) -> tuple[int, int, int]:
    return (64, 64, 32) if device.type == "cuda" else (16, 16, 16)


def grouped_mm(x, w, sched: Schedule, transpose_w: bool = True):
    """x ``[R, K]`` (rows sorted by expert) -> ``[R, N]``: ``x_e @ W[e]^T`` (``W [E, N, K]``) or, with
    ``transpose_w=False``, ``x_e @ W[e]`` (``W [E, K, N]``)."""
    r, k = x.shape
    if transpose_w:
        n, swn, swk = w.shape[1], w.stride(1), w.stride(2)
    else:
        n, swn, swk = w.shape[2], w.stride(2), w.stride(1)
    y = torch.empty(r, n, device=x.device, dtype=x.dtype)
    bm, bn, bk = _blocks(x.device)
    assert bm == sched.block_m
    if r:
        grid = (sched.tile_expert.numel(), cdiv(n, bn))
        _grouped_mm[grid](x, w, y, sched.tile_expert, sched.tile_row, sched.expert_end, sched.n_experts, n, k,
                          w.stride(0), swn, swk, BM=bm, BN=bn, BK=bk, UPCAST=_UPCAST)
    return y


def grouped_wgrad(dy, x, sched: Schedule):
    """``[E, N, K]``: per expert, ``dy_e^T @ x_e`` over its rows."""
    n, k = dy.shape[1], x.shape[1]
    dw = torch.empty(sched.n_experts, n, k, device=x.device, dtype=torch.float32)
    bm, bn, bk = _blocks(x.device)
    _grouped_wgrad[(sched.n_experts, cdiv(n, bn), cdiv(k, bk))](
        dy, x, dw, sched.expert_start, sched.expert_end, n, k, BM=bm, BN=bn, BK=bk, UPCAST=_UPCAST)
    return dw


class _GroupedLinear(torch.autograd.Function):
    """Per-expert ``x_e @ W[e]^T`` on expert-sorted rows, differentiable in x and W."""

    @staticmethod
    def forward(ctx, x, w, sched):
        ctx.save_for_backward(x, w)
        ctx.sched = sched
        return grouped_mm(x, w, sched)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_mm(dy, w, ctx.sched, transpose_w=False) if ctx.needs_input_grad[0] else None
        dw = grouped_wgrad(dy, x, ctx.sched).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def moe_experts(hidden, gate_up_proj, down_proj, top_k_index, top_k_weights, act: str = "silu"):
    """Same contract as ``moe_experts_reference``: hidden ``[T, H]``, ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``, top-k index/weights ``[T, k]`` -> ``[T, H]``; differentiable."""
    t, k = top_k_index.shape
    n_experts, two_i, _ = gate_up_proj.shape
    sched = Schedule(top_k_index, n_experts, _blocks(hidden.device)[0])
    token = sched.order // k
    x = hidden[token].contiguous()                               # [T*k, H], grouped by expert
    gate_up = _GroupedLinear.apply(x, gate_up_proj, sched)      # [T*k, 2I]
    inter = act_and_mul_packed(gate_up, act)                    # [T*k, I]; one packed gradient
    y = _GroupedLinear.apply(inter, down_proj, sched)           # [T*k, H]
    # Back to (token, slot) order, weighted in the weights' dtype, summed per token.
    unsorted = torch.empty_like(y).index_copy(0, sched.order, y).view(t, k, -1)
    return (unsorted * top_k_weights[..., None]).to(hidden.dtype).sum(1)


__all__ = ["moe_experts", "moe_experts_reference", "route", "route_reference", "grouped_mm", "Schedule"]
