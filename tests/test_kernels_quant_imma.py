"""The integer tensor-core GEMV (kernels/quant_imma.py) against dequantize-then-matmul, under the
Triton interpreter; tests/gpu/test_quant_gpu.py runs the compiled kernel."""

from __future__ import annotations

import pytest
import torch

from cudaformers import Int4Config, Int8Config
from cudaformers.kernels.quant_imma import quant_imma, supports
from cudaformers.kernels.quant_matmul import dequantize, quant_matmul_reference
from cudaformers.quant.apply import quantize


def _layer(cfg, n, k, dtype, bias):
    holder = torch.nn.Sequential(torch.nn.Linear(k, n, bias=bias, dtype=dtype))
    torch.nn.init.normal_(holder[0].weight, std=0.05)
    return quantize(holder, cfg)[0]


def _close(out, expected, dtype, x=None, w=None):
    """Within one unit in the last place of the output dtype; for fp32 x also the error of scaling x
    to its planes in fp32 (2**-24 of each element) and of the last plane (``max|x| / 2 / 127 / 254**3``),
    against the row's sum of |w * x|: fp32 F.linear's own bound is K times that."""
    eps = torch.finfo(dtype).eps
    tol = eps * expected.abs() * 1.01 + 1e-6 * eps * expected.abs().max()
    if dtype == torch.float32:
        wd, xd = dequantize(w, torch.float64).abs(), x.double().abs()
        tol = tol + 2.0 ** -23 * (wd @ xd.T).T + xd.max() / (2 * 127 * 254 ** 3) * wd.sum(1)
    assert (out.double() - expected).abs().le(tol).all(), (out.double() - expected).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n,k", [(40, 256), (33, 200), (64, 1000), (17, 64)])
def test_matches_dequantize_then_matmul(n, k, dtype):
    layer = _layer(Int8Config(), n, k, dtype, bias=n % 2 == 1)
    w = layer.packed()
    x = torch.randn(1, k, dtype=dtype) * torch.linspace(0.01, 30, k).to(dtype)  # a wide range of magnitudes
    assert supports(x, w)
    bias = None if layer.bias is None else layer.bias.double()
    expected = quant_matmul_reference(x.double(), _double(w), bias)
    out = quant_imma(x, w, layer.bias)
    assert out.dtype == dtype and out.shape == (1, n)
    _close(out, expected, dtype, x, w)


@pytest.mark.parametrize("groups,split", [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (1, 3), (2, 4)])
def test_blocks_per_step_and_splits_any_count(groups, split):
    """Several blocks per step and splits that do not divide the 10 blocks of 600 features, twice
    (the arrival counters reset), with an all-zero x once."""
    layer = _layer(Int8Config(), 40, 600, torch.bfloat16, bias=True)
    w = layer.packed()
    for seed in range(2):
        x = torch.randn(1, 600, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(seed))
        expected = quant_matmul_reference(x.double(), _double(w), layer.bias.double())
        _close(quant_imma(x, w, layer.bias, tiles=(16, groups, split, 1, 2)), expected, torch.bfloat16)
    zero = quant_imma(torch.zeros(1, 600, dtype=torch.bfloat16), w, layer.bias, tiles=(16, groups, split, 1, 2))
    assert torch.equal(zero, layer.bias[None])


def test_refuses_what_it_does_not_serve():
    int8 = _layer(Int8Config(), 16, 128, torch.bfloat16, bias=False)
    int4 = _layer(Int4Config(group_size=128), 16, 128, torch.bfloat16, bias=False)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    assert supports(x, int8.packed()) and not supports(x, int4.packed())
    assert not supports(torch.randn(2, 128, dtype=torch.bfloat16), int8.packed())
    with pytest.raises(ValueError, match="one row of x against int8"):
        quant_imma(torch.randn(2, 128, dtype=torch.bfloat16), int8.packed())
    with pytest.raises(ValueError, match="x has 100 features"):
        quant_imma(torch.randn(1, 100, dtype=torch.bfloat16), int8.packed())


def _double(w):
    from dataclasses import replace

    return replace(w, scales=w.scales.double())


def test_dispatch_takes_it_when_switched_on(monkeypatch):
    from cudaformers.kernels import quant_matmul

    layer = _layer(Int8Config(), 24, 128, torch.bfloat16, bias=False)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(quant_matmul, "USE_IMMA", True)
    calls = []
    import cudaformers.kernels.quant_imma as imma

    monkeypatch.setattr(imma, "quant_imma", lambda *a, **k: calls.append(1) or quant_imma(*a, **k))
    out = quant_matmul.quant_matmul_triton(x, layer.packed())
    assert calls and torch.equal(out, quant_imma(x, layer.packed()))
