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
import triton  # noqa: E402

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


@pytest.mark.parametrize("method", ["int8", "int4_sym", "int4_asym", "nf4", "fp4_dq", "fp8"])
def test_quantizing_in_pieces_of_rows_gives_the_same_parameters(monkeypatch, method):
    from cudaformers.quant import fp8, int4, int8, linear, nf4

    args = (200, 77, False, torch.bfloat16)  # 77 rows: pieces of 10 leave a remainder
    module, quantizer, make = {
        "int8": (int8, "quantize_int8", lambda: int8.Int8Linear(*args)),
        "int4_sym": (int4, "quantize_int4", lambda: int4.Int4Linear(*args, 128, True)),
        "int4_asym": (int4, "quantize_int4", lambda: int4.Int4Linear(*args, 128, False)),
        "nf4": (nf4, "quantize_4bit", lambda: nf4.NF4Linear(*args, "nf4", False)),
        "fp4_dq": (nf4, "quantize_4bit", lambda: nf4.NF4Linear(*args, "fp4", True)),
        "fp8": (fp8, "quantize_fp8_rows", lambda: fp8.FP8Linear(*args))}[method]
    w = torch.randn(77, 200, generator=torch.Generator().manual_seed(3)).bfloat16()
    whole, pieces = make(), make()
    whole.quantize_(w)
    rows, real = [], getattr(module, quantizer)
    monkeypatch.setattr(module, quantizer, lambda t, *a: rows.append(t.shape[0]) or real(t, *a))
    monkeypatch.setattr(linear, "ROWS_ELEMENTS", 200 * 10)
    pieces.quantize_(w)
    assert rows == [10] * 7 + [7]
    for (name, a), (_, b) in zip(whole.named_parameters(), pieces.named_parameters()):
        assert torch.equal(a, b), name


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


# -- the M = 1 GEMV (quant_gemv.py) over its tilings, and the fp8 GEMV --------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tiles", [(1, 1, 1), (2, 2, 1), (8, 4, 2)], ids=str)
@pytest.mark.parametrize("k", [320, 512], ids=lambda k: f"k{k}")  # 320: masked tail; 512: whole steps
def test_gemv_tilings_with_bias(fmt, tiles, k):
    """Several K steps per program (the loop after the first, pre-wait tile), 1-8 rows a program."""
    from cudaformers.kernels.quant_gemv import quant_gemv

    g = torch.Generator().manual_seed(k + tiles[0])
    w = packed(fmt, torch.randn(29, k, generator=g))
    x, bias = torch.randn(1, k, generator=g).to(torch.bfloat16), torch.randn(29, generator=g).to(torch.bfloat16)
    out = quant_gemv(x, w, bias, tiles=tiles)
    assert out.dtype == torch.bfloat16
    ref32 = qm.quant_matmul_reference(x.float(), w, bias.float())
    ref_lp = qm.quant_matmul_reference(x, w, bias).float()
    bound = 2 * (ref_lp - ref32).abs().max().item() + 2 * torch.finfo(torch.bfloat16).eps * ref32.abs().max().item()
    assert (out.float() - ref32).abs().max().item() <= bound


def test_gemv_handles_large_and_zero_activations():
    """The activations are pre-scaled by up to 2**85 inside the kernel: large, tiny and zero inputs stay exact."""
    w = packed("int4_sym", torch.randn(16, 256, generator=torch.Generator().manual_seed(11)))
    x = torch.tensor([[3e4, -1e-30, 0.0, 1.0] * 64])
    torch.testing.assert_close(qm.quant_matmul_triton(x, w), qm.quant_matmul_reference(x, w), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nk", [(37, 200), (64, 4096), (8, 2500)], ids=str)
def test_fp8_gemv_matches_weight_only_reference(nk, dtype):
    from cudaformers.kernels.quant_gemv import fp8_gemv
    from cudaformers.quant.fp8 import quantize_fp8_rows

    n, k = nk
    g = torch.Generator().manual_seed(n + k)
    q, s = quantize_fp8_rows(torch.randn(n, k, generator=g))
    x, bias = torch.randn(1, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    out = fp8_gemv(x, q, s[:, 0].contiguous(), bias)
    ref = x.float() @ (q.float() * s).t() + bias.float()
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert out.dtype == dtype and (out.float() - ref).abs().max().item() <= tol * ref.abs().max().item() + 1e-6


# -- what the GPU compiler makes of the GEMV (sm90 PTX, compiled here without a GPU) ------------------
def _gemv_ptx() -> dict:
    """In a subprocess (compiled Triton, not the interpreter): each format's GEMV as launched for a
    qwen3-8b layer, compiled for sm90; returns its global loads/stores and grid-dependency events."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", "from tests.test_quant_kernels import _probe_gemv; _probe_gemv()"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _probe_gemv() -> None:
    import json

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cudaformers.kernels import quant_gemv as qg

    types = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
             torch.int8: "*i8", torch.uint8: "*u8"}
    qg.pdl_enabled = lambda device: True  # the CPU tensors stand in for a Hopper GPU
    w = torch.randn(64, 4096) * 0.02
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    out = {}
    for fmt in ("int8", "int4_sym", "int4_asym", "nf4", "fp4_dq", "fp8"):
        launches = []
        name = "_fp8_gemv_kernel" if fmt == "fp8" else "_gemv_kernel"
        kernel = getattr(qg, name)
        setattr(qg, name, type("Recorder", (), {"__getitem__": lambda self, grid: lambda *a, **kw: launches.append(
            (a, kw))})())
        try:
            if fmt == "fp8":
                qg.fp8_gemv(x, w.to(torch.float8_e4m3fn), torch.ones(64))
            else:
                qg.quant_gemv(x, packed(fmt, w))
        finally:
            setattr(qg, name, kernel)
        (args, kwargs), = launches
        names = [p.name for p in kernel.params]
        values = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
        signature, constexprs, attrs = {}, {}, {}
        for i, p in enumerate(kernel.params):
            v = values[p.name]
            if p.is_constexpr:
                signature[p.name], constexprs[p.name] = "constexpr", v
                continue
            signature[p.name] = types[v.dtype] if isinstance(v, torch.Tensor) else ("fp32" if isinstance(v, float)
                                                                                     else "i32")
            if isinstance(v, torch.Tensor) or (isinstance(v, int) and v % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]  # what Triton's launcher specializes on
        options = {k: v for k, v in kwargs.items() if k not in names}
        ptx = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                             options=options).asm["ptx"]
        events = []
        for line in ptx.splitlines():
            op = line.strip().lstrip("@!%p0123456789 ").split(" ")[0].rstrip(";")
            if op.startswith(("griddepcontrol.", "ld.global", "st.global", "atom.global", "red.global")):
                events.append(op)
        out[fmt] = {"events": events, "launch_pdl": kwargs.get("launch_pdl")}
    print(json.dumps(out))


@pytest.fixture(scope="module")
def gemv_ptx():
    return _gemv_ptx()


@pytest.mark.parametrize("fmt", ["int8", "int4_sym", "int4_asym", "nf4", "fp4_dq", "fp8"])
def test_gemv_compiles_to_one_pdl_launch_with_vector_weight_loads(gemv_ptx, fmt):
    """PDL contract (kernels/pdl.py) and the streaming loads: before the wait only loads of the weights
    (16-byte words, scales, zero points), no stores and no x (one load per code plane; fp8 reads x 16 bytes
    at a time, like its weights, so there the order is all this checks); one
    release right after the wait; 16-byte weight loads; no atomics."""
    events, launch_pdl = gemv_ptx[fmt]["events"], gemv_ptx[fmt]["launch_pdl"]
    assert launch_pdl is True
    wait = events.index("griddepcontrol.wait")
    before, after = events[:wait], events[wait:]
    assert before and all(e.startswith("ld.global") for e in before), before
    assert "ld.global.v4.b32" in before, f"{fmt}: the first weight tile is not requested before the wait: {before}"
    # x is one load per code plane (4 for int8, 8 for 4-bit codes); scales and zero points are at most two
    # narrower loads, the only ones besides the weight words that may come first.
    narrow = [e for e in before if e != "ld.global.v4.b32"]
    assert len(narrow) <= 2, f"{fmt}: x loaded before the wait: {before}"
    assert events.count("griddepcontrol.wait") == 1 and events.count("griddepcontrol.launch_dependents") == 1
    assert after[1] == "griddepcontrol.launch_dependents"
    assert not [e for e in events if e.startswith(("atom", "red"))], "no atomics: one launch, deterministic"
    assert [e for e in after if e.startswith("st.global")], "the output is stored after the wait"
