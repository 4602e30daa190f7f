"""The tensor-core dequantize-matmul (kernels/quant_mma.py) against dequantize-then-matmul.

The Triton kernel runs under the interpreter, which cannot run PTX: there it computes the planes with
plain ops. The PTX that the GPU runs instead is checked here by executing it, instruction by
instruction, on random words (``_run_ptx``, through tests/ptx_exec.py) and comparing with the same plane formula; the GPU tests
(tests/gpu/test_quant_gpu.py) then compare the compiled kernel with the reference.
"""

from __future__ import annotations

import pytest
import torch

from cudaformers import Int4Config, Int8Config
from cudaformers.kernels.quant_matmul import quant_matmul_reference
from cudaformers.kernels.quant_mma import _unpack_asm, quant_mma, supports
from cudaformers.quant.apply import quantize
from ptx_exec import half_value as _half_value
from ptx_exec import run_warp



def _run_ptx(asm: str, args: list[int]) -> dict[int, int]:
    """Execute the unpack's PTX for one lane; returns the output registers ``$i``."""
    return run_warp(asm, [args])[0]


@pytest.mark.parametrize("bits,fp16,zero", [(4, False, 8), (4, False, 0), (4, True, 8), (4, True, 0), (8, True, 128)])
def test_unpack_ptx_gives_the_planes(bits, fp16, zero):
    planes = 32 // bits
    asm = _unpack_asm(bits, fp16, zero)
    gen = torch.Generator().manual_seed(bits + zero)
    for a, b in torch.randint(0, 2 ** 32, (40, 2), generator=gen, dtype=torch.int64).tolist():
        outs = _run_ptx(asm, [0] * planes + [a, b])  # $0..$planes-1 are outputs, then the two words
        for j in range(planes):
            for half, word in enumerate((a, b)):
                code = (word >> (bits * j)) & ((1 << bits) - 1)
                if bits == 8:
                    code ^= 128  # two's complement byte -> q + 128
                got = _half_value((outs[j] >> (16 * half)) & 0xFFFF, fp16)
                assert got == code - zero, (j, half, hex(word))


def _layer(cfg, n, k, dtype, bias):
    holder = torch.nn.Sequential(torch.nn.Linear(k, n, bias=bias, dtype=dtype))
    torch.nn.init.normal_(holder[0].weight, std=0.05)
    return quantize(holder, cfg)[0]


# int8 runs on tensor cores for fp16 x only (test_refuses_what_it_does_not_serve)
CASES = [pytest.param(cfg, dtype, id=f"{name}-{str(dtype)[6:]}")
         for name, cfg in [("int4", Int4Config(group_size=128)), ("int4-zeros", Int4Config(group_size=128, sym=False)),
                           ("int4-g256", Int4Config(group_size=256)), ("int8", Int8Config())]
         for dtype in (torch.bfloat16, torch.float16) if name != "int8" or dtype == torch.float16]


@pytest.mark.parametrize("cfg,dtype", CASES)
@pytest.mark.parametrize("n,k,m", [(40, 256, 1), (33, 200, 3), (16, 384, 16), (17, 130, 7)])
def test_quant_mma_matches_dequantize_then_matmul(n, k, m, cfg, dtype):
    layer = _layer(cfg, n, k, dtype, bias=m % 2 == 1)
    w = layer.packed()
    x = torch.randn(m, k, dtype=dtype)
    assert supports(x, w)
    expected = quant_matmul_reference(x.double(), _as_double(w), None if layer.bias is None else layer.bias.double())
    out = quant_mma(x, w, layer.bias)
    assert out.dtype == dtype and out.shape == (m, n)
    # the products are exact and summed in fp32: only the output's rounding remains (to nearest on
    # the GPU; the interpreter truncates to bf16), within one unit in the last place of each element
    assert (out.double() - expected).abs().le(_ulp(expected, dtype) * 1.01 + 1e-6 * expected.abs().max()).all()


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tiny = torch.finfo(dtype).tiny
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(tiny))))


def _as_double(w):
    from dataclasses import replace

    return replace(w, scales=w.scales.double(), zeros=None if w.zeros is None else w.zeros.double())


def test_refuses_what_it_does_not_serve():
    layer = _layer(Int4Config(group_size=64), 16, 128, torch.bfloat16, bias=False)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    assert not supports(x, layer.packed())  # a 64-code group makes 8-word planes, narrower than a dot
    with pytest.raises(ValueError, match="not served here"):
        quant_mma(x, layer.packed())
    big = _layer(Int4Config(group_size=128), 16, 128, torch.bfloat16, bias=False)
    assert not supports(torch.randn(17, 128, dtype=torch.bfloat16), big.packed())
    assert not supports(torch.randn(1, 128), big.packed())
    int8 = _layer(Int8Config(), 16, 128, torch.bfloat16, bias=False)
    assert not supports(x, int8.packed())  # int8 codes need fp16 products
    assert supports(x.half(), int8.packed())


@pytest.mark.parametrize("groups,split", [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (1, 3), (1, 5), (2, 4)])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_blocks_per_step_and_splits_any_count(groups, split, fmt):
    """Several blocks per step and the blocks split over programs, including counts that do not divide
    the blocks (5 of 128 codes; int8: 10 of 64), then a second call (the arrival counters reset)."""
    cfg = Int4Config(group_size=128) if fmt == "int4" else Int8Config()
    layer = _layer(cfg, 40, 600, torch.float16, bias=True)
    w = layer.packed()
    for seed in range(2):
        x = torch.randn(3, 600, dtype=torch.float16, generator=torch.Generator().manual_seed(seed))
        expected = quant_matmul_reference(x.double(), _as_double(w), layer.bias.double())
        out = quant_mma(x, w, layer.bias, tiles=(16, groups, split, 1, 2))
        assert (out.double() - expected).abs().le(_ulp(expected, torch.float16) * 1.01 + 1e-6).all()


def test_unsplit_fallback_when_counters_cannot_be_made(monkeypatch):
    """Inside a CUDA-graph capture that would have to make the arrival counters the launch runs unsplit:
    the same result, with step overhang masked (3 blocks of 128 codes in steps of 2)."""
    import cudaformers.kernels.quant_mma as qmma

    monkeypatch.setattr(qmma, "arrival_counters", lambda device, n: None)
    layer = _layer(Int4Config(group_size=128), 24, 384, torch.float16, bias=False)
    w = layer.packed()
    x = torch.randn(2, 384, dtype=torch.float16)
    expected = quant_matmul_reference(x.double(), _as_double(w))
    out = quant_mma(x, w, tiles=(16, 2, 4, 1, 2))
    assert (out.double() - expected).abs().le(_ulp(expected, torch.float16) * 1.01 + 1e-6).all()


def test_one_row_against_long_weight_rows_takes_its_own_default():
    """At M = 1 a layer of 64 blocks or more a row gets four blocks a step over four splits (the
    down-projection tiling); at M = 2 the general rule; the default launch is right at M = 1."""
    from cudaformers.kernels.quant_mma import default_tiles

    cpu = torch.device("cpu")
    assert default_tiles(4096, 96, cpu, 1) == (32, 4, 4, 2, 3)
    assert default_tiles(4096, 96, cpu, 2)[1:3] != (4, 4)
    assert default_tiles(4096, 32, cpu, 1)[1] == 2
    layer = _layer(Int4Config(group_size=128), 40, 64 * 128, torch.bfloat16, bias=False)
    w = layer.packed()
    x = torch.randn(1, 64 * 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    expected = quant_matmul_reference(x.double(), _as_double(w))
    out = quant_mma(x, w)
    assert (out.double() - expected).abs().le(_ulp(expected, torch.bfloat16) * 1.01 + 1e-6).all()


def test_one_row_with_too_few_programs_goes_to_the_fma_gemv(monkeypatch):
    """At one row the tensor-core kernel is used only where its tiling makes two programs per SM (8
    SMs stand for a CPU): 40 rows make 2 programs and go to the FMA GEMV; 600 rows make 19 and come
    here; at two rows it is always here."""
    import cudaformers.kernels.quant_mma as qmma
    from cudaformers.kernels import quant_matmul as qm

    launched = []
    real = qmma.quant_mma
    monkeypatch.setattr(qmma, "quant_mma", lambda *a, **k: (launched.append(a[1].out_features), real(*a, **k))[1])
    for n, rows, here in ((40, 1, False), (600, 1, True), (40, 2, True)):
        w = _layer(Int4Config(group_size=128), n, 256, torch.bfloat16, bias=False).packed()
        x = torch.randn(rows, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(n))
        assert qmma.preferred(x, w) is here
        launched.clear()
        out = qm.quant_matmul_triton(x, w)
        assert launched == ([n] if here else [])
        expected = quant_matmul_reference(x.double(), _as_double(w))
        assert (out.double() - expected).abs().le(_ulp(expected, torch.bfloat16) * 2.01 + 1e-6).all()
