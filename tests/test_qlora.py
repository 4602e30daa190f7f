"""QLoRA on CPU: a 4-bit base with LoRA adapters trains (gradients through the dequantizing matmul,
with gradient checkpointing); a quantized model without adapters refuses to train."""

import pytest
import torch

from cudaformers import AutoModelForCausalLM, BitsAndBytesConfig, Int4Config, LoraConfig, PeftModel, get_peft_model
from cudaformers.errors import UnsupportedError
from tests import tiny

NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


def _model(config=None):
    return AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"),
                                                quantization_config=config or BitsAndBytesConfig(**NF4))


def test_qlora_loss_falls_with_gradient_checkpointing():
    base = _model()
    base.gradient_checkpointing_enable()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.float32 for p in params)
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(20):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_adapter_gradients_match_a_dequantized_base():
    """Same adapters on (a) the 4-bit base and (b) a float model holding its dequantized weights:
    equal loss and equal adapter gradients, so the backward through the quantized matmul is right."""
    quantized = get_peft_model(_model(Int4Config(group_size=32)), LoraConfig(r=4, target_modules=["v_proj", "up_proj"],
                                                                         init_lora_weights=False))
    plain = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"))
    with torch.no_grad():
        for name, module in quantized.base_model.named_modules():
            if hasattr(module, "dequantize") and hasattr(module, "quantize_"):
                plain.get_submodule(name.removesuffix(".base_layer")).weight.copy_(module.dequantize(torch.float32))
    plain = get_peft_model(plain, LoraConfig(r=4, target_modules=["v_proj", "up_proj"]))
    plain.load_adapter_weights(quantized.adapter_state_dict())
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (quantized, plain):
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 8
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_training_a_quantized_model_without_adapters_is_an_error():
    model = _model()
    with pytest.raises(UnsupportedError, match="cannot be trained.*LoRA"):
        model.train()
    assert not model.training


def test_qlora_adapter_round_trip(tmp_path):
    model = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj", "o_proj"], init_lora_weights=False))
    ids = torch.randint(3, 200, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    again = PeftModel.from_pretrained(_model(), tmp_path)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, expected)
