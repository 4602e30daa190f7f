"""The decode GEMV (plain, with the gated activation fused into its input, and with the RMSNorm that feeds
it folded in) against F.linear on odd and power-of-two shapes, all dtypes."""

import os

import pytest
import torch
import torch.nn.functional as F

import cudaformers.kernels.gemv as gemv_module
from cudaformers.errors import UnsupportedError
from cudaformers.kernels.gemv import (gemv, gemv_act_mul, gemv_applies, gemv_rms_norm, gemv_rms_norm_reference,
                                      linear)
from cudaformers.kernels.rms_norm import rms_norm
from cudaformers.layers.activation import act_and_mul_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _tolerance(got, exact, same_dtype, dtype):
    """(error of ``got``, allowed error) against the fp64 ``exact``. Half types: twice the error of
    the same-dtype reference, plus one ulp of the output for the final rounding (Triton's
    interpreter rounds fp32 -> bf16 toward zero, GPUs to nearest)."""
    err = (got.double() - exact).abs().max()
    ref_err = (same_dtype.double() - exact).abs().max()
    ulp = exact.abs().max() * {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(dtype, 0.0)
    return err, (1e-5 if dtype == torch.float32 else 2 * ref_err + ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 8, 32), (1, 37, 100), (3, 64, 256), (4, 130, 77), (2, 1, 513)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(m, n, k, dtype, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    got = gemv(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    same_dtype = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    err, tol = _tolerance(got, exact, same_dtype, dtype)
    assert got.dtype == dtype and got.shape == (m, n)
    assert err <= tol, (err, tol)


def test_linear_dispatch(monkeypatch):
    calls = []
    monkeypatch.setattr(gemv_module, "gemv", lambda *a: calls.append(a) or torch.nn.functional.linear(*a))
    w = torch.randn(16, 32, device=DEVICE)
    with torch.no_grad():
        linear(torch.randn(1, 32, device=DEVICE), w)  # decode-sized: the kernel
        linear(torch.randn(9, 32, device=DEVICE), w)  # prefill-sized: F.linear
    assert len(calls) == 1
    x = torch.randn(1, 32, device=DEVICE, requires_grad=True)
    linear(x, w).sum().backward()  # autograd needed: F.linear
    assert len(calls) == 1 and x.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("m,n,k,packed", [(1, 8, 32, True), (1, 37, 100, True), (3, 64, 256, False),
                                          (4, 130, 77, True), (2, 1, 513, False)])
def test_gemv_act_mul_matches_reference(m, n, k, packed, activation, dtype):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    if packed:  # gate and up as the strided halves of one packed gate/up projection output
        gate, up = (torch.randn(m, 2 * k, generator=g) * 2).to(DEVICE, dtype).split(k, dim=-1)
        assert gate.stride(0) == 2 * k
    else:
        gate, up = ((torch.randn(m, k, generator=g) * 2).to(DEVICE, dtype) for _ in range(2))
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    got = gemv_act_mul(gate, up, w, activation=activation)
    exact = F.linear(act_and_mul_reference(gate.double(), up.double(), activation), w.double())
    # The unfused path: the activation rounded to the input dtype, then the matmul.
    same_dtype = F.linear(act_and_mul_reference(gate, up, activation).float(), w.float()).to(dtype)
    err, tol = _tolerance(got, exact, same_dtype, dtype)
    assert got.dtype == dtype and got.shape == (m, n)
    assert err <= tol, (err, tol)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gemv_act_mul_bias_and_leading_dims(activation):
    g = torch.Generator().manual_seed(7)
    gate, up = torch.randn(1, 2, 2 * 96, generator=g).to(DEVICE).chunk(2, dim=-1)  # [B, T, K] views
    w, b = torch.randn(40, 96, generator=g).to(DEVICE), torch.randn(40, generator=g).to(DEVICE)
    got = gemv_act_mul(gate, up, w, b, activation)
    assert got.shape == (1, 2, 40)
    torch.testing.assert_close(got, F.linear(act_and_mul_reference(gate, up, activation), w, b),
                               atol=1e-5, rtol=1e-5)


def test_gemv_act_mul_rejects_bad_inputs():
    w = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="same shape"):
        gemv_act_mul(torch.randn(1, 16, device=DEVICE), torch.randn(1, 8, device=DEVICE), w)
    with pytest.raises(UnsupportedError, match="relu"):
        gemv_act_mul(torch.randn(1, 16, device=DEVICE), torch.randn(1, 16, device=DEVICE), w, activation="relu")


def test_gemv_applies():
    w = torch.randn(16, 32, device=DEVICE)
    x = torch.randn(1, 32, device=DEVICE)
    with torch.no_grad():
        assert gemv_applies(w, x, x)
        assert not gemv_applies(w, torch.randn(5, 32, device=DEVICE))  # prefill-sized
        assert not gemv_applies(w, x, x.double())  # mixed dtypes
    assert not gemv_applies(w, x, x.requires_grad_())  # autograd through up


def _norm_inputs(m, n, k, dtype, strided, seed):
    g = torch.Generator().manual_seed(seed)
    if strided:  # rows of a wider activation, as slices of a packed output produce them
        x = torch.randn(m, k + 24, generator=g)[:, 8:8 + k]
        assert x.stride(0) == k + 24
    else:
        x = torch.randn(m, k, generator=g)
    residual = torch.randn(m, k, generator=g) * 4
    norm_w = 1 + 0.3 * torch.randn(k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g)
    return [t.to(DEVICE, dtype) for t in (x, residual, norm_w, w, b)]


# (m, n, k, one K tile): on the interpreter's 8 "SMs", n = 1000 takes 16 weight rows a program and
# 256 columns a K step, so k = 300 and 513 span several tiles (pass 1 loops, as qwen3-8b's 4096 does).
NORM_SHAPES = [(1, 8, 32, True), (1, 37, 100, True), (3, 64, 256, True), (4, 130, 77, True),
               (2, 1000, 300, False), (1, 1000, 513, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,one_tile", NORM_SHAPES)
@pytest.mark.parametrize("residual", [True, False])
def test_gemv_rms_norm_matches_reference(m, n, k, one_tile, residual, dtype):
    x, r, norm_w, w, b = _norm_inputs(m, n, k, dtype, strided=m > 1, seed=m * 1000 + n + k)
    r = r if residual else None
    out = gemv_rms_norm(x, w, norm_w, 1e-6, r, b)
    got, s = out if residual else (out, None)
    ref = gemv_rms_norm_reference(x, w, norm_w, 1e-6, r, b)
    exact = gemv_rms_norm_reference(*(t.double() if t is not None else None for t in (x, w, norm_w)), 1e-6,
                                    r.double() if residual else None, b.double())
    exact, ref = (exact[0], ref[0]) if residual else (exact, ref)
    err, tol = _tolerance(got, exact, ref, dtype)
    assert got.dtype == dtype and got.shape == (m, n)
    assert err <= tol, (err, tol)
    if residual:
        # x + residual as PyTorch rounds it; the interpreter rounds half types toward zero: one ulp
        ulp = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
        want_s = (x + r).double()
        assert s.shape == x.shape and s.dtype == dtype and s.is_contiguous()
        assert ((s.double() - want_s).abs() <= ulp * want_s.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,one_tile", NORM_SHAPES)
def test_gemv_rms_norm_rounds_like_the_unfused_kernels(m, n, k, one_tile, dtype):
    """Against rms_norm's kernel, then the GEMV: the same rounding steps, so the same bits, except
    where the sum of squares is associated differently: over several K tiles here (rms_norm sums a
    row in one tile), or by another reduction tree on a GPU. That changes rstd by an ulp of fp32."""
    x, r, norm_w, w, b = _norm_inputs(m, n, k, dtype, strided=True, seed=k)
    got, s = gemv_rms_norm(x, w, norm_w, 1e-6, r, b)
    normed, want_s = rms_norm(x, norm_w, 1e-6, r)
    want = gemv(normed, w, b)
    assert torch.equal(s, want_s)
    assert torch.equal(gemv_rms_norm(x, w, norm_w, 1e-6), gemv(rms_norm(x, norm_w, 1e-6), w)) or not one_tile
    if one_tile and DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        # an ulp of rstd moves each normed input by at most an ulp of the dtype (fp32: a few 1e-7)
        ulp = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
        bound = ulp * (normed.float().abs() @ w.float().abs().T).max() + ulp * want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= bound


def test_gemv_rms_norm_leading_dims_and_bad_inputs():
    x, r, norm_w, w, _ = _norm_inputs(2, 40, 96, torch.float32, strided=False, seed=5)
    got, s = gemv_rms_norm(x.view(1, 2, 96), w, norm_w, 1e-5, r.view(1, 2, 96))
    assert got.shape == (1, 2, 40) and s.shape == (1, 2, 96)
    want, want_s = gemv_rms_norm_reference(x, w, norm_w, 1e-5, r)
    torch.testing.assert_close(got.view(2, 40), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.view(2, 96), want_s, atol=0, rtol=0)
    with pytest.raises(ValueError, match="residual"):
        gemv_rms_norm(x, w, norm_w, 1e-6, r[:1])
    with pytest.raises(ValueError, match="norm weight"):
        gemv_rms_norm(x, w, norm_w.double(), 1e-6, r)
    with pytest.raises(ValueError, match="norm weight"):
        gemv_rms_norm(x, w, norm_w[:95], 1e-6, r)
