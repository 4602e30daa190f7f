"""The fused decode attention on the GPU (compiled, with programmatic dependent launch on Hopper): at
qwen3-0.6b's attention shapes (16 q heads, 8 kv heads, head_dim 128) against the unfused pair
(qk_norm_rope with the store, then paged_decode), at batch 1 and 32, split and unsplit, eagerly and
in a CUDA graph; and a qwen3-0.6b-shaped model's tokens from generate() and the engine.

The fused kernel computes the per-head norm in another kernel than qk_norm_rope, and the compiler may
sum the squares in another order: k may differ from the unfused k by a rounding step, so the cache's
k is held to one step of a half-precision cache dtype (a few fp32 ulps of its head's scale), v exactly, the output to twice the bf16 reference error,
and the model's tokens to equality in fp32."""

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
DEV = "cuda"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _case(k_lens, dtype, norm=True, splits=None, graph=False):
    from test_kernels_paged_decode_rope import _fused, _step, _unfused

    args = _step(k_lens, 16, 8, 128, 128, dtype, page=16)
    want_k, want_v = args[5].clone(), args[6].clone()
    want = _unfused(*args[:5], want_k, want_v, *args[7:], norm, None, splits)
    if graph:
        from cudaformers.kernels.paged_decode import paged_decode_rope

        q, k, v, cos, sin, k_cache, v_cache, slots, lens, table, weights = args
        capacity = int(lens.max())  # read before the capture: no host sync inside it

        def step():
            return paged_decode_rope(q, k, v, cos, sin, k_cache, v_cache, slots, lens, table, capacity, 0.125,
                                     None, *(weights if norm else (None, None)), 1e-6, 1e-5, num_splits=splits)

        k0, v0 = k_cache.clone(), v_cache.clone()
        step()  # the split counters exist before the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = step()
        k_cache.copy_(k0)
        v_cache.copy_(v0)
        g.replay()
    else:
        got = _fused(*args, norm, None, splits)
    torch.cuda.synchronize()
    eps = torch.finfo(dtype).eps
    assert torch.equal(args[6], want_v)
    diff, ref = (args[5].float() - want_k.float()).abs(), want_k.float().abs()
    if dtype == torch.float32:  # a few ulps of the head's scale (see test_qk_norm_rope_store_gpu.py)
        assert (diff <= 16 * eps * ref.amax(dim=-1, keepdim=True)).all()
    else:
        assert (diff <= eps * ref).all()
    err = (got.float() - want.float()).abs().max().item()
    bound = 1e-4 if dtype == torch.float32 else 4 * eps
    assert err <= bound * max(1.0, want.float().abs().max().item()), f"max difference {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("k_lens", [[1], [129], [384], [700], list(range(1, 800, 25))])
def test_fused_equals_the_unfused_pair(k_lens, norm, dtype):
    _case(k_lens, dtype, norm)


@pytest.mark.parametrize("splits", [1, 4])
def test_in_a_cuda_graph(splits):
    _case([300, 17, 512], torch.bfloat16, splits=splits, graph=True)


@pytest.mark.timeout(600)  # a cold Triton cache compiles and autotunes the fp32 prefill kernels first
def test_qwen3_06b_shaped_generate_and_engine_tokens_in_fp32(monkeypatch):
    from test_decode_fusion_gpu import _qwen3_06b_shaped

    from cudaformers.engine.llm_engine import LLMEngine
    from cudaformers.engine.sampling_params import SamplingParams
    from cudaformers.kernels import fused_decode_attention as fda
    from cudaformers.kernels import paged_decode as pd
    from cudaformers.kernels.hub import kernelize

    model = _qwen3_06b_shaped().to(torch.float32)
    model.set_attn_implementation("triton")
    kernelize(model)
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
    real = pd.paged_decode_rope
    monkeypatch.setattr(pd, "paged_decode_rope", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    fused = run()
    assert calls, "the fused launch never ran"
    assert torch.equal(fused[0][0], fused[0][1])  # graph == eager
    monkeypatch.setattr(fda, "_applies", lambda *a: False)
    unfused = run()
    assert torch.equal(fused[0][0], unfused[0][0]) and fused[1] == unfused[1]
