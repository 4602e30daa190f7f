"""Attention kernels and backends at full size on the GPU: long sequences, real head dims, bf16/fp16,
backward, and decode captured in a CUDA graph."""

import pytest
import torch

from cudaformers.attention.kv_cache import KVCache, store_kv
from cudaformers.attention.metadata import AttentionBatch
from cudaformers.attention.registry import get_backend
from cudaformers.kernels.flash_attention import attention_reference, flash_attn_varlen
from cudaformers.kernels.flash_attention_fwd import attention_fwd
from cudaformers.kernels.paged_decode import paged_decode, paged_decode_reference

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
LOW = [torch.bfloat16, torch.float16]


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=CUDA)


def _rand(*shape, dtype, seed, grad=False):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=CUDA).to(dtype).requires_grad_(grad)


def _check(out, ref32, ref_same, what):
    err = (out.float() - ref32).abs().max().item()
    bound = 2 * (ref_same.float() - ref32).abs().max().item() + 2e-3
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("lens,window", [([8192], None), ([1000, 3001, 17, 4096], None), ([5000, 2048], 1024)])
def test_forward_full_size(lens, window, d, dtype):
    hq, hkv = 8, 2
    cu = _cu(lens)
    q, k, v = (_rand(sum(lens), h, d, dtype=dtype, seed=i) for i, h in enumerate((hq, hkv, hkv)))
    out = flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), d ** -0.5, window)
    ref32, _ = attention_reference(q, k, v, cu, cu, d ** -0.5, window, upcast=True)
    ref, _ = attention_reference(q, k, v, cu, cu, d ** -0.5, window)
    _check(out, ref32, ref, "forward")


@pytest.mark.timeout(600)  # a cold Triton cache autotunes the fp32 kernel over its configs first (> 120 s)
def test_forward_fp32_is_exact_fp32():
    lens, d = [777, 1500], 128
    cu = _cu(lens)
    q, k, v = (_rand(sum(lens), h, d, dtype=torch.float32, seed=i) for i, h in enumerate((8, 2, 2)))
    out = flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), d ** -0.5, None)
    ref, _ = attention_reference(q, k, v, cu, cu, d ** -0.5, None, upcast=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window", [None, 512])
def test_backward_full_size(d, dtype, window):
    lens, hq, hkv = [4096, 1000, 33], 16, 8
    cu = _cu(lens)
    q, k, v = (_rand(sum(lens), h, d, dtype=dtype, seed=i, grad=True) for i, h in enumerate((hq, hkv, hkv)))
    dout = _rand(sum(lens), hq, d, dtype=dtype, seed=7)
    out = flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), d ** -0.5, window)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref32 = attention_reference(q, k, v, cu, cu, d ** -0.5, window, upcast=True)[0]
    grads32 = torch.autograd.grad(ref32, (q, k, v), dout.float())
    ref = attention_reference(q, k, v, cu, cu, d ** -0.5, window)[0]
    grads_same = torch.autograd.grad(ref, (q, k, v), dout)
    for name, g, g32, gs in zip("qkv", grads, grads32, grads_same):
        _check(g, g32, gs, f"d{name}")


def _paged_cache(k_lens, hkv, d, dtype, page, seed=0):
    pages = -(-max(k_lens) // page)
    n = len(k_lens) * pages + 7
    k_cache = _rand(n, page, hkv, d, dtype=dtype, seed=seed)
    v_cache = _rand(n, page, hkv, d, dtype=dtype, seed=seed + 1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: len(k_lens) * pages]
    return k_cache, v_cache, perm.view(len(k_lens), pages).to(torch.int32).to(CUDA)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("window", [None, 700])
def test_paged_decode_full_size(page, window, dtype):
    k_lens, hq, hkv, d = [1, 8000, 4097, 31] + [1500] * 28, 16, 8, 128
    k_cache, v_cache, table = _paged_cache(k_lens, hkv, d, dtype, page)
    q = _rand(len(k_lens), hq, d, dtype=dtype, seed=3)
    lens = torch.tensor(k_lens, dtype=torch.int32, device=CUDA)
    out = paged_decode(q, k_cache, v_cache, lens, table, 8192, d ** -0.5, window)
    ref32 = paged_decode_reference(q, k_cache, v_cache, lens, table, d ** -0.5, window, upcast=True)
    ref = paged_decode_reference(q, k_cache, v_cache, lens, table, d ** -0.5, window)
    _check(out, ref32, ref, "decode")


def _decode_case(k_lens, hq, hkv, d, dtype, page, capacity, seed=0):
    """A cache with ``k_lens`` keys per sequence in a ``capacity``-wide table (as during graph capture)."""
    k_cache, v_cache, table = _paged_cache(k_lens, hkv, d, dtype, page, seed)
    width = -(-capacity // page)
    wide = torch.full((len(k_lens), width), int(table[0, 0]), dtype=torch.int32, device=CUDA)
    wide[:, :table.shape[1]] = table
    q = _rand(len(k_lens), hq, d, dtype=dtype, seed=seed + 2)
    return q, k_cache, v_cache, torch.tensor(k_lens, dtype=torch.int32, device=CUDA), wide


# Batch 1 and 32 at short and long contexts in a 16k-capacity grid: one program per sequence at
# short contexts, splits merged in the same launch at long ones (and both in one batch).
DECODE_MIXES = {"b1-130": [130], "b1-1000": [1000], "b1-8192": [8192], "b32-131": [131] * 32,
                "b32-mixed": [1, 17, 130, 260, 1000, 1024, 4097, 8192] * 4, "b32-8192": [8192] * 32}


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("mix", list(DECODE_MIXES))
def test_paged_decode_short_and_long_contexts(mix, page, dtype):
    k_lens = DECODE_MIXES[mix]
    q, k_cache, v_cache, lens, table = _decode_case(k_lens, 16, 8, 128, dtype, page, 16384)
    out = paged_decode(q, k_cache, v_cache, lens, table, 16384, 128 ** -0.5)
    ref32 = paged_decode_reference(q, k_cache, v_cache, lens, table, 128 ** -0.5, upcast=True)
    ref = paged_decode_reference(q, k_cache, v_cache, lens, table, 128 ** -0.5)
    _check(out, ref32, ref, f"decode {mix}")


@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 64), (16, 2, 256), (32, 4, 128), (6, 3, 96)])
@pytest.mark.parametrize("window", [None, 300])
def test_paged_decode_groups_head_dims_windows(hq, hkv, d, window):
    k_lens = [1, 17, 130, 1000, 3000, 299]
    q, k_cache, v_cache, lens, table = _decode_case(k_lens, hq, hkv, d, torch.bfloat16, 16, 4096, seed=5)
    out = paged_decode(q, k_cache, v_cache, lens, table, 4096, d ** -0.5, window)
    ref32 = paged_decode_reference(q, k_cache, v_cache, lens, table, d ** -0.5, window, upcast=True)
    ref = paged_decode_reference(q, k_cache, v_cache, lens, table, d ** -0.5, window)
    _check(out, ref32, ref, "decode")


def test_paged_decode_fp32_is_exact_fp32():
    q, k_cache, v_cache, lens, table = _decode_case([130, 5000, 1], 16, 8, 128, torch.float32, 16, 8192)
    out = paged_decode(q, k_cache, v_cache, lens, table, 8192, 128 ** -0.5)
    ref = paged_decode_reference(q, k_cache, v_cache, lens, table, 128 ** -0.5, upcast=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pdl", ["0", "1"])
def test_paged_decode_merge_is_race_free_in_a_graph(pdl, monkeypatch):
    """The last split to arrive merges: replayed many times, with lengths that switch between one
    program and many splits between replays, every output is bitwise the eager one."""
    monkeypatch.setenv("CUDAFORMERS_PDL", pdl)
    capacity, reps = 16384, 50
    mixes = [[8192] * 2 + [130] * 30, [131] * 32, [1000, 1, 16384, 2047] * 8]
    q, k_cache, v_cache, lens, table = _decode_case([capacity] * 32, 16, 8, 128, torch.bfloat16, 16, capacity)
    lens_buf = lens.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode(q, k_cache, v_cache, lens_buf, table, capacity, 128 ** -0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [paged_decode(q, k_cache, v_cache, lens_buf, table, capacity, 128 ** -0.5) for _ in range(reps)]
    for k_lens in mixes * 2:
        lens_buf.copy_(torch.tensor(k_lens, dtype=torch.int32))
        expect = paged_decode(q, k_cache, v_cache, lens_buf, table, capacity, 128 ** -0.5)
        graph.replay()
        for i, out in enumerate(outs):
            assert torch.equal(out, expect), f"replayed call {i} differs from eager for lengths {k_lens[:4]}..."
        ref32 = paged_decode_reference(q, k_cache, v_cache, lens_buf, table, 128 ** -0.5, upcast=True)
        ref = paged_decode_reference(q, k_cache, v_cache, lens_buf, table, 128 ** -0.5)
        _check(expect, ref32, ref, "decode")


def test_paged_decode_captured_before_any_split_call(monkeypatch, caplog):
    """A capture cannot create the split counters (they would not be zeroed until the graph runs):
    it runs each sequence in one program instead, says so, and is still right."""
    from cudaformers.kernels import arrivals
    from cudaformers.kernels import paged_decode as pd

    monkeypatch.setattr(arrivals, "_BUFFERS", {})
    monkeypatch.setattr(pd, "_warned_capture", [])
    q, k_cache, v_cache, lens, table = _decode_case([8192, 130], 16, 8, 128, torch.bfloat16, 16, 16384)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles the one-program kernel; makes no counters
        paged_decode(q, k_cache, v_cache, lens, table, 16384, 128 ** -0.5, num_splits=1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with caplog.at_level("WARNING", logger="cudaformers"), torch.cuda.graph(graph):
        out = paged_decode(q, k_cache, v_cache, lens, table, 16384, 128 ** -0.5)
    assert "run one decode step before capturing" in caplog.text
    graph.replay()
    ref32 = paged_decode_reference(q, k_cache, v_cache, lens, table, 128 ** -0.5, upcast=True)
    ref = paged_decode_reference(q, k_cache, v_cache, lens, table, 128 ** -0.5)
    _check(out, ref32, ref, "decode")


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_paged_prefill_full_size(d, dtype):
    q_lens, k_lens, page = [512, 1, 2000], [3000, 700, 2000], 16
    k_cache, v_cache, table = _paged_cache(k_lens, 4, d, dtype, page, seed=4)
    q = _rand(sum(q_lens), 16, d, dtype=dtype, seed=5)
    out, _ = attention_fwd(q, k_cache, v_cache, _cu(q_lens), _cu(k_lens), max(q_lens), d ** -0.5, None,
                           block_table=table)
    keys, values = [], []
    for b, n in enumerate(k_lens):
        pos = torch.arange(n, device=CUDA)
        slots = table[b, pos // page].long() * page + pos % page
        keys.append(k_cache.view(-1, 4, d)[slots])
        values.append(v_cache.view(-1, 4, d)[slots])
    k, v = torch.cat(keys), torch.cat(values)
    ref32, _ = attention_reference(q, k, v, _cu(q_lens), _cu(k_lens), d ** -0.5, None, upcast=True)
    ref, _ = attention_reference(q, k, v, _cu(q_lens), _cu(k_lens), d ** -0.5, None)
    _check(out, ref32, ref, "paged prefill")


@pytest.mark.parametrize("name", ["triton", "flash_attention_2", "sdpa"])
@pytest.mark.parametrize("window", [None, 100])
def test_decode_cuda_graph_replay_matches_eager(name, window):
    """Capture one decode step with fixed buffers, replay it on new contents, compare with eager."""
    batch_size, hq, hkv, d, page, capacity = 8, 16, 8, 128, 16, 4096
    dtype = torch.bfloat16
    cache = KVCache(1, batch_size * capacity // page, page, hkv, d, dtype, CUDA)
    table = cache.contiguous_block_table(batch_size, capacity, CUDA)
    backend = get_backend(name, device=CUDA, dtype=dtype, head_dim=d, sliding_window=window)
    eager = get_backend("eager", device=CUDA, dtype=dtype, head_dim=d)
    # Fill the cache with random context once.
    flat = cache.k[0].view(-1, hkv, d)
    flat.copy_(_rand(*flat.shape, dtype=dtype, seed=10))
    cache.v[0].view(-1, hkv, d).copy_(_rand(*flat.shape, dtype=dtype, seed=11))

    def step_batch(lens):
        lens_t = torch.tensor(lens, dtype=torch.int32, device=CUDA)
        slots = table[torch.arange(batch_size, device=CUDA), (lens_t - 1) // page].long() * page + (lens_t - 1) % page
        return AttentionBatch.with_cache([1] * batch_size, lens, cache, slots, table, CUDA, max_seqlen_k=capacity)

    static = step_batch([capacity] * batch_size)  # has_context: the captured path is with_cache
    q_buf = torch.zeros(batch_size, hq, d, dtype=dtype, device=CUDA)
    k_buf = torch.zeros(batch_size, hkv, d, dtype=dtype, device=CUDA)
    v_buf = torch.zeros_like(k_buf)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend(q_buf, k_buf, v_buf, static, 0, d ** -0.5, window)  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    # As the model does at every forward: values derived from the batch (sdpa's padding mask) are
    # rebuilt inside the capture, so replays follow the refilled buffers.
    static.clear_memo()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_buf = backend(q_buf, k_buf, v_buf, static, 0, d ** -0.5, window)

    for seed, lens in enumerate([[1, 2, 3, 4, 5, 6, 7, 8], [4096, 17, 1000, 2500, 1, 333, 4000, 64]]):
        new = step_batch(lens)
        for dst, src in ((static.cu_seqlens_k, new.cu_seqlens_k), (static.seqlens_k, new.seqlens_k),
                         (static.slot_mapping, new.slot_mapping)):
            dst.copy_(src)
        q_buf.copy_(_rand(batch_size, hq, d, dtype=dtype, seed=20 + seed))
        k_buf.copy_(_rand(batch_size, hkv, d, dtype=dtype, seed=30 + seed))
        v_buf.copy_(_rand(batch_size, hkv, d, dtype=dtype, seed=40 + seed))
        graph.replay()
        ref = eager(q_buf, k_buf, v_buf, new, 0, d ** -0.5, window)
        torch.testing.assert_close(out_buf, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["triton", "flex_attention", "flash_attention_2", "sdpa"])
@pytest.mark.parametrize("window", [None, 64])
def test_backends_match_eager_on_gpu(name, window):
    """Outputs and gradients: within twice eager-bf16's error against eager-fp32 on the same inputs."""
    dtype, d = torch.bfloat16, 128
    lens = [300, 1, 1025, 64]
    batch = AttentionBatch.from_seqlens(lens, CUDA)
    backend = get_backend(name, device=CUDA, dtype=dtype, head_dim=d, sliding_window=window, training=True)
    eager = get_backend("eager", device=CUDA, dtype=dtype, head_dim=d)
    results = []
    for b, dt in ((backend, dtype), (eager, dtype), (eager, torch.float32)):
        q, k, v = (_rand(sum(lens), h, d, dtype=dtype, seed=i).to(dt).requires_grad_(True)
                   for i, h in enumerate((16, 8, 8)))
        out = b(q, k, v, batch, 0, d ** -0.5, window)
        dout = _rand(*out.shape, dtype=dtype, seed=9).to(dt)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for what, got, same, ref32 in zip(("out", "dq", "dk", "dv"), *results):
        _check(got, ref32, same, what)
