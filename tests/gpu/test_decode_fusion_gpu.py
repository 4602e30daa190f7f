"""The fused decode kernels at full size on the GPU: qk_norm_rope, the KV store, paged decode with a
16k-capacity grid over short contexts, store_kv's dispatch inside a CUDA graph, and the RMSNorm folded
into the GEMV (kernel at qwen3-0.6b/8b shapes, graph capture, a qwen3-0.6b-shaped model decoding)."""

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


# (K, N) of the projections a norm feeds: packed q/k/v and gate/up of qwen3-0.6b and qwen3-8b
NORM_GEMV_SHAPES = {"0.6b qkv": (1024, 4096), "0.6b gate_up": (1024, 6144), "8b qkv": (4096, 6144),
                    "8b gate_up": (4096, 24576)}


def _norm_gemv_inputs(rows, k, n, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, k, device=DEV, generator=g).to(dtype)
    r = (torch.randn(rows, k, device=DEV, generator=g) * 8).to(dtype)
    nw = (torch.rand(k, device=DEV, generator=g) + 0.5).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    return x, r, nw, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("shape", list(NORM_GEMV_SHAPES))
def test_gemv_rms_norm_full_size(shape, rows, dtype):
    from cudaformers.kernels.gemv import gemv, gemv_rms_norm, gemv_rms_norm_reference
    from cudaformers.kernels.rms_norm import rms_norm

    k, n = NORM_GEMV_SHAPES[shape]
    x, r, nw, w = _norm_gemv_inputs(rows, k, n, dtype)
    got, s = gemv_rms_norm(x, w, nw, 1e-6, r)
    assert torch.equal(s, x + r)  # rounded to nearest, as PyTorch does
    exact = gemv_rms_norm_reference(x.double(), w.double(), nw.double(), 1e-6, r.double())[0]
    ref = gemv_rms_norm_reference(x, w, nw, 1e-6, r)[0]
    _close(got, ref, exact, f"norm + GEMV {shape}")
    # Against the unfused kernels: the same rounding steps; only the association of the sum of
    # squares may differ (an ulp of rstd moves a normed input by at most an ulp of the dtype).
    normed = rms_norm(x, nw, 1e-6, r)[0]
    unfused = gemv(normed, w)
    ulp = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    bound = ulp * ((normed.float().abs() @ w.float().abs().T).max() + unfused.float().abs().max())
    err = (got.float() - unfused.float()).abs().max()
    assert err <= bound, f"{shape}: {err:.3g} from the unfused kernels > {bound:.3g}"


def test_gemv_rms_norm_chain_in_a_graph_equals_eager():
    """Two layers' worth of folded norms, each feeding the next through the residual, under PDL."""
    from cudaformers.kernels.gemv import gemv, gemv_rms_norm

    x, r, nw, w = _norm_gemv_inputs(1, 1024, 4096, torch.bfloat16)
    down = torch.randn(1024, 4096, device=DEV, dtype=torch.bfloat16) / 64

    def chain():
        h, res = x, r
        for _ in range(2):
            y, res = gemv_rms_norm(h, w, nw, 1e-6, res)
            h = gemv(y, down)
        return gemv_rms_norm(h, w, nw, 1e-6, res)

    want = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _qwen3_06b_shaped(seed=0, dtype=torch.bfloat16):
    from cudaformers import AutoConfig, AutoModelForCausalLM
    from cudaformers.kernels.fused_projections import fuse_projections

    config = AutoConfig.for_model("qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
                                  tie_word_embeddings=True, hidden_act="silu", architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, device=DEV).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # not all ones: a norm weight applied twice would show
    fuse_projections(model)  # as from_pretrained does
    return model


@pytest.mark.parametrize("attn", ["triton", "sdpa"])
def test_qwen3_06b_shaped_decode_with_folded_norms(attn, monkeypatch):
    from cudaformers.kernels import fused_norm_decode
    from cudaformers.kernels.hub import KernelConfig, kernelize

    model = _qwen3_06b_shaped()
    model.set_attn_implementation(attn)
    ids = torch.randint(3, 151000, (1, 12), device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    kw = dict(max_new_tokens=32, do_sample=False, eos_token_id=None)
    kernelize(model)  # the CUDA defaults: every decode kernel, the folded norms among them
    assert "DecoderLayer -> cudaformers:fused_norm_decode" in model.explain()
    folded, real_fold = [], fused_norm_decode._fold
    monkeypatch.setattr(fused_norm_decode, "_fold", lambda *a: (lambda r: (folded.append(r is not None), r)[1])(
        real_fold(*a)))
    graph = model.generate(ids, use_cuda_graph=True, **kw)
    assert any(folded), "no norm folded: the comparison below would be the unfused path against itself"
    assert torch.equal(graph, model.generate(ids, use_cuda_graph=False, **kw))
    with torch.no_grad():
        fused_logits = model(graph[:, :13]).logits[:, -1].float()
    kernelize(model, KernelConfig({"DecoderLayer": ""}))
    unfused = model.generate(ids, use_cuda_graph=True, **kw)
    with torch.no_grad():
        logits = model(graph[:, :13]).logits[:, -1].float()
    torch.testing.assert_close(fused_logits, logits, atol=0.05 * logits.abs().max().item(), rtol=0)
    if not torch.equal(graph, unfused):
        at = int((graph != unfused).nonzero()[0, 1])
        with torch.no_grad():
            top = model(unfused[:, :at]).logits[0, -1].float().topk(2).values
        raise AssertionError(f"greedy tokens differ from the unfused kernels' at position {at} (top-2 logit "
                             f"margin of the unfused model there: {(top[0] - top[1]).item():.3g})")
