"""The q/k/v GEMV finishing its own heads (kernels/gemv_heads.py) on the GPU, at qwen3-0.6b's attention
shapes (hidden 1024, 16 q heads, 8 kv heads, head_dim 128: sixteen 8-row programs a head, whichever
arrives last finishing it): q, k, v, the residual sum and both caches against the GEMV then
qk_norm_rope with its fused store, eagerly and replayed from a CUDA graph; then a qwen3-0.6b-shaped
model with it switched on decodes the same tokens from its graph as eagerly, and the unfolded path's."""

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
DEV = "cuda"
HQ, HKV, D, HIDDEN = 16, 8, 128, 1024


def _inputs(t, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    n = (HQ + 2 * HKV) * D
    x, residual = (torch.randn(t, HIDDEN, device=DEV, generator=g).to(dtype) for _ in range(2))
    weight = (torch.randn(n, HIDDEN, device=DEV, generator=g) / HIDDEN ** 0.5).to(dtype)
    norm_w = (torch.rand(HIDDEN, device=DEV, generator=g) + 0.5).to(dtype)
    qw, kw = ((torch.rand(D, device=DEV, generator=g) + 0.5).to(dtype) for _ in range(2))
    emb = torch.arange(t, device=DEV).float()[:, None] * 37 * torch.rand(D // 2, device=DEV, generator=g)
    cos, sin = torch.cat([emb, emb], -1).cos().to(dtype), torch.cat([emb, emb], -1).sin().to(dtype)
    caches = [torch.randn(8, 16, HKV, D, device=DEV, generator=g).to(dtype) for _ in range(2)]
    slots = torch.randperm(128, device=DEV, generator=g)[:t]
    if t > 2:
        slots[1] = -1  # a padding token
    return x, residual, weight, norm_w, qw, kw, cos, sin, caches, slots


def _heads(args):
    from cudaformers.kernels.gemv_heads import Heads, gemv_heads

    x, residual, weight, norm_w, qw, kw, cos, sin, caches, slots = args
    heads = Heads(HQ, HKV, D, cos, sin, qw, kw, 1e-6, 1e-6, (*caches, slots))
    return gemv_heads(x, weight, heads, None, (norm_w, 1e-6, residual))


def _two_launches(args, caches):
    from cudaformers.attention.kv_cache import KVStore
    from cudaformers.kernels.gemv import gemv_rms_norm
    from cudaformers.kernels.qk_norm_rope import qk_norm_rope_forward

    x, residual, weight, norm_w, qw, kw, cos, sin, _, slots = args
    qkv, summed = gemv_rms_norm(x, weight, norm_w, 1e-6, residual)
    t = x.shape[0]
    q, k, v = (p.view(t, -1, D) for p in qkv.split([HQ * D, HKV * D, HKV * D], -1))
    q, k = qk_norm_rope_forward(q, k, cos, sin, qw, kw, 1e-6, 1e-6, KVStore(v, *caches, slots))
    return q, k, v, summed


def _assert_matches(got, want, caches, want_caches, dtype):
    """v and the residual sum bit for bit (the same GEMV); q and k within one rounding step of the
    unfused kernel (a head's sum of squares may be reduced in another order by another kernel layout,
    as for qk_norm_rope's fused store), and the cache holding exactly the k returned, and v."""
    from cudaformers.attention.kv_cache import store_kv

    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    eps = torch.finfo(dtype).eps
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, rtol=eps, atol=eps * b.abs().amax().item())
    store_kv(*want_caches, got[1], got[2], want[4])  # the unfused store of the k the launch returned
    torch.cuda.synchronize()
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 3, 4])
def test_matches_the_gemv_then_qk_norm_rope(t, dtype):
    args = _inputs(t, dtype)
    caches = args[8]
    before = [c.clone() for c in caches]
    got = _heads(args)
    want = _two_launches(args, [c.clone() for c in before])
    _assert_matches(got, (*want, args[9]), caches, [c.clone() for c in before], dtype)
    from cudaformers.kernels.arrivals import arrival_counters

    assert int(arrival_counters(torch.device(DEV), 64)[:t * (HQ + HKV)].abs().sum()) == 0


def test_replayed_from_a_cuda_graph():
    args = _inputs(1, torch.bfloat16)
    caches = args[8]
    _heads(args)  # compile, and make the arrival counters, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _heads(args)
    for seed in (1, 2, 3):  # a decode step's new inputs in the captured buffers
        new = _inputs(1, torch.bfloat16, seed)
        for buf, x in zip((*args[:8], args[9]), (*new[:8], new[9])):
            buf.copy_(x)
        before = [c.clone() for c in caches]
        graph.replay()
        want = _two_launches(args, [c.clone() for c in before])
        _assert_matches(out, (*want, args[9]), caches, before, torch.bfloat16)


def _qwen3_06b_shaped(seed=0, dtype=torch.bfloat16):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_decode_fusion_gpu import _qwen3_06b_shaped as shaped

    return shaped(seed, dtype)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("norm_folded", [True, False])  # False: as past FOLD_MAX_HIDDEN (qwen3-8b)
def test_qwen3_06b_shaped_generate_graph_equals_eager_and_the_unfolded_path(norm_folded, monkeypatch):
    from cudaformers.kernels import fused_norm_decode, gemv_heads
    from cudaformers.kernels.hub import kernelize

    if not norm_folded:
        monkeypatch.setattr(fused_norm_decode, "FOLD_MAX_HIDDEN", HIDDEN - 1)

    # fp32: the head's norm may round its last bit otherwise than qk_norm_rope (see above), which bf16
    # greedy decoding can turn into a different token at a near-tie; in fp32 the tokens must agree.
    model = _qwen3_06b_shaped(dtype=torch.float32)
    model.set_attn_implementation("triton")
    kernelize(model)
    ids = torch.randint(3, 151000, (1, 12), device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    calls = []
    real = gemv_heads.gemv_heads
    monkeypatch.setattr(gemv_heads, "gemv_heads", lambda *a, **k: (calls.append(1), real(*a, **k))[1])

    def run(graph):
        return model.generate(ids, use_cuda_graph=graph, max_new_tokens=24, do_sample=False, eos_token_id=None)

    monkeypatch.setattr(gemv_heads, "HEAD_EPILOGUE", True)
    folded = [run(True)]
    assert calls, "the head epilogue was not captured into the decode graph"
    folded.append(run(False))
    assert torch.equal(folded[0], folded[1])  # graph == eager
    monkeypatch.setattr(gemv_heads, "HEAD_EPILOGUE", False)
    calls.clear()
    unfolded = run(True)
    assert not calls and torch.equal(folded[0], unfolded)
