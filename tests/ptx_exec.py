"""A CPU executor for the few PTX instructions the project's inline assembly uses, so that tests can run
that assembly on chosen inputs and compare with a formula (the interpreter cannot run PTX).

``run_warp`` executes a block for the lanes of a warp in lockstep: each lane has its own registers;
``mma.sync.aligned.m16n8k16`` (bf16 in, f32 accumulate) gathers its operands from all 32 lanes with the
fragment layouts of the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type") and
scatters the result back. Integer registers hold Python ints (32 bits), f32 registers floats.
"""

from __future__ import annotations

import re
import struct

import torch

M32 = 0xFFFFFFFF


def half_value(bits16: int, fp16: bool) -> float:
    if fp16:
        return struct.unpack("<e", struct.pack("<H", bits16 & 0xFFFF))[0]
    return struct.unpack("<f", struct.pack("<I", (bits16 & 0xFFFF) << 16))[0]  # bf16: fp32's top half


def half_bits(v: float, fp16: bool) -> int:
    dtype = torch.float16 if fp16 else torch.bfloat16
    t = torch.tensor([v], dtype=dtype)
    assert t.item() == v, f"{v} is not exact in {dtype}"  # every value the assembly makes must be exact
    return t.view(torch.int16).item() & 0xFFFF


def lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def prmt(a: int, b: int, sel: int) -> int:
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(pool[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & M32))[0]


def _names(text: str) -> list[str]:
    return [r.strip() for r in text.strip().strip("{}").split(",")]


def _mma(lanes: list[dict], d, a, b, c) -> None:
    A = torch.zeros(16, 16, dtype=torch.float64)
    B, C = torch.zeros(16, 8, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
    cd = lambda g, t: ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))  # noqa: E731
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for r, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row, col], A[row, col + 1] = half_value(regs[a[r]] & 0xFFFF, False), half_value(regs[a[r]] >> 16, False)
        for r, k in enumerate((2 * t, 2 * t + 8)):
            B[k, g], B[k + 1, g] = half_value(regs[b[r]] & 0xFFFF, False), half_value(regs[b[r]] >> 16, False)
        for r, (row, col) in enumerate(cd(g, t)):
            C[row, col] = regs[c[r]]
    D = A @ B + C
    for lane, regs in enumerate(lanes):
        for r, (row, col) in enumerate(cd(lane // 4, lane % 4)):
            regs[d[r]] = float(D[row, col])


def run_warp(asm: str, args: list[list[int]]) -> list[dict[int, int | float]]:
    """Runs ``asm`` for ``len(args)`` lanes (32 where it has an mma); lane i's ``args[i]`` fill $0, $1, ...
    (outputs first, as placeholders). Returns each lane's outputs: {n: value written to $n}."""
    lanes = [{f"${i}": v for i, v in enumerate(lane_args)} for lane_args in args]
    outs: list[dict[int, int | float]] = [{} for _ in lanes]

    def val(regs: dict, tok: str):
        if tok.startswith("0f"):
            return _f32(int(tok[2:], 16))
        return int(tok, 0) & M32 if tok[0].isdigit() else regs[tok]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        if line.startswith("fence."):  # orders memory, which is read in program order here
            continue
        op, rest = line.split(None, 1)
        if op == "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32":
            assert len(lanes) == 32, "an mma needs the whole warp"
            _mma(lanes, *(_names(x) for x in re.findall(r"\{[^}]*\}", rest)))
            continue
        for regs, out in zip(lanes, outs):
            if op == "mov.b64":
                lo, hi = _names(rest[: rest.index("}") + 1])
                v = regs[rest[rest.index("}") + 2:].strip()]
                regs[lo], regs[hi] = v & M32, (v >> 32) & M32
                continue
            ops = _names(rest)
            dst = ops[0]
            if op in ("mov.b32", "mov.u32", "mov.f32"):
                r = val(regs, ops[1])
            elif op == "prmt.b32":
                r = prmt(val(regs, ops[1]), val(regs, ops[2]), val(regs, ops[3]))
            elif op == "shr.u32":
                r = val(regs, ops[1]) >> val(regs, ops[2])
            elif op == "lop3.b32":
                r = lop3(*(val(regs, o) for o in ops[1:5]))
            elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
                fp16 = op == "fma.rn.f16x2"
                a, b, c = (val(regs, o) for o in ops[1:4])
                r = 0
                for half in range(2):
                    h = lambda x: half_value((x >> (16 * half)) & 0xFFFF, fp16)  # noqa: E731
                    r |= half_bits(h(a) * h(b) + h(c), fp16) << (16 * half)
            else:
                raise AssertionError(f"the executor does not know {op!r}")
            if re.fullmatch(r"\$\d+", dst):
                out[int(dst[1:])] = r
            regs[dst] = r & M32 if isinstance(r, int) else r
    return outs


def _operand(value, constraint: str):
    if constraint == "f":
        return float(value)
    return int(value) & (M32 if constraint == "r" else 0xFFFFFFFFFFFFFFFF)


def emulate_inline_asm(monkeypatch) -> None:
    """Lets the Triton interpreter run ``tl.inline_asm_elementwise`` (``pack=1``) through ``run_warp``,
    so a kernel with inline PTX runs whole on the CPU. Element e of the operands is lane e % 32 of warp
    e // 32: right for kernels whose tensors are ``[32 * warps]`` laid out one element per thread (the
    fragment GEMV); the mma's lanes exchange operands as on the GPU."""
    import numpy as np
    from triton.runtime import interpreter

    class _Call:  # what the interpreter's caller reads results from
        def __init__(self, results):
            self.results = results

        def get_result(self, i):
            return self.results[i]

    def load_pairs(asm, values, types):
        """The fragment GEMV's 16-byte weight loads (``quant_gemv_mma._PAIR``/``_PAIR_IF`` and their coherent
        forms): two int64 at each lane's address, 0 where the predicate operand is 0; read from the
        interpreter's memory."""
        import ctypes

        addresses = values[0].data.reshape(-1)
        keep = values[1].data.reshape(-1) if len(values) > 1 else np.ones(addresses.size, dtype=bool)
        assert "@p ld." in asm or len(values) == 1, "a predicated load takes its predicate operand"
        words = np.zeros((addresses.size, 2), dtype=np.int64)
        for i, (address, on) in enumerate(zip(addresses.tolist(), keep.tolist())):
            if on:
                assert address % 16 == 0, f"a 16-byte load from an unaligned address {address:#x}"
                words[i] = np.frombuffer(ctypes.string_at(address, 16), dtype=np.int64)
        shape = values[0].data.shape
        return _Call([interpreter.TensorHandle(words[:, j].reshape(shape).copy(), ty.scalar)
                      for j, ty in enumerate(types)])

    def load_scalars(values, types, dtype):
        """The fragment GEMV's predicated scalar loads: x's 8 bytes (``quant_gemv_mma._X_IF``, relaxed or
        not) and the relaxed 2-byte scales (``_HALF_R_IF``): a ``dtype`` at each lane's address, 0 where
        the predicate operand is 0."""
        import ctypes

        size = np.dtype(dtype).itemsize
        addresses, keep = values[0].data.reshape(-1), values[1].data.reshape(-1)
        out = np.zeros(addresses.size, dtype=dtype)
        for i, (address, on) in enumerate(zip(addresses.tolist(), keep.tolist())):
            if on:
                assert address % size == 0, f"a {size}-byte load from an unaligned address {address:#x}"
                out[i] = np.frombuffer(ctypes.string_at(address, size), dtype=dtype)[0]
        return _Call([interpreter.TensorHandle(out.reshape(values[0].data.shape), types[0].scalar)])

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        assert pack == 1, "only one element per asm instance is emulated"
        loads = ("ld.global", "ld.relaxed.cta.global")
        if any(op in asm for op in loads) and "v2.u64" in asm:
            return load_pairs(asm, values, types)
        if "ld.global.nc.u64" in asm or "ld.relaxed.cta.global.u64" in asm:
            return load_scalars(values, types, np.int64)
        if "ld.relaxed.cta.global.b16" in asm:
            return load_scalars(values, types, np.int16)
        cons = constraints.split(",")
        n_out = sum(c.startswith("=") for c in cons)
        flat = [v.data.reshape(-1) for v in values]
        n = flat[0].size
        assert n % 32 == 0 and all(f.size == n for f in flat), "operands must be [32 * warps], one per lane"
        outs = [[0] * n for _ in types]
        for w in range(n // 32):
            lanes = [[0] * n_out + [_operand(f[32 * w + lane], c) for f, c in zip(flat, cons[n_out:])]
                     for lane in range(32)]
            for lane, out in enumerate(run_warp(asm, lanes)):
                for i in range(n_out):
                    outs[i][32 * w + lane] = out[i]
        shape = values[0].data.shape
        results = []
        for out, ty in zip(outs, types):
            scalar = ty.scalar
            if scalar.is_floating():
                data = np.array(out, dtype=np.float64).astype(interpreter._get_np_dtype(scalar))
            else:
                data = np.array([v & M32 for v in out], dtype=np.uint32).view(np.int32)
            results.append(interpreter.TensorHandle(data.reshape(shape), scalar))
        return _Call(results)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", create_inline_asm)
