"""Quantization on a real GPU: the compiled Triton kernels against the reference at model sizes, the
fp8 path, quantized models end to end (CUDA-graph decode included) and a QLoRA step in bf16."""

import json
import tempfile

import pytest
import torch

from cudaformers import AutoModelForCausalLM, BitsAndBytesConfig, FP8Config, Int4Config, Int8Config, LoraConfig
from cudaformers import get_peft_model
from cudaformers.kernels import quant_matmul as qm
from cudaformers.quant.fp8 import FP8Linear, fp8_matmul_reference
from tests import tiny

pytestmark = pytest.mark.gpu
FORMATS = ["int8", "int4_sym", "int4_asym", "nf4", "fp4_dq"]


def _packed(fmt, w, group=128):
    # Not imported from tests/test_quant_kernels.py: that module switches Triton to the interpreter.
    from cudaformers.quant.int4 import quantize_int4
    from cudaformers.quant.int8 import quantize_int8
    from cudaformers.quant.nf4 import CODES, double_quantize, quantize_4bit

    k = w.shape[1]
    if fmt == "int8":
        return qm.PackedWeight("int8", *quantize_int8(w), k)
    if fmt.startswith("int4"):
        q, s, z = quantize_int4(w, group, sym=fmt == "int4_sym")
        return qm.PackedWeight("int4", q, s, k, group, zeros=z)
    q, absmax = quantize_4bit(w, fmt[:3])
    code = torch.tensor(CODES[fmt[:3]], device=w.device)
    if fmt.endswith("_dq"):
        q2, s2, offset = double_quantize(absmax)
        return qm.PackedWeight("lut4", q, q2, k, 64, code=code, scales2=s2, offset=float(offset))
    return qm.PackedWeight("lut4", q, absmax, k, 64, code=code)


def _bound(out, x, w, bias=None):
    ref32 = qm.quant_matmul_reference(x.float(), w, None if bias is None else bias.float())
    ref_lp = qm.quant_matmul_reference(x, w, bias).float()
    bound = 2 * (ref_lp - ref32).abs().max().item() + torch.finfo(x.dtype).eps * ref32.abs().max().item() + 1e-3
    return (out.float() - ref32).abs().max().item(), bound


# qwen3-8b decode shapes with q/k/v and gate/up packed, plus an odd one
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (1000, 1030)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 16, 300])
@pytest.mark.parametrize("nk", SHAPES, ids=str)
def test_kernels_match_reference_at_model_sizes(nk, m, fmt, dtype):
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(0)
    w = _packed(fmt, torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    bias = torch.randn(n, device="cuda", generator=g).to(dtype) * 0.1
    out = qm.quant_matmul_triton(x, w, bias)
    assert out.dtype == dtype
    err, bound = _bound(out, x, w, bias)
    assert err <= bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", ["int8", "int4_sym", "int4_asym"])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("tiles", [(16, 1, 1, 1, 4), (32, 2, 4, 2, 4), (64, 4, 1, 4, 3), (128, 2, 3, 4, 3)], ids=str)
def test_mma_ptx_unpack_equals_plain_ops(tiles, m, fmt, dtype):
    """The tensor-core kernel's PTX unpack gives the values the plain ops give: equal outputs, bit for bit."""
    from cudaformers.kernels.quant_mma import quant_mma

    if fmt == "int8":
        dtype = torch.float16  # the only x int8 runs on tensor cores for
    w = _packed(fmt, torch.randn(6144, 4096, device="cuda") * 0.02)
    x = torch.randn(m, 4096, device="cuda").to(dtype)
    out = quant_mma(x, w, tiles=tiles)
    torch.testing.assert_close(out, quant_mma(x, w, tiles=tiles, use_asm=False), atol=0, rtol=0)
    err, bound = _bound(out, x, w)
    assert err <= bound


@pytest.mark.parametrize("fmt", ["int8", "int4_sym"])
@pytest.mark.parametrize("m", [1, 16])
def test_fma_kernels_still_match_with_mma_off(fmt, m, monkeypatch):
    """USE_MMA = False (the A/B switch) keeps the FMA GEMV / tl.dot kernels, which must stay right."""
    monkeypatch.setattr(qm, "USE_MMA", False)
    w = _packed(fmt, torch.randn(4096, 4096, device="cuda") * 0.02)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    err, bound = _bound(qm.quant_matmul_triton(x, w), x, w)
    assert err <= bound


@pytest.mark.parametrize("fmt", ["int8", "int4_sym", "nf4"])
@pytest.mark.parametrize("block_n", [1, 2, 4, 8, 16])
def test_gemv_every_tiling_at_model_size(fmt, block_n):
    from cudaformers.kernels.quant_gemv import gemv_tiles, quant_gemv

    w = _packed(fmt, torch.randn(6144, 4096, device="cuda") * 0.02)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    n_blocks = w.n_blocks
    tiles = (block_n, *gemv_tiles(6144, n_blocks, w.block * w.bits // 32, x.device)[1:])
    err, bound = _bound(quant_gemv(x, w, tiles=tiles), x, w)
    assert err <= bound


def test_fp8_gemv_at_model_size():
    from cudaformers.kernels.quant_gemv import fp8_gemv
    from cudaformers.quant.fp8 import quantize_fp8_rows

    q, s = quantize_fp8_rows(torch.randn(6144, 4096, device="cuda") * 0.02)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ (q.float() * s).t()
    out = fp8_gemv(x, q, s[:, 0].contiguous())
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_chain_in_cuda_graph(fmt):
    """Three dependent GEMVs (PDL-launched on Hopper) in a graph equal the eager chain, bit for bit."""
    ws = [_packed(fmt, torch.randn(1024, 1024, device="cuda") * 0.05) for _ in range(3)]
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)

    def chain():
        y = x
        for w in ws:
            y = qm.quant_matmul_triton(y, w)
        return y
    chain()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    x.copy_(torch.randn_like(x))
    expected = chain()
    graph.replay()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("m", [1, 7, 64])
def test_fp8_linear_matches_reference(m):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.fail("fp8 needs compute capability 8.9+; run this file on an Ada/Hopper/Blackwell GPU")
    layer = FP8Linear(1024, 512, False, torch.bfloat16).cuda()
    layer.quantize_(torch.randn(512, 1024, device="cuda") * 0.02)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    if m == 1:  # the weight-only GEMV: x is not quantized
        ref = x.float() @ (layer.weight.float() * layer.weight_scale[:, None]).t()
    else:
        ref = fp8_matmul_reference(x.float(), layer.weight, layer.weight_scale)
    out = layer(x).float()
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-2


CONFIGS = {"int8": Int8Config, "int4": lambda: Int4Config(group_size=32),
           "nf4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True),
           "fp8": FP8Config}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_quantized_model_on_gpu_matches_cpu_reference_path(name):
    folder = tiny.checkpoint("qwen3")
    ids = torch.randint(3, 200, (2, 13), generator=torch.Generator().manual_seed(0))
    gpu = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cuda",
                                               quantization_config=CONFIGS[name]())
    assert "cuda" in gpu.explain() and "PyTorch reference" not in gpu.explain()
    assert "packed" in gpu.explain() or name == "nf4"  # double-quantized NF4 does not pack
    with torch.no_grad():
        out = gpu(ids.cuda()).logits.cpu()
    if name == "fp8":
        plain = AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            ref = plain(ids).logits
        assert ((out - ref).abs().max() / ref.abs().max()).item() < 0.1
    else:
        cpu = AutoModelForCausalLM.from_pretrained(folder, quantization_config=CONFIGS[name]())
        with torch.no_grad():
            ref = cpu(ids).logits
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    gen = gpu.generate(ids[:1].cuda(), max_new_tokens=8, do_sample=False)
    eager = gpu.generate(ids[:1].cuda(), max_new_tokens=8, do_sample=False, use_cuda_graph=False)
    assert torch.equal(gen, eager)


@pytest.mark.parametrize("kind", ["gptq_act_order", "awq"])
def test_imported_int4_checkpoint_on_gpu_matches_cpu_reference_path(kind):
    from tests.test_quant_checkpoints import write_awq_checkpoint, write_gptq_checkpoint

    src = tiny.checkpoint("llama_mha_untied")
    folder, _ = write_awq_checkpoint(src, 32) if kind == "awq" else write_gptq_checkpoint(src, 32, False, True)
    ids = torch.randint(3, 200, (2, 13), generator=torch.Generator().manual_seed(0))
    gpu = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cuda")
    cpu = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(gpu(ids.cuda()).logits.cpu(), cpu(ids).logits, atol=2e-4, rtol=2e-4)
    gen = gpu.generate(ids[:1].cuda(), max_new_tokens=8, do_sample=False)
    assert torch.equal(gen, gpu.generate(ids[:1].cuda(), max_new_tokens=8, do_sample=False, use_cuda_graph=False))


def test_block_fp8_checkpoint_runs_on_the_fp8_kernels(tmp_path):
    from tests.test_quant_fp8_blocks import write_fp8_block_checkpoint

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.fail("fp8 needs compute capability 8.9+; run this file on an Ada/Hopper/Blackwell GPU")
    folder, _ = write_fp8_block_checkpoint(tiny.checkpoint("llama_mha_untied"))
    ids = torch.randint(3, 200, (2, 13), generator=torch.Generator().manual_seed(0))
    gpu = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda")  # re-quantized
    assert any(isinstance(m, FP8Linear) for m in gpu.modules())
    floats = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  quantization_config=FP8Config(dequantize=True))
    with torch.no_grad():
        out, ref = gpu(ids.cuda()).logits.float().cpu(), floats(ids).logits
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 0.1
    gpu.save_pretrained(tmp_path)  # per-channel fp8 now
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["weight_block_size"] is None
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cuda")
    with torch.no_grad():
        assert torch.equal(again(ids.cuda()).logits.float().cpu(), out)


def test_qlora_step_bf16():
    folder = tiny.checkpoint("qwen3")
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda", quantization_config=(
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16")))
    base.gradient_checkpointing_enable()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0)).cuda()
    losses = []
    for _ in range(20):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses


@pytest.mark.parametrize("plan", [(4, 1, 1), (8, 1, 1), (16, 1, 1), (8, 2, 1), (16, 2, 1), (8, 1, 2), (16, 2, 2),
                                  (4, 2, 3), (16, 1, 3), None, (16, 1, 1, 1), (8, 1, 2, 1), (8, 2, 2, 1),
                                  (16, 1, 3, 1), (16, 1, 2, 2), (8, 2, 2, 2),  # staged (with x, weights only)
                                  (16, 1, 1, 3), (8, 2, 1, 3), (8, 1, 2, 3), (16, 1, 1, 4), (8, 2, 1, 4),
                                  (8, 1, 2, 4), (16, 1, 3, 4), (8, 2, 2, 4)], ids=str)  # pinned (read-only, coherent)
@pytest.mark.parametrize("fmt", ["int4_sym", "int4_asym", "int8"])
@pytest.mark.parametrize("nk", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (96, 256), (32, 128),
                                (64, 4224), (32, 1152)], ids=str)  # and blocks not a multiple of the warps
@pytest.mark.parametrize("unmasked", [False, True], ids=["masked", "unmasked"])
def test_fragment_gemv_matches_reference(nk, fmt, plan, unmasked, monkeypatch):
    from cudaformers.kernels import quant_gemv_mma as module

    monkeypatch.setattr(module, "UNMASKED_EVEN", unmasked)  # the weights' loads as by default (WIDE_LOADS)
    _fragment_gemv_matches(nk, fmt, plan)


@pytest.mark.parametrize("plan", [(8, 1, 2), (8, 2, 1), (16, 1, 3), None], ids=str)
@pytest.mark.parametrize("fmt", ["int4_sym", "int4_asym", "int8"])
@pytest.mark.parametrize("nk", [(6144, 4096), (24576, 4096), (4096, 12288), (64, 4224), (32, 1152)], ids=str)
@pytest.mark.parametrize("wide", [False, True])
def test_fragment_gemv_load_switches_match_reference(wide, nk, fmt, plan, monkeypatch):
    """``WIDE_LOADS`` (one 16-byte load a row and lane) off and on, with the unmasked loads: unmasked
    where the warps' blocks are even, masked where they are not (the last two shapes)."""
    from cudaformers.kernels import quant_gemv_mma as module

    monkeypatch.setattr(module, "WIDE_LOADS", wide)
    monkeypatch.setattr(module, "UNMASKED_EVEN", True)
    _fragment_gemv_matches(nk, fmt, plan)


def _fragment_gemv_matches(nk, fmt, plan):
    from cudaformers.kernels.quant_gemv_mma import quant_gemv_mma, supports

    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = _packed(fmt, torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    bias = torch.randn(n, device="cuda", generator=g).bfloat16() * 0.1
    assert supports(x, w)
    for b in (None, bias):
        out = quant_gemv_mma(x, w, b, plan=plan)
        assert out.dtype == torch.bfloat16 and out.shape == (1, n)
        err, bound = _bound(out, x, w, b)
        assert err <= bound, (err, bound)
    # In a CUDA graph, replayed after x changes.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_gemv_mma(x, w, bias, plan=plan)
    x.copy_(torch.randn(1, k, device="cuda", generator=g).bfloat16())
    graph.replay()
    err, bound = _bound(out, x, w, bias)
    assert err <= bound, (err, bound)


def test_fragment_gemv_takes_int8_only_in_whole_blocks():
    from cudaformers.kernels.quant_gemv_mma import quant_gemv_mma, supports

    w = _packed("int8", torch.randn(32, 100, device="cuda") * 0.02)  # K padded to 128 in the packing
    x = torch.randn(1, 100, device="cuda").bfloat16()
    assert not supports(x, w)
    with pytest.raises(ValueError, match="int8 with K a multiple of 64"):
        quant_gemv_mma(x, w)
    err, bound = _bound(qm.quant_matmul_triton(x, w), x, w)  # served by the FMA GEMV instead
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("act,plan", [("silu", p) for p in (None, (8, 1, 1), (8, 2, 1), (16, 2, 2), (4, 1, 3),
                                                             (8, 2, 2, 1), (16, 1, 1, 1), (8, 2, 1, 3), (8, 2, 1, 4),
                                                             (8, 1, 2, 4))]
                         + [("gelu_pytorch_tanh", None), ("gelu", None)], ids=str)
@pytest.mark.parametrize("fmt", ["int4_sym", "int4_asym", "int8"])
@pytest.mark.parametrize("nk", [(24576, 4096), (6144, 1024), (64, 256), (32, 1152)], ids=str)  # gate + up rows
def test_gated_fragment_gemv_is_the_act_and_mul_of_the_plain_one(nk, fmt, plan, act):
    """``act``: the packed gate/up GEMV with the act-and-mul in its epilogue, bit for bit the plain GEMV's
    output through the act-and-mul kernel, with and without bias and in a CUDA graph."""
    from cudaformers.kernels.activation import act_and_mul_forward
    from cudaformers.kernels.quant_gemv_mma import quant_gemv_mma

    n, k = nk  # every half a whole number of 16-row programs, so every plan applies
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = _packed(fmt, torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    bias = torch.randn(n, device="cuda", generator=g).bfloat16() * 0.1
    for b in (None, bias):
        plain = quant_gemv_mma(x, w, b, plan=plan)
        gated = quant_gemv_mma(x, w, b, plan=plan, act=act)
        assert gated.shape == (1, n // 2)
        assert torch.equal(gated, act_and_mul_forward(plain[:, : n // 2], plain[:, n // 2:], act))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gated = quant_gemv_mma(x, w, bias, plan=plan, act=act)
    x.copy_(torch.randn(1, k, device="cuda", generator=g).bfloat16())
    graph.replay()
    plain = quant_gemv_mma(x, w, bias, plan=plan)
    assert torch.equal(gated, act_and_mul_forward(plain[:, : n // 2], plain[:, n // 2:], act))


def test_gated_fragment_gemv_refuses_a_plan_that_splits_rows():
    from cudaformers.kernels.quant_gemv_mma import quant_gemv_mma

    w = _packed("int8", torch.randn(16, 256, device="cuda") * 0.02)
    x = torch.randn(1, 256, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="gated: 2 x 8 of the 8 output rows"):
        quant_gemv_mma(x, w, plan=(8, 2, 1), act="silu")


def _wide_model(method):
    """A 2-layer qwen3 1024 wide (8b's head dim, 0.6b's width) quantized with ``method``, triton attention
    and the kernels, on the GPU."""
    import transformers

    config = transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=4096,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="cf-wide-")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    quant = Int8Config() if method == "int8" else Int4Config(group_size=128)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                quantization_config=quant, attn_implementation="triton",
                                                use_kernels=True)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_decode_with_gated_gemv_gives_the_same_tokens(method, monkeypatch):
    """batch 1: ``GATED`` on runs the gated fragment GEMV at every decode step and gives the same greedy
    tokens as the two launches, graphs and eager."""
    from cudaformers.kernels import quant_gemv_mma as fragment
    from cudaformers.kernels import quant_gemv_plans

    model = _wide_model(method)
    ids = torch.randint(3, 4000, (1, 9), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    want = model.generate(ids, **kw)
    calls = []
    real = fragment.quant_gemv_mma
    monkeypatch.setattr(fragment, "quant_gemv_mma", lambda *a, **k: calls.append(k.get("act")) or real(*a, **k))
    monkeypatch.setattr(quant_gemv_plans, "GATED", ("int4", "int8"))
    model.__dict__.pop("_decode_runners", None)  # graphs captured without the switch
    got = model.generate(ids, **kw)
    eager = model.generate(ids, use_cuda_graph=False, **kw)
    assert "silu" in calls
    assert torch.equal(got, want) and torch.equal(eager, want)
