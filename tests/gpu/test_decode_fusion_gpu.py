"""The fused decode kernels at full size on the GPU: qk_norm_rope, the KV store, paged decode with a
16k-capacity grid over short contexts, and store_kv's dispatch inside a CUDA graph."""

import pytest
import torch

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _close(out, ref, ref32, what):
    budget = 2 * (ref.float() - ref32.float()).abs().max().item() + 1e-6
    err = (out.float() - ref32.float()).abs().max().item()
    assert err <= budget, f"{what}: error {err:.3g} > 2x same-dtype reference error {budget:.3g}"


@pytest.mark.parametrize("t", [1, 32, 300])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_bf16(t, norm):
    from cudaformers.kernels.qk_norm_rope import qk_norm_rope_forward, qk_norm_rope_reference

    hq, hkv, d = 16, 8, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV)
    q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    w = [torch.rand(d, device=DEV) + 0.5 for _ in range(2)] if norm else [None, None]
    emb = torch.arange(t, device=DEV).float()[:, None] * torch.rand(d // 2, device=DEV)
    cos, sin = torch.cat([emb, emb], -1).cos(), torch.cat([emb, emb], -1).sin()
    bf = [x.bfloat16() if x is not None else None for x in (q, k, cos, sin, *w)]
    ours = qk_norm_rope_forward(*bf, 1e-6, 1e-6)
    ref = qk_norm_rope_reference(*bf, 1e-6, 1e-6)
    ref32 = qk_norm_rope_reference(*[x.float() if x is not None else None for x in bf], 1e-6, 1e-6)
    for a, b, c, name in zip(ours, ref, ref32, "qk"):
        _close(a, b, c, name)


@pytest.mark.parametrize("src,cache", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                       (torch.float16, torch.float32)])
def test_kv_store_bit_exact(src, cache):
    from cudaformers.kernels.kv_store import store_kv_reference, store_kv_triton

    t, hkv, d = 37, 8, 128
    kv = torch.randn(t, 2 * hkv * d + 64, device=DEV).to(src)
    k, v = kv[:, 64:64 + hkv * d].view(t, hkv, d), kv[:, 64 + hkv * d:].view(t, hkv, d)
    k_cache = torch.randn(8, 16, hkv, d, device=DEV).to(cache)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(128, device=DEV)[:t]
    slots[::5] = -1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(ref_k, ref_v, k, v, slots)
    store_kv_triton(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("capacity", [512, 16384])
def test_paged_decode_short_contexts_in_a_large_grid(capacity):
    from cudaformers.kernels.paged_decode import paged_decode, paged_decode_reference

    b, hq, hkv, d, page = 3, 16, 8, 128, 16
    per_seq = capacity // page
    k_cache = torch.randn(b * per_seq, page, hkv, d, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(b * per_seq, device=DEV).to(torch.int32).view(b, per_seq)
    q = torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16)
    seqlens = torch.tensor([1, 130, 500], device=DEV, dtype=torch.int32)
    out = paged_decode(q, k_cache, v_cache, seqlens, table, capacity, d ** -0.5)
    ref = paged_decode_reference(q, k_cache, v_cache, seqlens, table, d ** -0.5)
    ref32 = paged_decode_reference(q, k_cache, v_cache, seqlens, table, d ** -0.5, upcast=True)
    _close(out, ref, ref32, "paged decode")


def test_store_kv_dispatch_is_graph_capturable():
    from cudaformers.attention.kv_cache import store_kv
    from cudaformers.kernels.kv_store import store_kv_reference

    k_cache = torch.zeros(4, 16, 2, 64, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(2, 3, 2, 64, device=DEV, dtype=torch.bfloat16).unbind(0)
    slots = torch.tensor([5, 40, 17], device=DEV)
    store_kv(k_cache, v_cache, k, v, slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(k_cache, v_cache, k, v, slots)
    k_cache.zero_(), v_cache.zero_()
    graph.replay()
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_reference(ref_k, ref_v, k, v, slots)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
