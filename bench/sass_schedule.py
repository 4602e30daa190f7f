"""Where ptxas put a kernel's global loads, read from its sm_90 SASS on a machine without a GPU.

    python bench/sass_schedule.py [--formats int4,int8] [--variants 8,2,1;8,2,2,s] [--gated] [--dump DIR]

A batch-1 GEMV streams its weights once, so it runs at HBM speed only if each warp has its next
blocks' loads in flight while it works on the current one. The Triton source asks for that (the
loads of the blocks ahead come first in the loop body, and the PTX keeps them there), but ptxas
schedules again and may sink them to just before their use to save registers: the prefetch then
exists in the source only. This tool compiles the fragment GEMV (``kernels/quant_gemv_mma.py``) for
sm_90 as a launch specialises it, disassembles the cubin with the ``cuobjdump`` that Triton ships,
and for every global load of the main loop reports its distance to the first instruction that reads
what it loaded (following the loop's back edge): in instructions of the warp's own stream, and in
blocks of work (the mmas in between over a block's mmas). A weight load a fraction of a block ahead
is no prefetch. Also the registers a thread, the programs an SM holds at that count, and the shared
memory a program.

Run it under the GPU image's Triton to see what that machine will run (``PYTHONPATH`` at an unpacked
triton 3.6 wheel): each Triton brings its own ptxas. No GPU is needed; what the loads cost in time
only a GPU can say (``bench/quant_gemv_mma.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_REG = re.compile(r"(?<![U\w])R(\d+)(\.64)?")


@dataclass
class Instr:
    addr: int
    op: str
    operands: list[str]

    def regs(self, operand: str) -> set[int]:
        """The registers ``operand`` names: an mma's A and C fragments span 4, its B fragment 2; a 64-bit
        address 2; a load's destination its width."""
        found = set()
        for m in _REG.finditer(operand):
            first = int(m.group(1))
            found.update(range(first, first + (2 if m.group(2) else 1)))
        return found

    def writes(self) -> set[int]:
        if not self.operands or self.op.startswith(("ST", "BRA", "BAR", "RED", "ATOM")):
            return set()
        regs = self.regs(self.operands[0])
        if not regs:
            return set()
        first = min(regs)
        if self.op.startswith(("LDG", "LDS", "LD.")):
            return set(range(first, first + load_width(self.op)))
        if self.op.startswith("HMMA"):
            return set(range(first, first + 4))
        return regs

    def reads(self) -> set[int]:
        sources = self.operands if self.op.startswith(("ST", "RED", "ATOM")) else self.operands[1:]
        found = set()
        for i, operand in enumerate(sources):
            regs = self.regs(operand)
            if self.op.startswith("HMMA") and regs:  # A: 4 registers, B: 2, C: 4
                first = min(regs)
                regs = set(range(first, first + (4, 2, 4)[min(i, 2)]))
            found |= regs
        return found


def load_width(op: str) -> int:
    """Registers a load writes, from its opcode's size suffix."""
    for suffix, regs in ((".128", 4), (".64", 2)):
        if suffix in op:
            return regs
    return 1


def parse(sass: str) -> list[Instr]:
    out = []
    for m in _LINE.finditer(sass):
        operands = [o.strip() for o in m.group(4).split(",")] if m.group(4).strip() else []
        out.append(Instr(int(m.group(1), 16), m.group(3), operands))
    return out


def loops(code: list[Instr]) -> list[tuple[int, int]]:
    """(first, last) indices of each loop body: a branch back to an earlier address."""
    index = {ins.addr: i for i, ins in enumerate(code)}
    found = []
    for i, ins in enumerate(code):
        if ins.op.startswith("BRA") and ins.operands:
            target = int(ins.operands[-1].split()[-1], 16)
            if target < ins.addr and target in index:
                found.append((index[target], i))
    return found


def distances(code: list[Instr], first: int, last: int, wrap: bool = True) -> list[tuple[Instr, int | None, int]]:
    """Each global load of ``code[first:last + 1]``: (load, instructions until its value is first read,
    mmas in between). ``wrap``: the region is a loop body, followed by itself. None: never read there."""
    body = code[first:last + 1]
    out = []
    for i, ins in enumerate(body):
        if not ins.op.startswith("LDG"):
            continue
        dest = ins.writes()
        found = None
        mmas = 0
        for step in range(1, len(body) if wrap else len(body) - i):
            j = (i + step) % len(body)
            if body[j].reads() & dest:
                found = step
                break
            if body[j].writes() >= dest:  # overwritten before any read
                break
            mmas += body[j].op.startswith("HMMA")
        out.append((ins, found, mmas))
    return out


def kind(ins: Instr) -> str:
    if "128" in ins.op or "CONSTANT" in ins.op:
        return "weights"
    return "scales" if "U16" in ins.op else "x/other"


def fragment_cubin(fmt: str, plan: tuple, gated: int, zeros: bool, wide: bool, even: bool) -> tuple[bytes, dict]:
    """The fragment GEMV compiled for sm_90 as a launch would specialise it (16-byte aligned pointers
    and strides)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cudaformers.kernels import quant_gemv_mma as m

    warps, tiles, depth, *mode = plan
    loads = mode[0] if mode else m.REGISTERS
    sig = dict(x_ptr="*i64", q_ptr="*i64", s_ptr="*fp32" if fmt == "int8" else "*bf16", z_ptr="*bf16",
               b_ptr="*bf16", out_ptr="*bf16", n_blocks="i32", ld_q="i32", half="i32")
    consts = dict(FMT=int(fmt == "int8"), WARPS=warps, TILES=tiles, DEPTH=depth, HAS_ZEROS=zeros, HAS_BIAS=False,
                  EVEN=even, GATED=gated, USE_PDL=True, WIDE=wide, **m.load_constexprs(loads))
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(m._kernel, sig, consts, {(i,): [["tt.divisibility", 16]] for i in range(9)})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    return c.asm["cubin"], dict(shared=c.metadata.shared)


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def disassemble(cubin: bytes) -> tuple[str, int]:
    """(SASS, registers a thread)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    return sass, regs


def programs_an_sm(regs: int, warps: int, shared: int) -> int:
    """Hopper: 64K registers (allocated 8 a thread at a time, whole warps), 64 warps, 227 KB of shared
    memory an SM."""
    by_regs = 65536 // (((regs + 7) // 8 * 8) * 32 * warps)
    by_warps = 64 // warps
    by_shared = (227 * 1024) // shared if shared else by_warps
    return max(0, min(by_regs, by_warps, by_shared, 32))


def report(name: str, cubin: bytes, warps: int, shared: int, mmas_a_block: int, dump: Path | None) -> dict:
    """Registers, programs an SM, and per kind of load the distances to first use, in instructions and in
    blocks (the mmas in between over a block's mmas): the main loop's body (the longest loop), or the
    whole kernel where it has no loop but the final reduction's."""
    sass, regs = disassemble(cubin)
    if dump:
        (dump / f"{name}.sass").write_text(sass)
    code = parse(sass)
    bodies = [b for b in loops(code) if any(ins.op.startswith("HMMA") for ins in code[b[0]:b[1] + 1])]
    if bodies:
        first, last = max(bodies, key=lambda b: b[1] - b[0])
    else:
        first, last = 0, len(code) - 1
    per_kind: dict[str, list] = {}
    for ins, dist, mmas in distances(code, first, last, wrap=bool(bodies)):
        per_kind.setdefault(kind(ins), []).append((dist, mmas / mmas_a_block))
    weights = [(d, b) for d, b in per_kind.get("weights", []) if d is not None]
    return dict(name=name, regs=regs, shared=shared, programs=programs_an_sm(regs, warps, shared),
                loop=bool(bodies), body=last - first + 1,
                hmma=sum(ins.op.startswith("HMMA") for ins in code[first:last + 1]),
                weights=weights, other={k: [d for d, _ in v] for k, v in per_kind.items() if k != "weights"})


def main() -> None:
    from quant_gemv_mma import LOAD_LETTERS, parse_variants

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--variants", default="16,1,1;8,1,2;8,2,1;8,1,3;16,1,2;8,2,2;16,1,1,p;8,1,2,p;8,2,1,p;"
                    "16,1,2,p;8,2,2,p;8,2,1,c;8,2,2,c;8,2,2,s;8,2,2,w")
    ap.add_argument("--gated", action="store_true", help="the gate/up form with SiLU-and-mul in the epilogue")
    ap.add_argument("--nowide", action="store_true")
    ap.add_argument("--even", action="store_true", help="loads without masks (UNMASKED_EVEN)")
    ap.add_argument("--json", action="store_true", help="also a JSON line a variant")
    ap.add_argument("--dump", default=None, help="write each variant's SASS to this folder")
    args = ap.parse_args()
    import triton

    dump = Path(args.dump) if args.dump else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
    print(f"triton {triton.__version__}; a load's distance: instructions of the warp's own stream before its value "
          f"is read, and blocks of work (mmas) in between")
    print(f"{'variant':<24}{'regs':>5}{'progs':>6}{'smem':>7}{'code':>6}  weights: blocks ahead (min/mean), "
          f"instructions (min)  | x, scales: instructions (min)")
    for fmt in args.formats.split(","):
        for plan in parse_variants(args.variants):
            letter = {v[0]: k for k, v in LOAD_LETTERS.items()}.get(plan[3] if len(plan) > 3 else 0)
            name = f"{fmt}_{'_'.join(map(str, plan[:3]))}{'_' + letter if letter else ''}"
            cubin, meta = fragment_cubin(fmt, plan, 1 if args.gated else -1, False, not args.nowide, args.even)
            mmas = 8 * plan[1] if fmt == "int8" else 8 * (plan[1] + 1)
            r = report(name, cubin, plan[0], meta["shared"], mmas, dump)
            if args.json:
                print(json.dumps(dict(r, fmt=fmt, plan=list(plan))))
            w = r["weights"]
            if letter in ("s", "w"):  # the weights reach registers from shared memory, DEPTH + 1 stages
                ahead = f"- (cp.async, {plan[2] + 1} stages)"
            else:
                ahead = (f"{min(b for _, b in w):.2f}/{sum(b for _, b in w) / len(w):.2f}, {min(d for d, _ in w)}"
                         if w else "- (no weight loads found)")
            other = "; ".join(f"{k} {min((d for d in v if d is not None), default='-')}" for k, v in r["other"].items())
            where = "loop" if r["loop"] else "all"
            print(f"{name:<24}{r['regs']:>5}{r['programs']:>6}{r['shared']:>7}{r['body']:>5}{where[0]}  "
                  f"{ahead:<34}| {other}")


if __name__ == "__main__":
    main()
