"""The q/k/v GEMV that finishes the heads (kernels/gemv_heads.py), in the Triton interpreter: its
packed output, residual sum, query and the whole KV cache are bit for bit what the two launches it
replaces leave (``gemv_rms_norm``, then ``qk_norm_rope`` with its fused cache store). Then the model:
a tiny Qwen3 decodes the same tokens, logits and caches with it as without.

Covers 1-4 rows, MHA and GQA, head dims 32/64/128, with and without q/k norm, partial rotary, a
residual or not (the first layer), a bias, padding slots, fp32/bf16/fp16 and a widening fp32 cache.
"""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.attention.kv_cache import KVStore  # noqa: E402
from cudaformers.kernels import paged_decode as pd  # noqa: E402
from cudaformers.kernels.gemv import gemv_rms_norm  # noqa: E402
from cudaformers.kernels.gemv_heads import Heads, gemv_rms_norm_heads, heads_fit  # noqa: E402
from cudaformers.kernels.qk_norm_rope import output_dtypes, qk_norm_rope_forward  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _inputs(t, hq, hkv, d, rot, hidden, dtype, cache_dtype, norm, residual, bias, pad, seed):
    g = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * d
    make = lambda *shape, s=1.0: (s * torch.randn(*shape, generator=g)).to(dtype).to(DEV)  # noqa: E731
    x, res = make(t, hidden), make(t, hidden) if residual else None
    w, b = make(n, hidden, s=hidden ** -0.5), make(n) if bias else None
    norm_w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    qw, kw = ((1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEV) for _ in range(2)) if norm else (None, None)
    pos = torch.arange(3, 3 + t).float()
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([pos[:, None] * inv] * 2, -1)
    cos, sin = emb.cos().to(dtype).to(DEV), emb.sin().to(dtype).to(DEV)
    blocks, page = 6, 4
    k_cache = torch.randn(blocks, page, hkv, d, generator=g).to(cache_dtype).to(DEV)
    v_cache = torch.randn(blocks, page, hkv, d, generator=g).to(cache_dtype).to(DEV)
    slots = torch.randperm(blocks * page, generator=g)[:t].to(DEV)
    slots[list(pad)] = -1
    return x, res, w, b, norm_w, qw, kw, cos, sin, k_cache, v_cache, slots


# (rows, Hq, Hkv, head_dim, rotary dim, hidden, q/k norm, residual, bias, padding rows)
CASES = [
    (1, 4, 2, 64, 64, 96, True, True, False, ()),      # batch 1, GQA 2
    (1, 2, 2, 128, 128, 64, True, False, False, ()),   # MHA, the first layer (no residual), one program a head
    (3, 4, 1, 32, 16, 80, False, True, True, (1,)),    # GQA 4, partial rotary, no norm, a bias, padding
    (4, 8, 2, 64, 32, 128, True, True, False, (0, 3)),  # the most rows the GEMV takes
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-r{c[4]}-"
                                                      f"{'norm' if c[6] else 'plain'}-res{int(c[7])}-b{int(c[8])}")
def test_equals_the_gemv_then_qk_norm_rope(case, dtype):
    t, hq, hkv, d, rot, hidden, norm, residual, bias, pad = case
    cache_dtype = torch.float32 if (dtype == torch.bfloat16 and t == 1) else dtype  # and a widening cache
    x, res, w, b, norm_w, qw, kw, cos, sin, k_cache, v_cache, slots = _inputs(
        t, hq, hkv, d, rot, hidden, dtype, cache_dtype, norm, residual, bias, pad, seed=t * d)
    assert heads_fit(w.shape[0], hidden, d, DEV)
    eps, (q_eps, k_eps) = 1e-5, (1e-6, 1e-5)

    # the two launches
    want_k, want_v = k_cache.clone(), v_cache.clone()
    y = gemv_rms_norm(x, w, norm_w, eps, res, b)
    y, s = y if residual else (y, None)
    q, k, v = (z.view(t, -1, d) for z in y.split([hq * d, hkv * d, hkv * d], -1))
    want_q, _ = qk_norm_rope_forward(q, k, cos, sin, qw, kw, q_eps, k_eps, KVStore(v, want_k, want_v, slots))

    out = torch.empty_like(y)
    heads = Heads(hq, hkv, d, qw, kw, q_eps, k_eps, cos, sin, k_cache, v_cache, slots,
                  output_dtypes(q, k, cos, qw)[0])
    got_q, got_s = gemv_rms_norm_heads(x, w, norm_w, eps, res, b, heads, out)
    assert torch.equal(_bits(out), _bits(y))  # the packed q/k/v rows, as the GEMV writes them
    assert got_q.dtype == want_q.dtype and torch.equal(_bits(got_q), _bits(want_q))
    assert (got_s is None) == (not residual) and (got_s is None or torch.equal(got_s, s))
    assert torch.equal(_bits(k_cache), _bits(want_k)) and torch.equal(_bits(v_cache), _bits(want_v))
    assert int(pd._arrival_counters(x.device, 1).abs().sum()) == 0  # the counters reset for the next launch


def test_rejects_heads_the_programs_do_not_tile():
    x, res, w, b, norm_w, qw, kw, cos, sin, k_cache, v_cache, slots = _inputs(
        1, 4, 2, 64, 64, 96, torch.float32, torch.float32, True, True, False, (), seed=0)
    heads = Heads(4, 2, 64, qw, kw, 1e-6, 1e-6, cos, sin, k_cache, v_cache, slots, torch.float32)
    out = torch.empty(1, w.shape[0] - 64)
    with pytest.raises(ValueError, match="not 4 \\+ 2 x 2 heads of 64"):
        gemv_rms_norm_heads(x, w[:-64], norm_w, 1e-6, res, None, heads, out)
    assert not heads_fit(48 * 3, 96, 3, DEV)  # 3-wide heads: every program's rows span two


# -- the model --------------------------------------------------------------------------------------

@pytest.fixture
def heads_calls(monkeypatch):
    """Rows of each launch that finished the heads."""
    from cudaformers.kernels import gemv_heads

    calls = []
    real = gemv_heads.gemv_rms_norm_heads

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(gemv_heads, "gemv_rms_norm_heads", counting)
    return calls


@pytest.mark.parametrize("name,dtype,generate", [("qwen3", torch.float32, True), ("qwen3_tied", torch.bfloat16, False)])
def test_tiny_model_decodes_the_same_with_the_heads_finished_in_the_gemv(name, dtype, generate, heads_calls,
                                                                          monkeypatch):
    from test_kernels_paged_decode_fused import _decode, _model

    from cudaformers.kernels import fused_norm_decode

    model = _model(name, "triton", dtype)
    monkeypatch.setattr(fused_norm_decode, "FINISH_HEADS_IN_GEMV", False)
    want = _decode(model, monkeypatch, fuse=False, generate=generate)
    assert not heads_calls
    monkeypatch.setattr(fused_norm_decode, "FINISH_HEADS_IN_GEMV", True)
    monkeypatch.setattr(fused_norm_decode, "FINISH_HEADS_WITHOUT_PDL", True)
    got = _decode(model, monkeypatch, fuse=False, generate=generate)
    assert heads_calls == [2] * (4 * generate + 3) * len(model.model.layers)  # every decode step, every layer
    assert generate is False or torch.equal(got[0], want[0])
    for a, b in zip(got[1] + got[2], want[1] + want[2]):  # logits and caches, bit for bit
        assert torch.equal(_bits(a), _bits(b))
