"""The fragment GEMV (kernels/quant_gemv_mma.py, kernels/quant_fragments.py) on the CPU: its PTX for
one int4 or int8 block run lane by lane through tests/ptx_exec.py (mma with the ISA's m16n8k16 fragment
layouts) against the plain dot product over the plane packing, and the kernel built for sm_90. The
GPU run against ``quant_matmul_reference`` is tests/gpu/test_quant_gpu.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

from cudaformers.kernels.quant_fragments import int4_block_asm as _block_asm
from cudaformers.kernels.quant_fragments import int8_block_asm
from cudaformers.kernels.quant_matmul import pack_planes
from ptx_exec import emulate_inline_asm, run_warp


def _i64(values: list[int], bits: int) -> int:
    return sum((v & ((1 << bits) - 1)) << (bits * i) for i, v in enumerate(values))


def _block_case(seed: int, tiles: int, asm: str):
    """(each lane's outputs of ``asm``, the dots of the 16 * tiles rows, the sum of x) for one random block."""
    g = torch.Generator().manual_seed(seed)
    rows = 16 * tiles
    codes = torch.randint(0, 16, (rows, 128), generator=g)
    if seed == 1:
        codes[3] = 15  # extremes: every code of a row at the top or the bottom
        codes[rows - 5] = 0
    x = torch.randn(128, generator=g).bfloat16()
    words = pack_planes(codes, 128, 4).view(torch.int32).reshape(rows, 16).tolist()  # [row, word]
    xbits = x.view(torch.int16).tolist()
    inputs = []
    for lane in range(32):  # what the kernel's loads put in each lane
        gg, t = lane // 4, lane % 4
        mine = [gg + 8 * i for i in range(2 * tiles)]  # rows g, g + 8 (g + 16, g + 24)
        ins = [_i64(words[r][4 * t + h: 4 * t + h + 2], 32) for r in mine for h in (0, 2)]
        inputs.append(ins + [_i64(xbits[16 * j + 4 * t: 16 * j + 4 * t + 4], 16) for j in range(8)])
    xf = x.double()
    n_out = 2 * tiles + 1
    outs = run_warp(asm, [[0] * n_out + ins for ins in inputs])
    return [[o[i] for i in range(n_out)] for o in outs], ((codes.double() + 128) * xf).sum(1), float(xf.sum())


def _matches(out, want, xsum) -> bool:
    close = lambda a, b: abs(a - b) <= 1e-9 + 1e-12 * abs(b)  # noqa: E731
    return all(close(s, xsum) and all(close(d, float(want[lane // 4 + 8 * i])) for i, d in enumerate(dots))
               for lane, (*dots, s) in enumerate(out))


@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_ptx_is_the_dot_product_over_the_plane_packing(seed, tiles):
    assert _matches(*_block_case(seed, tiles, _block_asm(tiles)))


@pytest.mark.parametrize("change", [("mov.b64 {w0_0, w0_1}, $3;", "mov.b64 {w0_1, w0_0}, $3;"),  # two words
                                    ("0x7632;", "0x5410;"),  # the wrong halves of x
                                    ("{pa, pb, pc, pd}", "{pa, pc, pb, pd}"),  # fragment registers out of order
                                    ("$1, c0_2", "$1, c0_1")])  # the wrong accumulator out
def test_the_check_catches_a_wrong_block(change):
    assert change[0] in _block_asm(1)
    assert not _matches(*_block_case(0, 1, _block_asm(1).replace(*change)))


def test_the_check_catches_a_wrong_second_tile():
    asm = _block_asm(2)
    assert "mov.b64 {v1_2, v1_3}, $12;" in asm
    assert not _matches(*_block_case(0, 2, asm.replace("mov.b64 {v1_2, v1_3}, $12;", "mov.b64 {v1_3, v1_2}, $12;")))


def _int8_case(seed: int, tiles: int, asm: str):
    """(each lane's outputs of ``asm``, the running sums plus the dots of the 16 * tiles rows)."""
    g = torch.Generator().manual_seed(seed)
    rows = 16 * tiles
    q = torch.randint(-128, 128, (rows, 64), generator=g)
    if seed == 1:
        q[3], q[rows - 5], q[rows - 1] = 127, -128, 0  # extremes
    x = torch.randn(64, generator=g).bfloat16()
    sums = torch.randn(rows, generator=g).double()
    words = pack_planes(q, 64, 8).view(torch.int32).reshape(rows, 16).tolist()
    xbits = x.view(torch.int16).tolist()
    inputs = []
    for lane in range(32):
        gg, t = lane // 4, lane % 4
        mine = [gg + 8 * i for i in range(2 * tiles)]
        inputs.append([0] * (2 * tiles) + [float(sums[r]) for r in mine]
                      + [_i64(words[r][4 * t + h: 4 * t + h + 2], 32) for r in mine for h in (0, 2)]
                      + [_i64(xbits[16 * j + 4 * t: 16 * j + 4 * t + 4], 16) for j in range(4)])
    outs = run_warp(asm, inputs)
    return [[o[i] for i in range(2 * tiles)] for o in outs], sums + (q.double() * x.double()).sum(1)


def _int8_matches(out, want) -> bool:
    return all(abs(d - float(want[lane // 4 + 8 * i])) <= 1e-9 for lane, dots in enumerate(out)
               for i, d in enumerate(dots))


@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_block_ptx_adds_the_signed_dot_product(seed, tiles):
    assert _int8_matches(*_int8_case(seed, tiles, int8_block_asm(tiles)))


@pytest.mark.parametrize("change", [("0xC300C300", "0x43004300"),  # the sign bit read as +128 / +256
                                    ("shr.u32 sh, w0_0, 8;", "shr.u32 sh, w0_0, 16;"),  # bytes 1 and 3 misplaced
                                    ("{be, bo}", "{bo, be}"),  # x at the wrong elements
                                    ("$1, c0_2", "$1, c0_0")])  # the wrong row out
def test_the_check_catches_a_wrong_int8_block(change):
    assert change[0] in int8_block_asm(1)
    assert not _int8_matches(*_int8_case(0, 1, int8_block_asm(1).replace(*change)))


_COMPILE = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cudaformers.kernels import quant_gemv_mma as m
sig = dict(x_ptr="*i64", q_ptr="*i64", s_ptr="*bf16", z_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", n_blocks="i32",
           ld_q="i32", half="i32", FMT="constexpr", WARPS="constexpr", TILES="constexpr", DEPTH="constexpr",
           HAS_ZEROS="constexpr", HAS_BIAS="constexpr", EVEN="constexpr", GATED="constexpr", USE_PDL="constexpr",
           WIDE="constexpr", STAGED="constexpr", PIN="constexpr")
# (fmt, zero points and bias, tiles, depth, gated, staged, pinned)
for fmt, zeros, tiles, depth, gated, staged, pin in (
        (0, False, 1, 1, -1, 0, 0), (0, True, 1, 2, -1, 0, 0), (0, True, 2, 3, -1, 0, 0), (1, False, 1, 2, -1, 0, 0),
        (1, False, 2, 1, -1, 0, 0), (1, False, 2, 3, -1, 0, 0), (0, True, 2, 1, 0, 0, 0), (0, False, 1, 2, 1, 0, 0),
        (1, False, 1, 3, 0, 0, 0), (1, True, 2, 2, 2, 0, 0), (0, False, 2, 2, 0, 1, 0), (1, False, 1, 2, -1, 2, 0),
        (0, True, 1, 2, -1, 0, 1), (0, False, 2, 1, 0, 0, 2), (1, False, 1, 3, -1, 0, 2), (0, True, 2, 1, 0, 0, 3),
        (1, False, 1, 3, -1, 0, 3)):
    src = ASTSource(m._kernel, dict(sig, s_ptr="*fp32" if fmt else "*bf16"),
                    dict(FMT=fmt, WARPS=8, TILES=tiles, DEPTH=depth, HAS_ZEROS=zeros, HAS_BIAS=zeros,
                         EVEN=(zeros or tiles == 2) and not staged and not pin, GATED=gated, USE_PDL=True,
                         WIDE=tiles == 2 or pin > 0, STAGED=staged, PIN=pin),
                    {(i,): [["tt.divisibility", 16]] for i in range(9)})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    ptx = c.asm["ptx"]
    print(fmt, tiles, depth, gated, staged, pin, int(zeros), ptx.count("mma.sync.aligned.m16n8k16"), ptx.count("st.shared"),
          ptx.count("ex2.approx"), ptx.count("cp.async.cg.shared.global"), ptx.count("fence.acq_rel.cta"),
          ptx.count("ld.global.L1::no_allocate.v2.u64"), ptx.count("ld.relaxed.cta.global.L1::no_allocate.v2.u64"),
          ptx.count("ld.relaxed.cta.global.b16"), len(c.asm["cubin"]))
"""


def test_the_kernel_builds_for_hopper_with_mma_from_registers():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600,
                          cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()[-17:]
    assert len(lines) == 17
    for line in lines:
        (fmt, tiles, depth, gated, staged, pin, zeros, mmas, shared_stores, exps, async_copies, fences, coherent, relaxed,
         relaxed_scales, cubin) = map(int, line.split())
        # Per block int4 has 8 mma per tile and 8 for the sum of x, int8 two per word and tile. In registers
        # a block is inlined in the loop (unrolled ``depth`` times, ``depth + 1`` pinned on the coherent
        # path, plus its remainder loop) and once after it, and the loop moves nothing through shared memory
        # (only the final sums over warps do). Staged, the pipeliner keeps one copy of the block and copies
        # each row's 16 bytes a lane into shared memory ahead: ``depth`` stages before the loop and one in
        # it. Pinned, each block in the loop has its fence; ordered (pin 3) none, its loads relaxed instead
        # (int4's scales with them: 2 rows a tile, and zero points where there are some). Gated, SiLU and
        # tanh GELU are one exponential for each of a lane's output rows (one a tile); erf has its own.
        unroll = depth + 1 if pin >= 2 else depth
        in_loop = unroll + 1 if unroll > 1 else 1
        copies = 1 if staged else in_loop + 1
        assert mmas == (8 * tiles if fmt else 8 * (tiles + 1)) * copies and cubin > 0
        assert async_copies == (2 * tiles * (depth + 1) if staged else 0)
        assert fences == (in_loop if pin in (1, 2) else 0)
        # coherent loads: the blocks before the loop, and each block's ahead in it (2 rows a tile)
        assert coherent == (2 * tiles * (depth + in_loop) if pin == 2 else 0)
        assert relaxed == (2 * tiles * (depth + in_loop) if pin == 3 else 0)
        assert relaxed_scales == (2 * tiles * (depth + in_loop) * (1 + zeros) if pin == 3 and fmt == 0 else 0)
        assert shared_stores <= 4 * tiles  # (triton 3.6: 2, 3.9: 1)
        assert exps == 0 if gated == -1 else (exps > 0 if gated == 2 else exps == tiles)


def test_pinned_and_ordered_loads_run_about_as_far_ahead_as_asked_in_sass():
    """ptxas schedules the loads again: in registers it sinks the blocks ahead to a fraction of a block
    before their use. Past a fence on the coherent path, with the loop unrolled so no block's words move
    between registers, sm_90 SASS issues each load ``depth`` whole blocks of work (mmas) before its value
    is read (``bench/sass_schedule.py`` reads the cubin). Ordered (relaxed loads, no fence) ptxas may
    interleave the loads ahead with the first mmas of the block in hand: at least half of ``depth``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    variants = "8,2,1,c;8,1,2,c;16,1,3,c;8,2,1,o;8,1,2,o;8,1,3,o"
    done = subprocess.run([sys.executable, "bench/sass_schedule.py", "--formats", "int4,int8", "--gated", "--variants",
                           variants, "--json"], env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True,
                          text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 12
    for row in rows:
        depth = row["plan"][2]
        ahead = [blocks for _, blocks in row["weights"]]
        assert row["loop"] and len(ahead) == 2 * row["plan"][1] * (depth + 1)  # the loads of the unrolled loop
        assert min(ahead) >= (depth if row["plan"][3] == 4 else 0.5 * depth), row


# The whole kernel on the CPU: the interpreter runs it, with its inline PTX emulated lane by lane.
def _weights(fmt: str, n: int, k: int, seed: int):
    from cudaformers.kernels.quant_matmul import PackedWeight
    from cudaformers.quant.int4 import quantize_int4
    from cudaformers.quant.int8 import quantize_int8

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(1, k, generator=g).bfloat16()
    bias = (torch.randn(n, generator=g) * 0.1).bfloat16()
    if fmt == "int8":
        return PackedWeight("int8", *quantize_int8(w), k), x, bias
    q, s, z = quantize_int4(w, 128, sym=fmt == "int4_sym")
    return PackedWeight("int4", q, s, k, 128, zeros=z), x, bias


def _launch(monkeypatch, x, w, bias, plan, act=None, even=False, loads=""):
    """The kernel on the CPU; ``loads="wide"``: the weights as 16-byte loads (WIDE_LOADS), ``"staged"``:
    through the pipeliner's stages (the plan's fourth element), ``"staged_weights"``: the weights so and
    x loaded inline, ``"pinned"``/``"pinned_coherent"``: 16-byte loads past a fence a block, ``"ordered"``:
    16-byte relaxed loads kept in order with x's and the scales', else 8-byte loads into registers."""
    from cudaformers.kernels import quant_gemv_mma as m

    emulate_inline_asm(monkeypatch)
    monkeypatch.setattr(m, "UNMASKED_EVEN", even)
    monkeypatch.setattr(m, "WIDE_LOADS", loads in ("wide", "pinned", "pinned_coherent"))
    mode = {"staged": m.STAGED, "staged_weights": m.STAGED_WEIGHTS, "pinned": m.PINNED,
            "pinned_coherent": m.PINNED_COHERENT, "ordered": m.ORDERED}.get(loads)
    return m._launch(x, w, bias, (*plan, mode) if mode else plan, act)


# (fmt, n, k, plan, unmasked where every warp has as many blocks): 2-12 blocks a row (int4 128 codes,
# int8 64) over 1-4 warps: loops of one to six steps, blocks in flight past the loop's first steps, a
# remainder and masked warps.
KERNEL_CASES = [("int4_sym", 32, 640, (2, 1, 1), False), ("int4_asym", 64, 256, (4, 2, 1), False),
                ("int4_asym", 32, 512, (2, 1, 2), True), ("int4_sym", 64, 640, (1, 2, 3), True),
                ("int8", 32, 320, (2, 1, 3), False), ("int8", 64, 256, (2, 2, 2), True),
                ("int8", 32, 256, (4, 1, 1), False), ("int8", 32, 640, (2, 1, 2), False),
                ("int4_sym", 32, 1152, (2, 1, 3), False), ("int8", 32, 768, (2, 1, 3), True)]


# the weights as two 8-byte loads a row and lane, one of 16, staged through shared memory, or past fences
@pytest.mark.parametrize("loads", ["", "wide", "staged", "staged_weights", "pinned", "pinned_coherent", "ordered"])
@pytest.mark.parametrize("fmt,n,k,plan,even", KERNEL_CASES, ids=str)
def test_the_kernel_matches_the_reference_on_the_cpu(monkeypatch, fmt, n, k, plan, even, loads):
    from cudaformers.kernels.quant_matmul import quant_matmul_reference

    w, x, bias = _weights(fmt, n, k, seed=n + k)
    for b in (None, bias):
        out = _launch(monkeypatch, x, w, b, plan, even=even, loads=loads)
        ref32 = quant_matmul_reference(x.float(), w, None if b is None else b.float())
        ref = quant_matmul_reference(x, w, b).float()
        bound = 2 * (ref - ref32).abs().max() + torch.finfo(torch.bfloat16).eps * ref32.abs().max() + 1e-3
        assert out.shape == (1, n) and (out.float() - ref32).abs().max() <= bound


@pytest.mark.parametrize("fmt,n,k,plan,even,act", [c + ("silu",) for c in KERNEL_CASES] + [
    KERNEL_CASES[1] + ("gelu_pytorch_tanh",), KERNEL_CASES[5] + ("gelu",)], ids=str)
@pytest.mark.parametrize("loads", ["", "staged", "staged_weights", "pinned", "pinned_coherent", "ordered"])
def test_gated_kernel_is_the_act_and_mul_of_the_plain_one(monkeypatch, fmt, n, k, plan, even, act, loads):
    from cudaformers.kernels.activation import act_and_mul_forward

    w, x, bias = _weights(fmt, n, k, seed=n + k + 1)
    gate_up = _launch(monkeypatch, x, w, bias, plan, even=even, loads=loads)
    gated = _launch(monkeypatch, x, w, bias, plan, act=act, even=even, loads=loads)
    half = n // 2
    assert gated.shape == (1, half)
    assert torch.equal(gated, act_and_mul_forward(gate_up[:, :half], gate_up[:, half:], act))
    assert not torch.equal(gated, act_and_mul_forward(gate_up[:, half:], gate_up[:, :half], act))  # it can tell


# Each GPU's rules on one SM, so that small layers take every branch: n = 32 few programs, 80 not whole
# pairs of tiles, 96 pairs but under four programs an SM, 128 four or more.
@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
@pytest.mark.parametrize("fmt", ["int4_sym", "int8"])
@pytest.mark.parametrize("n", [32, 80, 96, 128])
def test_each_gpus_default_plan_runs_and_matches_the_reference(monkeypatch, gpu, fmt, n):
    from cudaformers.kernels import quant_gemv_mma as m
    from cudaformers.kernels import quant_gemv_plans as plans
    from cudaformers.kernels.activation import act_and_mul_forward
    from cudaformers.kernels.quant_matmul import quant_matmul_reference

    monkeypatch.setattr(plans, "device_name", lambda device: gpu)
    monkeypatch.setattr(plans, "sm_count", lambda device, off_gpu: 1)
    plan = plans.default_plan(n, fmt[:4], torch.device("cuda"))
    emulate_inline_asm(monkeypatch)
    monkeypatch.setattr(m, "WIDE_LOADS", True)
    w, x, bias = _weights(fmt, n, 256, seed=n)
    out = m._launch(x, w, bias, plan)
    ref32 = quant_matmul_reference(x.float(), w, bias.float())
    ref = quant_matmul_reference(x, w, bias).float()
    bound = 2 * (ref - ref32).abs().max() + torch.finfo(torch.bfloat16).eps * ref32.abs().max() + 1e-3
    assert (out.float() - ref32).abs().max() <= bound
    if fmt != "int8":  # int4's gate/up runs gated at the same plan
        gated = m._launch(x, w, bias, plan, act="silu")
        assert torch.equal(gated, act_and_mul_forward(out[:, : n // 2], out[:, n // 2:], "silu"))


# What each GPU's measured rules pick on qwen3-8b's layers (132 SMs): (fmt, N) -> plan; int4 gate/up gated.
QWEN3_8B_PLANS = {
    "NVIDIA H100 80GB HBM3": {("int4", 6144): (8, 2, 1, 4), ("int4", 4096): (8, 1, 2, 4), ("int4", 24576): (8, 2, 1, 4),
                              ("int8", 6144): (8, 1, 3, 4), ("int8", 4096): (16, 1, 1, 4),
                              ("int8", 24576): (8, 2, 1, 4)},
    "NVIDIA H200": {("int4", 6144): (8, 1, 2), ("int4", 4096): (16, 1, 1), ("int4", 24576): (8, 2, 1),
                    ("int8", 6144): (8, 1, 3), ("int8", 4096): (16, 1, 2), ("int8", 24576): (8, 1, 3)}}


@pytest.mark.parametrize("gpu", sorted(QWEN3_8B_PLANS))
def test_default_plans_on_qwen3_8b_are_the_measured_fastest(monkeypatch, gpu):
    from cudaformers.kernels import quant_gemv_plans as m

    monkeypatch.setattr(m, "device_name", lambda device: gpu)
    monkeypatch.setattr(m, "sm_count", lambda device, off_gpu: 132)
    picked = {(fmt, n): m.default_plan(n, fmt, torch.device("cuda")) for fmt, n in QWEN3_8B_PLANS[gpu]}
    assert picked == QWEN3_8B_PLANS[gpu]


def test_gate_up_runs_gated_per_gpu_unless_switched(monkeypatch):
    from cudaformers.kernels import quant_gemv_plans as m

    cuda = torch.device("cuda")
    for gpu, formats in (("NVIDIA H100 80GB HBM3", ("int4", "int8")), ("NVIDIA H200", ("int4",))):
        monkeypatch.setattr(m, "device_name", lambda device, gpu=gpu: gpu)
        assert m.gated_formats(cuda) == formats
        monkeypatch.setattr(m, "GATED", ())
        assert m.gated_formats(cuda) == ()
        monkeypatch.setattr(m, "GATED", None)
    assert m.gated_formats(torch.device("cpu")) == ("int4",)


def test_launch_cost_fit_splits_a_layers_time_into_a_fixed_part_and_a_rate():
    """bench/quant_gemv_mma.py's fit: layers timed at 3 us a launch plus 2.5 TB/s give those back, and
    noise-free points of one rate give no fixed part."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_quant_gemv_mma", "bench/quant_gemv_mma.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sizes = [8.9e6, 13.3e6, 26.7e6, 53.0e6]  # qwen3-8b's int4 o, q/k/v, down, gate/up bytes
    fixed_us, tb_s = bench.launch_cost_fit([(b, 3.0 + b / 2.5e6) for b in sizes])
    assert abs(fixed_us - 3.0) < 1e-9 and abs(tb_s - 2.5) < 1e-9
    fixed_us, tb_s = bench.launch_cost_fit([(b, b / 4.0e6) for b in sizes[:2]])
    assert abs(fixed_us) < 1e-9 and abs(tb_s - 4.0) < 1e-9
