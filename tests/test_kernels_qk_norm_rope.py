import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_forward, qk_norm_rope_reference  # noqa: E402
from cudaformers.layers.attention import ApplyRotary  # noqa: E402
from cudaformers.layers.norm import RMSNorm  # noqa: E402

from test_kernels_tolerance import assert_matches  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cos_sin(t, rot, dtype):
    pos = torch.arange(t, dtype=torch.float32) * 5 + 2
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([pos[:, None] * inv] * 2, -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _strided(t, hq, hkv, d, g, layout, dtype=torch.float32):
    """q, k as the layer sees them: plain, slices of one packed projection, or with padded heads."""
    if layout == "packed":
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
        return qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    if layout == "padded_heads":
        q, k = torch.randn(t, hq, d + 3, generator=g), torch.randn(t, hkv, d + 5, generator=g)
        return q.to(dtype)[..., :d], k.to(dtype)[..., :d]
    return torch.randn(t, hq, d, generator=g).to(dtype), torch.randn(t, hkv, d, generator=g).to(dtype)


CASES = [(1, 16, 8, 128, 128), (3, 5, 1, 12, 12), (7, 4, 2, 64, 32), (2, 6, 3, 10, 6), (5, 3, 3, 24, 8)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("layout", ["contiguous", "packed", "padded_heads"])
@pytest.mark.parametrize("t,hq,hkv,d,rot", CASES)
def test_matches_reference(t, hq, hkv, d, rot, layout, norm, dtype):
    seed = t * 31 + d + rot
    g = torch.Generator().manual_seed(seed)
    q32, k32 = _strided(t, hq, hkv, d, g, layout)
    qw = (1 + 0.2 * torch.randn(d, generator=g)) if norm else None
    kw = (1 + 0.2 * torch.randn(d, generator=g)) if norm else None
    cos, sin = _cos_sin(t, rot, torch.float32)

    def run(fn, dt):
        w = (qw.to(dt), kw.to(dt)) if norm else (None, None)
        return fn(q32.to(dt), k32.to(dt), cos.to(dt), sin.to(dt), *w, 1e-6, 1e-5)

    # The same values again, as strided views in the test dtype: the kernel must see the strides.
    q_in, k_in = _strided(t, hq, hkv, d, torch.Generator().manual_seed(seed), layout, dtype)
    assert q_in.stride() == q32.stride()
    before = q_in.clone(), k_in.clone()
    w = (qw.to(dtype), kw.to(dtype)) if norm else (None, None)
    ours = qk_norm_rope_forward(q_in, k_in, cos.to(dtype), sin.to(dtype), *w, 1e-6, 1e-5)
    ref = run(qk_norm_rope_reference, dtype)
    ref32 = run(qk_norm_rope_reference, torch.float32)
    for name, a, b, c in zip("qk", ours, ref, ref32):
        assert a.is_contiguous() and a.dtype == b.dtype, name
        assert_matches(a, b, c, f"{name} ({dtype}, {layout}, norm={norm})")
    torch.testing.assert_close(q_in, before[0], rtol=0, atol=0)  # inputs are left untouched
    torch.testing.assert_close(k_in, before[1], rtol=0, atol=0)


def test_module_entry_point_matches_apply_rotary_layer():
    g = torch.Generator().manual_seed(3)
    q, k = _strided(4, 6, 2, 32, g, "packed")
    cos, sin = _cos_sin(4, 32, torch.float32)
    q_norm, k_norm = RMSNorm(32, eps=1e-6), RMSNorm(32, eps=1e-3)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5, generator=g)
        k_norm.weight.uniform_(0.5, 1.5, generator=g)
        ref = ApplyRotary()(q, k, cos, sin, q_norm, k_norm)
        ours = qk_norm_rope(q, k, cos, sin, q_norm, k_norm)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_grad_enabled_uses_differentiable_kernels():
    g = torch.Generator().manual_seed(4)
    q0, k0 = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    cos, sin = _cos_sin(3, 16, torch.float32)
    q_norm, k_norm = RMSNorm(16), RMSNorm(16)
    outs = []
    for fn in (qk_norm_rope, ApplyRotary()):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        rq, rk = fn(q * 1, k * 1, cos, sin, q_norm, k_norm)
        (rq.square().sum() + rk.sum()).backward()
        outs.append((rq.detach(), rk.detach(), q.grad, k.grad, q_norm.weight.grad.clone()))
        q_norm.weight.grad = k_norm.weight.grad = None
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_clear_errors():
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cos, sin = _cos_sin(2, 16, torch.float32)
    with pytest.raises(ValueError, match="even R <= head_dim"):
        qk_norm_rope_forward(q, k, *_cos_sin(2, 32, torch.float32))
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope_forward(q, k, cos, sin, torch.ones(16), None)
    with pytest.raises(ValueError, match=r"\[head_dim=16\]"):
        qk_norm_rope_forward(q, k, cos, sin, torch.ones(8), torch.ones(8))
    with pytest.raises(TypeError, match="must be an RMSNorm"):
        with torch.no_grad():
            qk_norm_rope(q, k, cos, sin, torch.nn.Identity(), torch.nn.Identity())


def test_hub_binds_it_for_inference_and_keeps_rotary_for_training():
    from cudaformers.errors import UnsupportedError
    from cudaformers.kernels.hub import KernelConfig, resolve

    assert resolve("rotary_pos_emb", "cuda", "inference", None) == ("cudaformers:qk_norm_rope", "default on cuda")
    assert resolve("rotary_pos_emb", "cuda", "training", None) == ("cudaformers:rotary", "default on cuda")
    with pytest.raises(UnsupportedError, match="no backward"):
        resolve("rotary_pos_emb", "cuda", "training", KernelConfig({"rotary_pos_emb": "cudaformers:qk_norm_rope"}))


def test_tiny_qwen3_with_the_kernel_matches_the_plain_model():
    import tiny
    from cudaformers import AutoModelForCausalLM
    from cudaformers.kernels.hub import KernelConfig

    folder = tiny.checkpoint("qwen3")
    plain = AutoModelForCausalLM.from_pretrained(folder)
    mapping = {"rotary_pos_emb": {"cpu": {"inference": "cudaformers:qk_norm_rope", "training": "cudaformers:rotary"}}}
    fast = AutoModelForCausalLM.from_pretrained(folder, kernel_config=KernelConfig(mapping, inherit_mapping=False))
    assert "qk_norm_rope" in fast.explain()
    ids = torch.randint(3, 211, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, plain(ids).logits, atol=1e-4, rtol=1e-4)
    fast.train()
    assert "cudaformers:rotary" in fast.explain()
