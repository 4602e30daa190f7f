"""The dequantize-matmul Triton kernels against their PyTorch reference, in the Triton interpreter on
CPU, and the quantizers' own guarantees (round trips, error bounds, nearest codes).

Low-precision tolerance: the kernel's error against the fp32 reference may be at most twice that of
the reference computed in the low-precision dtype (dequantize to it, then matmul), plus one unit in
the last place of the output (both round their fp32 sums once, not always the same way).
"""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "cudaformers.kernels.quant_matmul" in sys.modules:  # imported earlier without the interpreter
        importlib.reload(sys.modules["cudaformers.kernels.quant_matmul"])

import pytest  # noqa: E402

from cudaformers.kernels import quant_matmul as qm  # noqa: E402
from cudaformers.quant.int4 import quantize_int4  # noqa: E402
from cudaformers.quant.int8 import quantize_int8  # noqa: E402
from cudaformers.quant.nf4 import CODES, FP4_CODE, NF4_CODE, double_quantize, nearest_code, quantize_4bit  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FORMATS = ["int8", "int4_sym", "int4_asym", "nf4", "fp4_dq"]


def packed(fmt: str, w: torch.Tensor, group: int = 64) -> qm.PackedWeight:
    k = w.shape[1]
    if fmt == "int8":
        q, s = quantize_int8(w)
        return qm.PackedWeight("int8", q, s, k)
    if fmt.startswith("int4"):
        q, s, z = quantize_int4(w, group, sym=fmt == "int4_sym")
        return qm.PackedWeight("int4", q, s, k, group, zeros=z)
    q, absmax = quantize_4bit(w, fmt[:3])
    code = torch.tensor(CODES[fmt[:3]])
    if fmt.endswith("_dq"):
        q2, s2, offset = double_quantize(absmax)
        return qm.PackedWeight("lut4", q, q2, k, 64, code=code, scales2=s2, offset=float(offset))
    return qm.PackedWeight("lut4", q, absmax, k, 64, code=code)


def _check(out, x, w, dtype, what):
    ref32 = qm.quant_matmul_reference(x.float(), w)
    err = (out.float() - ref32).abs().max().item()
    if dtype == torch.float32:
        bound = 1e-4 * max(1.0, ref32.abs().max().item())
    else:
        ref_lp = qm.quant_matmul_reference(x, w).float()
        ulp = torch.finfo(dtype).eps * ref32.abs().max().item()  # the output's own rounding may differ
        bound = 2 * (ref_lp - ref32).abs().max().item() + ulp + 1e-2
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


# (M, N, K): M = 1 takes the GEMV, M > 1 the tl.dot kernel; odd N and K are masked (K padded to the
# packing block inside the packed weight).
SHAPES = [(1, 64, 128), (1, 37, 200), (1, 19, 130), (2, 32, 256), (5, 50, 130), (16, 64, 256), (33, 24, 64),
          (70, 40, 96)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference(shape, fmt, dtype):
    m, n, k = shape
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = packed(fmt, torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    out = qm.quant_matmul_triton(x, w)
    assert out.dtype == dtype and out.shape == (m, n)
    _check(out, x, w, dtype, f"{fmt} {shape}")


@pytest.mark.parametrize("group", [32, 128])
def test_int4_group_sizes_and_bias(group):
    g = torch.Generator().manual_seed(1)
    w = packed("int4_asym", torch.randn(48, 384, generator=g), group)
    x, bias = torch.randn(5, 384, generator=g), torch.randn(48, generator=g)
    out = qm.quant_matmul_triton(x, w, bias)
    torch.testing.assert_close(out, qm.quant_matmul_reference(x, w, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["int8", "int4_sym", "nf4"])
def test_backward_through_quantized_layer(fmt, dtype):
    """dL/dx of the quantized Linear (Triton forward in the interpreter) equals the reference's."""
    from cudaformers.quant.int4 import Int4Linear
    from cudaformers.quant.int8 import Int8Linear
    from cudaformers.quant.nf4 import NF4Linear

    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 128, generator=g)
    layer = {"int8": lambda: Int8Linear(128, 40, False, dtype), "int4_sym": lambda: Int4Linear(128, 40, False, dtype, 64),
             "nf4": lambda: NF4Linear(128, 40, False, dtype)}[fmt]()
    layer.quantize_(w)
    layer.matmul = lambda x: qm.quant_matmul_triton(x, layer.packed())  # the GPU path, interpreted
    x = torch.randn(3, 7, 128, generator=g).to(dtype).requires_grad_(True)
    dy = torch.randn(3, 7, 40, generator=g).to(dtype)
    layer(x).backward(dy)
    x_ref = x.detach().float().requires_grad_(True)
    (x_ref @ layer.dequantize(torch.float32).t()).backward(dy.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * x_ref.grad.abs().max().item()
    assert (x.grad.float() - x_ref.grad).abs().max().item() <= tol


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (5, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    for group in (16, 32, 64, 128):
        packed_ = qm.pack_4bit(codes, group)
        assert packed_.shape == (5, 128)
        assert torch.equal(qm.unpack_4bit(packed_, group), codes)
    q = torch.randint(-127, 128, (3, 128), dtype=torch.int8, generator=torch.Generator().manual_seed(8))
    assert torch.equal(qm.unpack_planes(qm.pack_planes(q, 64, 8), 64, 8), q)


@pytest.mark.parametrize("bits, block", [(4, 128), (4, 64), (8, 64)])
def test_plane_layout(bits, block):
    """Code j of little-endian int32 word w of a block is element j * W + w (W words per block)."""
    per, width = 32 // bits, block * bits // 32
    codes = torch.randint(0, 1 << bits, (2, 2 * block), generator=torch.Generator().manual_seed(9))
    words = qm.pack_planes(codes.to(torch.int8 if bits == 8 else torch.uint8), block, bits).view(torch.int32)
    for b in range(2):
        for w in range(width):
            word = words[1, b * width + w].item() & 0xFFFFFFFF
            for j in range(per):
                code = (word >> (j * bits)) & ((1 << bits) - 1)
                assert code == codes[1, b * block + j * width + w].item() & ((1 << bits) - 1)


def test_int8_error_is_half_a_step():
    w = torch.randn(33, 77, generator=torch.Generator().manual_seed(4))
    q, s = quantize_int8(w)
    codes = qm.unpack_planes(q, 64, 8)
    assert q.shape == (33, 128) and not codes[:, 77:].any()  # padded to a whole block of 64
    assert (codes[:, :77].float() * s[:, None] - w).abs().le(s[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("sym", [True, False])
def test_int4_error_is_half_a_step(sym):
    w = torch.randn(9, 200, generator=torch.Generator().manual_seed(3))  # K padded to 256: no leaks
    q, s, z = quantize_int4(w, 64, sym)
    deq = qm.dequantize(qm.PackedWeight("int4", q, s, 200, 64, zeros=z))
    step = s.float().repeat_interleave(64, 1)[:, :200]
    assert deq.shape == w.shape
    # Half a step, plus what the fp16 rounding of the scale does at the ends of the range (15 codes).
    assert (deq - w).abs().le(step / 2 + 15 * 2 ** -11 * step).all()


@pytest.mark.parametrize("code", [NF4_CODE, FP4_CODE], ids=["nf4", "fp4"])
def test_lut_codes_are_nearest(code):
    code = torch.tensor(code)
    x = torch.rand(1000, generator=torch.Generator().manual_seed(5)) * 2 - 1
    idx = nearest_code(x, code)
    best = (x[:, None] - code[None, :]).abs().min(1).values
    assert torch.allclose((x - code[idx]).abs(), best)


def test_double_quantization_keeps_absmax_close():
    absmax = torch.rand(37, 11, generator=torch.Generator().manual_seed(6)) + 0.5
    q2, s2, offset = double_quantize(absmax)
    w = qm.PackedWeight("lut4", torch.zeros(37, 11 * 32, dtype=torch.uint8), q2, 11 * 64, 64, scales2=s2,
                        offset=float(offset))
    rebuilt = qm.group_scales(w)
    assert (rebuilt - absmax).abs().max().item() <= s2.max().item() / 2 + 1e-6
