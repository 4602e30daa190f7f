"""The Triton attention kernels against their PyTorch references, in the Triton interpreter on CPU.

Low-precision tolerance: the kernel's error against an fp32 reference may be at most twice the error
of the same reference computed in the low-precision dtype (plus a tiny floor).
"""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.kernels.flash_attention import attention_reference, flash_attn_varlen  # noqa: E402
from cudaformers.kernels.flash_attention_fwd import attention_fwd, lse_natural  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _close(out, ref_fp32, ref_same_dtype, dtype, what):
    err = (out.float() - ref_fp32).abs().max().item()
    if dtype == torch.float32:
        bound = 1e-4 * max(1.0, ref_fp32.abs().max().item())
    else:
        bound = 2 * (ref_same_dtype.float() - ref_fp32).abs().max().item() + 1e-3
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _qkv(tq, tk, hq, hkv, d, dtype, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, generator=g).to(dtype)
    k = torch.randn(tk, hkv, d, generator=g).to(dtype)
    v = torch.randn(tk, hkv, d, generator=g).to(dtype)
    return [x.requires_grad_(grad) for x in (q, k, v)]


# (query lengths, key lengths or None for prefill, Hq, Hkv, head_dim, window)
FWD_CASES = [
    ([17, 1, 32], None, 4, 1, 16, None),
    ([33, 7], None, 2, 2, 24, None),  # odd head dim: padded to the next power of two, masked
    ([16, 40], None, 4, 2, 32, 5),
    ([9, 3], [30, 3], 4, 2, 16, None),  # bottom-right: queries are the last of their keys
    ([20, 5], [25, 64], 2, 1, 64, 11),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: f"q{c[0]}-k{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-w{c[5]}")
def test_forward_matches_reference(case, dtype):
    q_lens, k_lens, hq, hkv, d, window = case
    k_lens = k_lens or q_lens
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    q, k, v = _qkv(sum(q_lens), sum(k_lens), hq, hkv, d, dtype)
    scale = d ** -0.5
    out, lse = attention_fwd(q, k, v, cu_q, cu_k, max(q_lens), scale, window)
    ref32, lse32 = attention_reference(q, k, v, cu_q, cu_k, scale, window, upcast=True)
    ref, _ = attention_reference(q, k, v, cu_q, cu_k, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    _close(out, ref32, ref, dtype, "output")
    torch.testing.assert_close(lse_natural(lse), lse32, rtol=1e-4, atol=1e-3 if dtype != torch.float32 else 1e-5)


BWD_CASES = [
    ([17, 1, 32], None, 4, 1, 16, None),
    ([33, 7], None, 2, 2, 24, 6),
    ([9, 3], [30, 3], 4, 2, 32, None),
    ([16, 19], [16, 40], 2, 1, 16, 9),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: f"q{c[0]}-k{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-w{c[5]}")
def test_backward_matches_reference(case, dtype):
    q_lens, k_lens, hq, hkv, d, window = case
    k_lens = k_lens or q_lens
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    q, k, v = _qkv(sum(q_lens), sum(k_lens), hq, hkv, d, dtype, grad=True, seed=1)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    scale = d ** -0.5
    out = flash_attn_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), scale, window)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref32 = attention_reference(q, k, v, cu_q, cu_k, scale, window, upcast=True)[0]
    grads32 = torch.autograd.grad(ref32, (q, k, v), dout.float())
    ref = attention_reference(q, k, v, cu_q, cu_k, scale, window)[0]
    grads_same = torch.autograd.grad(ref, (q, k, v), dout)
    for name, g, g32, gs in zip("qkv", grads, grads32, grads_same):
        assert g.dtype == dtype
        _close(g, g32, gs, dtype, f"d{name}")


def test_backward_of_empty_keys_is_zero_for_unseen_tokens():
    # With a window of 1 each query sees only itself: dk/dv of token t depend on query t alone.
    q, k, v = _qkv(20, 20, 2, 2, 16, torch.float32, grad=True, seed=3)
    cu = _cu([20])
    out = flash_attn_varlen(q, k, v, cu, cu, 20, 20, 0.25, window=1)
    torch.testing.assert_close(out, v.detach(), rtol=1e-5, atol=1e-5)
    dv, = torch.autograd.grad(out, (v,), torch.ones_like(out))
    torch.testing.assert_close(dv, torch.ones_like(dv))


def _paged(k_lens, hkv, d, dtype, page, seed=4):
    """A cache with shuffled pages holding ``k_lens`` keys per sequence, plus the packed keys."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = -(-max(k_lens) // page)
    num_blocks = len(k_lens) * pages_per_seq + 3
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: len(k_lens) * pages_per_seq]
    table = table.view(len(k_lens), pages_per_seq).to(torch.int32)
    return k_cache, v_cache, table


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page,window", [(4, None), (16, 7), (5, None)])
def test_paged_prefill_matches_reference(dtype, page, window):
    q_lens, k_lens = [6, 1, 13], [21, 9, 13]
    hq, hkv, d = 4, 2, 32
    k_cache, v_cache, table = _paged(k_lens, hkv, d, dtype, page)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    scale = d ** -0.5
    out, _ = attention_fwd(q, k_cache, v_cache, _cu(q_lens), _cu(k_lens), max(q_lens), scale, window,
                           block_table=table)
    # Reference: the same keys gathered into packed form.
    keys, values = [], []
    for b, n in enumerate(k_lens):
        pos = torch.arange(n)
        slots = table[b, pos // page].long() * page + pos % page
        keys.append(k_cache.view(-1, hkv, d)[slots])
        values.append(v_cache.view(-1, hkv, d)[slots])
    k, v = torch.cat(keys), torch.cat(values)
    ref32, _ = attention_reference(q, k, v, _cu(q_lens), _cu(k_lens), scale, window, upcast=True)
    ref, _ = attention_reference(q, k, v, _cu(q_lens), _cu(k_lens), scale, window)
    _close(out, ref32, ref, dtype, "paged prefill")


def test_kernels_reject_unsupported_shapes():
    q, k, v = _qkv(4, 4, 2, 2, 320, torch.float32)
    with pytest.raises(ValueError, match="head_dim up to 256"):
        attention_fwd(q, k, v, _cu([4]), _cu([4]), 4, 1.0)
    q, k, v = _qkv(4, 4, 3, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        attention_fwd(q, k, v, _cu([4]), _cu([4]), 4, 1.0)
