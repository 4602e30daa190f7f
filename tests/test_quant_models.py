"""Quantized models end to end on CPU (the PyTorch reference path): loading with each config, the
error against the unquantized model, save/load round trips, and the errors a user can meet (GPTQ and
AWQ checkpoints: test_quant_checkpoints.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from cudaformers import AutoModelForCausalLM, BitsAndBytesConfig, FP8Config, Int4Config, Int8Config
from cudaformers.errors import CheckpointError, UnsupportedError
from cudaformers.quant.linear import QuantLinear
from tests import tiny

CONFIGS = {
    "int8": lambda: Int8Config(),
    "int4": lambda: Int4Config(group_size=32),
    "int4_asym": lambda: Int4Config(group_size=32, sym=False),
    "nf4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4_dq": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4",
                                         bnb_4bit_use_double_quant=True),
    "bnb8": lambda: BitsAndBytesConfig(load_in_8bit=True),
}
# Largest logit error against the fp32 model, as a share of the largest logit: int8 keeps ~1%,
# 4-bit formats ~15% on this tiny random model (its weights are Gaussian, the worst case for 4 bits).
BOUNDS = {"int8": 0.02, "bnb8": 0.02, "int4": 0.25, "int4_asym": 0.25, "nf4": 0.25, "fp4_dq": 0.3}
IDS = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def folder():
    return tiny.checkpoint("llama_bias")


@pytest.fixture(scope="module")
def reference(folder):
    return _logits(AutoModelForCausalLM.from_pretrained(folder))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_quantized_model_is_close_and_round_trips(name, folder, reference, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=CONFIGS[name]())
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 7 and not isinstance(model.lm_head, QuantLinear)
    out = _logits(model)
    rel = (out - reference).abs().max().item() / reference.abs().max().item()
    assert 0 < rel <= BOUNDS[name], f"{name}: relative logit error {rel:.3f}"
    assert "PyTorch reference" in model.explain() and "bytes/weight" in model.explain()

    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype in (torch.int8, torch.uint8)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=saved)
    assert torch.equal(_logits(again), out)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)  # the stored quantization_config applies itself
    assert torch.equal(_logits(plain), out)


def test_bytes_per_weight(folder):
    per_weight = {}
    for name in ("int8", "int4", "nf4", "fp4_dq"):
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=CONFIGS[name]())
        layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
        nbytes = sum(p.numel() * p.element_size() for m in layers for n, p in m.named_parameters() if n != "bias")
        per_weight[name] = nbytes / sum(m.in_features * m.out_features for m in layers)
    assert per_weight["int8"] == pytest.approx(1.0, abs=0.07)  # + an fp32 scale per row of 64-128
    assert per_weight["int4"] == pytest.approx(0.5 + 2 / 32, abs=0.01)  # fp16 scale per 32
    assert per_weight["nf4"] == pytest.approx(0.5 + 4 / 64, abs=0.01)  # fp32 absmax per 64
    assert per_weight["fp4_dq"] < per_weight["nf4"] - 0.04  # int8 absmax


def test_modules_to_not_convert_and_transformers_config(folder):
    import transformers

    hf_cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             llm_int8_skip_modules=["lm_head", "down_proj"])
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=hf_cfg)
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)
    assert type(model.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert model.model.layers[0].self_attn.q_proj.method == "nf4"


def test_compute_dtype(folder):
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype="bfloat16"))
    assert model.model.layers[0].mlp.up_proj.compute_dtype == torch.bfloat16
    assert _logits(model).dtype == torch.float32  # activations between layers keep the model dtype


def test_fp8_on_cpu_is_an_error_naming_alternatives(folder):
    with pytest.raises(UnsupportedError, match=r"fp8.*8\.9.*Int8Config or Int4Config"):
        AutoModelForCausalLM.from_pretrained(folder, quantization_config=FP8Config())


def test_fp8_reference_math():
    from cudaformers.quant.fp8 import fp8_matmul_reference, quantize_fp8_rows

    w = torch.randn(32, 64)
    q, s = quantize_fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn
    assert ((q.float() * s - w).abs() <= w.abs() * 2 ** -3 + 1e-6).all()  # e4m3: 3 mantissa bits
    x = torch.randn(5, 64)
    rel = (fp8_matmul_reference(x, q, s[:, 0]) - x @ w.t()).abs().max() / (x @ w.t()).abs().max()
    assert rel < 0.05


@pytest.mark.parametrize("bad", [dict(load_in_4bit=True, load_in_8bit=True), dict(load_in_4bit=True,
                                 bnb_4bit_quant_type="int3"), dict()])
def test_bad_bnb_configs(bad):
    with pytest.raises(UnsupportedError):
        BitsAndBytesConfig(**bad)


def test_unknown_quant_method_and_requantizing(folder):
    with pytest.raises(UnsupportedError, match="quant_method='awq-ish'"):
        AutoModelForCausalLM.from_pretrained(folder, quantization_config={"quant_method": "awq-ish"})
    from cudaformers.quant.apply import quantize

    model = AutoModelForCausalLM.from_pretrained(folder)
    quantize(model, Int8Config())
    with pytest.raises(UnsupportedError, match="already quantized"):
        quantize(model, Int4Config())


def test_quantize_loaded_model_matches_quantize_on_load(folder):
    from cudaformers.quant.apply import quantize

    on_load = _logits(AutoModelForCausalLM.from_pretrained(folder, quantization_config=Int4Config(group_size=32)))
    after = quantize(AutoModelForCausalLM.from_pretrained(folder), Int4Config(group_size=32))
    assert torch.equal(_logits(after), on_load)


# -- packed q/k/v and gate/up of quantized models ---------------------------------------------------------
@pytest.mark.parametrize("name", ["int8", "int4_asym", "nf4"])
def test_packed_quantized_projections_are_exact(name, folder):
    """The stacked quantized q/k/v and gate/up give bit-identical logits and greedy tokens to the separate
    layers (rows quantize independently), and share their storage (no second copy)."""
    from cudaformers.kernels.fused_projections import unpack_projections
    from cudaformers.quant.packing import PackedQuantLinear

    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=CONFIGS[name]())
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.packed_qkv, PackedQuantLinear) and "packed" in model.explain()
    assert attn.k_proj.weight.data_ptr() == attn.packed_qkv.layer.weight.data_ptr() + \
        attn.q_proj.weight.numel() * attn.q_proj.weight.element_size()
    packed_logits = _logits(model)
    packed_tokens = model.generate(IDS[:1], max_new_tokens=6, do_sample=False)
    assert unpack_projections(model) == 4
    torch.testing.assert_close(_logits(model), packed_logits, atol=0, rtol=0)
    assert torch.equal(model.generate(IDS[:1], max_new_tokens=6, do_sample=False), packed_tokens)


def test_double_quantized_nf4_is_not_packed(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=CONFIGS["fp4_dq"]())
    assert not hasattr(model.model.layers[0].self_attn, "packed_qkv")


def test_quantizing_a_loaded_model_repacks_its_projections(folder):
    from cudaformers.kernels.fused_projections import PackedLinear
    from cudaformers.quant.apply import quantize
    from cudaformers.quant.packing import PackedQuantLinear

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(model.model.layers[0].mlp.packed_gate_up, PackedLinear)
    quantize(model, Int8Config())
    assert isinstance(model.model.layers[0].mlp.packed_gate_up, PackedQuantLinear)  # the float copy is gone


def test_checkpoint_with_the_old_packing_is_refused(folder, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=Int4Config(group_size=32))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]["packing"]  # as written before the plane layout
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="earlier cudaformers"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
