"""The paged decode's early start under programmatic dependent launch (lengths, block table and an
L2 prefetch of the first K/V tile before the wait) on the GPU: the same bits as the launch that waits
first, eagerly and in a CUDA graph behind the kernel that writes the newest cache row."""

import pytest
import torch

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("batch", [1, 32])
def test_early_paged_decode_same_bits(batch, monkeypatch):
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

    monkeypatch.setattr(pd, "pdl_enabled", lambda device: False)
    want = step()  # waits for nothing, reads everything in order
    monkeypatch.undo()
    assert pd.pdl_enabled(q.device), "this GPU runs without PDL: the early start is not exercised"
    assert torch.equal(step(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    k_new.normal_(generator=g)  # a new newest row: the replay must read it, not the old one
    graph.replay()
    monkeypatch.setattr(pd, "pdl_enabled", lambda device: False)
    assert torch.equal(out, step())
