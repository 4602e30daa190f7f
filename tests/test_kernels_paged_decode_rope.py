"""The fused decode attention (``paged_decode_rope``: q/k norm + rope, the KV-cache store and paged
decode in one launch) against its unfused definition, ``qk_norm_rope_forward`` with the store and
then ``paged_decode``, in the Triton interpreter on CPU.

The unfused pair is itself tested against PyTorch (test_kernels_qk_norm_rope*.py,
test_kernels_paged_decode.py); here the fused launch must write the same cache and give the same
output. On the interpreter both compute in the same order, so the cache is compared exactly and the
outputs to a few rounding steps of fp32 accumulation.
"""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.attention.kv_cache import KVStore  # noqa: E402
from cudaformers.kernels.paged_decode import paged_decode, paged_decode_rope  # noqa: E402
from cudaformers.kernels.qk_norm_rope import qk_norm_rope_forward  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _step(k_lens, hq, hkv, d, rot, dtype, page=16, seed=0, pad_rows=()):
    """One decode step: raw projections as strided views of a packed row, a cache whose pages hold
    each sequence's older keys (the newest slot holds stale data), cos/sin and the slots."""
    g = torch.Generator().manual_seed(seed)
    b = len(k_lens)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
    width = -(-max(k_lens) // page)
    num_blocks = b * width + 1
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)[:b * width]
    table = perm.view(b, width).to(torch.int32)
    pos = torch.tensor([n - 1 for n in k_lens])
    slots = table[torch.arange(b), pos // page].long() * page + pos % page
    for r in pad_rows:
        slots[r] = -1
    angles = pos[:, None].float() * (1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    weights = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype), (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    to = (lambda t: t.to(DEV))
    return (to(q), to(k), to(v), to(cos), to(sin), to(k_cache), to(v_cache), to(slots), to(torch.tensor(k_lens,
            dtype=torch.int32)), to(table), tuple(to(w) for w in weights))


def _unfused(q, k, v, cos, sin, k_cache, v_cache, slots, lens, table, weights, norm, window, splits):
    qw, kw = weights if norm else (None, None)
    q2, _ = qk_norm_rope_forward(q, k, cos, sin, qw, kw, 1e-6, 1e-5, KVStore(v, k_cache, v_cache, slots))
    return paged_decode(q2, k_cache, v_cache, lens, table, int(lens.max()), 0.125, window, num_splits=splits)


def _fused(q, k, v, cos, sin, k_cache, v_cache, slots, lens, table, weights, norm, window, splits):
    qw, kw = weights if norm else (None, None)
    return paged_decode_rope(q, k, v, cos, sin, k_cache, v_cache, slots, lens, table, int(lens.max()), 0.125,
                             window, qw, kw, 1e-6, 1e-5, num_splits=splits)


def _check(k_lens, hq, hkv, d, rot, dtype, norm=True, window=None, splits=None, pad_rows=()):
    args = _step(k_lens, hq, hkv, d, rot, dtype, pad_rows=pad_rows)
    want_cache = (args[5].clone(), args[6].clone())
    want = _unfused(*args[:5], *want_cache, *args[7:], norm, window, splits)
    got = _fused(*args, norm, window, splits)
    assert torch.equal(args[5], want_cache[0]) and torch.equal(args[6], want_cache[1]), "the caches differ"
    real = [i for i in range(len(k_lens)) if i not in pad_rows]
    err = (got[real].float() - want[real].float()).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert err <= tol * max(1.0, want.float().abs().max().item()), f"max difference {err:.3g}"
    return got, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
def test_equals_the_unfused_pair(dtype, norm):
    # GQA 2, mixed lengths (one key only, the newest key inside the first tile, one past a page, one
    # filling pages exactly).
    _check([1, 9, 21, 32], hq=4, hkv=2, d=64, rot=64, dtype=dtype, norm=norm)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_contexts_merge_in_the_same_launch(splits):
    # Forced splits: the newest key sits in the last split, which is not the one that stores it.
    _check([47, 80], hq=2, hkv=1, d=32, rot=32, dtype=torch.float32, splits=splits)


def test_partial_rotary_odd_head_dim_and_groups():
    # head_dim 48 (a padded tile), rope on the first 16 channels, 3 query heads per kv head.
    _check([5, 18], hq=6, hkv=2, d=48, rot=16, dtype=torch.bfloat16)


def test_sliding_window():
    _check([40, 9], hq=4, hkv=2, d=32, rot=32, dtype=torch.float32, window=8)


def test_padding_rows_store_nothing():
    # A negative slot (a padding row of a CUDA-graph bucket): no cache write, the stale row is read.
    _check([12, 30], hq=2, hkv=2, d=32, rot=32, dtype=torch.float32, pad_rows=(1,))


def test_bad_shapes_name_the_inputs():
    q, k, v, cos, sin, kc, vc, slots, lens, table, _ = _step([4, 6], 2, 1, 32, 32, torch.float32)
    with pytest.raises(ValueError, match="do not fit a cache"):
        paged_decode_rope(q, k, v, cos[:1], sin[:1], kc, vc, slots, lens, table, 6, 0.1)
    with pytest.raises(ValueError, match="unit stride"):
        paged_decode_rope(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cos, sin, kc, vc, slots, lens,
                          table, 6, 0.1)
