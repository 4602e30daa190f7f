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


def _grads(fn, inputs, cotangents, dtype):
    """Runs fn on inputs (floating ones of the activation kind cast to dtype) and returns the outputs
    and every input's gradient for a fixed random cotangent on each output."""
    leaves = [t.to(dtype if cast else t.dtype).requires_grad_() if t is not None else None
              for t, cast in inputs]
    outs = fn(*leaves)
    sum(((o.float() * c).sum() for o, c in zip(outs, cotangents) if c is not None)).backward()
    return [o.detach() for o in outs] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,c,seq,k,with_state,bias,silu", [
    (1, 8, 1, 4, True, True, True), (2, 37, 45, 4, False, True, True),
    (3, 64, 16, 3, True, False, False), (1, 5, 7, 2, False, False, True)])
def test_causal_conv1d_backward_matches_reference(b, c, seq, k, with_state, bias, silu, dtype):
    g = torch.Generator().manual_seed(c * seq + k)
    inputs = [(torch.randn(b, c, seq, generator=g), True), (torch.randn(c, k, generator=g), True),
              (torch.randn(c, generator=g) if bias else None, True),
              (torch.randn(b, c, k - 1, generator=g) if with_state else None, True)]
    cot = [torch.randn(b, c, seq, generator=g), torch.randn(b, c, k - 1, generator=g)]  # y and the new state

    def run(fn, dt):
        return _grads(lambda *a: fn(*a, silu=silu), inputs, cot, dt)

    names = ["y", "state", "dx", "dweight"] + ["dbias"] * bias + ["dstate"] * with_state
    for name, ours, ref, ref32 in zip(names, run(causal_conv1d, dtype), run(causal_conv1d_reference, dtype),
                                      run(causal_conv1d_reference, torch.float32)):
        assert ours.dtype == ref.dtype, name
        assert_matches(ours, ref, ref32, f"conv {name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bt,i,seq,n,with_state,full,chunk", [
    (1, 16, 1, 16, True, True, 64), (2, 24, 13, 8, False, True, 4), (1, 40, 9, 5, True, False, 4),
    (2, 8, 32, 4, False, False, 64)])
def test_selective_scan_backward_matches_reference(bt, i, seq, n, with_state, full, chunk, dtype, monkeypatch):
    """``full``: with D, z and delta_bias; else without. ``chunk`` < seq exercises the chunked replay."""
    import cudaformers.kernels.mamba as mamba

    monkeypatch.setattr(mamba, "_SCAN_CHUNK", chunk)
    g = torch.Generator().manual_seed(i * seq + n)
    act = lambda *shape: (torch.randn(*shape, generator=g), True)  # noqa: E731
    param = lambda t: (t if full else None, False)  # noqa: E731
    inputs = [act(bt, i, seq), act(bt, i, seq), (-torch.exp(torch.randn(i, n, generator=g)), False),
              act(bt, n, seq), act(bt, n, seq), param(torch.randn(i, generator=g)),
              (torch.randn(bt, i, seq, generator=g) if full else None, True), param(torch.randn(i, generator=g)),
              (torch.randn(bt, i, n, generator=g) if with_state else None, False)]
    cot = [torch.randn(bt, i, seq, generator=g), torch.randn(bt, i, n, generator=g)]  # y and the last state
    names = ["y", "state", "du", "ddelta", "dA", "dB", "dC"] + ["dD", "dz", "ddelta_bias"] * full + \
        ["dstate"] * with_state
    outs = [_grads(fn, inputs, cot, dt) for fn, dt in [(selective_scan, dtype), (selective_scan_reference, dtype),
                                                       (selective_scan_reference, torch.float32)]]
    for name, ours, ref, ref32 in zip(names, *outs):
        assert ours.dtype == ref.dtype, name
        assert_matches(ours, ref, ref32, f"scan {name} {dtype}", dtype=dtype)
