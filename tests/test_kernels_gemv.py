"""The decode GEMV against F.linear (its reference) on odd and power-of-two shapes, all dtypes."""

import os

import pytest
import torch

import cudaformers.kernels.gemv as gemv_module
from cudaformers.kernels.gemv import gemv, linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 8, 32), (1, 37, 100), (3, 64, 256), (4, 130, 77), (2, 1, 513)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(m, n, k, dtype, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    got = gemv(x, w, b)
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    same_dtype = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    err = (got.double() - exact).abs().max()
    ref_err = (same_dtype.double() - exact).abs().max()
    # Half types: twice the same-dtype reference's error, plus one ulp of the output for the final
    # rounding (Triton's interpreter rounds fp32 -> bf16 toward zero, GPUs to nearest).
    ulp = exact.abs().max() * {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(dtype, 0.0)
    tol = 1e-5 if dtype == torch.float32 else 2 * ref_err + ulp
    assert got.dtype == dtype and got.shape == (m, n)
    assert err <= tol, (err, ref_err)


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
