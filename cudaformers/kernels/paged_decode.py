"""Flash-decoding over the paged KV cache, in Triton: one new query token per sequence, one launch.

Grid ``(sequence, kv head, split)``: each program reads one slice of its sequence's keys through the
block table once and serves every query head of its GQA group with it (decode is bound by reading
the cache, so each key byte is read once per step).

Decode latency at short contexts is a chain of dependent memory accesses (length -> block table ->
keys -> output), so the kernel keeps that chain short: split 0 requests its first block-table
entries together with the length, each program keeps three tiles of K and V in flight, and a short
context runs in a single program that writes the final output itself.

The grid's split count is fixed at launch (CUDA graphs replay it for every context up to the
capacity); how many splits a sequence *uses* is decided on the device from its length
(``DecodeTiling.split_above``), and splits past that count exit at once. Used splits merge inside
the same launch: each writes its normalised partial output and logsumexp, then counts its arrival
for its (sequence, kv head); the last to arrive merges the partials and resets the counter to zero.
No second kernel. The counters are one small zeroed int32 buffer per device, kept for the life of
the process, so split launches on one device must not run concurrently on two streams.

CUDA-graph capturable: the grid depends only on tensor shapes and the Python int ``max_seqlen_k``
(the cache capacity during capture), and nothing is read back to the host.

With ``FUSED`` the same kernel also does qk_norm_rope's work for the new token: q and the new key
from the raw projections, the new key and value into the softmax from registers and into the cache
(``paged_decode_fused.py`` has the design). One main loop serves both launches.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters
from .flash_attention import attention_reference
from .flash_attention_fwd import (LOG2E, _UPCAST_DOT, _dot, _dot_precision, block_d, check_inputs, interpreting,
                                  output_like)
from .grid import cdiv, next_power_of_2, sm_count
from .l2_prefetch import LINE_BYTES, prefetch_l2
from .pdl import pdl_enabled, release_dependents, wait_for_producer
from .qk_norm_rope import norm_rope, rope_layout, rope_rows

logger = logging.getLogger("cudaformers")

MAX_SPLITS = 64
# Busy grids (a program per SM or more): split contexts past this many keys into pieces of at least
# this many tiles, each program keeping BUSY_STAGES - 1 tiles in flight (default_tiling).
BUSY_SPLIT_ABOVE, BUSY_SPLIT_TILES, BUSY_STAGES = 2048, 3, 4
# Grids of fewer programs than SMs (decode at batch 1): warps, keys a tile (0: 32 KB of K at bf16) and
# stages. W1 on an H200 (bench/generate.py "latW.N.S", bench/RESULTS.md run 23): 4 warps of 64-key tiles
# in 2 stages 1,518 tok/s, 3 stages 1,507-1,509, 4 stages 1,473; 32-key tiles 1,463, 128-key (the
# former default, 32 KB of K) 1,452, 8 warps of 64-key tiles 1,407: smaller tiles split a short context
# over more programs, each with fewer keys in its chain.
LATENCY_WARPS, LATENCY_KEYS, LATENCY_STAGES = 4, 64, 2
# fp32 elements of partial outputs the merging program holds at once (64 registers a thread at 4 warps).
_MERGE_ELEMENTS = 8192


@triton.jit
def _slots(bt_row, pos, mask, PAGE_SIZE: tl.constexpr, CACHE: tl.constexpr):
    """Cache row of each key position (int64); masked positions get a harmless row of block 0."""
    block = tl.load(bt_row + pos // PAGE_SIZE, mask=mask, other=0, cache_modifier=CACHE)
    return block.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE


@triton.jit
def _merge_splits(O_PART, LSE, O, seq, heads, g_mask, offs_d, d_mask, used,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                  BLOCK_GM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr):
    """Weighted sum of the ``used`` partial outputs of heads ``heads`` by their (base-2) logsumexps."""
    offs_s = tl.arange(0, BLOCK_S)
    lse_row = LSE + seq.to(tl.int64) * stride_lb + heads[None, :] * stride_lh
    # .cg: the partials were written by other programs, maybe on other SMs; never trust this SM's L1.
    lse = tl.load(lse_row + offs_s[:, None], mask=(offs_s < used)[:, None] & g_mask[None, :],
                  other=float("-inf"), cache_modifier=".cg")  # [BLOCK_S, BLOCK_GM]
    m = tl.where(g_mask, tl.max(lse, 0), 0.0)  # every used split saw keys: finite for real heads
    total = tl.sum(tl.exp2(lse - m[None, :]), 0)
    part_row = O_PART + seq.to(tl.int64) * stride_pb + heads[None, :, None] * stride_ph + offs_d[None, None, :]
    acc = tl.zeros([BLOCK_GM, BLOCK_D], tl.float32)
    for s0 in range(0, used, CHUNK_S):
        offs_c = s0 + tl.arange(0, CHUNK_S)
        c_mask = (offs_c < used)[:, None] & g_mask[None, :]
        w = tl.exp2(tl.load(lse_row + offs_c[:, None], mask=c_mask, other=float("-inf"), cache_modifier=".cg")
                    - m[None, :])  # [CHUNK_S, BLOCK_GM]
        part = tl.load(part_row + offs_c[:, None, None] * stride_ps, mask=c_mask[:, :, None] & d_mask[None, None, :],
                       other=0.0, cache_modifier=".cg")  # [CHUNK_S, BLOCK_GM, BLOCK_D]
        acc += tl.sum(w[:, :, None] * part, 0)
    out = acc / tl.where(g_mask, total, 1.0)[:, None]
    o_ptrs = O + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _query(Q, K_NEW, V_NEW, COS, SIN, SLOTS, O, K, V, seq, kv_head, heads, g_mask, offs_d, d_mask,
           partner, sign, rotated, q_w, q_wp, k_w, k_wp, q_eps, k_eps,
           stride_qt, stride_qh, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_ct, stride_st,
           HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, FUSED: tl.constexpr):
    """This program's queries ``[BLOCK_G, BLOCK_D]`` in O's dtype; with FUSED, also the new token's key
    and value ``[1, BLOCK_D]`` as the cache holds them, and its cache slot (else placeholders).

    FUSED computes q and k as qk_norm_rope does (the same ``norm_rope`` arithmetic, rounded to its
    output dtype, which is O's) and then casts k and v to the cache's dtype as its fused store does:
    the values the unfused path would write to the cache and read back."""
    q_row = Q + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_mask = g_mask[:, None] & d_mask[None, :]
    if FUSED:
        cols = offs_d[None, :]
        c, s = rope_rows(COS + seq.to(tl.int64) * stride_ct, SIN + seq.to(tl.int64) * stride_st, cols, sign, rotated)
        x = tl.load(q_row + cols, mask=q_mask, other=0.0).to(tl.float32)
        xp = tl.load(q_row + partner, mask=q_mask, other=0.0).to(tl.float32)
        q = norm_rope(x, xp, q_w.to(tl.float32), q_wp.to(tl.float32), c, s, q_eps, HEAD_DIM,
                      HAS_NORM).to(O.dtype.element_ty)
        k_row = K_NEW + seq.to(tl.int64) * stride_nkt + kv_head * stride_nkh
        kv_mask = d_mask[None, :]
        x = tl.load(k_row + cols, mask=kv_mask, other=0.0).to(tl.float32)    # [1, BLOCK_D]
        xp = tl.load(k_row + partner, mask=kv_mask, other=0.0).to(tl.float32)
        k_new = norm_rope(x, xp, k_w.to(tl.float32), k_wp.to(tl.float32), c, s, k_eps, HEAD_DIM,
                          HAS_NORM).to(O.dtype.element_ty)
        k_new = k_new.to(K.dtype.element_ty)
        v_row = V_NEW + seq.to(tl.int64) * stride_nvt + kv_head * stride_nvh
        v_new = tl.load(v_row + cols, mask=kv_mask, other=0.0).to(V.dtype.element_ty)
        slot = tl.load(SLOTS + seq).to(tl.int64)
    else:
        q = tl.load(q_row + offs_d[None, :], mask=q_mask, other=0.0)
        k_new = q
        v_new = q
        slot = seq
    return q, k_new, v_new, slot


@triton.jit
def _paged_decode_kernel(
    Q, K, V, O,  # Q/O [B, Hq, D]; K/V flattened pages [slots, Hkv, D]
    O_PART, LSE, ARRIVED,  # O_PART [B, Hq, S, D] fp32; LSE [B, Hq, S] fp32 (base 2); ARRIVED [B * Hkv] int32
    seqlens_k, block_table, table_keys, qk_scale, window, split_above,
    # FUSED: Q is the raw projection; K_NEW/V_NEW [B, Hkv, D] raw; Q_W/K_W [D]; COS/SIN [B, R]; SLOTS [B]
    K_NEW, V_NEW, Q_W, K_W, COS, SIN, SLOTS, q_eps, k_eps, half, rot,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_ot, stride_oh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_ct, stride_st,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_GM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    MAY_SPLIT: tl.constexpr, SPLIT_TILES: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr,
    LINES: tl.constexpr, LINE_ELEMS: tl.constexpr, CACHE: tl.constexpr,
    FUSED: tl.constexpr, HAS_NORM: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUPS
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUPS + offs_g
    partner, sign, rotated = rope_layout(offs_d[None, :], half, rot)
    if FUSED and HAS_NORM:  # weights: requested while the previous kernel drains, converted after the wait
        q_w = tl.load(Q_W + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        q_wp = tl.load(Q_W + partner, mask=d_mask[None, :], other=0.0)
        k_w = tl.load(K_W + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        k_wp = tl.load(K_W + partner, mask=d_mask[None, :], other=0.0)
    else:  # never read
        q_w = sign
        q_wp = sign
        k_w = sign
        k_wp = sign
    if not EARLY:
        # Everything below reads what earlier kernels of the step wrote (q, the cache, lengths, tables).
        wait_for_producer(USE_PDL)
        release_dependents(USE_PDL)
        # q (and the new token) do not depend on the length: their loads are in flight while the
        # length -> range -> block table chain runs.
        q, k_new, v_new, slot = _query(
            Q, K_NEW, V_NEW, COS, SIN, SLOTS, O, K, V, seq, kv_head, heads, g_mask, offs_d, d_mask,
            partner, sign, rotated, q_w, q_wp, k_w, k_wp, q_eps, k_eps,
            stride_qt, stride_qh, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_ct, stride_st,
            HEAD_DIM, HAS_NORM, FUSED)  # q [BLOCK_G, BLOCK_D]
    # EARLY: the length and block table are read before the wait. Kernels that had finished before the
    # previous kernel released this grid wrote them (pdl.py); CACHE = ".cg" then reads them from L2,
    # never from a line an SM cached earlier.
    k_len = tl.load(seqlens_k + seq, cache_modifier=CACHE)
    # Split 0 starts at key 0 (without a window), so its first tile's block-table entries do not wait
    # for the length: requested now, they arrive with it. Entries past the length are never used.
    bt_row = block_table + seq.to(tl.int64) * stride_bt
    offs_k = tl.arange(0, BLOCK_N)
    rows = _slots(bt_row, offs_k, offs_k < table_keys, PAGE_SIZE, CACHE)
    lo = 0
    if HAS_WINDOW:  # the query sits at position k_len - 1 and sees keys j > k_len - 1 - window
        lo = tl.maximum(k_len - window, 0)
    visible = k_len - lo
    used = 1
    per_split = visible
    if MAY_SPLIT:
        # A context longer than split_above is cut into as many splits as the grid has, but no
        # fewer than SPLIT_TILES whole tiles each (what one program keeps in flight at once); a
        # shorter one runs in one program.
        n = tl.maximum(visible, 1)
        n_tiles = tl.cdiv(n, BLOCK_N)
        used = tl.where(n > split_above, tl.minimum(tl.cdiv(n_tiles, SPLIT_TILES), tl.num_programs(2)), 1)
        per_split = tl.cdiv(n_tiles, used) * BLOCK_N
        used = tl.cdiv(n, per_split)
        if split >= used:
            if EARLY:  # every program waits once (pdl.py), even one with nothing to do
                wait_for_producer(USE_PDL)
                release_dependents(USE_PDL)
            return
    start = lo + split * per_split
    end = tl.minimum(start + per_split, k_len)
    if start != 0:
        rows = _slots(bt_row, start + offs_k, start + offs_k < end, PAGE_SIZE, CACHE)

    Kh = K + kv_head * stride_kh
    Vh = V + kv_head * stride_vh
    if EARLY:
        # While the previous kernel drains, L2 fetches this program's first tile of K and V from HBM. A
        # prefetch only: the newest row, which that kernel is writing, is read after the wait.
        lines = (tl.arange(0, LINES) * LINE_ELEMS)[None, :]
        first = tl.where((start + tl.arange(0, BLOCK_N) < end)[:, None], rows[:, None], 0)
        prefetch_l2(Kh + first * stride_kt + lines)
        prefetch_l2(Vh + first * stride_vt + lines)
        wait_for_producer(USE_PDL)
        release_dependents(USE_PDL)
        q, k_new, v_new, slot = _query(
            Q, K_NEW, V_NEW, COS, SIN, SLOTS, O, K, V, seq, kv_head, heads, g_mask, offs_d, d_mask,
            partner, sign, rotated, q_w, q_wp, k_w, k_wp, q_eps, k_eps,
            stride_qt, stride_qh, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_ct, stride_st,
            HEAD_DIM, HAS_NORM, FUSED)
    # FUSED: this launch writes the new token's row (position k_len - 1), so no program reads it from
    # the cache: the tiles stop short of it, and the split whose range holds it (the last used one)
    # adds it to its softmax from registers after them. The main loop stays the plain kernel's: a
    # select swapping the key into its tile made the launch up to 2x slower (paged_decode_fused.py).
    kv_end = end
    if FUSED:
        kv_end = tl.minimum(end, k_len - 1)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start_n in range(start, kv_end, BLOCK_N):
        # Every tile holds at least one real key, so the running max stays finite.
        offs_n = start_n + offs_k
        valid = offs_n < kv_end
        kv_mask = valid[:, None] & d_mask[None, :]
        # K and V are requested together, then the next tile's block-table entries: all of it is
        # in flight while this tile's scores are computed.
        k = tl.load(Kh + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(Vh + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        rows = _slots(bt_row, offs_n + BLOCK_N, offs_n + BLOCK_N < kv_end, PAGE_SIZE, CACHE)
        s = _dot(q, tl.trans(k), PREC, UPCAST) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, PREC, UPCAST)
        m_i = m_new
    if FUSED:
        holds_new = split == used - 1
        if holds_new & (k_len > 0):
            # The new key as one more (one-key) tile: rounded as the cache would hold it, and p as the
            # tiles round it for the PV product.
            k_one = k_new.to(q.dtype).to(tl.float32)  # [1, BLOCK_D]
            v_one = v_new.to(q.dtype).to(tl.float32)
            s_new = tl.sum(q.to(tl.float32) * k_one, 1) * qk_scale  # [BLOCK_G]
            m_new = tl.maximum(m_i, s_new)
            p_new = tl.exp2(s_new - m_new)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new.to(q.dtype).to(tl.float32)[:, None] * v_one
            m_i = m_new
        # The same program (one per sequence and kv head) stores the new row, after the tiles, when the
        # slot's load is long back. Negative slots (padding) are skipped.
        if holds_new & (slot >= 0):
            tl.store(Kh + slot * stride_kt + offs_d[None, :], k_new, mask=d_mask[None, :])
            tl.store(Vh + slot * stride_vt + offs_d[None, :], v_new, mask=d_mask[None, :])

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i == 0 only for an empty sequence: zeros
    if used == 1:
        o_ptrs = O + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        p_ptrs = O_PART + seq.to(tl.int64) * stride_pb + split * stride_ps + heads[:, None] * stride_ph
        tl.store(p_ptrs + offs_d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
        lse = m_i + tl.log2(l_i)
        tl.store(LSE + seq.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=g_mask)
        # All of this program's stores happen before its arrival is counted (barrier, then a release
        # at GPU scope); the last arrival acquires them all before it reads.
        tl.debug_barrier()
        counter = ARRIVED + seq * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == used - 1:
            offs_gm = tl.arange(0, BLOCK_GM)
            gm_mask = offs_gm < GROUPS
            _merge_splits(O_PART, LSE, O, seq, kv_head * GROUPS + offs_gm, gm_mask, offs_d, d_mask, used,
                          stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ot, stride_oh,
                          BLOCK_GM, BLOCK_D, BLOCK_S, CHUNK_S)
            tl.store(counter, 0)  # ready for the next launch, which stream order puts after this one


@dataclass(frozen=True)
class DecodeTiling:
    """How a launch cuts the work.

    ``block_n`` keys per tile; ``num_stages`` software-pipeline stages (``num_stages - 1`` tiles of
    K and V in flight per program); a context longer than ``split_above`` keys is split into at most
    the grid's splits of at least ``split_tiles`` tiles, a shorter one runs in one program.
    """

    block_n: int
    num_warps: int
    num_stages: int
    split_above: int
    split_tiles: int


def _sms(device: torch.device) -> int:
    return 4 if interpreting() else sm_count(device, 4)


@functools.lru_cache(maxsize=None)
def default_tiling(num_seqs: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> DecodeTiling:
    """How to cut one decode launch, by how much work the grid has (measured on an H200 with
    ``bench/paged_decode.py --sweep``, bench/RESULTS.md run 8).

    A program's first tiles are requested together, so it covers its first tiles in about one
    memory latency. With few sequences (fewer programs than SMs) decode is pure latency: 32 KB tiles
    of K (128 keys at head_dim 128), double-buffered, and a context longer than one tile split into
    one-tile pieces that merge in the same launch (W1, batch 1 at 128-384 keys: 1,236 tok/s against
    1,186 when splitting only past 512 keys, ``bench/paged_split_ab.py``, run 9). Once every SM has
    a program the GPU is busy anyway: 16 KB tiles, three in flight, and splitting only balances long contexts (2 splits beat 1
    by 11% at B=32 x 8k keys); at four or more programs per SM, 8 KB tiles let four programs share
    an SM.
    """
    if interpreting():  # small tiles keep the CPU tests quick and still cover every path
        return DecodeTiling(block_n=16, num_warps=4, num_stages=1, split_above=32, split_tiles=1)
    bd = block_d(head_dim)
    programs = num_seqs * num_kv_heads
    busy = programs >= _sms(device)
    if dtype.itemsize > 2:  # fp32 (exactness tests, mostly): the tiles that compile without register spills
        block_n, stages = (64, 2) if bd <= 128 else (16, 4)
        tiling = DecodeTiling(block_n, 4, stages, 2048 if busy else 8 * block_n, max(1, stages - 1))
    elif not busy and bd <= 128:  # B=1 x 256-800 keys: 15-25% faster than 16 KB tiles
        block_n = LATENCY_KEYS or 16384 // bd
        tiling = DecodeTiling(block_n=block_n, num_warps=LATENCY_WARPS, num_stages=LATENCY_STAGES,
                              split_above=block_n, split_tiles=1)
    else:  # B=128-256 x 256-800 keys: 8 KB tiles 8-15% faster; B=32: 16 KB tiles faster
        block_n = 4096 // bd if programs >= 4 * _sms(device) else 8192 // bd
        tiling = DecodeTiling(block_n=block_n, num_warps=4, num_stages=BUSY_STAGES,
                              split_above=BUSY_SPLIT_ABOVE if busy else 8 * block_n, split_tiles=BUSY_SPLIT_TILES)
    logger.debug("paged decode: %s for %d sequences x %d kv heads, head_dim %d, %s", tiling, num_seqs,
                 num_kv_heads, head_dim, dtype)
    return tiling


def split_plan(num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device,
               block_n: int) -> tuple[int, int]:
    """``(num_splits, keys_per_split at full capacity)``: enough programs for ~2 waves, at least one tile each.

    This sizes the grid only: each sequence then uses as many of these splits as its length needs.
    """
    programs = max(1, num_seqs * num_kv_heads)
    splits = min(cdiv(2 * _sms(device), programs), cdiv(max(max_seqlen_k, 1), block_n), MAX_SPLITS)
    return _even_splits(max(1, splits), max_seqlen_k, block_n)


def _even_splits(splits: int, max_seqlen_k: int, block_n: int) -> tuple[int, int]:
    per_split = cdiv(cdiv(max(max_seqlen_k, 1), splits), block_n) * block_n
    return cdiv(max(max_seqlen_k, 1), per_split), per_split


_warned_capture: list[bool] = []


class NewToken(NamedTuple):
    """The fused prologue's inputs (``paged_decode_fused.py``): each sequence's new token as projected,
    ``k``/``v [B, Hkv, D]`` (q is the launch's query), optional q/k RMSNorm weights ``[D]`` and eps,
    rotary ``cos``/``sin [B, R]`` and the cache ``slots [B]`` its key and value go to."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    q_eps: float
    k_eps: float
    slots: torch.Tensor


def paged_decode(q, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k: int, scale: float,
                 window: int | None = None, num_splits: int | None = None,
                 tiling: DecodeTiling | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence against its paged keys: ``q [B, Hq, D]`` -> ``[B, Hq, D]``.

    ``k_cache``/``v_cache`` are ``[num_blocks, page, Hkv, D]``; sequence b has ``seqlens_k[b]`` keys
    (its query is the last of them) at the slots named by ``block_table[b]``. ``max_seqlen_k`` bounds
    every ``seqlens_k[b]`` and sizes the grid. ``num_splits`` fixes the grid's splits (default: from
    the SM count); ``tiling`` overrides ``default_tiling`` (benchmarks, tests). ``out`` (q's shape and
    dtype, last dim contiguous; e.g. the leading rows of a mixed step's output) receives the result.
    """
    check_inputs(q, k_cache, v_cache)
    q = q if q.stride(-1) == 1 else q.contiguous()
    return launch(q, output_like(q, out), k_cache, v_cache, seqlens_k, block_table, max_seqlen_k, scale, window,
                  num_splits, tiling)


def launch(q, out, k_cache, v_cache, seqlens_k, block_table, max_seqlen_k: int, scale: float, window: int | None,
           num_splits: int | None, tiling: DecodeTiling | None, new: NewToken | None = None) -> torch.Tensor:
    """The kernel launch behind ``paged_decode`` (``new=None``: q is final) and ``paged_decode_fused``
    (q as projected, ``new`` the rest of the token): writes and returns ``out [B, Hq, D]``.
    Inputs are checked by the callers; last dims contiguous."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} decode queries")
    k = k_cache.view(-1, num_kv_heads, head_dim)
    v = v_cache.view(-1, num_kv_heads, head_dim)
    if num_seqs == 0:
        return out
    tiling = tiling or default_tiling(num_seqs, num_kv_heads, head_dim, out.dtype, q.device)
    if num_splits is None:
        splits, _ = split_plan(num_seqs, num_kv_heads, max_seqlen_k, q.device, tiling.block_n)
    else:
        splits, _ = _even_splits(min(max(num_splits, 1), MAX_SPLITS), max_seqlen_k, tiling.block_n)
    arrived = arrival_counters(q.device, num_seqs * num_kv_heads) if splits > 1 else None
    if splits > 1 and arrived is None:
        if not _warned_capture:
            _warned_capture.append(True)
            logger.warning("paged decode: a CUDA graph captured before any eager call has no split counters, so "
                           "each sequence runs in one program in it (slower at long contexts); run one decode "
                           "step before capturing")
        splits = 1
    groups = num_heads // num_kv_heads
    bd = block_d(head_dim)
    block_gm = max(2, next_power_of_2(groups))
    block_s = max(2, next_power_of_2(splits))
    if splits > 1:
        part = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        split_strides = (part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    else:  # never touched: the only split writes the output
        part, lse, arrived, split_strides = out, out, seqlens_k, (0,) * 5
    if new is None:  # never read
        fused_args, fused_strides, has_norm = (q, q, q, q, q, q, seqlens_k, 0.0, 0.0, 0, 0), (0,) * 6, False
    else:
        has_norm = new.q_weight is not None
        w = (new.q_weight, new.k_weight) if has_norm else (q, q)
        rot = new.cos.shape[1]
        fused_args = (new.k, new.v, *w, new.cos, new.sin, new.slots, new.q_eps, new.k_eps, rot // 2, rot)
        fused_strides = (new.k.stride(0), new.k.stride(1), new.v.stride(0), new.v.stride(1), new.cos.stride(0),
                         new.sin.stride(0))
    pdl = pdl_enabled(q.device)
    # With PDL and fewer programs than SMs (decode is latency then), the launch requests its length,
    # block table and (into L2) first K/V tile before waiting for the previous kernel: qwen3-0.6b at
    # batch 1 1,320 -> 1,363 tok/s on an H200; at batch 32 (a busy grid) it cost 14% (RESULTS.md run 11).
    # PDL is never on under the interpreter, which has no prefetch instruction.
    early = pdl and num_seqs * num_kv_heads < _sms(q.device)
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k, v, out, part, lse, arrived, seqlens_k, block_table, block_table.shape[1] * page_size,
        scale * LOG2E, window or 0, tiling.split_above, *fused_args,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), *split_strides, *fused_strides,
        HEAD_DIM=head_dim, BLOCK_D=bd, GROUPS=groups, BLOCK_G=max(16, next_power_of_2(groups)),
        BLOCK_GM=block_gm, BLOCK_N=tiling.block_n, PAGE_SIZE=page_size, HAS_WINDOW=bool(window),
        MAY_SPLIT=splits > 1, SPLIT_TILES=tiling.split_tiles, BLOCK_S=block_s,
        CHUNK_S=max(1, min(block_s, _MERGE_ELEMENTS // (block_gm * bd))),
        PREC=_dot_precision(out.dtype), UPCAST=_UPCAST_DOT, USE_PDL=pdl, EARLY=early, CACHE=".cg" if early else "",
        LINES=next_power_of_2(cdiv(head_dim * k.element_size(), LINE_BYTES)),
        LINE_ELEMS=LINE_BYTES // k.element_size(), FUSED=new is not None, HAS_NORM=has_norm,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages, launch_pdl=pdl)
    return out


def paged_decode_reference(q, k_cache, v_cache, seqlens_k, block_table, scale: float, window: int | None = None,
                           upcast: bool = False) -> torch.Tensor:
    """Gather each sequence's keys through the block table, then plain attention of its last position."""
    page = k_cache.shape[1]
    outs = []
    for b, n in enumerate(seqlens_k.tolist()):
        pos = torch.arange(n, device=q.device)
        slots = block_table[b, pos // page].long() * page + pos % page
        keys = k_cache.view(-1, *k_cache.shape[2:])[slots].to(q.dtype)
        values = v_cache.view(-1, *v_cache.shape[2:])[slots].to(q.dtype)
        cu_q = torch.tensor([0, 1], dtype=torch.int32)
        cu_k = torch.tensor([0, n], dtype=torch.int32)
        outs.append(attention_reference(q[b:b + 1], keys, values, cu_q, cu_k, scale, window, upcast)[0])
    return torch.cat(outs)
