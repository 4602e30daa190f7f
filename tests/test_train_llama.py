"""The Trainer on cudaformers' own models (tiny random checkpoints), with transformers as the oracle."""

import json
import os

import pytest
import torch

import tiny
from cudaformers import AutoModelForCausalLM
from cudaformers.train.arguments import TrainingArguments
from cudaformers.train.trainer import Trainer
from test_train_toy import token_dataset


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=3e-3, max_steps=4,
                logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, lr_scheduler_type="constant",
                optim="adamw_torch")
    return TrainingArguments(**{**base, **kw})


def logged(tmp_path):
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "log.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def load(name="qwen3"):
    return AutoModelForCausalLM.from_pretrained(tiny.checkpoint(name), dtype=torch.float32)


def data(n=24, seed=0):
    return token_dataset(n, seed=seed, min_len=4, max_len=24, vocab=211)


def test_first_step_loss_matches_transformers(tmp_path):
    ds = data(4)
    Trainer(load(), args(tmp_path, max_steps=1), train_dataset=ds).train()
    ref = tiny.hf_model(tiny.checkpoint("qwen3"))
    # The Trainer's first batch: the sampler's order for seed 0; the loss is a token mean, order-free.
    lens = [len(d["input_ids"]) for d in ds]
    ids = torch.zeros(len(ds), max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(ds):
        ids[i, : lens[i]], mask[i, : lens[i]] = torch.tensor(d["input_ids"]), 1
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.item()
    assert logged(tmp_path)[1] == pytest.approx(want, rel=1e-4)


def test_loss_falls_and_accumulation_equals_large_batch(tmp_path):
    big, small = load(), load()
    Trainer(big, args(tmp_path / "a", per_device_train_batch_size=8, max_steps=6), train_dataset=data()).train()
    Trainer(small, args(tmp_path / "b", per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=6),
            train_dataset=data()).train()
    la, lb = logged(tmp_path / "a"), logged(tmp_path / "b")
    assert la == pytest.approx(lb, rel=1e-5)
    assert la[6] < la[1] - 0.5
    for (name, p), q in zip(big.named_parameters(), small.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_packed_step_equals_padded_step(tmp_path):
    ds = data(12, seed=3)
    padded, packed = load("llama"), load("llama")
    Trainer(padded, args(tmp_path / "pad", per_device_train_batch_size=12, max_steps=1), train_dataset=ds).train()
    # Every row of the packed dataset in one batch: the same documents, attention kept inside each.
    Trainer(packed, args(tmp_path / "pack", packing=True, max_seq_length=64, per_device_train_batch_size=12,
                         max_steps=1), train_dataset=ds).train()
    assert logged(tmp_path / "pack")[1] == pytest.approx(logged(tmp_path / "pad")[1], rel=1e-5)
    for (name, p), q in zip(padded.named_parameters(), packed.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_gradient_checkpointing_and_save_model_roundtrip(tmp_path):
    model = load()
    t = Trainer(model, args(tmp_path, max_steps=2, gradient_checkpointing=True), train_dataset=data())
    t.train()
    assert model.is_gradient_checkpointing
    t.save_model(str(tmp_path / "final"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
