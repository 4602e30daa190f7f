"""Packed q/k/v and gate/up projections: same numbers, same names, and out of the way of training
and adapters."""

import torch

import tiny
from cudaformers import AutoModelForCausalLM, LoraConfig, get_peft_model
from cudaformers.kernels.fused_projections import fuse_projections


def test_loaded_models_are_packed_and_match_transformers():
    folder = tiny.checkpoint("qwen2")  # qkv biases packed too
    model = AutoModelForCausalLM.from_pretrained(folder)
    attn = model.model.layers[0].self_attn
    assert attn.packed_qkv.weight.data_ptr() == attn.q_proj.weight.data_ptr()
    assert "packed" in model.explain()
    ids = torch.randint(3, 211, (2, 18))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny.hf_model(folder)(ids).logits, atol=1e-4, rtol=1e-4)
    assert set(model.state_dict()) == set(tiny.hf_model(folder).state_dict())


def test_training_uses_separate_parameters_and_updates_the_packed_copy():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama")).train()
    ids = torch.randint(3, 211, (2, 12))
    model(ids, labels=ids).loss.backward()
    attn = model.model.layers[1].self_attn
    assert attn.v_proj.weight.grad is not None and attn.v_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():
        attn.v_proj.weight.add_(1.0)  # an optimizer step writes through the view
    n_q, n_k = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    assert torch.equal(attn.packed_qkv.weight[n_q + n_k:], attn.v_proj.weight)


def test_lora_adapters_are_not_bypassed():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama")).eval()
    ids = torch.randint(3, 211, (1, 10))
    with torch.no_grad():
        before = model(ids).logits
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    with torch.no_grad():
        after = peft(ids).logits
    assert not torch.allclose(before, after)


def test_packing_twice_is_harmless():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"))
    ids = torch.randint(3, 211, (1, 9))
    with torch.no_grad():
        before = model(ids).logits
        fuse_projections(model)
        torch.testing.assert_close(model(ids).logits, before)


def test_unpack_restores_separate_storage():
    from cudaformers.kernels.fused_projections import unpack_projections

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen2"))
    ids = torch.randint(3, 211, (1, 9))
    with torch.no_grad():
        before = model(ids).logits
    assert unpack_projections(model) == 4
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn, "packed_qkv") and attn.q_proj.weight.data_ptr() != attn.k_proj.weight.data_ptr()
    assert "projections" not in model.explain()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before)
