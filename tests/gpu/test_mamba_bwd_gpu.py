"""Backward of the Mamba kernels (selective scan, causal conv1d) and the MoE router at full size on the GPU.

Rule (as tests/test_kernels_tolerance.py): bf16 error against the fp32 reference at most twice the
same-dtype reference's; fp32 within 1e-4 of the gradient's scale (long reductions over L and batch).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float32]


def check(out, ref, ref32, what, dtype):
    out, ref, ref32 = out.float(), ref.float(), ref32.float()
    err = (out - ref32).abs().max().item()
    if dtype == torch.float32:
        scale = ref32.abs().max().item() + 1e-6
        assert err <= 1e-4 * scale + 1e-5, f"{what}: fp32 error {err:.3g} (scale {scale:.3g})"
        return
    budget = 2 * (ref - ref32).abs().max().item() + 1e-6
    assert err <= budget, f"{what}: error {err:.3g} > 2x same-dtype reference error {budget:.3g}"


def grads(fn, inputs, cotangents, dtype):
    """inputs: (tensor or None, cast to dtype?) pairs -> outputs + gradients of the non-None inputs."""
    leaves = [t.to(dtype if cast else t.dtype).detach().requires_grad_() if t is not None else None
              for t, cast in inputs]
    outs = fn(*leaves)
    sum((o.float() * c).sum() for o, c in zip(outs, cotangents)).backward()
    return [o.detach() for o in outs] + [t.grad for t in leaves if t is not None]


def compare(kernel, reference, inputs, cotangents, dtype, names):
    results = [grads(kernel, inputs, cotangents, dtype), grads(reference, inputs, cotangents, dtype),
               grads(reference, inputs, cotangents, torch.float32)]
    for name, ours, ref, ref32 in zip(names, *results):
        check(ours, ref, ref32, name, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv1d_backward_full_size(dtype, with_state):
    from cudaformers.kernels.mamba import causal_conv1d, causal_conv1d_reference

    b, c, seq, k = 2, 3072, 1000, 4
    inputs = [(torch.randn(b, c, seq, device=DEV), True), (torch.randn(c, k, device=DEV), True),
              (torch.randn(c, device=DEV), True),
              (torch.randn(b, c, k - 1, device=DEV) if with_state else None, True)]
    cot = [torch.randn(b, c, seq, device=DEV), torch.randn(b, c, k - 1, device=DEV)]
    compare(lambda *a: causal_conv1d(*a, silu=True), lambda *a: causal_conv1d_reference(*a, silu=True),
            inputs, cot, dtype, ["y", "state", "dx", "dweight", "dbias", "dstate"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_selective_scan_backward_full_size(dtype):
    from cudaformers.kernels.mamba import selective_scan, selective_scan_reference

    bt, i, seq, n = 2, 1536, 300, 16  # 300: several chunks and a partial one
    act = lambda *shape: (torch.randn(*shape, device=DEV), True)  # noqa: E731
    inputs = [act(bt, i, seq), act(bt, i, seq), (-torch.exp(torch.randn(i, n, device=DEV)), False),
              act(bt, n, seq), act(bt, n, seq), (torch.randn(i, device=DEV), False), act(bt, i, seq),
              (torch.randn(i, device=DEV), False), (torch.randn(bt, i, n, device=DEV), False)]
    cot = [torch.randn(bt, i, seq, device=DEV), torch.randn(bt, i, n, device=DEV)]
    compare(selective_scan, selective_scan_reference, inputs, cot, dtype,
            ["y", "state", "du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "dstate"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_router_backward_full_size(dtype):
    from cudaformers.kernels.moe import route, route_reference

    t, e, k = 4096, 128, 8
    logits = torch.stack([torch.randperm(e, device=DEV) for _ in range(t)]).float() / 32 - e / 64  # no ties
    cot = [torch.randn(t, k, device=DEV)]
    compare(lambda x: route(x, k, True)[:1], lambda x: route_reference(x, k, True)[:1], [(logits, True)], cot,
            dtype, ["weights", "dlogits"])
