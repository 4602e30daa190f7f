"""The L2 prefetch of the next projections' weights (off by default, kernels/l2_prefetch.py) on the GPU:
a prefetching GEMV gives the same bits as one that does not, and a qwen3-0.6b-shaped model decodes
the same tokens with it on and off, with and without CUDA graphs."""

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
DEV = "cuda"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("rows", [1, 4])
def test_prefetching_gemv_same_bits(rows):
    from cudaformers.kernels.gemv import gemv_rms_norm

    g = torch.Generator(device=DEV).manual_seed(rows)
    x, res = (torch.randn(rows, 1024, device=DEV, generator=g).bfloat16() for _ in range(2))
    w = (torch.randn(4096, 1024, device=DEV, generator=g) / 32).bfloat16()
    nw = (1 + 0.1 * torch.randn(1024, device=DEV, generator=g)).bfloat16()
    nxt = [torch.randn(n, 1024, device=DEV, generator=g).bfloat16() for n in (1024, 6144)]
    want = gemv_rms_norm(x, w, nw, 1e-6, res)
    got = gemv_rms_norm(x, w, nw, 1e-6, res, prefetch=tuple(nxt))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_qwen3_06b_shaped_tokens_with_and_without_the_prefetch(monkeypatch):
    from test_decode_fusion_gpu import _qwen3_06b_shaped

    from cudaformers.kernels import fused_norm_decode, gemv
    from cudaformers.kernels.hub import kernelize

    model = _qwen3_06b_shaped()
    model.set_attn_implementation("triton")
    kernelize(model)
    ids = torch.randint(3, 151000, (1, 12), device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    kw = dict(max_new_tokens=32, do_sample=False, eos_token_id=None)
    want = model.generate(ids, use_cuda_graph=False, **kw)  # no graph captured yet: the next one has the prefetch
    prefetches = []
    real = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *a, **k: (prefetches.append(len(k.get("prefetch", ()))),
                                                          real(*a, **k))[1])
    monkeypatch.setattr(fused_norm_decode, "PREFETCH_NEXT_WEIGHTS", 2)
    got = [model.generate(ids, use_cuda_graph=graph, **kw) for graph in (True, False)]
    assert 2 in prefetches, "no GEMV prefetched the o and gate/up weights"
    assert torch.equal(got[0], want) and torch.equal(got[1], want)
