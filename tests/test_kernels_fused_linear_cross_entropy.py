import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.kernels.fused_linear_cross_entropy import (  # noqa: E402
    fused_linear_cross_entropy, fused_linear_cross_entropy_reference)

from test_kernels_tolerance import assert_matches  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(n, h, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h ** 0.5 * 4
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < 0.25] = -100
    return hidden, weight, targets


def _run(fn, hidden, weight, targets, dtype, **kw):
    h = hidden.to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    loss = fn(h, w, targets, **kw)
    (loss * 1.5).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,h,v,chunk", [(1, 16, 64, None), (13, 24, 37, 4), (32, 32, 1500, 8), (9, 8, 2048, None)])
def test_flce_matches_reference(n, h, v, chunk, dtype):
    hidden, weight, targets = _inputs(n, h, v, seed=n + v)
    if (targets == -100).all():
        targets[0] = 3
    ours = _run(fused_linear_cross_entropy, hidden, weight, targets, dtype, chunk_size=chunk)
    ref = _run(fused_linear_cross_entropy_reference, hidden, weight, targets, dtype)
    ref32 = _run(fused_linear_cross_entropy_reference, hidden, weight, targets, torch.float32)
    for what, a, b, c in zip(["loss", "dhidden", "dweight"], ours, ref, ref32):
        assert a.dtype == b.dtype, what
        assert_matches(a, b, c, f"{what} {dtype}", dtype=dtype)


def test_flce_num_items_in_batch_and_frozen_weight():
    hidden, weight, targets = _inputs(11, 16, 50, seed=3)
    h = hidden.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, weight, targets, num_items_in_batch=7, chunk_size=4)
    loss.backward()
    h_ref = hidden.clone().requires_grad_()
    ref = fused_linear_cross_entropy_reference(h_ref, weight, targets, num_items_in_batch=7)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, h_ref.grad)
    with torch.no_grad():
        torch.testing.assert_close(fused_linear_cross_entropy(hidden, weight, targets),
                                   fused_linear_cross_entropy_reference(hidden, weight, targets))


def test_flce_fp32_weight_with_half_hidden_as_under_autocast():
    hidden, weight, targets = _inputs(6, 16, 40, seed=5)
    h = hidden.bfloat16().requires_grad_()
    w = weight.clone().requires_grad_()
    fused_linear_cross_entropy(h, w, targets).backward()
    assert w.grad.dtype == torch.float32 and h.grad.dtype == torch.bfloat16
    w_ref = weight.clone().requires_grad_()
    fused_linear_cross_entropy_reference(hidden.bfloat16(), w_ref, targets).backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=2e-2, atol=2e-3)


def test_flce_rejects_out_of_range_targets():
    hidden, weight, targets = _inputs(4, 8, 10)
    targets[1] = 10
    with pytest.raises(RuntimeError, match="outside"):
        fused_linear_cross_entropy(hidden, weight, targets)


def test_flce_under_autocast_with_fp32_residual_stream():
    # Autocast training: fp32 hidden (embeddings + residual adds) and fp32 master weights, matmuls in bf16.
    g = torch.Generator().manual_seed(3)
    h = torch.randn(40, 32, generator=g, requires_grad=True)
    w = torch.randn(100, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 100, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(h, w, t)
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.cross_entropy((h2 @ w2.t()).float(), t)
    ref.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(h.grad, h2.grad, atol=5e-3, rtol=5e-2)
    torch.testing.assert_close(w.grad, w2.grad, atol=5e-3, rtol=5e-2)


def test_chunks_fill_the_logits_budget_evenly():
    from cudaformers.kernels import fused_linear_cross_entropy as flce

    # W6 (qwen3-0.6b, 8 x 2048 tokens, bf16 logits): 10 chunks of ~1.7k rows, not 64 of 256, so the
    # fp32 weight-gradient accumulator is read and written 10 times instead of 64.
    c = flce._chunk_size(16384, 151936, 2)
    assert c % 64 == 0 and 1536 <= c <= 1792, c
    assert c * 151936 * 2 <= flce.LOGITS_BUDGET * 1.05
    assert -(-16384 // c) == 10
    assert flce._chunk_size(100, 151936, 2) == 100  # a small batch is one chunk
    assert flce._chunk_size(5, 32, 4) == 5
    assert flce._chunk_size(10**6, 10**7, 4) == 128  # a huge vocabulary keeps 128 rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_flce_default_chunking_over_several_chunks(monkeypatch, dtype):
    from cudaformers.kernels import fused_linear_cross_entropy as flce

    n, h, v = 300, 16, 96
    monkeypatch.setattr(flce, "LOGITS_BUDGET", 128 * v * dtype.itemsize)  # 128-row cap: 3 chunks of 128
    assert flce._chunk_size(n, v, dtype.itemsize) == 128
    hidden, weight, targets = _inputs(n, h, v, seed=4)
    ours = _run(fused_linear_cross_entropy, hidden, weight, targets, dtype)
    ref = _run(fused_linear_cross_entropy_reference, hidden, weight, targets, dtype)
    ref32 = _run(fused_linear_cross_entropy_reference, hidden, weight, targets, torch.float32)
    for what, a, b, c in zip(["loss", "dhidden", "dweight"], ours, ref, ref32):
        assert_matches(a, b, c, f"{what} {dtype}", dtype=dtype)


def test_flce_matmuls_run_in_the_autocast_dtype(monkeypatch):
    from cudaformers.kernels import fused_linear_cross_entropy as flce

    seen = []
    inner = flce._flce
    monkeypatch.setattr(flce, "_flce", lambda h, w, *a: seen.append((h.dtype, w.dtype)) or inner(h, w, *a))
    hidden, weight, targets = _inputs(6, 16, 40, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        flce.fused_linear_cross_entropy(hidden.requires_grad_(), weight.requires_grad_(), targets).backward()
    assert seen == [(torch.bfloat16, torch.float32)]  # hidden cast once; the weight is cast inside
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
