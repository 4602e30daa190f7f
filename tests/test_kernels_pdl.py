"""The programmatic-dependent-launch contract (kernels/pdl.py), checked without a GPU in the PTX that
Triton generates for sm90 from the real launch arguments of each inference kernel:
- no global store before ``griddepcontrol.wait``; ``launch_dependents`` only after a wait;
- before the wait, only weight loads. Weights are bf16 and activations fp32 here, and without
  alignment hints every load is scalar, so the load width tells them apart (``ld.global.b16``: a
  weight; anything wider: an activation or an index);
- the GEMV does request weights before the wait (the prefetch PDL is for), and plain launches
  (backward, PDL off) carry no griddepcontrol at all.

The kernels are compiled in a subprocess with the interpreter off (this process interprets them).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from cudaformers.kernels.pdl import pdl_enabled

# case -> (loads allowed before the wait: "weights" | "none", must the kernel load weights before it)
CASES = {
    "gemv": ("weights", True),
    "gemv_k_loop": ("weights", True),
    "gemv_act_mul": ("weights", True),
    "gemv_rms_norm": ("weights", True),
    "gemv_rms_norm_k_loop": ("weights", True),
    "rms_norm": ("weights", False),
    "rms_norm_residual": ("weights", False),
    "qk_norm_rope": ("weights", False),
    "qk_norm_rope_store": ("weights", False),
    "kv_store": ("none", False),
    # Lengths and block tables (int64 here) before the wait, the first K/V tile into L2.
    "paged_decode": ("step inputs", False),
    # ... and with qk_norm_rope fused in, its norm weights too; the raw q/k/v, cos/sin, slots after it.
    "paged_decode_fused": ("step inputs", True),
    "act_and_mul": ("none", False),
}
PLAIN = ("act_and_mul_pdl_off", "act_and_mul_backward")


def _cases():
    """name -> (module, kernel attribute, call that launches it with bf16 weights, fp32 activations)."""
    from cudaformers.attention.kv_cache import KVStore
    from cudaformers.kernels import activation, gemv, kv_store, paged_decode, paged_decode_fused, qk_norm_rope, rms_norm

    bf, f32 = torch.bfloat16, torch.float32
    x, w = torch.randn(1, 96, dtype=f32), torch.randn(40, 96, dtype=bf)
    big_k = torch.randn(1, 9000, dtype=f32), torch.randn(8, 9000, dtype=bf)  # more than one K step
    gate_up = torch.randn(2, 192, dtype=f32)
    qkv = torch.randn(2, 4 * 32, dtype=f32)
    cos, sin = torch.randn(2, 32, dtype=f32), torch.randn(2, 32, dtype=f32)
    cache = torch.zeros(4, 4, 1, 32, dtype=f32)
    # A decode step of two sequences over a bf16 paged cache, with int64 lengths and block tables.
    kv_cache, lens, table = torch.zeros(4, 4, 1, 32, dtype=bf), torch.tensor([3, 7]), torch.tensor([[0, 1], [2, 3]])

    return {
        "gemv": (gemv, "_gemv_kernel", lambda: gemv.gemv(x, w)),
        "gemv_k_loop": (gemv, "_gemv_kernel", lambda: gemv.gemv(*big_k)),
        "gemv_act_mul": (gemv, "_gemv_kernel", lambda: gemv.gemv_act_mul(x, x, w, activation="silu")),
        # Through _launch: gemv_rms_norm wants the norm weight in x's dtype, and here it must be bf16.
        "gemv_rms_norm": (gemv, "_gemv_kernel", lambda: gemv._launch(
            x, x.clone(), w, None, gemv._NO_ACT, norm=(w[0], 1e-6, torch.empty_like(x)))),
        "gemv_rms_norm_k_loop": (gemv, "_gemv_kernel", lambda: gemv._launch(
            big_k[0], big_k[0].clone(), big_k[1], None, gemv._NO_ACT,
            norm=(big_k[1][0], 1e-6, torch.empty_like(big_k[0])))),
        "rms_norm": (rms_norm, "_rms_norm_fwd", lambda: rms_norm.rms_norm_forward(x, w[0], 1e-6, pdl=True)),
        "rms_norm_residual": (rms_norm, "_rms_norm_fwd",
                              lambda: rms_norm.rms_norm_forward(x, w[0], 1e-6, residual=x, pdl=True)),
        "qk_norm_rope": (qk_norm_rope, "_qk_norm_rope_kernel", lambda: qk_norm_rope.qk_norm_rope_forward(
            qkv[:, :64].view(2, 2, 32), qkv[:, 64:96].view(2, 1, 32), cos, sin, w[0, :32], w[1, :32])),
        # The KV-cache store fused in: one launch, k's and v's cache writes after the wait too.
        "qk_norm_rope_store": (qk_norm_rope, "_qk_norm_rope_kernel", lambda: qk_norm_rope.qk_norm_rope_forward(
            qkv[:, :64].view(2, 2, 32), qkv[:, 64:96].view(2, 1, 32), cos, sin, w[0, :32], w[1, :32],
            kv_store=KVStore(qkv[:, 96:].view(2, 1, 32), cache, cache.clone(), torch.tensor([3, 9])))),
        "kv_store": (kv_store, "_store_kv_kernel", lambda: kv_store.store_kv_triton(
            cache, cache.clone(), qkv[:, :32].view(2, 1, 32), qkv[:, 32:64].view(2, 1, 32), torch.tensor([3, 9]))),
        "paged_decode": (paged_decode, "_paged_decode_kernel", lambda: paged_decode.paged_decode(
            qkv[:, :64].view(2, 2, 32), kv_cache, kv_cache.clone(), lens, table, 8, 0.1)),
        "paged_decode_fused": (paged_decode, "_paged_decode_kernel", lambda: paged_decode_fused.paged_decode_fused(
            qkv[:, :64].view(2, 2, 32), qkv[:, 64:96].view(2, 1, 32), qkv[:, 96:].view(2, 1, 32), kv_cache,
            kv_cache.clone(), lens, table, torch.tensor([3, 9]), 8, 0.1, cos, sin, w[0, :32], w[1, :32])),
        "act_and_mul": (activation, "_act_mul_fwd",
                        lambda: activation.act_and_mul_forward(gate_up[:, :96], gate_up[:, 96:], pdl=True)),
        "act_and_mul_pdl_off": (activation, "_act_mul_fwd",
                                lambda: activation.act_and_mul_forward(gate_up[:, :96], gate_up[:, 96:])),
        "act_and_mul_backward": (activation, "_act_mul_bwd", lambda: activation._backward_into(
            gate_up[:, :96], gate_up[:, :96], gate_up[:, 96:], *torch.empty(2, 192).split(96, -1), "silu")),
    }


_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
          torch.int32: "i32"}


def _ptx(kernel, args, kwargs) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = [p.name for p in kernel.params]
    values = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
    signature, constexprs = {}, {}
    for p in kernel.params:
        v = values[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            signature[p.name] = "i64" if abs(v) >= 2 ** 31 else "i32"
    options = {k: v for k, v in kwargs.items() if k not in names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    return compiled.asm["ptx"]


def _events(ptx: str) -> list[str]:
    """Global memory and grid-dependency instructions, in program order."""
    events = []
    for line in ptx.splitlines():
        op = line.strip()
        if op.startswith("@"):  # a predicate
            op = op.split(None, 1)[1]
        op = op.split(" ")[0]
        if op.startswith("griddepcontrol."):
            events.append(op.rstrip(";"))
        elif op.startswith(("ld.global", "st.global", "atom.global", "red.global", "prefetch.global")):
            events.append(op)
    return events


def _probe() -> dict:
    """In the subprocess: launch every case through a recorder, compile what it would launch."""
    out = {}
    for name, (module, attr, call) in _cases().items():
        kernel, launches = getattr(module, attr), []

        class Recorder:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: launches.append((args, kwargs))

        setattr(module, attr, Recorder())
        original = getattr(module, "pdl_enabled", None)
        if original is not None:
            module.pdl_enabled = lambda device: True  # the CPU tensors stand in for a Hopper GPU
        try:
            call()
        finally:
            setattr(module, attr, kernel)
            if original is not None:
                module.pdl_enabled = original
        assert len(launches) == 1, (name, len(launches))
        out[name] = {"events": _events(_ptx(kernel, *launches[0])), "launch_pdl": launches[0][1].get("launch_pdl")}
    return out


def run_probe(script: str) -> dict:
    """Runs a test file as a script with the interpreter off (compiled Triton) and returns the JSON
    its last output line holds."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probe():
    return run_probe(__file__)


def _summary(events):
    return [(k, len(list(g))) for k, g in itertools.groupby(events)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_pdl_kernel_keeps_the_contract(probe, case):
    allowed, prefetches = CASES[case]
    events, launch_pdl = probe[case]["events"], probe[case]["launch_pdl"]
    assert launch_pdl is True, f"{case}: launched without launch_pdl=True while USE_PDL is set"
    assert "griddepcontrol.wait" in events, f"{case}: no wait compiled in: {_summary(events)}"
    first_wait = events.index("griddepcontrol.wait")
    before = events[:first_wait]
    if allowed == "step inputs":  # the first tile of K and V, into L2 only
        assert "prefetch.global.L2" in before, f"{case}: no L2 prefetch before the wait: {_summary(events)}"
        before = [e for e in before if not e.startswith("prefetch.")]
    assert not [e for e in before if not e.startswith("ld.")], \
        f"{case}: writes or prefetches before the wait: {_summary(events)}"
    # By width (see the module docstring): weights are b16; "step inputs" also allows the int64
    # lengths and block tables (b64), which kernels finished before this grid was released wrote.
    widths = ("b16", "b64") if allowed == "step inputs" else ("b16",)
    activations = [e for e in before if e.split(".")[-1] not in widths]
    assert not activations, f"{case}: activation loads before the wait: {_summary(events)}"
    if allowed == "none":
        assert not before, f"{case}: loads before the wait: {_summary(events)}"
    if prefetches:
        assert before, f"{case}: no weight is requested before the wait (nothing to overlap): {_summary(events)}"
    # every release follows a wait (at most two grids overlap)
    waits = 0
    for e in events:
        waits += e == "griddepcontrol.wait"
        assert e != "griddepcontrol.launch_dependents" or waits, f"{case}: release before any wait"
    assert events.count("griddepcontrol.launch_dependents") == waits, \
        f"{case}: a release was compiled out (dependents would start only when this grid ends): {_summary(events)}"


def test_only_the_paged_decode_prefetches(probe):
    assert not [e for c in CASES if not c.startswith("paged_decode") for e in probe[c]["events"]
                if e.startswith("prefetch.")]


def test_fused_paged_decode_requests_its_norm_weights_before_the_wait(probe):
    events = probe["paged_decode_fused"]["events"]
    before = events[:events.index("griddepcontrol.wait")]
    assert any(e.endswith(".b16") for e in before), _summary(events)
    assert "st.global.b16" in events, "the bf16 cache store was compiled out"


@pytest.mark.parametrize("case", PLAIN)
def test_plain_launches_have_no_grid_dependency_control(probe, case):
    assert not probe[case]["launch_pdl"]
    assert not [e for e in probe[case]["events"] if e.startswith("griddepcontrol")], _summary(probe[case]["events"])


def test_pdl_enabled_only_on_cuda_outside_the_interpreter(monkeypatch):
    assert not pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_enabled(torch.device("cuda", 0))  # decided before any CUDA query


if __name__ == "__main__":
    print(json.dumps(_probe()))
