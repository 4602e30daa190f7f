"""Paged flash-decoding against its PyTorch reference, in the Triton interpreter on CPU.

Covers one-program contexts, contexts split across the grid and merged in the same launch (with the
merge's chunked loop), sliding windows, GQA groups 1/2/8, head dims 64/128/256 and page sizes 16 and
256. Low-precision tolerance: at most twice the error of the reference computed in that dtype.
"""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.kernels import paged_decode as pd  # noqa: E402
from cudaformers.kernels.arrivals import arrival_counters  # noqa: E402
from cudaformers.kernels.paged_decode import (  # noqa: E402
    DecodeTiling, paged_decode, paged_decode_reference, split_plan)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _close(out, ref32, ref_same, dtype, what="paged decode"):
    err = (out.float() - ref32).abs().max().item()
    if dtype == torch.float32:
        bound = 1e-4 * max(1.0, ref32.abs().max().item())
    else:
        bound = 2 * (ref_same.float() - ref32).abs().max().item() + 1e-3
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _paged(k_lens, hkv, d, dtype, page, capacity=None, seed=0, poison=False):
    """A cache with shuffled pages holding ``k_lens`` keys per sequence and a ``capacity``-wide table.

    With ``poison``, every cache slot no sequence owns (the tails of last pages, spare blocks, and
    the table entries past each sequence's pages) holds NaN: reading one would show in the output.
    """
    g = torch.Generator().manual_seed(seed)
    width = -(-(capacity or max(k_lens)) // page)
    owned = [-(-n // page) for n in k_lens]
    num_blocks = sum(owned) + 2
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(k_lens), width), int(perm[-1]), dtype=torch.int32)  # a spare block
    used = 0
    for b, n in enumerate(owned):
        table[b, :n] = perm[used:used + n]
        used += n
    if poison:
        mask = torch.ones(num_blocks, page, dtype=torch.bool)
        for b, n in enumerate(k_lens):
            pos = torch.arange(n)
            mask[table[b, pos // page].long(), pos % page] = False
        k_cache[mask] = float("nan")
        v_cache[mask] = float("nan")
    return k_cache.to(DEV), v_cache.to(DEV), table.to(DEV)


def _run(k_lens, hq, hkv, d, dtype, page, window=None, capacity=None, seed=0, **kw):
    k_cache, v_cache, table = _paged(k_lens, hkv, d, dtype, page, capacity, seed, poison=dtype == torch.float32)
    q = torch.randn(len(k_lens), hq, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEV)
    lens = torch.tensor(k_lens, dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    out = paged_decode(q, k_cache, v_cache, lens, table, capacity or max(k_lens), scale, window, **kw)
    ref32 = paged_decode_reference(q, k_cache, v_cache, lens, table, scale, window, upcast=True)
    ref = paged_decode_reference(q, k_cache, v_cache, lens, table, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    _close(out, ref32, ref, dtype)
    return out


# (key lengths, Hq, Hkv, head_dim, page, window, grid splits)
CASES = [
    ([1, 17, 130], 2, 1, 64, 16, None, None),  # MHA; 130 keys split across the grid
    ([130, 17, 1], 16, 2, 128, 256, None, 3),  # GQA 8, one page holds everything
    ([45, 1], 4, 2, 256, 16, 40, 4),  # window: later keys only (a split starting past 0), split too
    ([33, 64], 6, 3, 24, 5, None, 1),  # odd head dim and page, one split: direct write only
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-p{c[4]}-w{c[5]}-s{c[6]}")
def test_matches_reference(case, dtype):
    k_lens, hq, hkv, d, page, window, splits = case
    # A capacity beyond every length, as in a captured graph: the grid does not follow the lengths.
    _run(k_lens, hq, hkv, d, dtype, page, window, capacity=max(k_lens) + 40, num_splits=splits)


def test_long_context_splits_and_chunked_merge():
    # 1000 keys over 16 splits of one tile each; GQA 8 at head dim 256 merges 4 splits per step.
    tiling = DecodeTiling(block_n=64, num_warps=4, num_stages=1, split_above=64, split_tiles=1)
    _run([1000, 5], 16, 2, 256, torch.float32, 16, num_splits=16, tiling=tiling)


@pytest.mark.parametrize("page", [16, 256])
def test_short_contexts_in_a_large_grid(page):
    # A 16k-capacity grid (many splits) over contexts of a few tiles: one program each, no merge.
    _run([1, 17, 30, 9], 4, 2, 32, torch.float32, page, capacity=16384, num_splits=32)


def test_window_longer_than_context_and_window_of_one():
    _run([7, 40], 4, 4, 16, torch.float32, 4, window=100, num_splits=2)
    out = _run([7, 40], 4, 4, 16, torch.float32, 4, window=1, num_splits=2)
    assert torch.isfinite(out).all()


def test_merge_leaves_counters_zeroed_for_the_next_call():
    k_lens = [100, 3, 77]
    for seed in range(2):  # the second call would merge wrongly if the first left counts behind
        _run(k_lens, 4, 2, 16, torch.float32, 8, capacity=128, num_splits=5, seed=seed)
    counters = arrival_counters(DEV, 1)
    assert int(counters.abs().sum()) == 0


def test_never_reads_partials_of_unused_splits(monkeypatch):
    # Fresh buffers are NaN here, not zeros: the merge must read only the splits a sequence used.
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    _run([1, 70, 7], 4, 2, 16, torch.float32, 4, capacity=16384, num_splits=8)


def test_split_plan_covers_the_capacity():
    dev = torch.device("cpu")
    for seqs, heads, max_k in [(1, 8, 32768), (32, 8, 1024), (3, 2, 1), (1, 1, 300)]:
        splits, per_split = split_plan(seqs, heads, max_k, dev, block_n=64)
        assert 1 <= splits <= pd.MAX_SPLITS and per_split % 64 == 0
        assert (splits - 1) * per_split < max_k <= splits * per_split


def test_rejects_mismatched_shapes():
    k_cache, v_cache, table = _paged([5, 6], 2, 16, torch.float32, 4)
    lens = torch.tensor([5, 6], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="block_table has 2 rows for 3"):
        paged_decode(torch.zeros(3, 4, 16, device=DEV), k_cache, v_cache, lens, table, 8, 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode(torch.zeros(2, 3, 16, device=DEV), k_cache, v_cache, lens, table, 8, 1.0)
