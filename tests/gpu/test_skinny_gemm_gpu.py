"""The skinny GEMM at qwen3-0.6b / qwen3-8b projection sizes on the GPU: every element against F.linear
in fp32, determinism of split-K, PDL on and off, CUDA-graph capture and replay."""

import logging

import pytest
import torch
import torch.nn.functional as F

import cudaformers.kernels.skinny_gemm as sg
from cudaformers.kernels import arrivals
from cudaformers.kernels.arrivals import arrival_counters
from cudaformers.kernels.skinny_gemm import SkinnyConfig, plan, skinny_linear

pytestmark = pytest.mark.gpu
# (N, K): qwen3-0.6b qkv, o, gate_up, down; qwen3-8b the same four.
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
          (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
# Elementwise error allowed: one rounding of the output relative to |y|, plus a summation-order
# allowance relative to the largest output.
REL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}
ABS = {torch.bfloat16: 1e-4, torch.float16: 1e-4, torch.float32: 1e-5}


def _inputs(m, n, k, dtype, bias=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    return x, w, b


def _check(got, x, w, b):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    err = (got.float() - ref).abs()
    allowed = REL[x.dtype] * ref.abs() + ABS[x.dtype] * ref.abs().max()
    assert got.dtype == x.dtype and got.shape == ref.shape
    assert (err <= allowed).all(), (err.max().item(), (err - allowed).max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [5, 8, 32, 37, 64])
@pytest.mark.parametrize("n,k", SHAPES)
def test_full_size_against_f_linear(n, k, m, dtype):
    x, w, b = _inputs(m, n, k, dtype, bias=m % 2 == 1)
    _check(skinny_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("m", [16, 64])
@pytest.mark.parametrize("n,k", SHAPES[:4])
def test_fp16(n, k, m):
    x, w, b = _inputs(m, n, k, torch.float16)
    _check(skinny_linear(x, w, b), x, w, b)


# The configurations bench/skinny_gemm.py --sweep times: each must be right before it is fast.
SWEEP = [SkinnyConfig(16, 128, 128, 1024), SkinnyConfig(32, 64, 128, 128, num_stages=1),
         SkinnyConfig(64, 32, 64, 512, num_warps=8), SkinnyConfig(128, 64, 64, 256)]


@pytest.mark.parametrize("cfg", SWEEP, ids=str)
@pytest.mark.parametrize("m", [9, 128])
def test_configs(cfg, m):
    x, w, b = _inputs(m, 1024, 3072, torch.bfloat16)
    _check(skinny_linear(x, w, b, config=cfg), x, w, b)


def test_strided_rows_of_a_packed_output():
    qkv = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    x = qkv[:, 2048:3072]  # the k part of a packed q/k/v output: rows 4096 elements apart
    _, w, b = _inputs(32, 2048, 1024, torch.bfloat16)
    _check(skinny_linear(x, w, b), x.contiguous(), w, b)


@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 3072)])
def test_split_k_is_deterministic(n, k):
    x, w, b = _inputs(32, n, k, torch.bfloat16)
    assert -(-k // plan(32, n, k, x.dtype, sg.sm_count(x.device)).k_split) > 1  # the split path
    first = skinny_linear(x, w, b)
    for _ in range(5):
        assert torch.equal(first, skinny_linear(x, w, b))
    assert not arrival_counters(x.device, 1).any()


def test_pdl_on_and_off_agree(monkeypatch):
    x, w, b = _inputs(32, 1024, 2048, torch.bfloat16)
    w2 = _inputs(32, 2048, 1024, torch.bfloat16)[1]
    chain = lambda: skinny_linear(skinny_linear(x, w, b), w2)  # noqa: E731 (back-to-back dependent launches)
    with_pdl = chain()
    monkeypatch.setenv("CUDAFORMERS_PDL", "0")
    assert torch.equal(with_pdl, chain())


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("n,k", [(1024, 2048), (24576, 4096)])
def test_graph_capture_and_replay(n, k):
    x, w, b = _inputs(32, n, k, torch.bfloat16)
    w2 = _inputs(32, k, n, torch.bfloat16)[1]
    chain = lambda: skinny_linear(skinny_linear(x, w, b), w2)  # noqa: E731
    graph, out = _capture(chain)
    for seed in range(3):  # new inputs in place, the same graph
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        want = chain()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_first_call_inside_a_capture(caplog, monkeypatch):
    monkeypatch.setattr(sg, "_warned_capture", [])
    x, w, b = _inputs(32, 1024, 2048, torch.bfloat16)
    skinny_linear(x, w, b, config=plan(32, 1024, 2048, x.dtype, sg.sm_count(x.device), split_ok=False))  # compile
    monkeypatch.setattr(arrivals, "_BUFFERS", {})  # no counters yet: the capture cannot make them
    graph = torch.cuda.CUDAGraph()
    with caplog.at_level(logging.INFO, logger="cudaformers"), torch.cuda.graph(graph):
        out = skinny_linear(x, w, b)
    graph.replay()
    torch.cuda.synchronize()
    assert "without split-K" in caplog.text
    _check(out, x, w, b)


@pytest.mark.parametrize("n,k", [(6144, 1024), (24576, 4096), (6146, 1000)])
@pytest.mark.parametrize("m", [5, 8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_equals_projection_then_act_and_mul(n, k, m, dtype):
    """skinny_gated is bit for bit the packed gate/up launch followed by the act-and-mul kernel, on the
    tensor cores, eagerly and replayed from a CUDA graph."""
    from cudaformers.kernels.activation import act_and_mul_forward
    from cudaformers.kernels.skinny_gemm import skinny_gated

    x, w, b = _inputs(m, n, k, dtype, bias=m == 8)
    i = n // 2
    gate_up = skinny_linear(x, w, b)
    want = act_and_mul_forward(gate_up[:, :i], gate_up[:, i:], "silu")
    assert torch.equal(skinny_gated(x, w, b, "silu"), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_gated(x, w, b, "silu")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
