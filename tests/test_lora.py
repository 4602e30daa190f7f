"""LoRA against the peft package (the oracle): adapters move both ways with equal logits, merging,
trainable parameters and the errors a user can meet."""

import json

import pytest
import torch

from cudaformers import AutoModelForCausalLM, LoraConfig, PeftModel, get_peft_model
from cudaformers.errors import CheckpointError, UnsupportedError
from tests import tiny

peft = pytest.importorskip("peft")
IDS = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
CASES = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all_linear_bias": dict(r=8, lora_alpha=16, target_modules="all-linear", bias="all"),
    "regex_lora_only_bias_rslora": dict(r=4, lora_alpha=8, target_modules=r".*layers\.1\..*_proj",
                                        bias="lora_only", use_rslora=True),
    "modules_to_save": dict(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"],
                            modules_to_save=["lm_head"]),
}


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.fixture(scope="module")
def folder():
    return tiny.checkpoint("llama_bias")


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_adapter_loads_here(case, folder, tmp_path):
    theirs = peft.get_peft_model(tiny.hf_model(folder), peft.LoraConfig(**CASES[case], init_lora_weights=False))
    _perturb(theirs, 1)
    theirs.save_pretrained(tmp_path)
    ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path)
    torch.testing.assert_close(_logits(ours), _logits(theirs), atol=1e-5, rtol=1e-5)
    assert ours.get_nb_trainable_parameters()[0] == 0  # loaded for inference unless is_trainable=True


@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_saved_here_loads_in_peft(case, folder, tmp_path):
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**CASES[case]))
    _perturb(ours, 2)
    ours.save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(tiny.hf_model(folder), tmp_path)
    torch.testing.assert_close(_logits(ours), _logits(theirs), atol=1e-5, rtol=1e-5)
    expected = peft.get_peft_model(tiny.hf_model(folder), peft.LoraConfig(**CASES[case]))
    assert ours.get_nb_trainable_parameters()[0] == expected.get_nb_trainable_parameters()[0]


def test_adapter_file_uses_peft_key_names(folder, tmp_path):
    from safetensors.torch import load_file

    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**CASES["qv"]))
    ours.save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight" in keys and len(keys) == 8
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["base_model_name_or_path"] == str(folder)


def test_new_adapter_is_a_no_op_and_only_adapters_train(folder, capsys):
    base = AutoModelForCausalLM.from_pretrained(folder)
    before = _logits(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "k_proj"]))
    assert torch.equal(_logits(model), before)  # B starts at zero
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    model.print_trainable_parameters()
    # per layer: q (A 4x64 + B 64x4) + k (A 4x64 + B 32x4) = 896
    assert "trainable params: 1,792 ||" in capsys.readouterr().out
    with model.disable_adapter():
        assert torch.equal(_logits(model), before)


def test_merge_and_unload(folder):
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**CASES["all_linear_bias"]))
    _perturb(model, 3)
    with_adapters = _logits(model)
    merged = model.merge_and_unload()
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    assert type(merged.model.layers[0].mlp.up_proj) is torch.nn.Linear
    torch.testing.assert_close(_logits(merged), with_adapters, atol=1e-5, rtol=1e-5)


def test_generate_with_adapters(folder):
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**CASES["qv"]))
    _perturb(model, 4)
    out = model.generate(IDS[:1], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, IDS.shape[1] + 3)


def test_errors(folder, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(UnsupportedError, match="matches no Linear"):
        get_peft_model(model, LoraConfig(target_modules=["qkv"]))
    with pytest.raises(UnsupportedError, match="target_modules"):
        get_peft_model(model, LoraConfig())
    with pytest.raises(CheckpointError, match="adapter_config.json"):
        PeftModel.from_pretrained(model, tmp_path)
    theirs = peft.get_peft_model(tiny.hf_model(folder), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    theirs.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedError, match="use_dora"):
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path)
