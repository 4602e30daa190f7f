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


@pytest.mark.parametrize("batch", [1, 32])
def test_early_paged_decode_same_bits(batch, monkeypatch):
    """paged_decode.EARLY_PREFETCH (off by default): the length, block table and an L2 prefetch of the
    first K/V tile before the PDL wait give the same bits as the plain launch, eagerly and in a graph
    behind a kernel that writes the newest cache row."""
    from cudaformers.attention.kv_cache import store_kv
    from cudaformers.kernels import paged_decode as pd

    g = torch.Generator(device=DEV).manual_seed(batch)
    lens = torch.randint(1, 700, (batch,), device=DEV, generator=g).int()
    pages = 16
    width = -(-700 // pages)
    k_cache, v_cache = (torch.randn(batch * width, pages, 8, 128, device=DEV, generator=g).bfloat16() for _ in range(2))
    table = torch.randperm(batch * width, device=DEV, generator=g).int().view(batch, width)
    slots = (table[torch.arange(batch, device=DEV), (lens - 1) // pages].long() * pages + (lens - 1) % pages)
    q = torch.randn(batch, 16, 128, device=DEV, generator=g).bfloat16()
    k_new, v_new = (torch.randn(batch, 8, 128, device=DEV, generator=g).bfloat16() for _ in range(2))

    def step():
        store_kv(k_cache, v_cache, k_new, v_new, slots)  # the producer the early reads must not race
        return pd.paged_decode(q, k_cache, v_cache, lens, table, 700, 0.088)

    want = step()
    monkeypatch.setattr(pd, "EARLY_PREFETCH", True)
    assert torch.equal(step(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    k_new.normal_(generator=g)  # a new newest row: the replay must read it, not the old one
    graph.replay()
    monkeypatch.setattr(pd, "EARLY_PREFETCH", False)
    assert torch.equal(out, step())
