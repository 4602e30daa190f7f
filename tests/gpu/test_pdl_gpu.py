"""Programmatic dependent launch on the GPU: the decode chain's kernels read what their producers
wrote (inside a CUDA graph, replayed with changing inputs), give the same bits with PDL on and off,
and leave generate() unchanged.

One chain at qwen3-0.6b shapes covers every PDL kernel, each right after a PDL kernel or a torch op,
some reading a tensor written two or three kernels earlier (the ordering PDL keeps transitively).
A negative control (a kernel that reads its input before the wait) shows the graph test can see a
race on this machine.
"""

import pytest
import torch
import triton
import triton.language as tl

from cudaformers.kernels import pdl
from cudaformers.kernels.activation import act_and_mul
from cudaformers.kernels.gemv import gemv, gemv_act_mul
from cudaformers.kernels.kv_store import store_kv_triton
from cudaformers.kernels.qk_norm_rope import qk_norm_rope_forward
from cudaformers.kernels.rms_norm import rms_norm

pytestmark = pytest.mark.gpu
H, HQ, HKV, D, I, PAGE, BLOCKS = 1024, 16, 8, 128, 3072, 16, 8
DT, EPS = torch.bfloat16, 1e-6
REPLAYS = 30


@pytest.fixture(autouse=True)
def _hopper():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm90 or newer")


def _weights():
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(DT)

    return dict(n1=rand(H, scale=0.1) + 1, n2=rand(H, scale=0.1) + 1, qn=rand(D, scale=0.1) + 1,
                kn=rand(D, scale=0.1) + 1, qkv=rand((HQ + 2 * HKV) * D, H, scale=H ** -0.5),
                o=rand(H, HQ * D, scale=(HQ * D) ** -0.5), o_bias=rand(H, scale=0.1),
                gate_up=rand(2 * I, H, scale=H ** -0.5), down=rand(H, I, scale=I ** -0.5))


def _inputs(t: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    angles = torch.rand(t, D // 2, device="cuda", generator=g) * 100
    emb = torch.cat([angles, angles], -1)
    return dict(x=torch.randn(t, H, device="cuda", generator=g).to(DT),
                resid=torch.randn(t, H, device="cuda", generator=g).to(DT),
                cos=emb.cos().to(DT), sin=emb.sin().to(DT),
                slots=torch.randperm(BLOCKS * PAGE, device="cuda", generator=g)[:t])


def _chain(w, inp, k_cache, v_cache):
    """One decoder layer's inference launches (torch ops marked), returning every kernel's output."""
    t = inp["x"].shape[0]
    h = inp["x"] + inp["resid"]                                           # torch
    n1 = rms_norm(h, w["n1"], EPS)                                        # after a torch op
    qkv = gemv(n1, w["qkv"])
    q, k = qk_norm_rope_forward(qkv[:, :HQ * D].view(t, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D),
                                inp["cos"], inp["sin"], w["qn"], w["kn"], EPS, EPS)
    store_kv_triton(k_cache, v_cache, k, qkv[:, (HQ + HKV) * D:].view(t, HKV, D), inp["slots"])
    o = gemv(q.view(t, HQ * D), w["o"], w["o_bias"])                      # q: written two kernels back
    n2, s = rms_norm(o, w["n2"], EPS, residual=h)
    gate_up = gemv(n2, w["gate_up"])
    act = act_and_mul(gate_up[:, :I], gate_up[:, I:], "silu")
    down = gemv(act, w["down"])
    fused_down = gemv_act_mul(gate_up[:, :I], gate_up[:, I:], w["down"])  # gate_up: three kernels back
    z = fused_down + s                                                    # torch
    again = gemv(z, w["o"][:, :H])                                        # right after a torch op
    kv_rows = (k_cache.view(-1, HKV, D)[inp["slots"]], v_cache.view(-1, HKV, D)[inp["slots"]])
    return dict(n1=n1, qkv=qkv, q=q, k=k, o=o, n2=n2, s=s, gate_up=gate_up, act=act, down=down,
                fused_down=fused_down, again=again, k_rows=kv_rows[0], v_rows=kv_rows[1])


def _caches():
    return (torch.zeros(BLOCKS, PAGE, HKV, D, device="cuda", dtype=DT),
            torch.zeros(BLOCKS, PAGE, HKV, D, device="cuda", dtype=DT))


def _eager(w, inp, pdl_on: bool, monkeypatch):
    monkeypatch.setenv("CUDAFORMERS_PDL", "1" if pdl_on else "0")
    assert pdl.pdl_enabled(torch.device("cuda")) == pdl_on
    out = _chain(w, inp, *_caches())
    torch.cuda.synchronize()
    return out


def _assert_same(got, want, what):
    for name in want:
        assert torch.equal(got[name], want[name]), \
            f"{what}: {name} differs (max {(got[name].float() - want[name].float()).abs().max().item():.3g})"


@pytest.mark.parametrize("t", [1, 3])
def test_each_kernel_same_bits_with_pdl_on_and_off(t, monkeypatch):
    w, inp = _weights(), _inputs(t, seed=t)
    with torch.inference_mode():
        off = _eager(w, inp, False, monkeypatch)
        on = _eager(w, inp, True, monkeypatch)
    _assert_same(on, off, f"T={t}, PDL on vs off")


@pytest.mark.parametrize("t", [1, 3])
def test_graph_replays_read_what_producers_wrote(t, monkeypatch):
    w = _weights()
    static = _inputs(t, seed=100)
    k_cache, v_cache = _caches()
    monkeypatch.setenv("CUDAFORMERS_PDL", "1")
    with torch.inference_mode():
        _chain(w, static, k_cache, v_cache)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(w, static, k_cache, v_cache)
        for i in range(REPLAYS):
            fresh = _inputs(t, seed=1000 + i)
            for name, value in fresh.items():
                static[name].copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            want = _eager(w, fresh, False, monkeypatch)
            monkeypatch.setenv("CUDAFORMERS_PDL", "1")
            _assert_same(out, want, f"T={t}, replay {i}")


@triton.jit
def _copy_before_wait(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    # Deliberately breaks the PDL contract: reads the producer's output before waiting for it.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + offs, x, mask=offs < n)


def test_negative_control_a_misplaced_wait_is_seen(monkeypatch):
    # A long PDL producer (a 128 MB GEMV) releases its dependent early; a consumer that loads
    # before its wait then copies rows the producer has not written yet, in some replay.
    monkeypatch.setenv("CUDAFORMERS_PDL", "1")
    n, k = 16384, 4096
    weight = (torch.randn(n, k, device="cuda") * k ** -0.5).to(DT)
    x = torch.randn(1, k, device="cuda", dtype=DT)
    copy = torch.empty(n, device="cuda", dtype=DT)

    def step():
        y = gemv(x, weight)
        _copy_before_wait[(triton.cdiv(n, 1024),)](y, copy, n, BLOCK=1024, launch_pdl=True)
        return y

    with torch.inference_mode():
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = step()
        stale = 0
        for _ in range(REPLAYS):
            x.normal_()
            graph.replay()
            torch.cuda.synchronize()
            stale += not torch.equal(copy, y.view(-1))
    assert stale > 0, ("the contract-breaking consumer never read stale data: on this machine the graph "
                       "test could not tell a misplaced wait from a correct one")


def test_generate_tokens_same_with_pdl_on_and_off(monkeypatch):
    import tiny
    from cudaformers import AutoModelForCausalLM
    import cudaformers.kernels.activation as activation
    import cudaformers.kernels.gemv as gemv_module
    import cudaformers.kernels.kv_store as kv_store
    import cudaformers.kernels.qk_norm_rope as qk_norm_rope
    import cudaformers.kernels.rms_norm as rms_norm_module

    launches = []
    for module in (activation, gemv_module, kv_store, qk_norm_rope, rms_norm_module):
        monkeypatch.setattr(module, "pdl_enabled",
                            lambda device, name=module.__name__: launches.append(name) or pdl.pdl_enabled(device))
    ids = torch.randint(3, 211, (2, 9), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    tokens = {}
    for on in (False, True):
        monkeypatch.setenv("CUDAFORMERS_PDL", "1" if on else "0")
        model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), dtype=DT, device_map="cuda",
                                                     attn_implementation="triton", use_kernels=True)
        tokens[on] = model.generate(ids, **kw)
        tokens[on, "one row"] = model.generate(ids[:1], **kw)
    for module in ("gemv", "rms_norm", "qk_norm_rope", "activation"):  # activation: the prefill
        assert any(name.endswith(module) for name in launches), f"generate() never launched {module}"
    # The KV-cache store is fused into qk_norm_rope: the store kernel has no launch of its own.
    assert not any(name.endswith("kv_store") for name in launches)
    assert torch.equal(tokens[True], tokens[False])
    assert torch.equal(tokens[True, "one row"], tokens[False, "one row"])
