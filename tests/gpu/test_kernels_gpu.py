"""Every Triton kernel at full size on the GPU against its PyTorch reference (fp32/bf16, fwd + bwd).

Accuracy rule: the kernel's error against the fp32 reference is at most twice the error of the
same-dtype reference (fp32: 1e-5 relative, loosened for long reductions).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float32]
DEV = "cuda"


def check(out, ref, ref32, what, dtype):
    out, ref, ref32 = out.float(), ref.float(), ref32.float()
    if dtype == torch.float32:
        scale = ref32.abs().max().item() + 1e-6
        err = (out - ref32).abs().max().item()
        assert err <= 1e-4 * scale + 1e-5, f"{what}: fp32 error {err:.3g} (scale {scale:.3g})"
        return
    budget = 2 * (ref - ref32).abs().max().item() + 1e-6
    err = (out - ref32).abs().max().item()
    assert err <= budget, f"{what}: error {err:.3g} > 2x same-dtype reference error {budget:.3g}"


def grads(fn, inputs, dout, dtype):
    leaves = [x.to(dtype).detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    (out.float() * dout).sum().backward() if dout is not None else out.backward()
    return [out.detach()] + [x.grad if x.grad is not None else torch.zeros_like(x)
                             for x in leaves if x.is_floating_point()]


def compare(kernel, reference, inputs, dout, dtype, what):
    ours = grads(kernel, inputs, dout, dtype)
    ref = grads(reference, inputs, dout, dtype)
    ref32 = grads(reference, inputs, dout, torch.float32)
    for i, (a, b, c) in enumerate(zip(ours, ref, ref32)):
        check(a, b, c, f"{what}[{i}]", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_full_size(dtype):
    from cudaformers.kernels.rms_norm import rms_norm, rms_norm_residual_reference

    x, r, w = torch.randn(8192, 4096, device=DEV), torch.randn(8192, 4096, device=DEV), torch.rand(4096, device=DEV)
    dout = torch.randn(8192, 4096, device=DEV)
    compare(lambda a, b, c: rms_norm(a, b, 1e-6, c)[0], lambda a, b, c: rms_norm_residual_reference(a, b, 1e-6, c)[0],
            [x, w, r], dout, dtype, "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_full_size(dtype):
    from cudaformers.kernels.rotary import apply_rotary, apply_rotary_reference

    t = 8192
    q, k = torch.randn(t, 32, 128, device=DEV), torch.randn(t, 8, 128, device=DEV)
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device=DEV).float() / 128))
    emb = torch.arange(t, device=DEV).float()[:, None] * inv
    emb = torch.cat([emb, emb], -1)
    cos, sin = emb.cos(), emb.sin()
    for which in (0, 1):
        def fn(impl):
            return lambda a, b: impl(a * 1, b * 1, cos.to(a.dtype), sin.to(a.dtype))[which]
        dout = torch.randn_like(q if which == 0 else k)
        compare(fn(apply_rotary), fn(apply_rotary_reference), [q, k], dout, dtype, f"rotary[{which}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_act_and_mul_full_size(dtype, act):
    from cudaformers.kernels.activation import act_and_mul, act_and_mul_reference

    g, u = torch.randn(8192, 12288, device=DEV), torch.randn(8192, 12288, device=DEV)
    compare(lambda a, b: act_and_mul(a, b, act), lambda a, b: act_and_mul_reference(a, b, act), [g, u],
            torch.randn_like(g), dtype, act)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_linear_cross_entropy_full_vocab(dtype):
    from cudaformers.kernels.fused_linear_cross_entropy import (fused_linear_cross_entropy,
                                                                fused_linear_cross_entropy_reference)

    n, h, v = 4096, 1024, 151936
    hidden, weight = torch.randn(n, h, device=DEV), torch.randn(v, h, device=DEV) * 0.02
    targets = torch.randint(0, v, (n,), device=DEV)
    targets[::7] = -100
    compare(lambda a, b: fused_linear_cross_entropy(a, b, targets),
            lambda a, b: fused_linear_cross_entropy_reference(a, b, targets), [hidden, weight], None, dtype, "flce")


def test_fused_linear_cross_entropy_peak_memory_stays_below_logits():
    from cudaformers.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

    n, h, v = 16384, 1024, 151936
    hidden = torch.randn(n, h, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device=DEV) * 0.02).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), device=DEV)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fused_linear_cross_entropy(hidden, weight, targets).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    logits_fp32 = n * v * 4
    assert extra < logits_fp32 / 4, f"peak extra {extra / 2**30:.2f} GiB vs fp32 logits {logits_fp32 / 2**30:.2f} GiB"


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_grouped_gemm_full_size(dtype):
    from cudaformers.kernels.moe import moe_experts, moe_experts_reference, route, route_reference

    t, e, k, h, i = 4096, 128, 8, 2048, 768  # Qwen3-30B-A3B shapes
    logits = torch.randn(t, e, device=DEV)
    w, idx = route(logits, k, True)
    w_ref, idx_ref = route_reference(logits, k, True)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(w, w_ref)
    hidden = torch.randn(t, h, device=DEV)
    gate_up, down = torch.randn(e, 2 * i, h, device=DEV) * h ** -0.5, torch.randn(e, h, i, device=DEV) * i ** -0.5
    compare(lambda a, b, c, d: moe_experts(a, b, c, idx, d), lambda a, b, c, d: moe_experts_reference(a, b, c, idx, d),
            [hidden, gate_up, down, w], torch.randn(t, h, device=DEV), dtype, "moe")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba_kernels_full_size(dtype):
    from cudaformers.kernels.mamba import (causal_conv1d, causal_conv1d_reference, selective_scan,
                                           selective_scan_reference)

    b, i, seq, n = 2, 1536, 512, 16
    x, w, bias = torch.randn(b, i, seq, device=DEV), torch.randn(i, 4, device=DEV), torch.randn(i, device=DEV)
    cast = (lambda t: t.to(dtype))
    check(causal_conv1d(cast(x), cast(w), cast(bias), silu=True)[0],
          causal_conv1d_reference(cast(x), cast(w), cast(bias), silu=True)[0],
          causal_conv1d_reference(x, w, bias, silu=True)[0], "conv1d", dtype)
    u, dt, z = (torch.randn(b, i, seq, device=DEV) for _ in range(3))
    A = -torch.exp(torch.randn(i, n, device=DEV))
    B, C, D = torch.randn(b, n, seq, device=DEV), torch.randn(b, n, seq, device=DEV), torch.randn(i, device=DEV)
    args = lambda f: (f(u), f(dt), A, f(B), f(C), D, f(z))  # noqa: E731
    check(selective_scan(*args(cast))[0], selective_scan_reference(*args(cast))[0],
          selective_scan_reference(*args(lambda t: t))[0], "scan", dtype)


def test_fused_linear_cross_entropy_autocast_master_weights_over_several_chunks():
    # W6's case: bf16 hidden, fp32 (tied) weight; the fp32 weight gradient accumulates over 3 chunks
    # in the matmul epilogue (addmm with an fp32 output) where torch has that overload.
    from cudaformers.kernels import fused_linear_cross_entropy as flce

    n, h, v = 4096, 1024, 151936
    g = torch.Generator(device=DEV).manual_seed(0)
    hidden = torch.randn(n, h, device=DEV, generator=g)
    weight = torch.randn(v, h, device=DEV, generator=g) * 0.02
    targets = torch.randint(0, v, (n,), device=DEV, generator=g)
    assert -(-n // flce._chunk_size(n, v, 2)) >= 3
    hb, w = hidden.bfloat16().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        flce.fused_linear_cross_entropy(hb, w, targets).backward()
    h_ref, w_ref = hidden.bfloat16().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        flce.fused_linear_cross_entropy_reference(h_ref, w_ref, targets).backward()
    h32, w32 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    flce.fused_linear_cross_entropy_reference(h32, w32, targets).backward()
    assert w.grad.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16
    check(w.grad, w_ref.grad, w32.grad, "flce autocast dweight", torch.bfloat16)
    check(hb.grad, h_ref.grad, h32.grad, "flce autocast dhidden", torch.bfloat16)
