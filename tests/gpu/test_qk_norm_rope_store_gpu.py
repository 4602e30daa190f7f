"""The KV-cache store fused into qk_norm_rope on the GPU, at qwen3-0.6b's attention shapes (16 q heads,
8 kv heads, head_dim 128): the cache holds what store_kv would write for the returned k and v, which
match the unfused path (the kernel, then store_kv's Triton store) eagerly and inside a CUDA graph, and
a qwen3-0.6b-shaped model decodes to the same tokens with it."""

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
DEV = "cuda"
HQ, HKV, D = 16, 8, 128


def _inputs(t, dtype, cache_dtype, norm, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEV, generator=g).to(dtype)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], -1)
    q, k, v = q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)
    w = [(torch.rand(D, device=DEV, generator=g) + 0.5).to(dtype) for _ in range(2)] if norm else [None, None]
    emb = torch.arange(t, device=DEV).float()[:, None] * torch.rand(D // 2, device=DEV, generator=g)
    cos, sin = torch.cat([emb, emb], -1).cos().to(dtype), torch.cat([emb, emb], -1).sin().to(dtype)
    blocks, page = -(-2 * t // 16) + 1, 16
    k_cache = torch.randn(blocks, page, HKV, D, device=DEV, generator=g).to(cache_dtype)
    v_cache = torch.randn(blocks, page, HKV, D, device=DEV, generator=g).to(cache_dtype)
    slots = torch.randperm(blocks * page, device=DEV, generator=g)[:t]
    if t > 1:
        slots[::5] = -1  # padding rows: skipped, as by the store kernel
    return (q, k, cos, sin, *w), v, k_cache, v_cache, slots


def _unfused(args, v, k_cache, v_cache, slots):
    from cudaformers.attention.kv_cache import store_kv
    from cudaformers.kernels.qk_norm_rope import qk_norm_rope_forward

    q, k = qk_norm_rope_forward(*args, 1e-6, 1e-6)
    store_kv(k_cache, v_cache, k, v, slots)  # the Triton store on CUDA
    return q, k


def _fused(args, v, k_cache, v_cache, slots):
    from cudaformers.attention.kv_cache import KVStore
    from cudaformers.kernels.qk_norm_rope import qk_norm_rope_forward

    return qk_norm_rope_forward(*args, 1e-6, 1e-6, KVStore(v, k_cache, v_cache, slots))


@pytest.mark.parametrize("src,cache", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                       (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t", [1, 7, 300])
def test_fused_store_matches_the_unfused_path(t, norm, src, cache, monkeypatch):
    """The cache holds exactly what store_kv writes for the k the fused call returns (and v); q is the
    unfused kernel's bit for bit, k too without the norm. With the norm the compiler may order the
    per-head sum of squares differently in the two variants (seen on an H200 with fp32 inputs: up to
    8 fp32 ulps of the head's largest value where x * cos + x' * sin cancels), so k is held to a few
    rounding steps of its head's scale there."""
    from cudaformers.attention import kv_cache

    args, v, k_cache, v_cache, slots = _inputs(t, src, cache, norm)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want = _unfused(args, v, k_cache.clone(), v_cache.clone(), slots)
    real_store = kv_cache.store_kv
    monkeypatch.setattr(kv_cache, "store_kv", lambda *a: pytest.fail("the store ran unfused"))
    got = _fused(args, v, k_cache, v_cache, slots)
    real_store(want_k_cache, want_v_cache, got[1], v, slots)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)
    assert torch.equal(got[0], want[0])
    if norm:
        eps = torch.finfo(src).eps
        if src == torch.float32:
            assert ((got[1] - want[1]).abs() <= 16 * eps * want[1].abs().amax(dim=-1, keepdim=True)).all()
        else:  # the output's rounding hides the sum's order: at most one rounding step apart
            torch.testing.assert_close(got[1], want[1], rtol=eps, atol=eps)
    else:
        assert torch.equal(got[1], want[1])


def test_fused_store_in_a_cuda_graph():
    from cudaformers.attention.kv_cache import store_kv

    args, v, k_cache, v_cache, slots = _inputs(4, torch.bfloat16, torch.bfloat16, True)
    _fused(args, v, k_cache.clone(), v_cache.clone(), slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _fused(args, v, k_cache, v_cache, slots)
    for seed in (1, 2):  # new inputs and slots in the captured buffers, as a decode step gets them
        new_args, new_v, _, _, new_slots = _inputs(4, torch.bfloat16, torch.bfloat16, True, seed)
        for buf, x in zip((*args, v, slots), (*new_args, new_v, new_slots)):
            buf.copy_(x)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        graph.replay()
        want = _unfused(args, v, k_cache.clone(), v_cache.clone(), slots)
        store_kv(ref_k, ref_v, out[1], v, slots)  # what the replay must have written
        torch.cuda.synchronize()
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
        assert torch.equal(out[0], want[0])
        torch.testing.assert_close(out[1], want[1], rtol=torch.finfo(torch.bfloat16).eps, atol=0.0)
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def _qwen3_06b_shaped(seed=0, dtype=torch.bfloat16):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_decode_fusion_gpu import _qwen3_06b_shaped as shaped

    return shaped(seed, dtype)


@pytest.mark.timeout(600)  # a cold Triton cache autotunes the fp32 prefill kernels first (> 120 s)
@pytest.mark.parametrize("attn", ["triton", "sdpa"])
def test_qwen3_06b_shaped_generate_and_engine_equal_the_unfused_store_in_fp32(attn, monkeypatch):
    from cudaformers.attention import kv_cache, registry
    from cudaformers.engine.llm_engine import LLMEngine
    from cudaformers.engine.sampling_params import SamplingParams
    from cudaformers.kernels import qk_norm_rope as qnr
    from cudaformers.kernels.hub import kernelize

    # fp32: the fused and unfused kernels may differ in the last bit of a k (see above), which bf16
    # greedy decoding can turn into a different token at a near-tie; in fp32 the tokens must agree.
    model = _qwen3_06b_shaped(dtype=torch.float32)  # built in fp32: a .to() would unpack q/k/v
    model.set_attn_implementation(attn)
    kernelize(model)
    assert "rotary_pos_emb -> cudaformers:qk_norm_rope" in model.explain()
    ids = torch.randint(3, 151000, (2, 12), device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    prompts = [torch.randint(3, 151000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 40, 1, 17)]

    def run():
        out = [model.generate(ids, use_cuda_graph=graph, max_new_tokens=24, do_sample=False, eos_token_id=None)
               for graph in (True, False)]
        engine = LLMEngine(model, num_blocks=64, block_size=16, max_batch_tokens=24, max_num_seqs=4)
        rq = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        return out, [engine.requests[i].output_token_ids for i in rq]

    calls = []
    real = kv_cache.store_kv
    for module in (kv_cache, registry):
        monkeypatch.setattr(module, "store_kv", lambda *a: (calls.append(1), real(*a))[1])
    fused = run()
    assert not calls, "the separate store ran with the kernel"
    assert torch.equal(fused[0][0], fused[0][1])  # graph == eager
    monkeypatch.setattr(qnr, "_fusable", lambda *a: False)
    unfused = run()
    assert calls
    assert torch.equal(fused[0][0], unfused[0][0]) and fused[1] == unfused[1]
