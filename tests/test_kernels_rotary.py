import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.kernels.rotary import apply_rotary, apply_rotary_reference  # noqa: E402

from test_kernels_tolerance import assert_matches  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cos_sin(t, rot):
    pos = torch.arange(t, dtype=torch.float32) * 3 + 1
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([pos[:, None] * inv] * 2, -1)
    return emb.cos(), emb.sin()


def _run(fn, q0, k0, cos, sin, dq, dk, dtype):
    # The projection output the rotation acts on is a view, as in the attention layer.
    q = q0.to(dtype).requires_grad_()
    k = k0.to(dtype).requires_grad_()
    qv, kv = (q * 1).reshape(q0.shape[0], -1).view(q0.shape), k * 1
    rq, rk = fn(qv, kv, cos.to(dtype), sin.to(dtype))
    ((rq.float() * dq).sum() + (rk.float() * dk).sum()).backward()
    return rq.detach(), rk.detach(), q.grad, k.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d,rot", [(1, 4, 2, 16, 16), (5, 3, 1, 12, 12), (9, 8, 8, 64, 32), (6, 6, 2, 10, 6)])
def test_rotary_matches_reference(t, hq, hkv, d, rot, dtype):
    _check_against_reference(t, hq, hkv, d, rot, dtype, seed=t * 7 + d)


def _check_against_reference(t, hq, hkv, d, rot, dtype, seed):
    """Rotated q, k and their gradients within the tolerance rule of test_kernels_tolerance."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)
    dq, dk = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)
    cos, sin = _cos_sin(t, rot)
    ours = _run(apply_rotary, q, k, cos, sin, dq, dk, dtype)
    ref = _run(apply_rotary_reference, q, k, cos, sin, dq, dk, dtype)
    ref32 = _run(apply_rotary_reference, q, k, cos, sin, dq, dk, torch.float32)
    for name, a, b, c in zip(["q", "k", "dq", "dk"], ours, ref, ref32):
        assert a.dtype == b.dtype
        assert_matches(a, b, c, f"{name} ({dtype}, t={t})")


def test_rotary_is_in_place_without_grad():
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    cos, sin = _cos_sin(3, 8)
    ref_q, ref_k = apply_rotary_reference(q, k, cos, sin)
    out_q, out_k = apply_rotary(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, ref_q)
    torch.testing.assert_close(k, ref_k)


def test_rotary_on_strided_views():
    # q and k as slices of one fused projection output: rows are strided, heads contiguous.
    qkv = torch.randn(4, 3 * 16)
    q, k = qkv[:, :32].view(4, 2, 16), qkv[:, 32:].view(4, 1, 16)
    cos, sin = _cos_sin(4, 16)
    ref_q, ref_k = apply_rotary_reference(q.clone(), k.clone(), cos, sin)
    apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(q, ref_q)
    torch.testing.assert_close(k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d,rot", [(37, 16, 8, 128, 128), (64, 4, 1, 64, 64), (7, 3, 1, 96, 96),
                                            (11, 5, 5, 96, 64)])
def test_rotary_token_tiles(t, hq, hkv, d, rot, dtype):
    # Several tokens a program (32 for one 64-channel head), a partial last tile, non-power-of-two
    # heads and head dims, and partial rotary with the pass-through channels' gradient.
    _check_against_reference(t, hq, hkv, d, rot, dtype, seed=t + hq + d)


def test_rotary_out_of_place_from_a_strided_input():
    from cudaformers.kernels.rotary import _rotate_into

    qkv = torch.randn(9, 4 * 32)
    q = qkv[:, :96].view(9, 3, 32)
    cos, sin = _cos_sin(9, 32)
    out = torch.empty(9, 3, 32)
    _rotate_into(q, out, cos, sin, -1.0)
    ref, _ = apply_rotary_reference(q, q[:, :1], cos, -sin)
    torch.testing.assert_close(out, ref)
    assert torch.equal(qkv[:, :96].view(9, 3, 32), q)  # the input is untouched
