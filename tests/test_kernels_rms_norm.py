import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.kernels.rms_norm import rms_norm, rms_norm_residual_reference  # noqa: E402

from test_kernels_tolerance import assert_matches  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(rows, cols, dtype, residual):
    g = torch.Generator().manual_seed(rows * 131 + cols)
    x = torch.randn(rows, cols, generator=g)
    w = 1 + 0.1 * torch.randn(cols, generator=g)
    r = torch.randn(rows, cols, generator=g) if residual else None
    dy = torch.randn(rows, cols, generator=g)
    return x, w, r, dy


def _run(fn, x, w, r, dy, dtype):
    x = x.to(dtype).requires_grad_()
    w = w.to(dtype).requires_grad_()
    r = r.to(dtype).requires_grad_() if r is not None else None
    out = fn(x, w, 1e-6, r)
    y, s = out if r is not None else (out, None)
    loss = (y.float() * dy).sum() + (0 if s is None else (s.float() * dy.flip(0)).sum())
    loss.backward()
    grads = [x.grad, w.grad] + ([r.grad] if r is not None else [])
    return [y] + ([s] if s is not None else []) + grads


def _ref(x, w, eps, r=None):
    return rms_norm_residual_reference(x, w, eps, r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,residual", [(1, 64, False), (7, 33, True), (16, 128, True), (5, 100, False)])
def test_rms_norm_matches_reference(rows, cols, residual, dtype):
    _check_against_reference(rows, cols, residual, dtype)


def _check_against_reference(rows, cols, residual, dtype):
    """Outputs and gradients within the tolerance rule of test_kernels_tolerance."""
    x, w, r, dy = _inputs(rows, cols, dtype, residual)
    ours = _run(rms_norm, x, w, r, dy, dtype)
    ref = _run(_ref, x, w, r, dy, dtype)
    ref32 = _run(_ref, x, w, r, dy, torch.float32)
    names = ["y", "s", "dx", "dw", "dr"] if residual else ["y", "dx", "dw"]
    for name, a, b, c in zip(names, ours, ref, ref32):
        assert a.dtype == b.dtype, name
        assert_matches(a, b, c, f"{name} ({dtype}, {rows}x{cols})")


def test_rms_norm_inference_path_and_fp32_weight():
    x, w, r, _ = _inputs(3, 48, torch.bfloat16, True)
    with torch.no_grad():
        y, s = rms_norm(x.bfloat16(), w, 1e-5, r.bfloat16())  # fp32 weight: output promoted as in PyTorch
        y_ref, s_ref = _ref(x.bfloat16(), w, 1e-5, r.bfloat16())
    assert y.dtype == y_ref.dtype == torch.float32
    # One bf16 ulp: the Triton interpreter rounds casts toward zero, GPUs to nearest.
    torch.testing.assert_close(s, s_ref, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)



def _view(packed, layout, t, h, d):
    if layout == "rows":
        return packed[:, 8:8 + h * d]
    if layout == "heads":
        return packed[:, 8:8 + h * d].view(t, h, d)
    return packed[:, :2 * h * d].view(t, h, 2 * d)[..., :d]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["rows", "heads", "padded_heads"])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_reads_strided_views(layout, residual, dtype):
    # Views as the model produces them: a slice of a packed projection's rows, or per-head [T, H, D].
    g = torch.Generator().manual_seed(11)
    t, h, d = 5, 3, 24
    packed0 = torch.randn(t, 2 * h * d + 8, generator=g)
    shape = _view(packed0, layout, t, h, d).shape
    r0 = torch.randn(shape, generator=g) if residual else None
    w0 = 1 + 0.1 * torch.randn(shape[-1], generator=g)
    dy = torch.randn(shape, generator=g)

    def run(fn, dt):
        packed = packed0.to(dt).requires_grad_()
        x = _view(packed, layout, t, h, d)
        assert not x.is_contiguous()
        r = r0.to(dt).requires_grad_() if residual else None
        out = fn(x, w0.to(dt), 1e-6, r)
        y, s = out if residual else (out, None)
        loss = (y.float() * dy).sum() + (0 if s is None else (s.float() * dy.flip(0)).sum())
        loss.backward()
        with torch.no_grad():  # the inference path too
            y_ng = fn(x, w0.to(dt), 1e-6, r)
        return [y, packed.grad] + ([s, r.grad] if residual else []) + [y_ng[0] if residual else y_ng]

    ours, ref, ref32 = run(rms_norm, dtype), run(_ref, dtype), run(_ref, torch.float32)
    for name, a, b, c in zip(["y", "dx", "s", "dr", "y (no grad)"] if residual else ["y", "dx", "y (no grad)"],
                             ours, ref, ref32):
        assert_matches(a, b, c, f"{name} ({dtype}, {layout})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [64, 96, 128, 1000, 1024])
@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
def test_rms_norm_tiles_odd_and_power_of_two_shapes(rows, cols, dtype):
    # Narrow rows share a tile (up to 64 rows of 64), wide ones fill it alone; 1000 rows leave a
    # partial last tile, and the backward's programs each walk several tiles.
    _check_against_reference(rows, cols, (rows + cols) % 2 == 1, dtype)


def test_rms_norm_weight_gradient_is_deterministic():
    x, w, r, dy = _inputs(999, 128, torch.float32, True)
    first = _run(rms_norm, x, w, r, dy, torch.bfloat16)[3]
    for _ in range(2):
        assert torch.equal(_run(rms_norm, x, w, r, dy, torch.bfloat16)[3], first)


def test_rms_norm_per_head_rows_as_in_qk_norm():
    # q_norm: [T, heads, head_dim] rows, bf16 activations, fp32 weight (autocast master weights).
    g = torch.Generator().manual_seed(2)
    q0, w0 = torch.randn(37, 16, 128, generator=g), 1 + 0.1 * torch.randn(128, generator=g)
    dy = torch.randn(37, 16, 128, generator=g)

    def run(fn, dt):
        q, w = q0.to(dt).requires_grad_(), w0.clone().requires_grad_()
        y = fn(q, w, 1e-6)
        (y.float() * dy).sum().backward()
        return y, q.grad, w.grad

    ours, ref, ref32 = run(rms_norm, torch.bfloat16), run(_ref, torch.bfloat16), run(_ref, torch.float32)
    assert ours[0].dtype == torch.float32 and ours[2].dtype == torch.float32
    for name, a, b, c in zip(["y", "dq", "dw"], ours, ref, ref32):
        assert_matches(a, b, c, f"{name} (q_norm)", dtype=torch.bfloat16)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_out_dtype_is_the_reference_rounded_once(residual, out_dtype):
    """fp32 activations and weight (autocast master weights) with a low-precision output: the norm
    is the fp32 reference rounded once (within one unit in the last place: the interpreter may round
    differently from torch); gradients flow back in fp32 as through a cast."""
    x, w, r, dy = _inputs(37, 96, torch.float32, residual)
    got = _run(lambda *a: rms_norm(*a, out_dtype=out_dtype), x, w, r, dy, torch.float32)

    def ref(x, w, eps, r=None):
        out = _ref(x, w, eps, r)
        return (out[0].to(out_dtype), out[1]) if r is not None else out.to(out_dtype)

    want = _run(ref, x, w, r, dy, torch.float32)
    assert got[0].dtype == out_dtype
    ulp = torch.finfo(out_dtype).eps
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=ulp, atol=1e-6)
    for g, e in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
