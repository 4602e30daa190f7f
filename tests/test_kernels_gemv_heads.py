"""The packed q/k/v GEMV that finishes its own heads (kernels/gemv_heads.py): q, k, v, the residual sum
and both caches bit for bit those of the two launches it replaces (the GEMV, with or without the
folded RMSNorm, then qk_norm_rope with its fused cache store), whichever program of a head arrives
last; counters back at zero after every launch; then the decode layer with it switched on gives the
unfolded layer's logits, caches and greedy tokens."""

import os

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers.attention.kv_cache import KVStore  # noqa: E402
from cudaformers.kernels import gemv_heads as gh  # noqa: E402
from cudaformers.kernels.arrivals import arrival_counters  # noqa: E402
from cudaformers.kernels.gemv import gemv, gemv_rms_norm  # noqa: E402
from cudaformers.kernels.qk_norm_rope import qk_norm_rope_forward  # noqa: E402

from test_kernels_qk_norm_rope_store import _caches, _cos_sin, _guards  # noqa: E402

# t, hq, hkv, d, rot, k: one to four tokens, GQA and MHA, partial rotary, head sizes whole programs of
# the CPU tiling (16 rows for these widths) once, twice or more times over, odd K
CASES = [(1, 4, 2, 32, 32, 48), (3, 2, 1, 16, 16, 40), (2, 3, 3, 64, 32, 33), (4, 6, 2, 32, 24, 64)]


def _inputs(t, hq, hkv, d, rot, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * d
    x, residual = (torch.randn(t, k, generator=g).to(dtype) for _ in range(2))
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    qw, kw = ((1 + 0.1 * torch.randn(d, generator=g)).to(dtype) for _ in range(2))
    cos, sin = _cos_sin(t, rot, dtype)
    return g, x, residual, weight, bias, norm_w, qw, kw, cos, sin


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["norm+residual", "norm", "plain"])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_equals_the_gemv_then_qk_norm_rope_with_its_store(case, dtype, mode, qk_norm):
    t, hq, hkv, d, rot, k = case
    g, x, residual, weight, bias, norm_w, qw, kw, cos, sin = _inputs(*case, dtype)
    # Caches of the outputs' dtype: the interpreter rounds fp32 -> bf16 otherwise than torch.
    start, *caches = (_caches(3, 2, hkv, d, dtype, torch.Generator().manual_seed(7)) for _ in range(3))
    slots = torch.tensor([4, 0, -1, 5][:t])  # a padding token (-1) writes nothing
    norms = (qw, kw, 1e-6, 1e-5) if qk_norm else (None, None, 1e-6, 1e-6)
    heads = gh.Heads(hq, hkv, d, cos, sin, *norms, cache=(*caches[0], slots))
    norm = None if mode == "plain" else (norm_w, 1e-6, residual if mode == "norm+residual" else None)

    q, k_out, v, summed = gh.gemv_heads(x, weight, heads, bias, norm)

    if norm is None:
        qkv, want_sum = gemv(x, weight, bias), None
    elif mode == "norm":
        qkv, want_sum = gemv_rms_norm(x, weight, norm_w, 1e-6, bias=bias), None
    else:
        qkv, want_sum = gemv_rms_norm(x, weight, norm_w, 1e-6, residual, bias)
    wq, wk, wv = (p.view(t, -1, d) for p in qkv.split([hq * d, hkv * d, hkv * d], -1))
    want_q, want_k = qk_norm_rope_forward(wq, wk, cos, sin, *norms, kv_store=KVStore(wv, *caches[1], slots))
    assert torch.equal(q, want_q) and torch.equal(k_out, want_k) and torch.equal(v, wv)
    assert (summed is None) == (want_sum is None) and (summed is None or torch.equal(summed, want_sum))
    for got, want, before in zip(caches[0], caches[1], start):
        assert torch.equal(got, want) and not torch.equal(got, before)
    assert _guards(caches[0]) == _guards(start)  # slot -1 wrote nothing
    assert int(arrival_counters(x.device, 64)[:64].abs().sum()) == 0  # every counter back at zero


def test_without_a_cache_and_into_a_given_output():
    t, hq, hkv, d, rot, k = CASES[0]
    _, x, _, weight, _, _, qw, kw, cos, sin = _inputs(*CASES[0], torch.float32, seed=3)
    out = torch.full((t, weight.shape[0]), float("nan"))
    q, k_out, v, summed = gh.gemv_heads(x, weight, gh.Heads(hq, hkv, d, cos, sin, qw, kw), out=out)
    qkv = gemv(x, weight)
    assert torch.equal(out, qkv) and summed is None and v.data_ptr() == out[:, (hq + hkv) * d:].data_ptr()
    wq, wk, _ = (p.view(t, -1, d) for p in qkv.split([hq * d, hkv * d, hkv * d], -1))
    want = qk_norm_rope_forward(wq, wk, cos, sin, qw, kw)
    assert torch.equal(q, want[0]) and torch.equal(k_out, want[1])


def test_any_program_of_a_head_may_finish_it(monkeypatch):
    """The interpreter runs programs in order, so a head's last program finishes it; on a GPU any may
    arrive last. Run in reverse order, the head's first program arrives last and must still finish
    the whole head from what the others stored."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    forward = builder.set_grid_idx
    monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: forward(builder.grid_dim[0] - 1 - x, y, z))
    t, hq, hkv, d, rot, k = CASES[2]
    _, x, _, weight, _, _, qw, kw, cos, sin = _inputs(*CASES[2], torch.float32, seed=5)
    finished = []
    real = gh._finish_head

    def finishing(y_row, head, m, *args):  # which program finished which head
        finished.append((int(head), int(m), interpreter.interpreter_builder.grid_idx[0]))
        return real(y_row, head, m, *args)

    monkeypatch.setattr(gh, "_finish_head", finishing)
    q, k_out, _, _ = gh.gemv_heads(x, weight, gh.Heads(hq, hkv, d, cos, sin, qw, kw))
    per_head = d // 16  # programs a head (16-row programs on the CPU tiling)
    assert per_head > 1 and sorted(finished) == [(h, m, h * per_head) for h in range(hq + hkv) for m in range(t)]
    qkv = gemv(x, weight)
    wq, wk, _ = (p.view(t, -1, d) for p in qkv.split([hq * d, hkv * d, hkv * d], -1))
    want = qk_norm_rope_forward(wq, wk, cos, sin, qw, kw)
    assert torch.equal(q, want[0]) and torch.equal(k_out, want[1])


def test_refuses_what_it_cannot_take():
    t, hq, hkv, d, rot, k = CASES[0]
    _, x, _, weight, _, _, qw, kw, cos, sin = _inputs(*CASES[0], torch.float32)
    heads = gh.Heads(hq, hkv, d, cos, sin, qw, kw)
    with pytest.raises(ValueError, match="packed q/k/v weight"):
        gh.gemv_heads(x, weight[:-d], heads)
    with pytest.raises(ValueError, match="even R"):
        gh.gemv_heads(x, weight, heads._replace(cos=cos[:, :5], sin=sin[:, :5]))
    with pytest.raises(ValueError, match="both"):
        gh.gemv_heads(x, weight, heads._replace(k_weight=None))
    with pytest.raises(ValueError, match="slot per token"):
        cache = torch.zeros(2, 2, hkv, d)
        gh.gemv_heads(x, weight, heads._replace(cache=(cache, cache.clone(), torch.tensor([0, 1]))))
    # 8-row heads against the GEMV's 16-row programs: the caller runs the two launches instead
    small, wide = gh.Heads(32, 16, 8, cos[:, :8], sin[:, :8]), torch.randn(512, k)
    assert "not a whole number" in gh.heads_declines(x, wide, small)
    with pytest.raises(ValueError, match="run the GEMV and qk_norm_rope apart"):
        gh.gemv_heads(x, wide, small)


# -- the decode layer: a tiny model with the fold's kernels mapped onto the CPU, interpreted --------------

@pytest.fixture
def head_calls(monkeypatch):
    """Rows of each launch that finished its heads."""
    calls = []
    real = gh.gemv_heads

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(gh, "gemv_heads", counting)
    return calls


# q/k norms and GQA at head_dim 32 (two programs a head), Llama-style biases at 16, on both backends
@pytest.mark.parametrize("name,attn", [("qwen3", "triton"), ("qwen3", "sdpa"), ("llama_bias", "triton")])
def test_decode_layer_gives_the_unfolded_logits_caches_and_tokens(name, attn, head_calls, monkeypatch):
    from test_kernels_paged_decode_fused import _decode, _model

    model = _model(name, attn)
    monkeypatch.setattr(gh, "HEAD_EPILOGUE", False)
    want = _decode(model, monkeypatch, fuse=False)
    assert not head_calls
    monkeypatch.setattr(gh, "HEAD_EPILOGUE", True)
    got = _decode(model, monkeypatch, fuse=False)
    # generate(): 4 decode steps of 2 rows; then 3 more over the paged cache (prefills are too many rows)
    assert head_calls == [2] * 7 * len(model.model.layers)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1] + got[2], want[1] + want[2]):  # logits of each step, then both caches
        assert torch.equal(a, b)


def test_wide_layers_finish_their_heads_without_the_folded_norm(head_calls, monkeypatch):
    """Past FOLD_MAX_HIDDEN the input norm runs as its own launch and the q/k/v GEMV still finishes its
    heads: the same logits, caches and tokens as the unfolded layer."""
    import tiny
    from test_kernels_paged_decode_fused import DECODE, _decode, _model

    from cudaformers import AutoModelForCausalLM
    from cudaformers.kernels import fused_norm_decode
    from cudaformers.kernels.hub import KernelConfig

    # The projection replaced alone: only where it runs the GEMV anyway (Linear mapped to it).
    mapping = {**DECODE, "Linear": {"cpu": {"inference": "cudaformers:gemv", "training": ""}}}
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), kernel_config=KernelConfig(mapping),
                                                 attn_implementation="triton").eval()
    monkeypatch.setattr(fused_norm_decode, "FOLD_MAX_HIDDEN", model.config.hidden_size - 1)
    monkeypatch.setattr(gh, "HEAD_EPILOGUE", False)
    want = _decode(model, monkeypatch, fuse=False)
    monkeypatch.setattr(gh, "HEAD_EPILOGUE", True)
    folds = []
    real = fused_norm_decode.gemv_rms_norm
    monkeypatch.setattr(fused_norm_decode, "gemv_rms_norm", lambda *a, **k: (folds.append(1), real(*a, **k))[1])
    got = _decode(model, monkeypatch, fuse=False)
    assert head_calls == [2] * 7 * len(model.model.layers) and not folds
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1] + got[2], want[1] + want[2]):
        assert torch.equal(a, b)
    # Left on PyTorch's matmul, the projection stays apart (the GEMV would round otherwise)
    head_calls.clear()
    _decode(_model("qwen3", "triton"), monkeypatch, fuse=False, generate=False)
    assert not head_calls


def test_decode_layer_keeps_the_two_launches_where_the_fold_would_differ(head_calls, monkeypatch):
    from test_kernels_paged_decode_fused import _decode, _model

    from cudaformers.kernels import heads_fold

    monkeypatch.setattr(gh, "HEAD_EPILOGUE", True)
    model = _model("qwen3", "triton")
    model.model.layers[0].self_attn.rotary.register_forward_hook(lambda *a: None)  # a hook it would bypass
    reasons = []
    real = heads_fold.rotation_declines
    monkeypatch.setattr(heads_fold, "rotation_declines", lambda *a: (lambda r: (reasons.append(r), r)[1])(
        real(*a)))
    _decode(model, monkeypatch, fuse=False, generate=False)
    assert head_calls == [2] * 3 * (len(model.model.layers) - 1)  # every layer but the hooked one
    assert "the rotary module does not run the hub's qk_norm_rope kernel alone" in reasons


# -- the quantized fragment GEMV finishing its heads (kernels/quant_gemv_heads.py), its PTX emulated -------

@pytest.fixture
def fragment_on_cpu(monkeypatch):
    from ptx_exec import emulate_inline_asm

    from cudaformers.kernels import quant_gemv_mma as fragment

    emulate_inline_asm(monkeypatch)
    monkeypatch.setattr(fragment, "supports", lambda x, w: x.dtype == torch.bfloat16 and x.dim() == 2
                        and x.shape[0] == 1)
    return fragment


# (format, heads, head_dim, k, plan): 1-2 programs a head (16- and 32-row programs), GQA and MHA
QUANT_CASES = [("int8", 2, 1, 32, 128, (2, 1, 2)), ("int4_asym", 2, 1, 32, 256, (2, 2, 1)),
               ("int4_sym", 1, 1, 64, 256, (1, 2, 3)), ("int8", 3, 3, 16, 192, (4, 1, 1))]


@pytest.mark.parametrize("fmt,hq,hkv,d,k,plan", QUANT_CASES, ids=str)
@pytest.mark.parametrize("rms", [False, True])
def test_quantized_equals_the_fragment_gemv_then_qk_norm_rope(fragment_on_cpu, fmt, hq, hkv, d, k, plan, rms):
    from test_kernels_quant_gemv_mma import _weights

    from cudaformers.kernels.quant_gemv_heads import quant_gemv_mma_heads

    fragment = fragment_on_cpu
    n = (hq + 2 * hkv) * d
    w, x, bias = _weights(fmt, n, k, seed=n + k)
    g = torch.Generator().manual_seed(k)
    qw, kw = ((1 + 0.1 * torch.randn(d, generator=g)).bfloat16() for _ in range(2))
    cos, sin = _cos_sin(1, d, torch.bfloat16)
    shares = (torch.rand(3, generator=g) * k, 1e-6) if rms else None
    start, *caches = (_caches(3, 2, hkv, d, torch.bfloat16, torch.Generator().manual_seed(7)) for _ in range(3))
    slots = torch.tensor([3])
    heads = gh.Heads(hq, hkv, d, cos, sin, qw, kw, 1e-6, 1e-5, (*caches[0], slots))

    q, k_out, v = quant_gemv_mma_heads(x, w, heads, bias, shares, plan)

    qkv = fragment._launch(x, w, bias, plan, None, shares)
    wq, wk, wv = (p.view(1, -1, d) for p in qkv.split([hq * d, hkv * d, hkv * d], -1))
    want_q, want_k = qk_norm_rope_forward(wq, wk, cos, sin, qw, kw, 1e-6, 1e-5, KVStore(wv, *caches[1], slots))
    assert torch.equal(q, want_q) and torch.equal(k_out, want_k) and torch.equal(v, wv)
    for got, want, before in zip(caches[0], caches[1], start):
        assert torch.equal(got, want) and not torch.equal(got, before)
    assert int(arrival_counters(x.device, 64)[:64].abs().sum()) == 0


def test_quantized_refuses_heads_across_programs(fragment_on_cpu):
    from test_kernels_quant_gemv_mma import _weights

    from cudaformers.kernels.quant_gemv_heads import quant_gemv_mma_heads, quant_heads_declines

    w, x, _ = _weights("int8", 64, 128, seed=1)
    cos, sin = _cos_sin(1, 16, torch.bfloat16)
    heads = gh.Heads(2, 1, 16, cos, sin)  # 16-row heads in 32-row programs
    assert "not a whole number" in quant_heads_declines(x, w, heads, (2, 2, 1))
    with pytest.raises(ValueError, match="run the GEMV and qk_norm_rope apart"):
        quant_gemv_mma_heads(x, w, heads, plan=(2, 2, 1))
    with pytest.raises(ValueError, match="packed q/k/v weight"):
        quant_gemv_mma_heads(x, w, heads._replace(n_q_heads=3), plan=(2, 1, 1))


@pytest.fixture
def quant_model(fragment_on_cpu, monkeypatch):
    """A tiny int8 Qwen3 in bf16 with the decode kernels mapped onto the CPU, whose one-row quantized
    matmuls run the emulated fragment GEMV (as on a GPU) instead of the reference, in 2-warp programs:
    with and without the head epilogue the same arithmetic, so the same bits."""
    import tiny

    from cudaformers import AutoModelForCausalLM, Int8Config
    from cudaformers.kernels.hub import KernelConfig
    from cudaformers.quant import linear as quant_linear

    fragment = fragment_on_cpu
    plan = (2, 1, 2)
    monkeypatch.setattr(fragment, "default_plan", lambda n, fmt, device: plan)
    reference = quant_linear.quant_matmul_reference

    def like_the_gpu(x, w, bias=None):
        if fragment.supports(x, w) and w.out_features % 16 == 0:
            return fragment._launch(x, w, bias, plan)
        return reference(x, w, bias)

    monkeypatch.setattr(quant_linear, "quant_matmul_reference", like_the_gpu)
    mapping = {layer: {"cpu": {"inference": name, "training": ""}} for layer, name in (
        ("DecoderLayer", "cudaformers:fused_norm_decode"), ("GatedMLP", "cudaformers:fused_mlp_decode"),
        ("SiluAndMul", "cudaformers:act_and_mul"), ("RMSNorm", "cudaformers:rms_norm"),
        ("rotary_pos_emb", "cudaformers:qk_norm_rope"))}
    return AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), dtype=torch.bfloat16,
                                                kernel_config=KernelConfig(mapping),
                                                quantization_config=Int8Config()).eval()


@pytest.mark.parametrize("norm_fold", [False, True])
def test_quantized_decode_layer_finishes_its_heads_with_the_same_tokens(quant_model, norm_fold, monkeypatch):
    """generate(): each one-token step's q/k/v fragment GEMVs finish their heads (and write the cache the
    next steps read), with the norm fold of quant_norm_fold.py or without; the tokens of the two launches."""
    from cudaformers.kernels import quant_gemv_heads, quant_norm_fold

    calls = []
    real = quant_gemv_heads.quant_gemv_mma_heads
    monkeypatch.setattr(quant_gemv_heads, "quant_gemv_mma_heads", lambda *a, **k: (calls.append(k.get("out")),
                                                                                     real(*a, **k))[1])
    monkeypatch.setattr(quant_norm_fold, "NORM_FOLD", norm_fold)
    ids = torch.randint(3, 211, (1, 5), generator=torch.Generator().manual_seed(6))
    finals = []  # each step's final hidden states, the lm_head's input
    quant_model.lm_head.register_forward_pre_hook(lambda mod, args: finals.append(args[0].clone()))
    monkeypatch.setattr(gh, "HEAD_EPILOGUE", False)
    want = quant_model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert not calls
    monkeypatch.setattr(gh, "HEAD_EPILOGUE", True)
    got = quant_model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert len(calls) == 3 * len(quant_model.model.layers)  # steps 2-4: the first token is the prompt's
    assert torch.equal(got, want)
    steps = len(finals) // 2
    assert steps == 4 and all(torch.equal(a, b) for a, b in zip(finals[:steps], finals[steps:]))


def test_explain_says_what_the_decode_layer_does_as_switched(monkeypatch):
    from test_kernels_paged_decode_fused import _model

    model = _model("qwen3", "triton")
    monkeypatch.setattr(gh, "HEAD_EPILOGUE", False)
    assert "decode layer: norms folded" in model.explain() and "finishes its heads" not in model.explain()
    monkeypatch.setattr(gh, "HEAD_EPILOGUE", True)  # switched after loading: explain() says so
    assert "the q/k/v GEMV finishes its heads" in model.explain()


_COMPILE_QUANT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cudaformers.kernels import quant_gemv_heads as qh
types = dict(x_ptr="*i64", q_ptr="*i64", s_ptr="*bf16", z_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16", n_blocks="i32",
             ld_q="i32", p_ptr="*fp32", n_shares="i32", n_in="i32", eps="fp32", qo_ptr="*bf16", ko_ptr="*bf16",
             qw_ptr="*bf16", kw_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", kc_ptr="*bf16", vc_ptr="*bf16",
             slot_ptr="*i64", arrived_ptr="*i32", n_q_heads="i32", n_kv_heads="i32", q_eps="fp32", k_eps="fp32",
             half="i32", rot="i32")
names = [p.name for p in qh._heads_kernel.params]
for fmt, tiles, depth, shares, norm, store in ((0, 1, 2, 0, True, True), (0, 2, 1, 256, True, True),
                                              (1, 1, 3, 0, False, True), (1, 1, 2, 256, True, False)):
    const = dict(FMT=fmt, WARPS=8, TILES=tiles, DEPTH=depth, HAS_ZEROS=fmt == 0, HAS_BIAS=False, EVEN=False,
                 SHARES=shares, USE_PDL=True, HEAD_DIM=128, BLOCK_D=128, HAS_QK_NORM=norm, STORE=store)
    sig = {n: "constexpr" if n in const else types[n] for n in names}
    sig["s_ptr"] = "*fp32" if fmt else "*bf16"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    c = triton.compile(ASTSource(qh._heads_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=8))
    ptx = c.asm["ptx"]
    print(ptx.count("mma.sync.aligned"), ptx.count("atom.global.gpu.acq_rel.add"),
          ptx.count("griddepcontrol.wait"), len(c.asm["cubin"]))
"""


def test_the_quantized_kernel_builds_for_hopper():
    """Compiled (not interpreted) for sm_90, as the GPU would: the fragment loop's mmas, one arrival, one wait."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _COMPILE_QUANT], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()[-4:]
    assert len(lines) == 4
    for line in lines:
        mmas, atomics, waits, cubin = map(int, line.split())
        assert mmas > 0 and atomics == 1 and waits == 1 and cubin > 0, line
