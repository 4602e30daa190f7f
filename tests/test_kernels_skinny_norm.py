"""skinny_rms_norm: a decode layer's RMSNorm folded into the skinny GEMM after it (5-32 rows), against
the norm kernel followed by the skinny GEMM (or its gated launch): the same residual sum bit for
bit, and outputs within what an ulp of rstd can move (the fold sums each row's squares in K tiles,
the norm kernel in one)."""

import os

import pytest
import torch

from cudaformers.kernels.arrivals import arrival_counters
from cudaformers.kernels.skinny_gemm import SkinnyConfig, skinny_gated, skinny_linear, skinny_rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
ULP = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _inputs(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(2, m, k, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    return x, r, norm_w, w, b


def _assert_near(got, want, normed, w):
    """An ulp of rstd moves each normed input by at most an ulp of the dtype."""
    ulp = ULP[got.dtype]
    bound = ulp * (normed.float().abs() @ w.float().abs().T).max() + ulp * want.float().abs().max()
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got.float() - want.float()).abs().max() <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(5, 37, 100), (17, 64, 130), (32, 48, 64), (8, 16, 513)])
@pytest.mark.parametrize("bias", [False, True])
def test_rounds_like_the_norm_kernel_then_the_skinny_gemm(m, n, k, dtype, bias):
    from cudaformers.kernels.rms_norm import rms_norm

    x, r, norm_w, w, b = _inputs(m, n, k, dtype, seed=m * 1000 + n + k)
    b = b if bias else None
    got, s = skinny_rms_norm(x, w, norm_w, 1e-6, r, b)
    normed, want_s = rms_norm(x, norm_w, 1e-6, r)
    assert torch.equal(s, want_s)
    _assert_near(got, skinny_linear(normed, w, b), normed, w)
    first = rms_norm(x, norm_w, 1e-6)  # the first layer: no residual yet
    _assert_near(skinny_rms_norm(x, w, norm_w, 1e-6, bias=b), skinny_linear(first, w, b), first, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_is_the_normed_gated_launch(dtype):
    from cudaformers.kernels.rms_norm import rms_norm

    x, r, norm_w, w, _ = _inputs(17, 2 * 40, 130, dtype, seed=3)
    got, s = skinny_rms_norm(x, w, norm_w, 1e-6, r, activation="silu")
    normed, want_s = rms_norm(x, norm_w, 1e-6, r)
    assert torch.equal(s, want_s) and got.shape == (17, 40)
    _assert_near(got, skinny_gated(normed, w, None, "silu"), normed, w)


CONFIGS = [SkinnyConfig(16, 16, 32, 64), SkinnyConfig(32, 32, 32, 32, num_stages=1)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.k_split}")
def test_split_k_writes_the_sum_once_and_leaves_counters_zero(cfg):
    """Every split reads whole rows for rstd; one program per row tile stores the sum."""
    from cudaformers.kernels.rms_norm import rms_norm

    x, r, norm_w, w, b = _inputs(37, 40, 160, torch.bfloat16, seed=7)
    got, s = skinny_rms_norm(x.view(37, 1, 160), w, norm_w, 1e-5, r.view(37, 1, 160), b, config=cfg)
    normed, want_s = rms_norm(x, norm_w, 1e-5, r)
    assert got.shape == (37, 1, 40) and s.shape == (37, 1, 160)
    assert torch.equal(s.view(37, 160), want_s)
    _assert_near(got.view(37, 40), skinny_linear(normed, w, b, config=cfg), normed, w)
    assert not arrival_counters(x.device, 1).any()


def test_bad_inputs_say_what_is_wrong():
    x, r, norm_w, w, _ = _inputs(8, 15, 32, torch.float32, seed=1)
    with pytest.raises(ValueError, match="residual"):
        skinny_rms_norm(x, w, norm_w, 1e-6, r[:1])
    with pytest.raises(ValueError, match="norm weight"):
        skinny_rms_norm(x, w, norm_w[:31], 1e-6, r)
    with pytest.raises(ValueError, match="stack gate and up"):
        skinny_rms_norm(x, w, norm_w, 1e-6, r, activation="silu")
