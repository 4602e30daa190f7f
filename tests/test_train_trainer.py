"""The Trainer on one CPU process: learning, accumulation, resume, packing, evaluation, stops."""

import json
import os
import signal

import pytest
import torch

from cudaformers.train.arguments import TrainingArguments
from cudaformers.train.checkpoint import list_checkpoints, load_safetensors
from cudaformers.train.trainer import NonFiniteLossError, Trainer
from test_train_toy import ToyConfig, ToyLM, token_dataset


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=3e-3, max_steps=6,
                logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, lr_scheduler_type="constant")
    return TrainingArguments(**{**base, **kw})


def logged(tmp_path, key="loss"):
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "log.jsonl"))]
    return {r["step"]: r[key] for r in rows if key in r}


def test_loss_falls(tmp_path):
    a = args(tmp_path, max_steps=40, logging_steps=10, learning_rate=1e-2)
    out = Trainer(ToyLM(), a, train_dataset=token_dataset(64)).train()
    losses = logged(tmp_path)
    assert losses[40] < 0.6 * losses[10], losses
    assert out.global_step == 40 and out.training_loss == pytest.approx(sum(losses.values()) / 4, rel=0.2)


def test_gradient_accumulation_equals_large_batch(tmp_path):
    data = token_dataset(48, seed=1, min_len=3, max_len=20)  # ragged: per-token weighting matters
    big, small = ToyLM(), ToyLM()
    Trainer(big, args(tmp_path / "a", per_device_train_batch_size=8, max_steps=4), train_dataset=data).train()
    Trainer(small, args(tmp_path / "b", per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=4),
            train_dataset=data).train()
    for (name, p), q in zip(big.named_parameters(), small.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    la, lb = logged(tmp_path / "a"), logged(tmp_path / "b")
    assert la == pytest.approx(lb, rel=1e-5)


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    data = token_dataset(40, seed=2)
    cfg = ToyConfig(dropout=0.2)  # the dropout masks after resume come from the restored RNG state
    kw = dict(max_steps=9, save_strategy="steps", save_steps=3, lr_scheduler_type="cosine", warmup_steps=2,
              weight_decay=0.1)
    full = ToyLM(cfg)
    Trainer(full, args(tmp_path / "full", **kw), train_dataset=data).train()
    resumed = ToyLM(cfg, seed=123)  # different initial weights: everything must come from the checkpoint
    Trainer(resumed, args(tmp_path / "resumed", **kw), train_dataset=data).train(
        resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-6"))
    want, got = logged(tmp_path / "full"), logged(tmp_path / "resumed")
    assert sorted(got) == [7, 8, 9]
    assert [got[s] for s in (7, 8, 9)] == [want[s] for s in (7, 8, 9)]  # exact, not approximate
    for p, q in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_resume_true_picks_latest_and_epochs_roll_over(tmp_path):
    data = token_dataset(10, seed=3)  # 3 micro-batches an epoch: steps cross epoch boundaries
    kw = dict(max_steps=7, save_strategy="steps", save_steps=2, save_total_limit=2)
    a = ToyLM()
    Trainer(a, args(tmp_path / "a", **kw), train_dataset=data).train()
    assert [p.name for p in list_checkpoints(tmp_path / "a")] == ["checkpoint-6", "checkpoint-7"]
    assert not [p for p in os.listdir(tmp_path / "a") if p.endswith(".tmp")]
    b = ToyLM()
    Trainer(b, args(tmp_path / "b", **{**kw, "max_steps": 4}), train_dataset=data).train()
    out = Trainer(b, args(tmp_path / "b", **kw), train_dataset=data).train(resume_from_checkpoint=True)
    assert out.global_step == 7
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_packing_trains_without_cross_document_attention(tmp_path):
    data = token_dataset(60, seed=4, min_len=3, max_len=30)
    a = args(tmp_path, packing=True, max_seq_length=64, per_device_train_batch_size=2, max_steps=30, logging_steps=10,
             learning_rate=1e-2)
    Trainer(ToyLM(), a, train_dataset=data).train()
    losses = logged(tmp_path)
    assert losses[30] < 0.7 * losses[10], losses


def test_packing_needs_the_flat_call(tmp_path):
    class Plain(torch.nn.Module):
        def forward(self, input_ids, labels=None):
            return {}

    with pytest.raises(ValueError, match="packing=True needs a model"):
        Trainer(Plain(), args(tmp_path, packing=True), train_dataset=token_dataset(4))


class CharTokenizer:
    pad_token_id = 0

    def encode(self, text):
        return [1 + ord(c) % 63 for c in text]


def test_text_dataset_evaluate_and_save_model(tmp_path):
    texts = ["abcdefghij" * 2, "klmnopqrst" * 3, {"text": "uvwxyzabcd"}] * 8
    a = args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2)
    t = Trainer(ToyLM(), a, train_dataset=texts, eval_dataset=texts[:6], processing_class=CharTokenizer())
    t.train()
    assert set(logged(tmp_path, "eval_loss")) == {2, 4}
    ev = t.evaluate()
    assert ev["eval_tokens"] == 2 * (19 + 29 + 9) and ev["eval_loss"] > 0
    t.save_model(str(tmp_path / "final"))
    saved = load_safetensors(tmp_path / "final")
    for name, p in t.model.state_dict().items():
        assert torch.equal(saved[name], p), name


def test_text_without_tokenizer_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer"):
        Trainer(ToyLM(), args(tmp_path), train_dataset=["some text"] * 8).train()


def test_nan_loss_stops_with_a_clear_message(tmp_path):
    class Exploding(ToyLM):
        def forward(self, *a, **kw):
            out = super().forward(*a, **kw)
            self.calls = getattr(self, "calls", 0) + 1
            return {"loss": out["loss"] * (float("nan") if self.calls == 3 else 1.0)}

    with pytest.raises(NonFiniteLossError, match="nan/inf at step 3"):
        Trainer(Exploding(), args(tmp_path), train_dataset=token_dataset(32)).train()


def test_sigterm_saves_a_checkpoint_then_exits(tmp_path):
    class Terminated(ToyLM):
        def forward(self, *a, **kw):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 2 and self.training:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().forward(*a, **kw)

    with pytest.raises(SystemExit) as e:
        Trainer(Terminated(), args(tmp_path, max_steps=50), train_dataset=token_dataset(32)).train()
    assert e.value.code == 128 + signal.SIGTERM
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_bf16_autocast_keeps_fp32_master_weights(tmp_path):
    model = ToyLM()
    Trainer(model, args(tmp_path / "bf16", bf16=True, max_steps=3), train_dataset=token_dataset(16)).train()
    Trainer(ToyLM(), args(tmp_path / "fp32", max_steps=3), train_dataset=token_dataset(16)).train()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    bf16, fp32 = logged(tmp_path / "bf16"), logged(tmp_path / "fp32")
    assert bf16[1] != fp32[1] and bf16 == pytest.approx(fp32, rel=3e-2)  # computed in bf16, close to fp32


def test_pure_bf16_model_trains_in_bf16(tmp_path, caplog):
    model = ToyLM().to(torch.bfloat16)
    with caplog.at_level("INFO", logger="cudaformers"):
        Trainer(model, args(tmp_path, max_steps=3), train_dataset=token_dataset(16)).train()
    assert "pure bf16" in caplog.text
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_gradient_checkpointing_gives_the_same_step(tmp_path):
    a, b = ToyLM(), ToyLM()
    Trainer(a, args(tmp_path / "a", max_steps=2), train_dataset=token_dataset(16)).train()
    Trainer(b, args(tmp_path / "b", max_steps=2, gradient_checkpointing=True), train_dataset=token_dataset(16)).train()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)
    assert logged(tmp_path / "a") == pytest.approx(logged(tmp_path / "b"))
