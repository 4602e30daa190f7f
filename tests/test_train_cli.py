"""`cudaformers train` end to end on a tiny checkpoint."""

import json

import torch

import tiny
from cudaformers import AutoModelForCausalLM
from cudaformers.cli import main
from test_train_toy import token_dataset


def test_train_command_writes_a_loadable_model(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in token_dataset(16, vocab=211)) + "\n")
    out = tmp_path / "out"
    rc = main(["train", str(tiny.checkpoint("llama")), "--data", str(data), "--output-dir", str(out),
               "--max-steps", "3", "--batch", "4", "--lr", "1e-3", "--dtype", "fp32", "--packing", "--seq", "64",
               "--logging-steps", "1"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["global_step"] == 3 and summary["train_loss"] > 0
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), dtype=torch.float32)
    assert not torch.equal(trained.lm_head.weight, base.lm_head.weight)
    assert len((out / "log.jsonl").read_text().splitlines()) == 3


def test_train_command_rejects_unknown_data(tmp_path, capsys):
    (tmp_path / "d.csv").write_text("a,b\n")
    assert main(["train", str(tiny.checkpoint("llama")), "--data", str(tmp_path / "d.csv")]) != 0
