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
    model.__dict__.pop("_decode_runners", None)  # the graphs captured with the switch on
    calls.clear()
    unfolded = run(True)
    assert not calls and torch.equal(folded[0], unfolded)


# -- the quantized q/k/v fragment GEMV finishing its heads (kernels/quant_gemv_heads.py) ---------------------

@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("rms", [False, True])
def test_quantized_matches_the_fragment_gemv_then_qk_norm_rope(method, rms):
    """qwen3-8b's q/k/v (32 + 2 x 8 heads of 128, K 4096) at one row: v bit for bit the fragment GEMV's, q
    and k within a rounding step of qk_norm_rope on it, the cache holding the k returned and v."""
    from cudaformers.attention.kv_cache import KVStore, store_kv
    from cudaformers.kernels.gemv_heads import Heads
    from cudaformers.kernels.qk_norm_rope import qk_norm_rope_forward
    from cudaformers.kernels.quant_gemv_heads import quant_gemv_mma_heads
    from cudaformers.kernels.quant_gemv_mma import quant_gemv_mma
    from cudaformers.quant.apply import quantize
    from cudaformers import Int4Config, Int8Config

    hq, hkv, k_in = 32, 8, 4096
    g = torch.Generator(device=DEV).manual_seed(3)
    linear = torch.nn.Linear(k_in, (hq + 2 * hkv) * D, bias=False, device=DEV, dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=0.02, generator=g)
    config = Int8Config() if method == "int8" else Int4Config(group_size=128)
    w = quantize(torch.nn.Sequential(linear), config)[0].packed()
    x = torch.randn(1, k_in, device=DEV, generator=g).bfloat16()
    shares = (torch.rand(7, device=DEV, generator=g) * k_in, 1e-6) if rms else None
    qw, kw = ((torch.rand(D, device=DEV, generator=g) + 0.5).bfloat16() for _ in range(2))
    emb = 300 * torch.rand(1, D // 2, device=DEV, generator=g)
    cos, sin = torch.cat([emb, emb], -1).cos().bfloat16(), torch.cat([emb, emb], -1).sin().bfloat16()
    caches = [torch.randn(8, 16, hkv, D, device=DEV, generator=g).bfloat16() for _ in range(2)]
    before = [c.clone() for c in caches]
    slots = torch.tensor([37], device=DEV)
    q, k, v = quant_gemv_mma_heads(x, w, Heads(hq, hkv, D, cos, sin, qw, kw, 1e-6, 1e-6, (*caches, slots)),
                                   rms=shares)
    qkv = quant_gemv_mma(x, w, rms=shares)
    wq, wk, wv = (p.view(1, -1, D) for p in qkv.split([hq * D, hkv * D, hkv * D], -1))
    want = [c.clone() for c in before]
    want_q, want_k = qk_norm_rope_forward(wq, wk, cos, sin, qw, kw, 1e-6, 1e-6, KVStore(wv, *want, slots))
    assert torch.equal(v, wv)
    eps = torch.finfo(torch.bfloat16).eps
    for a, b in zip((q, k), (want_q, want_k)):
        torch.testing.assert_close(a, b, rtol=eps, atol=eps * b.abs().amax().item())
    expected = [c.clone() for c in before]
    store_kv(*expected, k, v, slots)
    torch.cuda.synchronize()
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("norm_fold", [False, True])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_decode_finishing_its_heads_graph_equals_eager(method, norm_fold, monkeypatch):
    """A 2-layer 1024-wide qwen3 quantized: with the switch on every decode step's q/k/v fragment GEMV
    finishes its heads (norm fold on or off), the graph gives the eager tokens, and a one-token
    forward's logits are the two launches' up to a rounding step of q/k."""
    from test_quant_gpu import _wide_model

    from cudaformers.kernels import gemv_heads, quant_gemv_heads, quant_norm_fold

    model = _wide_model(method)
    monkeypatch.setattr(quant_norm_fold, "NORM_FOLD", norm_fold)
    ids = torch.randint(3, 4000, (1, 9), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        want = model(ids[:, :1]).logits
    calls = []
    real = quant_gemv_heads.quant_gemv_mma_heads
    monkeypatch.setattr(quant_gemv_heads, "quant_gemv_mma_heads", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    monkeypatch.setattr(gemv_heads, "HEAD_EPILOGUE", True)
    graph = model.generate(ids, **kw)
    assert calls, "the head epilogue was not captured into the decode graph"
    assert torch.equal(model.generate(ids, use_cuda_graph=False, **kw), graph)
    with torch.no_grad():
        got = model(ids[:, :1]).logits
    torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0.02)
