"""`cudaformers plan`: the arithmetic of each line, and the command."""

import pytest

import tiny
from cudaformers.cli import main
from cudaformers.errors import UnsupportedError
from cudaformers.train.memory import GiB, Shapes, plan

QWEN3_06B = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)


def test_parameter_count_matches_the_real_model():
    import torch
    from cudaformers import AutoModelForCausalLM

    for name in ("qwen3", "llama_mha_untied", "llama_tied"):
        model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name), dtype=torch.float32)
        linear, other = Shapes.from_config(model.config).counts()
        assert linear + other == model.num_parameters(), name


def test_training_lines():
    p = plan(QWEN3_06B, batch=8, seq=2048)
    n = sum(Shapes.from_config(QWEN3_06B).counts())
    assert 0.59e9 < n < 0.61e9  # Qwen3-0.6B
    assert p.get("weights") == n * 4 and p.get("gradients") == n * 4 and p.get("optimizer") == n * 8
    assert 10 * GiB < p.get("activations") < 25 * GiB
    unfused = plan(QWEN3_06B, batch=8, seq=2048, fused_loss=False)
    assert unfused.get("logits") > 20 * GiB > 2 * GiB > p.get("loss")
    ckpt = plan(QWEN3_06B, batch=8, seq=2048, gradient_checkpointing=True)
    assert ckpt.get("activations") < p.get("activations") / 5


def test_sharding_quantization_and_lora():
    one = plan(QWEN3_06B, batch=1, seq=1024)
    four = plan(QWEN3_06B, batch=1, seq=1024, gpus=4, strategy="fsdp")
    assert four.get("optimizer") == pytest.approx(one.get("optimizer") / 4)
    assert plan(QWEN3_06B, batch=1, seq=1024, gpus=4, strategy="ddp").get("optimizer") == one.get("optimizer")
    qlora = plan(QWEN3_06B, batch=1, seq=1024, quant="nf4", lora_rank=16)
    assert qlora.get("weights") < one.get("weights") / 4 and qlora.get("optimizer") < 0.1 * GiB
    with pytest.raises(UnsupportedError, match="--lora"):
        plan(QWEN3_06B, quant="int4")


def test_inference_kv_cache():
    p = plan(QWEN3_06B, task="infer", batch=32, seq=1024)
    assert p.get("KV cache") == 2 * 28 * 8 * 128 * 2 * 32 * 1024
    assert p.get("weights") == sum(Shapes.from_config(QWEN3_06B).counts()) * 2


def test_plan_command(capsys):
    assert main(["plan", str(tiny.checkpoint("qwen3")), "--batch", "2", "--seq", "64", "--gpu-mem", "1"]) == 0
    out = capsys.readouterr().out
    assert "fits on a 1 GiB GPU" in out and "optimizer" in out
    assert main(["plan", str(tiny.checkpoint("qwen3")), "--task", "infer", "--batch", "4096", "--seq", "65536",
                 "--gpu-mem", "1"]) == 1
    assert "does NOT fit" in capsys.readouterr().out


def test_recomputed_mlp_saves_one_intermediate_activation_per_layer():
    kept = plan(QWEN3_06B, batch=8, seq=2048, recompute_mlp=False).get("activations")
    recomputed = plan(QWEN3_06B, batch=8, seq=2048).get("activations")  # follows fused_loss (use_kernels)
    assert kept - recomputed == 8 * 2048 * 28 * 3072 * 2
    assert plan(QWEN3_06B, batch=8, seq=2048, fused_loss=False).get("activations") == kept
