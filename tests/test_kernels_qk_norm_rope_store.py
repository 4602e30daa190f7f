"""qk_norm_rope with the KV-cache store fused in: the cache must hold exactly what the unfused path
(the kernel's k output, then store_kv) writes, slots not written stay untouched, and the returned q/k
are the kernel's own. Then the model: with the kernel the separate store never runs, and logits,
cache and greedy tokens are those of the unfused path."""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.attention import kv_cache  # noqa: E402
from cudaformers.attention.kv_cache import KVStore  # noqa: E402
from cudaformers.kernels import qk_norm_rope as qnr  # noqa: E402
from cudaformers.kernels.kv_store import store_kv_reference  # noqa: E402
from cudaformers.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_forward, qk_norm_rope_reference  # noqa: E402
from cudaformers.layers.attention import ApplyRotary  # noqa: E402
from cudaformers.layers.norm import RMSNorm  # noqa: E402

from test_kernels_tolerance import assert_matches  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# t, hq, hkv, d, rot: decode (T=1) and chunk (T=7) sizes, odd and power-of-two, GQA, partial rotary
CASES = [(1, 16, 8, 128, 128), (7, 5, 1, 12, 12), (7, 4, 2, 64, 32), (1, 6, 3, 10, 6), (7, 3, 3, 24, 8)]


def _cos_sin(t, rot, dtype):
    pos = torch.arange(t, dtype=torch.float32) * 5 + 2
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([pos[:, None] * inv] * 2, -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _qkv(t, hq, hkv, d, g, dtype, layout):
    """q, k, v as the layer sees them: slices of one packed projection, or separate tensors."""
    if layout == "packed":
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
        return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    return tuple(torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


def _caches(blocks, page, hkv, d, dtype, g):
    """Random caches, each behind a guard slot where a write to slot -1 would land."""
    out = []
    for _ in range(2):
        flat = torch.randn((blocks * page + 1) * hkv * d, generator=g).to(dtype)
        out.append(flat[hkv * d:].view(blocks, page, hkv, d))
    return out


def _guards(caches):
    return [c.untyped_storage()[:c[0, 0].numel() * c.element_size()].tolist() for c in caches]


class _Counter:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = kv_cache.store_kv

        def counted(*args):
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(kv_cache, "store_kv", counted)
        from cudaformers.attention import registry
        monkeypatch.setattr(registry, "store_kv", counted)


def _run(t, hq, hkv, d, rot, dtype, norm, layout, cache_dtype, pad, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(t, hq, hkv, d, g, dtype, layout)
    cos, sin = (x.to(dtype) for x in _cos_sin(t, rot, torch.float32))
    w = [(1 + 0.2 * torch.randn(d, generator=g)).to(dtype) for _ in range(2)] if norm else [None, None]
    page, blocks = 4, 2 * t + 1
    k_cache, v_cache = _caches(blocks, page, hkv, d, cache_dtype, g)
    slots = torch.randperm(blocks * page, generator=g)[:t]
    if pad:
        slots[::3] = -1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    guards = _guards((k_cache, v_cache))
    inputs = [x.clone() for x in (q, k, v, slots)]
    want = qk_norm_rope_forward(q, k, cos, sin, *w, 1e-6, 1e-5)  # the unfused kernel, then the store
    store_kv_reference(ref_k, ref_v, want[1], v, slots)
    got = qk_norm_rope_forward(q, k, cos, sin, *w, 1e-6, 1e-5, KVStore(v, k_cache, v_cache, slots))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert guards == _guards((k_cache, v_cache))
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, slots), inputs))  # inputs untouched
    return q, k, cos, sin, w, got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("layout", ["contiguous", "packed"])
@pytest.mark.parametrize("t,hq,hkv,d,rot", CASES)
def test_fused_store_equals_kernel_then_store(t, hq, hkv, d, rot, layout, norm, dtype, monkeypatch):
    counter = _Counter(monkeypatch)
    q, k, cos, sin, w, got = _run(t, hq, hkv, d, rot, dtype, norm, layout, dtype, pad=t > 1, seed=t * 7 + d)
    assert counter.calls == 0, "the store ran unfused"
    # and the kernel's q/k are still the reference's (within the kernel tests' tolerance)
    ref = qk_norm_rope_reference(q, k, cos, sin, *w, 1e-6, 1e-5)
    up = [x.float() if x is not None else None for x in (q, k, cos, sin, *w)]
    ref32 = qk_norm_rope_reference(*up, 1e-6, 1e-5)
    for name, a, b, c in zip("qk", got, ref, ref32):
        assert_matches(a, b, c, f"{name} ({dtype}, {layout}, norm={norm})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_widening_into_an_fp32_cache_is_fused(dtype, monkeypatch):
    counter = _Counter(monkeypatch)
    _run(7, 4, 2, 16, 16, dtype, True, "packed", torch.float32, pad=True, seed=3)
    assert counter.calls == 0


def test_narrowing_off_the_gpu_falls_back_to_store_kv(monkeypatch):
    # Off the GPU store_kv casts with PyTorch, and fp32 -> bf16 rounds differently in the interpreter:
    # the kernel leaves that store to store_kv.
    counter = _Counter(monkeypatch)
    _run(7, 4, 2, 16, 8, torch.float32, True, "packed", torch.bfloat16, pad=False, seed=4)
    assert counter.calls == 1


def test_fusable_is_decided_like_store_kv():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 2, 16, generator=g)
    kc, vc = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    slots = torch.tensor([1, 5, 9])
    cpu = torch.device("cpu")
    assert qnr._fusable(KVStore(v, kc, vc, slots), torch.float32, (3, 2, 16), cpu)
    assert not qnr._fusable(KVStore(v, kc, vc.half(), slots), torch.float32, (3, 2, 16), cpu)  # mixed caches
    fp8 = kc.to(torch.float8_e4m3fn)  # no Triton store for fp8: store_kv's PyTorch copy, even on the GPU
    assert not qnr._fusable(KVStore(v, fp8, fp8.clone(), slots), torch.float32, (3, 2, 16), cpu)
    assert not qnr._fusable(KVStore(v, kc.bfloat16(), vc.bfloat16(), slots), torch.float32, (3, 2, 16), cpu)
    strided = torch.tensor([1, 0, 5, 0, 9, 0])[::2]  # the kernel reads slots as a contiguous row
    assert not qnr._fusable(KVStore(v, kc, vc, strided), torch.float32, (3, 2, 16), cpu)
    assert not qnr._fusable(KVStore(v, kc[:, :, :1], vc[:, :, :1], slots), torch.float32, (3, 2, 16), cpu)
    assert not qnr._fusable(KVStore(v.requires_grad_(), kc, vc, slots), torch.float32, (3, 2, 16), cpu)
    with torch.no_grad():
        assert qnr._fusable(KVStore(v, kc, vc, slots), torch.float32, (3, 2, 16), cpu)


def test_every_apply_rotary_implementation_stores():
    """The reference module, the hub's rotary kernel and qk_norm_rope (also with gradients on) leave
    the same cache; the backend is then told not to store again."""
    from cudaformers.kernels.hub import _qk_norm_rope, _rotary

    g = torch.Generator().manual_seed(5)
    q, k, v = _qkv(5, 4, 2, 16, g, torch.float32, "packed")
    cos, sin = _cos_sin(5, 16, torch.float32)
    q_norm, k_norm = RMSNorm(16, eps=1e-6), RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5, generator=g)
        k_norm.weight.uniform_(0.5, 1.5, generator=g)
    slots = torch.tensor([3, 17, 8, 0, 30])
    module = ApplyRotary()
    for fn, grad in [(module, False), (lambda *a, **kw: _rotary(module, *a, **kw), False),
                     (lambda *a, **kw: _qk_norm_rope(module, *a, **kw), False), (qk_norm_rope, True)]:
        kc, vc = torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16)
        with torch.set_grad_enabled(grad):
            qq, kk = (q.clone().requires_grad_(), k.clone().requires_grad_()) if grad else (q, k)
            rq, rk = fn(qq, kk, cos, sin, q_norm, k_norm, kv_store=KVStore(v, kc, vc, slots))
        ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
        store_kv_reference(ref_k, ref_v, rk.detach(), v, slots)
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
        assert not torch.equal(kc, torch.zeros_like(kc))


def test_empty_step_stores_nothing():
    kc = torch.zeros(2, 4, 2, 16)
    q, k, v = torch.zeros(0, 4, 16), torch.zeros(0, 2, 16), torch.zeros(0, 2, 16)
    cos, sin = _cos_sin(0, 16, torch.float32)
    out = qk_norm_rope_forward(q, k, cos, sin, kv_store=KVStore(v, kc, kc.clone(), torch.zeros(0, dtype=torch.long)))
    assert out[0].shape == (0, 4, 16) and not kc.any()


# -- the model: a tiny Qwen3 (q/k norms, GQA) with the kernel mapped onto the CPU, interpreted ----

KERNEL = {"rotary_pos_emb": {"cpu": {"inference": "cudaformers:qk_norm_rope", "training": "cudaformers:rotary"}}}


def _tiny_qwen3(kernel: bool):
    import tiny
    from cudaformers import AutoModelForCausalLM
    from cudaformers.kernels.hub import KernelConfig

    folder = tiny.checkpoint("qwen3")
    if not kernel:
        return AutoModelForCausalLM.from_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, kernel_config=KernelConfig(KERNEL, inherit_mapping=False))


def _steps(model, attn):
    """A prefill of two sequences, a mixed step (a decode beside a prompt chunk with context), then a
    decode of both, over a paged cache with scattered blocks: the logits of every step and the cache."""
    from cudaformers.attention.kv_cache import KVCache
    from cudaformers.attention.metadata import AttentionBatch

    model.set_attn_implementation(attn)
    cfg, bs = model.config, 4
    cache = KVCache(cfg.num_hidden_layers, 12, bs, cfg.num_key_value_heads, cfg.head_dim, torch.float32,
                    torch.device("cpu"))
    g = torch.Generator().manual_seed(9)
    table = torch.randperm(12, generator=g)[:8].view(2, 4).int()
    ids = torch.randint(3, 211, (2, 12), generator=g)
    done, logits = [0, 0], []
    for new in ([7, 5], [1, 3], [1, 1]):
        k_lens = [d + n for d, n in zip(done, new)]
        pos = torch.cat([torch.arange(d, k) for d, k in zip(done, k_lens)])
        rows = torch.cat([torch.full((n,), i) for i, n in enumerate(new)])
        slots = table[rows, pos // bs].long() * bs + pos % bs
        batch = AttentionBatch.with_cache(new, k_lens, cache, slots, table, "cpu")
        batch.num_decode_seqs = 1 if new == [1, 3] else (2 if new == [1, 1] else 0)
        with torch.inference_mode():
            logits.append(model.compute_logits(model.model(ids[rows, pos], pos, batch)))
        done = k_lens
    return logits, cache.k + cache.v


@pytest.mark.parametrize("attn", ["sdpa", "triton"])
def test_tiny_qwen3_steps_store_in_the_kernel(attn, monkeypatch):
    counter = _Counter(monkeypatch)
    fast = _tiny_qwen3(kernel=True)
    fused = _steps(fast, attn)
    assert counter.calls == 0, "use_kernels: the separate store ran"
    monkeypatch.setattr(qnr, "_fusable", lambda *args: False)  # the kernel, then store_kv: as before
    unfused = _steps(fast, attn)
    layers_x_steps = fast.config.num_hidden_layers * 3
    assert counter.calls == layers_x_steps
    plain = _steps(_tiny_qwen3(kernel=False), attn)
    assert counter.calls == 2 * layers_x_steps
    for a, b in zip(fused[0] + fused[1], unfused[0] + unfused[1]):
        assert torch.equal(a, b)  # logits and every layer's k and v cache, bit for bit
    for a, b in zip(fused[0] + fused[1], plain[0] + plain[1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # the kernel's rounding vs PyTorch's


def test_tiny_qwen3_generate_greedy_tokens(monkeypatch):
    counter = _Counter(monkeypatch)
    ids = torch.randint(3, 211, (2, 9), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    fused = _tiny_qwen3(kernel=True).generate(ids, **kw)
    assert counter.calls == 0
    plain = _tiny_qwen3(kernel=False).generate(ids, **kw)
    assert counter.calls > 0
    assert torch.equal(fused, plain)


def test_tiny_qwen3_engine_chunked_prefill_and_prefix_hits(monkeypatch):
    from cudaformers.engine.llm_engine import LLMEngine
    from cudaformers.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 211, (9,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 211, (n,), generator=g).tolist() for n in (2, 11, 5)]
    outs = {}
    for kernel in (True, False):
        counter = _Counter(monkeypatch)
        engine = LLMEngine(_tiny_qwen3(kernel), num_blocks=48, block_size=4, max_batch_tokens=7, max_num_seqs=4)
        ids = []
        for p in prompts:
            ids.append(engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
            for _ in range(2 if len(ids) == 1 else 0):  # the shared prefix is cached before the others arrive
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        seqs = [engine.requests[i] for i in ids]
        outs[kernel] = [s.output_token_ids for s in seqs]
        assert sum(s.num_prefix_hit_tokens for s in seqs) >= 8
        assert (counter.calls == 0) == kernel
        monkeypatch.undo()
    assert outs[True] == outs[False]
