"""The skinny (5-32 rows by default, up to 128) tensor-core GEMM against F.linear: odd and
power-of-two shapes, all dtypes, bias, strided rows, split-K (deterministic, counters left at zero), the launch plan and the errors."""

import os

import pytest
import torch
import torch.nn.functional as F

import cudaformers.kernels.skinny_gemm as sg
from cudaformers.kernels.arrivals import arrival_counters
from cudaformers.errors import UnsupportedError
from cudaformers.kernels.skinny_gemm import SkinnyConfig, plan, skinny_applies, skinny_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(m, n, k, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed + m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


def _assert_close(got, x, w, b):
    """Against fp64: fp32 to 1e-5; half types to twice the error of F.linear in fp32 rounded to the
    dtype, plus one output ulp (the interpreter rounds fp32 -> half toward zero, GPUs to nearest)."""
    dtype = x.dtype
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    same = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    err = (got.double() - exact).abs().max()
    ulp = exact.abs().max() * {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(dtype, 0.0)
    tol = 1e-5 if dtype == torch.float32 else 2 * (same.double() - exact).abs().max() + ulp
    assert got.dtype == dtype and got.shape == exact.shape
    assert err <= tol, (err, tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(5, 37, 100), (8, 64, 256), (17, 130, 77), (32, 16, 513), (64, 48, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(m, n, k, dtype, bias):
    x, w, b = _inputs(m, n, k, dtype, bias)
    _assert_close(skinny_linear(x, w, b), x, w, b)


# block_m, block_n, block_k, k_split: several row tiles, uneven last split, a split of one step,
# ragged N and K (masked weights) and exact multiples (the unmasked EVEN path).
CONFIGS = [SkinnyConfig(16, 16, 32, 64), SkinnyConfig(16, 32, 16, 16), SkinnyConfig(32, 16, 64, 128),
           SkinnyConfig(64, 16, 32, 1024)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.k_split}")
@pytest.mark.parametrize("m,n,k", [(37, 48, 160), (9, 33, 150)])
def test_split_k_configs(cfg, m, n, k, dtype):
    x, w, b = _inputs(m, n, k, dtype, bias=True)
    got = skinny_linear(x, w, b, config=cfg)
    _assert_close(got, x, w, b)
    assert torch.equal(got, skinny_linear(x, w, b, config=cfg))  # fixed summation order
    assert not arrival_counters(x.device, 1).any()  # every tile counter reset for the next call


def test_without_counters_runs_unsplit_or_says_why(monkeypatch, caplog):
    """Where no arrival counters can be had (a first call inside a CUDA-graph capture) the planned
    launch runs unsplit, logged once; a config that asks for a split is refused, naming the fix."""
    monkeypatch.setattr(sg, "arrival_counters", lambda device, n: None)
    monkeypatch.setattr(sg, "_warned_capture", [])
    x, w, b = _inputs(9, 33, 600, torch.float32, bias=True)
    assert sg.plan(9, 33, 600, x.dtype, sg.sm_count(x.device)).k_split < 600  # the plan would split K
    with caplog.at_level("INFO", logger="cudaformers"):
        _assert_close(skinny_linear(x, w, b), x, w, b)
    assert "without split-K" in caplog.text
    with pytest.raises(ValueError, match="run one call outside the capture first"):
        skinny_linear(x, w, b, config=SkinnyConfig(16, 16, 32, 64))


def test_arrival_counters_grow_and_stay_zeroed():
    from cudaformers.kernels import arrivals

    dev = torch.device("cpu")
    first = arrival_counters(dev, 1)
    assert first.dtype == torch.int32 and first.numel() >= arrivals.MIN_COUNTERS and not first.any()
    assert arrival_counters(dev, first.numel()) is first  # one buffer for every launch that fits
    grown = arrival_counters(dev, first.numel() + 1)
    assert grown.numel() > first.numel() and not grown.any()
    assert any(r is first for r in arrivals._RETIRED)  # kept alive for graphs that captured it
    assert arrival_counters(dev, 1) is grown


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_of_a_packed_output(dtype):
    m, k, n = 12, 96, 40
    g = torch.Generator().manual_seed(3)
    packed = torch.randn(m, 3 * k, generator=g).to(DEVICE, dtype)
    x = packed[:, k:2 * k]  # e.g. the k part of a packed q/k/v projection output
    assert x.stride(0) == 3 * k and not x.is_contiguous()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    _assert_close(skinny_linear(x, w), x.contiguous(), w, None)


def test_leading_dims_and_empty():
    x, w, b = _inputs(12, 24, 40, torch.float32, bias=True)
    y = skinny_linear(x.view(3, 4, 40), w, b)
    assert y.shape == (3, 4, 24)
    _assert_close(y.view(12, 24), x, w, b)
    assert skinny_linear(x[:0], w, b).shape == (0, 24)


def test_applies():
    w = torch.randn(16, 32, device=DEVICE)
    rows = lambda m, **kw: skinny_applies(w, torch.randn(m, 32, device=DEVICE), **kw)  # noqa: E731
    with torch.no_grad():
        assert [rows(m) for m in (4, 5, 32, 33)] == [False, True, True, False]  # ROWS: where it beats cuBLAS
        assert rows(100, rows=(5, 128)) and not rows(6, rows=(8, 64))
        assert not skinny_applies(w, torch.randn(8, 32, device=DEVICE, dtype=torch.bfloat16))  # mixed dtypes
        assert not skinny_applies(w.t().contiguous().t(), torch.randn(8, 32, device=DEVICE))  # K not contiguous
    assert not skinny_applies(w.requires_grad_(), torch.randn(8, 32, device=DEVICE))  # autograd wanted


def test_errors(monkeypatch):
    x, w, b = _inputs(8, 16, 32, torch.float32, bias=True)
    with pytest.raises(ValueError, match="does not match the weight"):
        skinny_linear(x[:, :31], w)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, b[:3])
    with pytest.raises(UnsupportedError, match="one dtype"):
        skinny_linear(x.half(), w)
    with pytest.raises(UnsupportedError, match="no backward"):
        skinny_linear(x, w.clone().requires_grad_())
    with pytest.raises(ValueError, match="multiple of block_k"):
        skinny_linear(x, w, config=SkinnyConfig(16, 16, 32, 48))
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(UnsupportedError, match="runs on CUDA"):
            skinny_linear(x, w)


QWEN_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
               (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.parametrize("m", [5, 8, 32, 64, 128])
@pytest.mark.parametrize("n,k", QWEN_SHAPES)
def test_plan_on_an_h200(monkeypatch, n, k, m):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU plan, not the interpreter's small blocks
    sms = 132
    cfg = plan(m, n, k, torch.bfloat16, sms)
    steps = -(-k // cfg.block_k)
    splits = -(-k // cfg.k_split)
    programs = -(-n // cfg.block_n) * -(-m // cfg.block_m) * splits
    assert cfg.block_m >= min(m, 128) and cfg.k_split % cfg.block_k == 0 and splits <= steps
    # Per output feature: fp32 partials written (splits * block_m * 4 bytes) <= half its weight bytes (2k).
    assert splits * cfg.block_m * 4 <= k or splits == 1
    split_capped = splits * 2 > min(steps, k // (4 * cfg.block_m))
    # The SMs covered twice (a third at 17-32 rows, where fewer, longer programs measured
    # faster), unless splitting further costs too much; and no needless split.
    target = sms // 3 if cfg.block_m == 32 else 2 * sms
    assert programs >= target or split_capped
    assert -(-n // cfg.block_n) * -(-m // cfg.block_m) * (splits // 2) < target or splits == 1
    assert plan(m, n, k, torch.bfloat16, sms, split_ok=False).k_split >= k


# Compiles the kernel for an H100/H200 (sm_90) with Triton's bundled ptxas, no GPU needed: every
# launch plan the heuristic makes at the qwen3 shapes must fit in shared memory, and the PDL build
# must read only weights before waiting on the previous kernel. A subprocess, because the
# interpreter (on in this file) replaces the @triton.jit functions at import.
_AOT = r'''
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cudaformers.kernels import skinny_gemm as sg

variants = {}
for n, k in json.loads(sys.argv[1]):
    for m in (5, 8, 16, 32, 64, 128):
        for dtype in (torch.bfloat16, torch.float32):
            c = sg.plan(m, n, k, dtype, 132)
            split = triton.cdiv(k, c.k_split) > 1
            variants[("fp32" if dtype == torch.float32 else "bf16", c.block_m, c.block_n, c.block_k, split,
                      c.num_warps, c.num_stages)] = None
names = sg._skinny_kernel.arg_names
# The plain launch, and for bf16 the gated one (skinny_gated: SiLU epilogue) on the same plans.
for (dt, bm, bn, bk, split, warps, stages), act in [(v, a) for v in variants for a in (-1, 0)
                                                    if a < 0 or v[0] == "bf16"]:
    consts = dict(HAS_BIAS=True, SPLIT_K=split, EVEN=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  PREC="ieee" if dt == "fp32" else "tf32", UPCAST=False, USE_PDL=True, ACT=act)
    ptrs = dict(x_ptr=dt, w_ptr=dt, b_ptr=dt, y_ptr=dt, part_ptr="fp32", count_ptr="i32")
    sig = {a: "constexpr" if a in consts else "*" + ptrs[a] if a in ptrs else "i32" for a in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a not in consts}
    kernel = triton.compile(ASTSource(sg._skinny_kernel, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=stages))
    ptx = kernel.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    before = ptx[:wait]
    print(json.dumps(dict(variant=[dt, bm, bn, bk, split, warps, stages, act], shared=kernel.metadata.shared,
                          loads_before_wait=before.count("ld.global"), writes_before_wait=before.count("st.global")
                          + before.count("atom."), releases_after_wait="griddepcontrol.launch_dependents" in ptx[wait:])))
'''


def test_plans_compile_for_sm90():
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton install has no bundled ptxas")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", _AOT, json.dumps(QWEN_SHAPES)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) >= 8
    for r in results:
        assert r["shared"] <= 227 * 1024, r  # the most one program may use on sm_90
        assert r["loads_before_wait"] > 0 and r["writes_before_wait"] == 0 and r["releases_after_wait"], r


# skinny_gated: the gate/up projection and act_and_mul in one launch, bit for bit the two launches.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,i,k", [(5, 24, 40), (32, 64, 128), (17, 50, 130), (9, 16, 513)])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_equals_projection_then_act_and_mul(m, i, k, dtype, act):
    from cudaformers.kernels.activation import act_and_mul_forward
    from cudaformers.kernels.skinny_gemm import skinny_gated

    x, w, b = _inputs(m, 2 * i, k, dtype, bias=act == "gelu")
    gate_up = skinny_linear(x, w, b)
    assert torch.equal(skinny_gated(x, w, b, act), act_and_mul_forward(gate_up[:, :i], gate_up[:, i:], act))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.k_split}")
def test_gated_split_k_configs(cfg):
    from cudaformers.kernels.activation import act_and_mul_forward
    from cudaformers.kernels.skinny_gemm import skinny_gated

    x, w, b = _inputs(37, 2 * 40, 160, torch.bfloat16, bias=True)
    gate_up = skinny_linear(x, w, b, config=cfg)
    got = skinny_gated(x.view(37, 1, 160), w, b, "silu", config=cfg)
    assert got.shape == (37, 1, 40)
    assert torch.equal(got.view(37, 40), act_and_mul_forward(gate_up[:, :40], gate_up[:, 40:], "silu"))
    assert not arrival_counters(x.device, 1).any()


def test_gated_errors():
    from cudaformers.kernels.skinny_gemm import skinny_gated

    x, w, _ = _inputs(8, 15, 32, torch.float32, bias=False)
    with pytest.raises(ValueError, match="even rows"):
        skinny_gated(x, w)
    with pytest.raises(UnsupportedError, match="no fused kernel for hidden_act"):
        skinny_gated(x, w[:14], activation="relu")
