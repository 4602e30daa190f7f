import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.kernels.kv_store import store_kv_reference, store_kv_triton  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _case(t, hkv, d, page, blocks, dtype, cache_dtype, layout, pad, seed):
    g = torch.Generator().manual_seed(seed)
    # Each cache sits behind a guard region of one slot, where a write to slot -1 would land.
    k_cache = torch.randn((blocks * page + 1) * hkv * d, generator=g).to(cache_dtype)[hkv * d:]
    v_cache = torch.randn((blocks * page + 1) * hkv * d, generator=g).to(cache_dtype)[hkv * d:]
    k_cache, v_cache = k_cache.view(blocks, page, hkv, d), v_cache.view(blocks, page, hkv, d)
    if layout == "packed":  # k and v as slices of one q/k/v projection output
        qkv = torch.randn(t, 3 * hkv * d, generator=g).to(dtype)
        k, v = qkv[:, hkv * d:2 * hkv * d].view(t, hkv, d), qkv[:, 2 * hkv * d:].view(t, hkv, d)
    elif layout == "padded_heads":
        k = torch.randn(t, hkv, d + 3, generator=g).to(dtype)[..., :d]
        v = torch.randn(t, hkv, d + 1, generator=g).to(dtype)[..., :d]
    else:
        k, v = torch.randn(t, hkv, d, generator=g).to(dtype), torch.randn(t, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(blocks * page, generator=g)[:t]
    if pad:
        slots[::3] = -1
    return k_cache, v_cache, k, v, slots


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "packed", "padded_heads"])
@pytest.mark.parametrize("t,hkv,d,page,blocks,pad", [(1, 8, 128, 16, 3, False), (7, 3, 24, 5, 4, True),
                                                     (32, 2, 64, 16, 3, False), (5, 1, 10, 4, 2, True)])
def test_bit_exact_against_index_copy(t, hkv, d, page, blocks, pad, layout, dtype):
    k_cache, v_cache, k, v, slots = _case(t, hkv, d, page, blocks, dtype, dtype, layout, pad, seed=t + d)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    guards = [c.untyped_storage()[:hkv * d * c.element_size()].tolist() for c in (k_cache, v_cache)]
    store_kv_reference(ref_k, ref_v, k, v, slots)
    store_kv_triton(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert guards == [c.untyped_storage()[:hkv * d * c.element_size()].tolist() for c in (k_cache, v_cache)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_upcast_into_an_fp32_cache(dtype):
    k_cache, v_cache, k, v, slots = _case(6, 2, 16, 4, 3, dtype, torch.float32, "packed", False, seed=1)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(ref_k, ref_v, k, v, slots)
    store_kv_triton(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_bad_inputs_are_clear_errors():
    k_cache, v_cache, k, v, slots = _case(4, 2, 16, 4, 2, torch.float32, torch.float32, "contiguous", False, 2)
    with pytest.raises(ValueError, match="matching the caches"):
        store_kv_triton(k_cache, v_cache, k[:, :1], v[:, :1], slots)
    with pytest.raises(ValueError, match=r"slot_mapping must be \[T=4\]"):
        store_kv_triton(k_cache, v_cache, k, v, slots[:3])
    with pytest.raises(ValueError, match="contiguous caches of one dtype"):
        store_kv_triton(k_cache, v_cache.half(), k, v, slots)
