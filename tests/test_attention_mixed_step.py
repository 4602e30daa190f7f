"""A mixed engine step (decodes first, then prefill chunks with cached context): the triton backend's
split path (decode kernel + prefill kernel) equals the eager reference."""

import pytest
import torch

from cudaformers.attention.kv_cache import KVCache
from cudaformers.attention.metadata import AttentionBatch
from cudaformers.attention.registry import get_backend


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_step_matches_eager(window):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 4, 2, 16, 4
    q_lens = [1, 1, 1, 6, 3]  # three decodes, then two chunks
    k_lens = [9, 3, 14, 10, 7]
    cache = KVCache(1, 40, bs, hkv, d, torch.float32, torch.device("cpu"))
    cache.k[0].normal_(generator=g)
    cache.v[0].normal_(generator=g)
    width = max(-(-k // bs) for k in k_lens)
    perm = torch.randperm(40, generator=g)[: len(k_lens) * width].view(len(k_lens), width).int()
    slots = torch.cat([perm[i, (torch.arange(k - q, k) // bs)].long() * bs + torch.arange(k - q, k) % bs
                       for i, (q, k) in enumerate(zip(q_lens, k_lens))])
    t = sum(q_lens)
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    outs = {}
    for name in ("eager", "triton"):
        batch = AttentionBatch.with_cache(q_lens, k_lens, cache, slots, perm, "cpu")
        batch.num_decode_seqs = 3
        backend = get_backend(name, device=torch.device("cpu"), dtype=torch.float32, head_dim=d,
                              sliding_window=window)
        outs[name] = backend(q, k, v, batch, 0, d ** -0.5, window)
    torch.testing.assert_close(outs["triton"], outs["eager"], atol=1e-4, rtol=1e-4)
    # Every layer after the first reuses the step's split metadata; the result is the same.
    torch.testing.assert_close(backend(q, k, v, batch, 0, d ** -0.5, window), outs["triton"], atol=0, rtol=0)
    assert ("triton mixed split", 3) in batch._memo


def test_decode_and_prefill_kernels_write_into_a_given_output():
    import os

    from cudaformers.kernels.flash_attention_fwd import attention_fwd
    from cudaformers.kernels.paged_decode import paged_decode

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(1)
    cache = KVCache(1, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    cache.k[0].normal_(generator=g)
    cache.v[0].normal_(generator=g)
    q = torch.randn(2, 4, 16, generator=g)
    lens, table = torch.tensor([5, 7], dtype=torch.int32), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    out = torch.zeros(3, 4, 16)
    got = paged_decode(q, cache.k[0], cache.v[0], lens, table, 7, 0.25, out=out[1:])
    assert got.data_ptr() == out[1:].data_ptr() and not out[0].any()
    torch.testing.assert_close(out[1:], paged_decode(q, cache.k[0], cache.v[0], lens, table, 7, 0.25))
    with pytest.raises(ValueError, match="must have q's shape"):
        paged_decode(q, cache.k[0], cache.v[0], lens, table, 7, 0.25, out=out[:1])
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="must have q's shape"):
        attention_fwd(q, q, q, cu, cu, 2, 0.25, out=out[:2].double())
    into = torch.empty(2, 4, 16)
    assert attention_fwd(q, q, q, cu, cu, 2, 0.25, out=into)[0].data_ptr() == into.data_ptr()


def test_scheduler_puts_decodes_first():
    from cudaformers.engine.scheduler import ScheduledBatch, _decodes_first

    class Seq:
        def __init__(self, computed):
            self.num_computed_tokens = computed

    seqs = [Seq(0), Seq(5), Seq(3), Seq(9)]
    out = ScheduledBatch(seqs=list(seqs), num_new_tokens=[7, 1, 4, 1], sample_indices=[0, 1, 3],
                         num_tokens=13, num_decodes=2)
    out = _decodes_first(out)
    assert out.seqs == [seqs[1], seqs[3], seqs[0], seqs[2]]
    assert out.num_new_tokens == [1, 1, 7, 4]
    assert out.sample_indices == [0, 1, 2]
