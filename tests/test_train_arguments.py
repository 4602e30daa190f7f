"""TrainingArguments checks, and the lr schedules against transformers'."""

import pytest
import torch

from cudaformers.errors import UnsupportedError
from cudaformers.train.arguments import TrainingArguments
from cudaformers.train.schedule import build_scheduler, resolve_warmup


@pytest.mark.parametrize("kw, match", [
    (dict(learnin_rate=1e-3), "did you mean 'learning_rate'"),
    (dict(bf16=True, fp16=True), "pick one"),
    (dict(fp16=True), "needs a CUDA GPU"),
    (dict(warmup_steps=10, warmup_ratio=0.1), "keep one"),
    (dict(fsdp="full_shard", deepspeed={}), "pick one"),
    (dict(fsdp="full_shard shard_grad_op"), "contradict"),
    (dict(fsdp="zero9"), "fsdp='zero9' is not supported"),
    (dict(lr_scheduler_type="polynomial"), "choose one of"),
    (dict(optim="sgd"), "choose one of"),
    (dict(per_device_train_batch_size=0), "positive integer"),
    (dict(max_steps=-1, num_train_epochs=0), "nothing to train"),
    (dict(report_to="wandb"), "report_to='wandb'"),
    (dict(deepspeed="/no/such/ds.json"), "is not a file"),
    (dict(warmup_steps=2.5), "warmup_steps"),
])
def test_bad_arguments_raise_clear_errors(tmp_path, kw, match):
    with pytest.raises(UnsupportedError, match=match):
        TrainingArguments(output_dir=str(tmp_path), **kw)


def test_defaults_device_and_strategy(tmp_path, monkeypatch):
    a = TrainingArguments(str(tmp_path))
    assert a.output_dir == str(tmp_path) and a.optim == "adamw_torch_fused" and a.learning_rate == 5e-5
    assert a.device == torch.device("cpu") and a.strategy == "single"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert TrainingArguments(str(tmp_path)).strategy == "ddp"
    assert TrainingArguments(str(tmp_path), fsdp="full_shard auto_wrap").strategy == "fsdp"
    assert TrainingArguments(str(tmp_path), tp_size=2).strategy == "tp"
    assert TrainingArguments(str(tmp_path), deepspeed={"zero_optimization": {"stage": 2}}).strategy == "deepspeed"


def test_deepspeed_without_the_package_is_a_clear_error(tmp_path):
    try:
        import deepspeed  # noqa: F401
        pytest.skip("deepspeed is installed here")
    except ImportError:
        pass
    from cudaformers.distributed.deepspeed import require_deepspeed

    with pytest.raises(UnsupportedError, match="pip install deepspeed"):
        require_deepspeed()


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_schedules_match_transformers(kind):
    from transformers import get_scheduler

    total, warmup = 20, 4
    ours = build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), kind, warmup, total)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    ref = get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=total)
    for _ in range(total):
        assert ours.get_last_lr()[0] == pytest.approx(ref.get_last_lr()[0], abs=1e-12)
        ours.optimizer.step(), ours.step(), opt.step(), ref.step()


def test_warmup_as_share_of_the_run():
    assert resolve_warmup(0.1, None, 95) == 10
    assert resolve_warmup(0, 0.25, 8) == 2
    assert resolve_warmup(7, None, 100) == 7
