"""The accuracy rule every kernel test applies, and a check that the rule can fail.

fp32: the kernel equals the fp32 reference to 1e-5. bf16/fp16: the kernel's error against the fp32
reference is at most twice the error of the same-dtype reference. The Triton interpreter rounds
fp32 -> bf16 casts toward zero where GPUs round to nearest, so under TRITON_INTERPRET one more bf16
ulp of the value is allowed for bf16; GPU runs get the strict rule.
"""

import os

import torch


def assert_matches(out, ref_same_dtype, ref_fp32, what: str = "", dtype=None) -> None:
    """``dtype``: the precision the computation ran in (defaults to the output's)."""
    dtype = dtype or out.dtype
    out, ref_same_dtype, ref_fp32 = out.float(), ref_same_dtype.float(), ref_fp32.float()
    assert out.shape == ref_fp32.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref_fp32.shape)}"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_fp32, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
        return
    budget = 2 * (ref_same_dtype - ref_fp32).abs().max().item() + 1e-6
    err = (out - ref_fp32).abs()
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        err = (err - ref_fp32.abs() * 2 ** -7).clamp(min=0)
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= budget, f"{what}: max error {worst:.3g} > 2x same-dtype reference error {budget:.3g}"


def test_rule_rejects_a_wrong_result():
    ref = torch.randn(64)
    half = ref.half()
    assert_matches(half, half, ref)
    try:
        assert_matches((ref * 1.01).half(), half, ref)
    except AssertionError:
        return
    raise AssertionError("a 1% error passed the half-precision rule")
