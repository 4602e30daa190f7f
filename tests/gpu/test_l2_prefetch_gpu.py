"""L2 prefetches of the next projection's weights change no result: the GEMV kernels with a plan
against the same launches without one (bitwise), the plan a decode graph records, and greedy tokens
of a qwen3-0.6b-shaped model with prefetching off and on."""

import pytest
import torch

from cudaformers.kernels import l2_prefetch

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(autouse=True)
def prefetch_on(monkeypatch):
    monkeypatch.setenv("CUDAFORMERS_L2_PREFETCH", "1")


def _unplanned(fn):
    l2_prefetch._plan.clear()
    return fn()


@pytest.mark.parametrize("n,k", [(1024, 1024), (4096, 2048), (151936, 1024), (77, 300)])
def test_gemv_results_unchanged_by_prefetch(n, k):
    from cudaformers.kernels.gemv import gemv, gemv_act_mul, gemv_rms_norm

    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    nxt = torch.randn(12 << 20, device=DEV, dtype=torch.bfloat16)
    nw = torch.rand(k, device=DEV, dtype=torch.bfloat16) + 0.5
    calls = [lambda: gemv(x, w), lambda: gemv_act_mul(x, x, w), lambda: gemv_rms_norm(x, w, nw, 1e-6, x)[0]]
    for call in calls:
        want = _unplanned(call)
        l2_prefetch.plan([w, nxt])
        assert l2_prefetch.kernel_args(w)[1] > 0
        assert torch.equal(call(), want)


def test_quant_gemv_results_unchanged_by_prefetch():
    from cudaformers.kernels.quant_gemv import fp8_gemv

    x = torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16)
    w8 = torch.randn(1024, 4096, device=DEV).to(torch.float8_e4m3fn)
    scale = torch.rand(1024, device=DEV) + 0.5
    nxt = torch.randn(1 << 20, device=DEV)
    want = _unplanned(lambda: fp8_gemv(x, w8, scale))
    l2_prefetch.plan([w8, nxt])
    assert torch.equal(fp8_gemv(x, w8, scale), want)


def test_decode_graph_records_its_projection_order_and_tokens_are_unchanged(monkeypatch):
    from test_decode_fusion_gpu import _qwen3_06b_shaped

    from cudaformers.kernels.hub import kernelize

    model = _qwen3_06b_shaped()
    kernelize(model)
    ids = torch.randint(3, 151000, (1, 12), device=DEV, generator=torch.Generator(device=DEV).manual_seed(2))
    kw = dict(max_new_tokens=48, do_sample=False, eos_token_id=None)
    l2_prefetch._plan.clear()
    planned = model.generate(ids, use_cuda_graph=True, **kw)
    layer = model.model.layers[0]
    qkv = layer.self_attn.packed_qkv.weight
    assert l2_prefetch.after(qkv) is layer.self_attn.o_proj.weight, "the warm-up step recorded no plan"
    monkeypatch.setenv("CUDAFORMERS_L2_PREFETCH", "0")
    l2_prefetch._plan.clear()
    plain = model.generate(ids, use_cuda_graph=False, **kw)
    assert torch.equal(planned, plain)
