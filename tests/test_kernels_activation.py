import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from cudaformers.errors import UnsupportedError  # noqa: E402
from cudaformers.kernels.activation import act_and_mul, act_and_mul_packed, act_and_mul_reference  # noqa: E402

from test_kernels_tolerance import assert_matches  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(fn, g0, u0, dy, dtype, name):
    g, u = g0.to(DEVICE, dtype).requires_grad_(), u0.to(DEVICE, dtype).requires_grad_()
    y = fn(g, u, name)
    (y.float() * dy.to(DEVICE)).sum().backward()
    return y.detach(), g.grad, u.grad


def _run_packed(fn, p0, dy, dtype, name, layout):
    """``fn(gate, up)`` on views of one packed ``[..., 2I]`` tensor -> (y, d packed)."""
    p = p0.to(DEVICE, dtype).requires_grad_()
    i = p.shape[-1] // 2
    if layout == "packed":  # the packed kernel, on the tensor itself
        y = act_and_mul_packed(p, name) if fn is act_and_mul else fn(p[..., :i], p[..., i:], name)
    else:  # gate and up as split views (row stride 2I) through the two-input API
        y = fn(*p.split(i, dim=-1), name)
    (y.float() * dy.to(DEVICE)).sum().backward()
    return y.detach(), p.grad


def _compare(ours, ref, ref32, names, what):
    for n, a, b, c in zip(names, ours, ref, ref32):
        assert a.dtype == b.dtype, f"{n} {what}"
        assert a.is_contiguous(), f"{n} {what}"
        assert_matches(a, b, c, f"{n} {what}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("shape", [(1, 8), (7, 33), (3, 5, 64), (2, 1500)])
def test_act_and_mul_matches_reference(shape, name, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    g, u, dy = (torch.randn(shape, generator=gen) * 3 for _ in range(3))
    ours = _run(act_and_mul, g, u, dy, dtype, name)
    ref = _run(act_and_mul_reference, g, u, dy, dtype, name)
    ref32 = _run(act_and_mul_reference, g, u, dy, torch.float32, name)
    _compare(ours, ref, ref32, ["y", "dgate", "dup"], f"{name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("layout", ["split", "packed"])
@pytest.mark.parametrize("shape", [(1, 64), (5, 37), (2, 3, 128), (3, 300)])
def test_packed_halves_match_reference(shape, layout, name, dtype):
    # shape is the [..., I] of gate and up; the projection output is [..., 2I].
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    p = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * 3
    dy = torch.randn(shape, generator=gen)
    ours = _run_packed(act_and_mul, p, dy, dtype, name, layout)
    ref = _run_packed(act_and_mul_reference, p, dy, dtype, name, layout)
    ref32 = _run_packed(act_and_mul_reference, p, dy, torch.float32, name, layout)
    _compare(ours, ref, ref32, ["y", "d(gate_up)"], f"{name} {dtype} {layout}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_inference_forward_on_strided_rows(dtype):
    # A [B, S, I] view with padded rows (row stride > I) and a non-contiguous dy-like layout.
    gen = torch.Generator().manual_seed(5)
    base = (torch.randn(2, 3, 2 * 70 + 6, generator=gen) * 3).to(DEVICE, dtype)
    gate, up = base[..., 3:73], base[..., 76:146]
    with torch.no_grad():
        y = act_and_mul(gate, up, "silu")
        y_packed = act_and_mul_packed(base[..., 3:143], "silu")
    ref32 = act_and_mul_reference(gate.float(), up.float(), "silu")
    assert_matches(y, act_and_mul_reference(gate, up, "silu"), ref32, f"strided rows {dtype}")
    assert_matches(y_packed, act_and_mul_reference(base[..., 3:73], base[..., 73:143], "silu"),
                   act_and_mul_reference(base[..., 3:73].float(), base[..., 73:143].float(), "silu"),
                   f"packed strided rows {dtype}")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_views_are_not_copied_and_packed_gradient_is_not_concatenated():
    p = torch.randn(4, 2 * 48, device=DEVICE, requires_grad=True)
    gate, up = p.split(48, dim=-1)
    with _Ops() as ops:
        with torch.no_grad():
            act_and_mul(gate, up)
        y = act_and_mul(gate, up)
    assert "clone" not in ops.names and "contiguous" not in ops.names, ops.names
    dy = torch.randn(4, 48, device=DEVICE)  # dense (a plain .sum() would hand back a stride-0 expand)
    (y * dy).sum().backward()  # through split: autograd concatenates the two gradients (its own op)
    expected = p.grad.clone()
    p.grad = None
    with _Ops() as ops:
        (act_and_mul_packed(p) * dy).sum().backward()
    assert not {"clone", "cat", "slice_backward", "split_with_sizes_backward"} & set(ops.names), ops.names
    torch.testing.assert_close(p.grad, expected, rtol=0, atol=0)


def test_unknown_activation_is_a_clear_error():
    with pytest.raises(UnsupportedError, match="relu"):
        act_and_mul(torch.randn(2, 4), torch.randn(2, 4), "relu")


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="same shape"):
        act_and_mul(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(ValueError, match="even size"):
        act_and_mul_packed(torch.randn(2, 7))


def test_empty_batch():
    assert act_and_mul(torch.randn(0, 8), torch.randn(0, 8)).shape == (0, 8)
    p = torch.randn(0, 16, requires_grad=True)
    act_and_mul_packed(p).sum().backward()
    assert p.grad.shape == (0, 16)
