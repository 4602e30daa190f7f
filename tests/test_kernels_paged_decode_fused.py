"""The paged decode with qk_norm_rope fused in (kernels/paged_decode_fused.py), in the Triton interpreter:
the whole cache is bit for bit what the unfused path (qk_norm_rope with its fused store, then
paged_decode with the same splits) leaves, and the output is as close to an fp32 reference of that
path's q and cache as paged decode's own (the new key joins the softmax after the cached tiles, not
inside the last one); and both are close to the PyTorch definition.

Covers batch 1 and 3, GQA groups 1/2/4, head dims 32/64/128 and 80 (padded to a 128-wide tile), with and
without q/k norm, partial rotary, sliding windows (a split starting past key 0, a window of one),
contexts of one key, within one tile and over several splits, grids with splits no sequence uses,
padding slots, fp32/bf16/fp16 and a widening fp32 cache. Then the model: a tiny Qwen3 decodes the same
tokens and logits with and without the fused attention, which runs only on the triton backend (and,
by default, without PDL).
"""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.attention.kv_cache import KVStore  # noqa: E402
from cudaformers.kernels import paged_decode as pd  # noqa: E402
from cudaformers.kernels.arrivals import arrival_counters  # noqa: E402
from cudaformers.kernels.kv_store import store_kv_reference  # noqa: E402
from cudaformers.kernels.paged_decode import paged_decode, paged_decode_reference  # noqa: E402
from cudaformers.kernels.paged_decode_fused import paged_decode_fused  # noqa: E402
from cudaformers.kernels.qk_norm_rope import qk_norm_rope_forward, qk_norm_rope_reference  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = (1e-6, 1e-5)


def _close(out, ref32, ref_same, dtype, what):
    """Within three times the same-dtype reference's error: the interpreter truncates fp32 -> bf16 casts
    (of p, and of an fp32 cache's keys) where PyTorch rounds, which costs both paths alike."""
    err = (out.float() - ref32).abs().max().item()
    if dtype == torch.float32:
        bound = 1e-4 * max(1.0, ref32.abs().max().item())
    else:
        bound = 3 * (ref_same.float() - ref32).abs().max().item() + 1e-3
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaNs (poisoned rows) compare equal to themselves."""
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _setup(k_lens, hq, hkv, d, rot, page, dtype, cache_dtype, norm, pad, capacity, seed):
    """Raw packed q/k/v of the new tokens, norm weights, cos/sin, and a cache with shuffled pages.

    Every slot no sequence owns is NaN, and so is each sequence's newest row (the new token's, which
    the launch writes): reading any of them would show in the output. ``pad`` rows get slot -1 and
    keep their NaN row."""
    g = torch.Generator().manual_seed(seed)
    b = len(k_lens)
    width = -(-capacity // page)
    owned = [-(-n // page) for n in k_lens]
    blocks = sum(owned) + 2
    k_cache = torch.randn(blocks, page, hkv, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(blocks, page, hkv, d, generator=g).to(cache_dtype)
    perm = torch.randperm(blocks, generator=g)
    table = torch.full((b, width), int(perm[-1]), dtype=torch.int32)  # a spare block past each sequence's pages
    used = 0
    for i, n in enumerate(owned):
        table[i, :n] = perm[used:used + n]
        used += n
    stale = torch.ones(blocks, page, dtype=torch.bool)
    for i, n in enumerate(k_lens):
        pos = torch.arange(n - 1)  # the old keys; the newest is the launch's to write
        stale[table[i, pos // page].long(), pos % page] = False
    k_cache[stale], v_cache[stale] = float("nan"), float("nan")
    last = torch.tensor(k_lens) - 1
    slots = table[torch.arange(b), last // page].long() * page + last % page
    store_slots = slots.clone()
    store_slots[list(pad)] = -1
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = (x.view(b, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], -1))
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([last.float()[:, None] * inv] * 2, -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    w = [(1 + 0.2 * torch.randn(d, generator=g)).to(dtype) for _ in range(2)] if norm else [None, None]
    lens = torch.tensor(k_lens, dtype=torch.int32)
    move = lambda x: None if x is None else x.to(DEV)  # noqa: E731
    return [move(x) for x in (q, k, v, k_cache, v_cache, lens, table, slots, store_slots, cos, sin, *w)]


def _check(k_lens, hq, hkv, d, rot, page, window, splits, norm, dtype, cache_dtype=None, pad=(), capacity=None,
           seed=0, tiling=None):
    cache_dtype = cache_dtype or dtype
    capacity = capacity or max(k_lens) + 20  # beyond every length, as in a captured graph
    q, k, v, k_cache, v_cache, lens, table, slots, store_slots, cos, sin, qw, kw = _setup(
        k_lens, hq, hkv, d, rot, page, dtype, cache_dtype, norm, pad, capacity, seed)
    scale = d ** -0.5
    inputs = [x.clone() for x in (q, k, v, cos, sin, store_slots)]

    # The unfused path, storing every row (padding rows too: their output reads the new key there).
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q_out, k_out = qk_norm_rope_forward(q, k, cos, sin, qw, kw, *EPS, KVStore(v, want_k, want_v, slots))
    want = paged_decode(q_out, want_k, want_v, lens, table, capacity, scale, window, num_splits=splits, tiling=tiling)
    ref32 = paged_decode_reference(q_out, want_k, want_v, lens, table, scale, window, upcast=True)
    ref = paged_decode_reference(q_out, want_k, want_v, lens, table, scale, window)
    for i in pad:  # ... but a padding row's slot is left as it was
        s = slots[i]
        want_k.view(-1, hkv, d)[s] = k_cache.view(-1, hkv, d)[s]
        want_v.view(-1, hkv, d)[s] = v_cache.view(-1, hkv, d)[s]

    got = paged_decode_fused(q, k, v, k_cache, v_cache, lens, table, store_slots, capacity, scale, cos, sin, qw, kw,
                             *EPS, window=window, num_splits=splits, tiling=tiling)
    assert got.dtype == q_out.dtype and got.shape == q_out.shape
    assert torch.isfinite(got).all(), "a stale or unwritten cache row was read"
    _close(got, ref32, ref, dtype, "fused")
    _close(want, ref32, ref, dtype, "unfused")
    assert torch.equal(_bits(k_cache), _bits(want_k)) and torch.equal(_bits(v_cache), _bits(want_v))
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, cos, sin, store_slots), inputs))  # inputs untouched
    assert int(arrival_counters(q.device, 1).abs().sum()) == 0  # merge counters reset for the next launch
    return got, (q, k, v, k_cache, v_cache, lens, table, cos, sin, qw, kw, scale, window)


# (key lengths, Hq, Hkv, head_dim, rotary dim, page, window, grid splits, norm, padding rows)
CASES = [
    ([1], 2, 2, 64, 64, 16, None, None, True, ()),  # batch 1, MHA, the new key alone
    ([9], 4, 1, 32, 32, 4, None, 4, False, ()),  # batch 1, one tile over three pages, unused splits
    ([1, 9, 40], 4, 2, 128, 128, 16, None, 3, True, (1,)),  # GQA 2; one key, one tile, three splits; padding
    ([70, 33, 17], 8, 2, 64, 32, 8, None, 4, False, (0,)),  # GQA 4, partial rotary, several splits
    ([45, 3, 20], 4, 1, 80, 48, 16, 40, 4, True, ()),  # odd head dim, window: a split starting past key 0
    ([100], 4, 2, 64, 64, 4, 50, 4, True, ()),  # window inside a long context, split
    ([7, 40, 2], 2, 2, 32, 16, 4, 1, 2, True, (2,)),  # window of one: the new key alone, from registers
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-r{c[4]}-w{c[6]}-s{c[7]}"
                                                      f"-{'norm' if c[8] else 'plain'}-pad{len(c[9])}")
def test_equals_qk_norm_rope_then_paged_decode(case, dtype):
    k_lens, hq, hkv, d, rot, page, window, splits, norm, pad = case
    _check(k_lens, hq, hkv, d, rot, page, window, splits, norm, dtype, pad=pad, seed=len(k_lens) + d)


def test_close_to_the_pytorch_definition():
    """Both paths against the definition itself: torch norm + rope, an index_copy_ store, plain attention."""
    got, (q, k, v, k_cache, v_cache, lens, table, cos, sin, qw, kw, scale, window) = _check(
        [30, 1, 17], 8, 2, 64, 64, 8, None, 3, True, torch.float32, seed=3)
    ref_q, ref_k = qk_norm_rope_reference(q, k, cos, sin, qw, kw, *EPS)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    last = lens.long() - 1
    slots = table[torch.arange(3, device=DEV), last // 8].long() * 8 + last % 8
    store_kv_reference(ref_kc, ref_vc, ref_k, v, slots)
    torch.testing.assert_close(k_cache, ref_kc, atol=1e-5, rtol=1e-5, equal_nan=True)
    ref = paged_decode_reference(ref_q, ref_kc, ref_vc, lens, table, scale, window)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_long_context_with_a_chunked_merge():
    tiling = pd.DecodeTiling(block_n=32, num_warps=4, num_stages=1, split_above=32, split_tiles=1)
    _check([300, 5], 16, 2, 128, 128, 16, None, 10, True, torch.bfloat16, tiling=tiling, seed=7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_widening_into_an_fp32_cache(dtype):
    _check([5, 26], 4, 2, 32, 32, 8, None, 2, True, dtype, cache_dtype=torch.float32, pad=(0,), seed=11)


def test_rejects_what_it_cannot_take():
    q, k, v, k_cache, v_cache, lens, table, slots, _, cos, sin, qw, kw = _setup(
        [5, 6], 4, 2, 16, 16, 4, torch.float32, torch.float32, True, (), 8, 0)
    args = (q, k, v, k_cache, v_cache, lens, table, slots, 8, 0.25)

    def call(*a, **kw_):
        return paged_decode_fused(*a, **kw_)
    with pytest.raises(ValueError, match="k .* and v .* must be"):
        call(q, k[:, :1], v[:, :1], *args[3:], cos, sin)
    with pytest.raises(ValueError, match="even R <= head_dim"):
        call(*args, cos[:, :15], sin[:, :15])
    with pytest.raises(ValueError, match="both q and k norm weights"):
        call(*args, cos, sin, qw)
    with pytest.raises(ValueError, match="norm weights must be"):
        call(*args, cos, sin, qw[:8], kw[:8])
    with pytest.raises(ValueError, match="slot_mapping must be"):
        call(*args[:7], slots[:1], *args[8:], cos, sin)
    with pytest.raises(ValueError, match="contiguous caches of one dtype"):
        call(*args[:3], k_cache, v_cache.half(), *args[5:], cos, sin)
    with pytest.raises(ValueError, match="round to different dtypes"):
        call(q, k.double(), v, *args[3:], cos, sin)
    with pytest.raises(ValueError, match="not a multiple"):
        call(q[:, :3], *args[1:], cos, sin)
    with pytest.raises(ValueError, match="no backward"):
        call(q.clone().requires_grad_(), *args[1:], cos, sin)


# -- the model: a tiny Qwen3 (q/k norms, GQA) with every decode kernel mapped onto the CPU, interpreted ----

# The kernels the fused attention depends on (the folded q/k/v GEMV, qk_norm_rope); the other
# projections stay on PyTorch, which the interpreter would otherwise spend most of the time on.
DECODE = {"rotary_pos_emb": {"cpu": {"inference": "cudaformers:qk_norm_rope", "training": ""}},
          "DecoderLayer": {"cpu": {"inference": "cudaformers:fused_norm_decode", "training": ""}}}


@pytest.fixture
def fused_calls(monkeypatch):
    """Rows of each fused attention launch."""
    from cudaformers.kernels import paged_decode_fused as module

    calls = []
    real = module.paged_decode_fused

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(module, "paged_decode_fused", counting)
    return calls


def _model(name, attn, dtype=torch.float32):
    import tiny
    from cudaformers import AutoModelForCausalLM
    from cudaformers.kernels.hub import KernelConfig

    return AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name), kernel_config=KernelConfig(DECODE),
                                                attn_implementation=attn, dtype=dtype).eval()


def _decode(model, monkeypatch, fuse: bool, generate: bool = True):
    """Greedy tokens from generate() (4 decode steps of 2 rows), then over a paged cache with scattered
    blocks a prefill of two sequences and three decode steps of both: each step's logits and the
    caches (``cache.k + cache.v``)."""
    from cudaformers.attention.kv_cache import KVCache
    from cudaformers.attention.metadata import AttentionBatch
    from cudaformers.kernels import fused_norm_decode

    monkeypatch.setattr(fused_norm_decode, "FUSE_ATTENTION", fuse)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 211, (2, 12), generator=g)
    tokens = model.generate(ids[:, :6], max_new_tokens=5, do_sample=False, eos_token_id=None) if generate else None
    cfg, bs = model.config, 4
    cache = KVCache(cfg.num_hidden_layers, 12, bs, cfg.num_key_value_heads, cfg.head_dim, model.dtype,
                    torch.device("cpu"))
    table = torch.randperm(12, generator=g)[:8].view(2, 4).int()
    done, logits = [0, 0], []
    for new in ([7, 5], [1, 1], [1, 1], [1, 1]):
        k_lens = [d + n for d, n in zip(done, new)]
        pos = torch.cat([torch.arange(d, k) for d, k in zip(done, k_lens)])
        rows = torch.cat([torch.full((n,), i) for i, n in enumerate(new)])
        slots = table[rows, pos // bs].long() * bs + pos % bs
        batch = AttentionBatch.with_cache(new, k_lens, cache, slots, table, "cpu")
        batch.num_decode_seqs = 2 if new == [1, 1] else 0
        with torch.inference_mode():
            logits.append(model.compute_logits(model.model(ids[rows, pos], pos, batch)))
        done = k_lens
    return tokens, logits, cache.k + cache.v


# q/k norm; bf16 (its steps only: the interpreter is slow); Llama-style with a sliding window
@pytest.mark.parametrize("name,dtype,generate", [("qwen3", torch.float32, True), ("qwen3_tied", torch.bfloat16, False),
                                                 ("mistral_window", torch.float32, True)])
def test_tiny_model_decodes_the_same_with_the_fused_attention(name, dtype, generate, fused_calls, monkeypatch):
    model = _model(name, "triton", dtype)
    want = _decode(model, monkeypatch, fuse=False, generate=generate)
    assert not fused_calls
    got = _decode(model, monkeypatch, fuse=True, generate=generate)
    assert fused_calls == [2] * (4 * generate + 3) * len(model.model.layers)
    assert generate is False or torch.equal(got[0], want[0])
    layers = len(model.model.layers)
    first = (got[2][0], got[2][layers]), (want[2][0], want[2][layers])
    assert all(torch.equal(a, b) for a, b in zip(*first))  # the first layer's k and v cache, bit for bit
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # later layers: the new key's place in the softmax sum
    for a, b in zip(got[1] + got[2], want[1] + want[2]):
        torch.testing.assert_close(a, b, atol=tol * b.abs().max().item(), rtol=tol)


def test_not_taken_on_another_backend_nor_under_pdl(fused_calls, monkeypatch):
    from cudaformers.kernels import fused_norm_decode

    reasons = set()
    real = fused_norm_decode._attention_declines
    monkeypatch.setattr(fused_norm_decode, "_attention_declines", lambda *a: (lambda r: (reasons.add(r), r)[1])(
        real(*a)))
    _decode(_model("qwen3", "sdpa"), monkeypatch, fuse=True, generate=False)
    assert not fused_calls  # and FUSE_ATTENTION = False: see the test above
    assert any(r and "backend" in r for r in reasons), reasons  # says why
    # Under PDL the two launches measured faster: the fused one only where asked for.
    monkeypatch.setattr(fused_norm_decode, "pdl_enabled", lambda device: True)
    model = _model("qwen3", "triton")
    reasons.clear()
    _decode(model, monkeypatch, fuse=True, generate=False)
    assert not fused_calls
    assert "PDL is on and FUSE_ATTENTION_WITH_PDL off" in reasons
    monkeypatch.setattr(fused_norm_decode, "FUSE_ATTENTION_WITH_PDL", True)
    _decode(model, monkeypatch, fuse=True, generate=False)
    assert fused_calls == [2] * 3 * len(model.model.layers)
