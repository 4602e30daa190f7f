"""The paged decode with qk_norm_rope fused in (kernels/paged_decode_fused.py) on the GPU, at qwen3-0.6b's
attention shapes (16 q heads, 8 kv heads, head_dim 128, bf16): outputs and cache rows against the
unfused path (qk_norm_rope with its fused store, then paged_decode) at batch 1 (the early start under
PDL, contexts split across the grid) and 32 (a busy grid), eagerly and replayed from a CUDA graph; and
a qwen3-0.6b-shaped model decoding the same tokens with it as without (under PDL too, where the model
leaves it off by default).

The new key enters the softmax after the cached tiles rather than inside the last one, so outputs are
held to the attention's own bf16 error (against an fp32 reference of the unfused path's q and cache).
The cache rows are bit for bit the unfused path's without q/k norm; with it, the compiler may sum a
head's squares in another order in the decode kernel than in qk_norm_rope, so a new k can be one
rounding step off (as for the fused store: test_qk_norm_rope_store_gpu.py). Every other cache row must
be untouched."""

import pytest
import torch

pytestmark = pytest.mark.gpu
DEV = "cuda"
HQ, HKV, D, PAGE, CAPACITY = 16, 8, 128, 16, 2048
BF16_STEP = torch.finfo(torch.bfloat16).eps


def _inputs(batch, context, norm, seed=0):
    """Raw packed q/k/v, norm weights, cos/sin and a cache with shuffled pages; the new token of row b is
    key ``lens[b] - 1`` (a mix of ``context`` and shorter contexts)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
    lens[1::3] = max(1, context - 7)
    lens[2::3] = max(1, context // 3)
    width = CAPACITY // PAGE
    k_cache, v_cache = (torch.randn(batch * width, PAGE, HKV, D, device=DEV, generator=g).bfloat16() for _ in range(2))
    table = torch.randperm(batch * width, device=DEV, generator=g).int().view(batch, width)
    last = lens.long() - 1
    slots = table[torch.arange(batch, device=DEV), last // PAGE].long() * PAGE + last % PAGE
    qkv = torch.randn(batch, (HQ + 2 * HKV) * D, device=DEV, generator=g).bfloat16()
    q, k, v = (x.view(batch, -1, D) for x in qkv.split([HQ * D, HKV * D, HKV * D], -1))
    emb = last.float()[:, None] * torch.rand(D // 2, device=DEV, generator=g)
    cos, sin = torch.cat([emb, emb], -1).cos().bfloat16(), torch.cat([emb, emb], -1).sin().bfloat16()
    w = [(torch.rand(D, device=DEV, generator=g) + 0.5).bfloat16() for _ in range(2)] if norm else [None, None]
    return [q, k, v, k_cache, v_cache, lens, table, slots, cos, sin, *w]


def _unfused(q, k, v, k_cache, v_cache, lens, table, slots, cos, sin, qw, kw):
    from cudaformers.attention.kv_cache import KVStore
    from cudaformers.kernels.paged_decode import paged_decode
    from cudaformers.kernels.qk_norm_rope import qk_norm_rope_forward

    q_out, _ = qk_norm_rope_forward(q, k, cos, sin, qw, kw, 1e-6, 1e-6, KVStore(v, k_cache, v_cache, slots))
    return paged_decode(q_out, k_cache, v_cache, lens, table, CAPACITY, D ** -0.5), q_out


def _fused(q, k, v, k_cache, v_cache, lens, table, slots, cos, sin, qw, kw):
    from cudaformers.kernels.paged_decode_fused import paged_decode_fused

    return paged_decode_fused(q, k, v, k_cache, v_cache, lens, table, slots, CAPACITY, D ** -0.5, cos, sin, qw, kw,
                              1e-6, 1e-6)


def _compare(got, want, caches, want_caches, slots, norm, lens, table):
    from cudaformers.kernels.paged_decode import paged_decode_reference

    want, q_out = want
    ref32 = paged_decode_reference(q_out, *want_caches, lens, table, D ** -0.5, upcast=True)
    ref = paged_decode_reference(q_out, *want_caches, lens, table, D ** -0.5)
    for out, what in ((got, "fused"), (want, "unfused")):
        err, budget = (out.float() - ref32).abs().max().item(), 2 * (ref.float() - ref32).abs().max().item() + 1e-3
        assert err <= budget, f"{what}: error {err:.3g} > 2x the bf16 reference's {budget:.3g}"
    new = torch.zeros(caches[0].numel() // (HKV * D), dtype=torch.bool, device=DEV)
    new[slots] = True
    for cache, ref in zip(caches, want_caches):
        flat, flat_ref = cache.view(-1, HKV, D), ref.view(-1, HKV, D)
        assert torch.equal(flat[~new], flat_ref[~new]), "a cache row other than the new tokens' changed"
    got_k, want_k = caches[0].view(-1, HKV, D)[slots], want_caches[0].view(-1, HKV, D)[slots]
    assert torch.equal(caches[1].view(-1, HKV, D)[slots], want_caches[1].view(-1, HKV, D)[slots])  # v: a copy
    if norm:
        torch.testing.assert_close(got_k, want_k, rtol=BF16_STEP, atol=BF16_STEP)
    else:
        assert torch.equal(got_k, want_k)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("context", [1, 129, 300, 2000])
@pytest.mark.parametrize("batch", [1, 32])
def test_fused_matches_the_unfused_path(batch, context, norm):
    args = _inputs(batch, context, norm)
    want_k, want_v = args[3].clone(), args[4].clone()
    want = _unfused(*args[:3], want_k, want_v, *args[5:])
    got = _fused(*args)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    _compare(got, want, args[3:5], (want_k, want_v), args[7], norm, args[5], args[6])


@pytest.mark.parametrize("batch", [1, 32])
def test_fused_in_a_cuda_graph(batch):
    args = _inputs(batch, 300, True)
    _fused(*[x.clone() if isinstance(x, torch.Tensor) else x for x in args])  # compile, split counters: eagerly
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _fused(*args)
    for seed, context in ((1, 129), (2, 2000), (3, 1)):
        # A new step in the captured buffers: new tokens at new positions, as a decode step gets them.
        for buf, x in zip(args, _inputs(batch, context, True, seed)):
            if isinstance(buf, torch.Tensor):
                buf.copy_(x)
        want_k, want_v = args[3].clone(), args[4].clone()
        graph.replay()
        want = _unfused(*args[:3], want_k, want_v, *args[5:])
        torch.cuda.synchronize()
        _compare(out, want, args[3:5], (want_k, want_v), args[7], True, args[5], args[6])


@pytest.mark.timeout(600)  # a cold Triton cache compiles the fp32 prefill kernels first
def test_qwen3_06b_shaped_generates_the_same_tokens(monkeypatch):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_decode_fusion_gpu import _qwen3_06b_shaped

    from cudaformers.kernels import fused_norm_decode
    from cudaformers.kernels import paged_decode_fused as module
    from cudaformers.kernels.hub import kernelize

    # fp32: a q or k one bit apart (see the module docstring) can flip a bf16 greedy token at a near-tie.
    # Built in fp32: .to() afterwards would copy q/k/v apart from their packed matrix, and the fold
    # (so the fused attention past it) applies only while they are views of it.
    model = _qwen3_06b_shaped(dtype=torch.float32)
    model.set_attn_implementation("triton")
    kernelize(model)
    monkeypatch.setattr(fused_norm_decode, "FUSE_ATTENTION_WITH_PDL", True)  # the launch under test, PDL or not
    ids = torch.randint(3, 151000, (2, 12), device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    calls = []
    real = module.paged_decode_fused
    monkeypatch.setattr(module, "paged_decode_fused", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    declined, folds = set(), []
    real_declines, real_fold = fused_norm_decode._attention_declines, fused_norm_decode._fold
    monkeypatch.setattr(fused_norm_decode, "_attention_declines",
                        lambda *a: (lambda r: (declined.add(r), r)[1])(real_declines(*a)))
    monkeypatch.setattr(fused_norm_decode, "_fold", lambda *a: (lambda r: (folds.append(r is not None), r)[1])(
        real_fold(*a)))
    fused = [model.generate(ids, use_cuda_graph=graph, **kw) for graph in (True, False)]
    assert calls, f"the fused attention never ran: folded {sum(folds)} of {len(folds)} norms; declined: {declined}"
    assert torch.equal(fused[0], fused[1])  # graph == eager
    model.__dict__.pop("_decode_runners", None)  # the captured graphs hold the fused launches
    monkeypatch.setattr(fused_norm_decode, "FUSE_ATTENTION", False)
    calls.clear()
    unfused = model.generate(ids, use_cuda_graph=True, **kw)
    assert not calls
    assert torch.equal(fused[0], unfused)
