"""Every attention backend usable on CPU against eager, on mixed batches; registry errors and fallbacks."""

import logging
import os
import types

import torch

if not torch.cuda.is_available():  # the triton backend interprets its kernels on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.attention import flash  # noqa: E402
from cudaformers.attention.kv_cache import KVCache, store_kv  # noqa: E402
from cudaformers.attention.metadata import AttentionBatch  # noqa: E402
from cudaformers.attention.registry import get_backend, names  # noqa: E402
from cudaformers.attention.triton_backend import TritonAttention  # noqa: E402
from cudaformers.errors import UnsupportedError  # noqa: E402
from cudaformers.kernels.flash_attention import attention_reference  # noqa: E402

CPU = torch.device("cpu")
BACKENDS = ["sdpa", "triton", "flex_attention"]
HEADS = [(8, 2), (4, 4)]  # GQA 4:1 and plain multi-head
WINDOWS = [None, 5]
D = 16


def _backend(name, dtype=torch.float32, window=None, training=False):
    return get_backend(name, device=CPU, dtype=dtype, head_dim=D, sliding_window=window, training=training)


# Ragged (padded and masked in sdpa) and equal lengths (one batched view, no mask).
LENS = [[7, 1, 30, 16], [12, 12, 12]]


def _rand(*shape, seed, dtype=torch.float32, grad=False):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_(grad)


def _cached_step(q_lens, k_lens, hq, hkv, dtype=torch.float32, block_size=4, seed=0):
    """A step whose sequences already hold ``k_len - q_len`` keys in a shuffled paged cache."""
    b = len(q_lens)
    pages = -(-max(k_lens) // block_size)
    cache = KVCache(1, b * pages + 2, block_size, hkv, D, dtype, CPU)
    table = torch.randperm(b * pages + 2, generator=torch.Generator().manual_seed(seed))[: b * pages]
    table = table.view(b, pages).to(torch.int32)

    def slots(i, pos):
        return table[i, pos // block_size].long() * block_size + pos % block_size

    ctx = torch.cat([slots(i, torch.arange(k - q)) for i, (q, k) in enumerate(zip(q_lens, k_lens))])
    store_kv(cache.k[0], cache.v[0], _rand(len(ctx), hkv, D, seed=seed + 1, dtype=dtype),
             _rand(len(ctx), hkv, D, seed=seed + 2, dtype=dtype), ctx)
    new = torch.cat([slots(i, torch.arange(k - q, k)) for i, (q, k) in enumerate(zip(q_lens, k_lens))])
    batch = AttentionBatch.with_cache(q_lens, k_lens, cache, new, table, CPU)
    t = sum(q_lens)
    q, k, v = (_rand(t, h, D, seed=seed + 3 + i, dtype=dtype) for i, h in enumerate((hq, hkv, hkv)))
    return q, k, v, batch


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window{w}")
@pytest.mark.parametrize("lens", LENS, ids=lambda lens: "x".join(map(str, lens)))
def test_prefill_matches_eager(name, heads, window, lens):
    batch = AttentionBatch.from_seqlens(lens, CPU)
    q, k, v = (_rand(sum(lens), h, D, seed=i) for i, h in enumerate((heads[0], heads[1], heads[1])))
    out = _backend(name, window=window)(q, k, v, batch, 0, D ** -0.5, window)
    ref = _backend("eager")(q, k, v, batch, 0, D ** -0.5, window)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window{w}")
@pytest.mark.parametrize("step", ["decode", "chunked", "prefill_into_cache"])
def test_cached_steps_match_eager(name, heads, window, step):
    q_lens, k_lens = {
        "decode": ([1, 1, 1], [1, 13, 30]),
        "chunked": ([5, 1, 9, 4], [12, 7, 9, 4]),  # context + chunk, decode, fresh prompt, fresh prompt
        "prefill_into_cache": ([6, 11], [6, 11]),
    }[step]
    q, k, v, batch = _cached_step(q_lens, k_lens, *heads)
    assert batch.has_context == (step != "prefill_into_cache")
    out = _backend(name, window=window)(q, k, v, batch, 0, D ** -0.5, window)
    ref = _backend("eager")(q, k, v, batch, 0, D ** -0.5, window)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_bf16_matches_fp32_reference(name):
    lens, window = [9, 20], 6
    batch = AttentionBatch.from_seqlens(lens, CPU)
    q, k, v = (_rand(sum(lens), h, D, seed=i, dtype=torch.bfloat16) for i, h in enumerate((4, 2, 2)))
    out = _backend(name, torch.bfloat16, window)(q, k, v, batch, 0, D ** -0.5, window)
    ref32, _ = attention_reference(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, D ** -0.5, window, upcast=True)
    ref = _backend("eager", torch.bfloat16)(q, k, v, batch, 0, D ** -0.5, window)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref32).abs().max() <= 2 * (ref.float() - ref32).abs().max() + 1e-3


@pytest.mark.parametrize("name", [n for n in BACKENDS if n != "flex_attention"])  # flex: no CPU backward
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window{w}")
@pytest.mark.parametrize("lens", LENS, ids=lambda lens: "x".join(map(str, lens)))
def test_training_gradients_match_eager(name, heads, window, lens):
    batch = AttentionBatch.from_seqlens(lens, CPU)
    grads = []
    for backend in (_backend(name, window=window, training=True), _backend("eager")):
        q, k, v = (_rand(sum(lens), h, D, seed=i, grad=True) for i, h in enumerate((heads[0], heads[1], heads[1])))
        out = backend(q, k, v, batch, 0, D ** -0.5, window)
        grads.append(torch.autograd.grad(out, (q, k, v), _rand(*out.shape, seed=9)))
    for g, ref in zip(*grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5)


def test_unknown_name_lists_the_choices():
    with pytest.raises(UnsupportedError, match="unknown attn_implementation 'flash'") as e:
        _backend("flash")
    for n in ("eager", "sdpa", "triton", "flex_attention", "flash_attention_2", "flash_attention_3",
              "flash_attention_4"):
        assert n in str(e.value)
    assert set(BACKENDS) <= set(names())


def test_flash_attention_on_cpu_names_reason_and_alternatives():
    with pytest.raises(UnsupportedError) as e:
        _backend("flash_attention_2", torch.bfloat16)
    msg = str(e.value)
    assert "runs on CUDA GPUs only" in msg and "Backends that would work" in msg
    assert "'eager'" in msg and "'sdpa'" in msg and "'flash_attention_2'" not in msg.split("work")[1]


def test_flex_training_on_cpu_is_refused_with_reason():
    with pytest.raises(UnsupportedError, match="no backward pass on CPU") as e:
        _backend("flex_attention", training=True)
    assert "'sdpa'" in str(e.value) and "'triton'" in str(e.value)


def test_triton_head_dim_limit():
    with pytest.raises(UnsupportedError, match="head_dim up to 256, not 512"):
        get_backend("triton", device=CPU, dtype=torch.float16, head_dim=512)


def test_triton_refuses_gradients_through_the_cache():
    q, k, v, batch = _cached_step([3, 1], [8, 5], 4, 2)
    q.requires_grad_(True)
    with pytest.raises(UnsupportedError, match="no backward through the KV cache"):
        _backend("triton")(q, k, v, batch, 0, 0.25, None)


@pytest.mark.parametrize("version", [2, 3, 4])
def test_missing_flash_attn_resolves_to_triton_and_says_so(version, monkeypatch, caplog):
    backend = flash.FlashAttnBackend(version)
    monkeypatch.setattr(backend, "_lib", lambda: None)
    cuda = torch.device("cuda")  # resolve() and the checks need no GPU
    with caplog.at_level(logging.INFO, logger="cudaformers"):
        first = backend.resolve(device=cuda)
        backend.resolve(device=cuda)
    assert isinstance(first, TritonAttention) and first.name == "triton"
    assert first.resolved_from == f"flash_attention_{version}"
    logs = [r.getMessage() for r in caplog.records]
    assert len(logs) == 1 and logs[0].startswith(f"flash_attention_{version}: ")
    assert logs[0].endswith("is not installed; using cudaformers' bundled Triton kernel")
    assert backend.unsupported_reason(device=cuda, dtype=torch.bfloat16, head_dim=128, sliding_window=None,
                                      training=True) is None


def test_flash_attention_2_log_line(monkeypatch, caplog):
    backend = flash.FlashAttnBackend(2)
    monkeypatch.setattr(backend, "_lib", lambda: None)
    with caplog.at_level(logging.INFO, logger="cudaformers"):
        backend.resolve(device=torch.device("cuda"))
    assert caplog.records[0].getMessage() == (
        "flash_attention_2: flash-attn is not installed; using cudaformers' bundled Triton kernel")


def _fake_flash_attn():
    """A stand-in for the flash_attn package with its documented semantics, built on the reference."""

    def window_of(window_size):
        left = window_size[0]
        return None if left < 0 else left + 1  # flash-attn sees keys p - left .. p

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, window_size=(-1, -1),
               block_table=None):
        assert causal and block_table is None  # the CPU tests use pages of < 256 tokens
        return attention_reference(q, k, v, cu_q, cu_k, softmax_scale, window_of(window_size))[0]

    def with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None, causal=False,
                     window_size=(-1, -1)):
        assert causal and block_table is None and q.shape[1] == 1
        outs = []
        for b, n in enumerate(cache_seqlens.tolist()):
            cu_q, cu_k = torch.tensor([0, 1]), torch.tensor([0, n])
            outs.append(attention_reference(q[b], k_cache[b, :n], v_cache[b, :n], cu_q, cu_k, softmax_scale,
                                            window_of(window_size))[0])
        return torch.stack(outs)

    return types.SimpleNamespace(flash_attn_varlen_func=varlen, flash_attn_with_kvcache=with_kvcache)


@pytest.mark.parametrize("step", ["prefill", "decode", "chunked"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window{w}")
def test_flash_attention_2_wrapper_plumbing(step, window, monkeypatch):
    backend = flash.FlashAttnBackend(2)
    monkeypatch.setattr(backend, "_lib", _fake_flash_attn)
    q_lens, k_lens = {"prefill": ([6, 11], [6, 11]), "decode": ([1, 1, 1], [1, 13, 30]),
                      "chunked": ([5, 1, 9], [12, 7, 9])}[step]
    q, k, v, batch = _cached_step(q_lens, k_lens, 8, 2)
    out = backend(q, k, v, batch, 0, D ** -0.5, window)
    ref = _backend("eager")(q, k, v, batch, 0, D ** -0.5, window)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)

