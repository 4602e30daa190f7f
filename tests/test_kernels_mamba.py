import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.kernels.mamba import (causal_conv1d, causal_conv1d_reference, selective_scan,  # noqa: E402
                                       selective_scan_reference)

from test_kernels_tolerance import assert_matches  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,c,seq,k,with_state,bias", [(1, 8, 1, 4, True, True), (2, 37, 45, 4, False, True),
                                                       (3, 64, 16, 3, True, False), (1, 5, 7, 2, False, False)])
def test_causal_conv1d_matches_reference(b, c, seq, k, with_state, bias, dtype):
    g = torch.Generator().manual_seed(c + seq)
    x, w = torch.randn(b, c, seq, generator=g), torch.randn(c, k, generator=g)
    bs = torch.randn(c, generator=g) if bias else None
    st = torch.randn(b, c, k - 1, generator=g) if with_state else None
    cast = (lambda t: t.to(dtype) if t is not None else None)
    y, s = causal_conv1d(cast(x), cast(w), cast(bs), cast(st), silu=True)
    y_ref, s_ref = causal_conv1d_reference(cast(x), cast(w), cast(bs), cast(st), silu=True)
    y32, _ = causal_conv1d_reference(x, w, bs, st, silu=True)
    assert_matches(y, y_ref, y32, f"conv y {dtype}")
    assert torch.equal(s, s_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bt,i,seq,n,with_state", [(1, 16, 1, 16, True), (2, 24, 13, 8, False), (1, 40, 9, 5, True)])
def test_selective_scan_matches_reference(bt, i, seq, n, with_state, dtype):
    g = torch.Generator().manual_seed(i * seq)
    u, dt, z = (torch.randn(bt, i, seq, generator=g) for _ in range(3))
    A = -torch.exp(torch.randn(i, n, generator=g))
    B, C = torch.randn(bt, n, seq, generator=g), torch.randn(bt, n, seq, generator=g)
    D, bias = torch.randn(i, generator=g), torch.randn(i, generator=g)
    h0 = torch.randn(bt, i, n, generator=g) if with_state else None
    cast = (lambda t: t.to(dtype))
    y, h = selective_scan(cast(u), cast(dt), A, cast(B), cast(C), D, cast(z), bias, h0)
    y_ref, h_ref = selective_scan_reference(cast(u), cast(dt), A, cast(B), cast(C), D, cast(z), bias, h0)
    y32, h32 = selective_scan_reference(u, dt, A, B, C, D, z, bias, h0)
    assert_matches(y, y_ref, y32, f"scan y {dtype}")
    assert_matches(h, h_ref, h32, f"scan state {dtype}", dtype=dtype)


def test_scan_in_two_pieces_equals_one_pass():
    g = torch.Generator().manual_seed(0)
    u, dt = torch.randn(1, 8, 10, generator=g), torch.randn(1, 8, 10, generator=g)
    A, B, C = -torch.rand(8, 4, generator=g), torch.randn(1, 4, 10, generator=g), torch.randn(1, 4, 10, generator=g)
    y, h = selective_scan(u, dt, A, B, C)
    y1, h1 = selective_scan(u[..., :6], dt[..., :6], A, B[..., :6], C[..., :6])
    y2, h2 = selective_scan(u[..., 6:], dt[..., 6:], A, B[..., 6:], C[..., 6:], state=h1)
    torch.testing.assert_close(torch.cat([y1, y2], -1), y)
    torch.testing.assert_close(h2, h)
