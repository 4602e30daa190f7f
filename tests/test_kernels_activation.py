import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.errors import UnsupportedError  # noqa: E402
from cudaformers.kernels.activation import act_and_mul, act_and_mul_reference  # noqa: E402

from test_kernels_tolerance import assert_matches  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _run(fn, g0, u0, dy, dtype, name):
    g, u = g0.to(dtype).requires_grad_(), u0.to(dtype).requires_grad_()
    y = fn(g, u, name)
    (y.float() * dy).sum().backward()
    return y.detach(), g.grad, u.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("shape", [(1, 8), (7, 33), (3, 5, 64), (2, 1500)])
def test_act_and_mul_matches_reference(shape, name, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    g, u, dy = (torch.randn(shape, generator=gen) * 3 for _ in range(3))
    ours = _run(act_and_mul, g, u, dy, dtype, name)
    ref = _run(act_and_mul_reference, g, u, dy, dtype, name)
    ref32 = _run(act_and_mul_reference, g, u, dy, torch.float32, name)
    for what, a, b, c in zip(["y", "dgate", "dup"], ours, ref, ref32):
        assert a.dtype == b.dtype
        assert_matches(a, b, c, f"{what} {name} {dtype}")


def test_unknown_activation_is_a_clear_error():
    with pytest.raises(UnsupportedError, match="relu"):
        act_and_mul(torch.randn(2, 4), torch.randn(2, 4), "relu")
