"""Training on a GPU: bf16 autocast and fp16 with a scaler, logs with MFU and memory, packing through
the GPU attention backends, and `cudaformers plan`'s activation estimate against a measured peak."""

import gc
import json
import os

import pytest
import torch

import tiny
from cudaformers import AutoModelForCausalLM
from cudaformers.train.arguments import TrainingArguments
from cudaformers.train.memory import plan
from cudaformers.train.trainer import Trainer
from test_train_toy import token_dataset

pytestmark = pytest.mark.gpu


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=3e-3, max_steps=20,
                logging_steps=5, save_strategy="no", disable_tqdm=True, lr_scheduler_type="constant")
    return TrainingArguments(**{**base, **kw})


def logs(tmp_path):
    return [json.loads(line) for line in open(os.path.join(tmp_path, "log.jsonl"))]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("packing", [False, True])
def test_trains_on_the_gpu(tmp_path, precision, packing):
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), dtype=torch.float32, device_map="cuda")
    a = args(tmp_path, **{precision: True}, packing=packing, max_seq_length=64 if packing else None)
    assert a.device == torch.device("cuda", 0)
    Trainer(model, a, train_dataset=token_dataset(160, min_len=4, max_len=40, vocab=211)).train()
    rows = logs(tmp_path)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3
    assert rows[-1]["peak_mem_gib"] > 0 and rows[-1]["tokens_per_s"] > 0
    if "H200" in torch.cuda.get_device_name() or "H100" in torch.cuda.get_device_name():
        assert 0 < rows[-1]["mfu"] < 1
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_resume_is_exact_on_the_gpu(tmp_path):
    data = token_dataset(64, vocab=211)
    kw = dict(max_steps=6, save_strategy="steps", save_steps=3, logging_steps=1, bf16=True)
    full = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), dtype=torch.float32, device_map="cuda")
    Trainer(full, args(tmp_path / "a", **kw), train_dataset=data).train()
    again = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), dtype=torch.float32, device_map="cuda")
    Trainer(again, args(tmp_path / "b", **kw), train_dataset=data).train(
        resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    want = {r["step"]: r["loss"] for r in logs(tmp_path / "a")}
    got = {r["step"]: r["loss"] for r in logs(tmp_path / "b")}
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([want[s] for s in (4, 5, 6)], rel=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_activation_estimate_matches_measured_peak(tmp_path, checkpointing):
    """A qwen3-0.6b-shaped model cut to 6 layers, batch 4 x 2048: what the backward keeps (activations,
    loss, gradients) as planned vs measured, within 35%."""
    from cudaformers.config import PretrainedConfig

    shape = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 max_position_embeddings=4096, hidden_act="silu")
    config = PretrainedConfig(**shape)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, device="cuda")
    from cudaformers.kernels.hub import kernelize

    kernelize(model)  # the fused linear + cross-entropy, as the plan assumes
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, 151936, (4, 2048), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    gc.collect()
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()  # weights + optimizer state
    torch.cuda.reset_peak_memory_stats()
    step()
    measured = torch.cuda.max_memory_allocated() - static
    p = plan(config, batch=4, seq=2048, gradient_checkpointing=checkpointing, fused_loss=True)
    estimate = p.get("activations") + p.get("loss") + p.get("gradients") + p.get("bf16 weight copies")
    assert 0.65 * measured <= estimate <= 1.35 * measured, (estimate / 2**30, measured / 2**30)
