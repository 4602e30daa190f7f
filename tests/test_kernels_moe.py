import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.kernels.moe import moe_experts, moe_experts_reference, route, route_reference  # noqa: E402

from test_kernels_tolerance import assert_matches  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("t,e,k,renorm", [(1, 4, 1, False), (9, 7, 2, True), (16, 64, 8, True), (5, 3, 3, False)])
def test_routing_matches_reference(t, e, k, renorm):
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(t + e))
    w, i = route(logits, k, renorm)
    w_ref, i_ref = route_reference(logits, k, renorm)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-6)



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,k,renorm", [(1, 4, 1, False), (9, 7, 2, True), (16, 64, 8, True), (5, 3, 3, False)])
def test_routing_backward_matches_reference(t, e, k, renorm, dtype):
    g = torch.Generator().manual_seed(t * e + k)
    # Distinct logits, exact in every dtype: no ties, so the top-k choice is the reference's in bf16 too.
    logits = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).float() / 8 - e / 16
    dweights = torch.randn(t, k, generator=g)

    def run(fn, dt):
        x = logits.to(dt).requires_grad_()
        w, i = fn(x, k, renorm)
        (w * dweights).sum().backward()
        return w.detach(), i, x.grad

    (w, i, dx), (w_ref, i_ref, dx_ref), (_, _, dx32) = run(route, dtype), run(route_reference, dtype), \
        run(route_reference, torch.float32)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-6)
    assert dx.dtype == dx_ref.dtype == dtype
    assert_matches(dx, dx_ref, dx32, f"dlogits {dtype}")

def _inputs(t, e, k, h, i, skew, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    down = torch.randn(e, h, i, generator=g) / i ** 0.5
    logits = torch.randn(t, e, generator=g)
    if skew:  # most tokens to expert 0, expert e-1 to none: tiles of very different counts
        logits[:, 0] += 4
        logits[:, -1] -= 100
    weights, index = route_reference(logits, k, True)
    dout = torch.randn(t, h, generator=g)
    return hidden, gate_up, down, index, weights, dout


def _run(fn, hidden, gate_up, down, index, weights, dout, dtype, act):
    leaves = [x.to(dtype).requires_grad_() for x in (hidden, gate_up, down)]
    w = weights.clone().requires_grad_()
    out = fn(*leaves, index, w, act)
    (out.float() * dout).sum().backward()
    return [out.detach()] + [x.grad for x in leaves] + [w.grad]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,k,h,i,skew,act", [
    (1, 4, 2, 16, 16, False, "silu"),
    (13, 5, 2, 24, 20, True, "silu"),
    (32, 8, 3, 32, 48, False, "gelu_pytorch_tanh"),
])
def test_grouped_experts_match_reference(t, e, k, h, i, skew, act, dtype):
    args = _inputs(t, e, k, h, i, skew, seed=t * e)
    ours = _run(moe_experts, *args, dtype, act)
    ref = _run(moe_experts_reference, *args, dtype, act)
    ref32 = _run(moe_experts_reference, *args, torch.float32, act)
    for what, a, b, c in zip(["out", "dhidden", "dgate_up", "ddown", "drouting"], ours, ref, ref32):
        assert a.dtype == b.dtype, what
        assert_matches(a, b, c, f"{what} {dtype}", dtype=dtype)


def test_router_kernel_trains_like_the_plain_router():
    """Mapped in training, the hub's router forward gives the plain TopKRouter's weight gradient."""
    from cudaformers.kernels.hub import LAYER_TYPES, KernelConfig, resolve
    from cudaformers.layers.moe import TopKRouter

    config = KernelConfig({"MoeRouter": "cudaformers:topk_softmax"})
    name, _ = resolve("MoeRouter", "cuda", "training", config)
    assert name == "cudaformers:topk_softmax"
    g = torch.Generator().manual_seed(5)
    router = TopKRouter(24, 6, 2, renormalize=True)
    with torch.no_grad():
        router.weight.copy_(torch.randn(6, 24, generator=g))
    hidden, dweights = torch.randn(11, 24, generator=g), torch.randn(11, 2, generator=g)
    grads = []
    for forward in (router.forward, lambda x: LAYER_TYPES["MoeRouter"].kernels[name](router, x)):
        router.weight.grad = None
        weights, _ = forward(hidden)
        (weights * dweights).sum().backward()
        grads.append(router.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
