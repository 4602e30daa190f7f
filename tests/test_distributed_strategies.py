"""DDP, FSDP2 and tensor parallelism on 2 CPU processes (gloo) against the single-process run."""

import json
import os

import pytest
import torch

from cudaformers.train.arguments import TrainingArguments
from cudaformers.train.checkpoint import load_safetensors
from cudaformers.train.trainer import Trainer
from test_train_toy import ToyLM, run_processes, token_dataset

STEPS, GLOBAL_BATCH = 10, 4


def train_curve(outdir, per_device, resume=None, save_model=None, **kw):
    """Train the toy model; rank 0 returns {step: loss} and how many parameters are sharded DTensors."""
    from torch.distributed.tensor import DTensor

    base = dict(output_dir=outdir, per_device_train_batch_size=per_device, max_steps=STEPS, learning_rate=1e-2,
                logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, lr_scheduler_type="linear",
                warmup_steps=2, weight_decay=0.01)
    a = TrainingArguments(**{**base, **kw})
    model = ToyLM()
    trainer = Trainer(model, a, train_dataset=token_dataset(40, seed=5, min_len=3, max_len=20))
    sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    trainer.train(resume_from_checkpoint=resume)
    if save_model:
        trainer.save_model(save_model)
    if int(os.environ.get("RANK", "0")):
        return None
    rows = [json.loads(line) for line in open(os.path.join(outdir, "log.jsonl"))]
    return {str(r["step"]): r["loss"] for r in rows if "loss" in r}, sharded


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("single")
    curve, _ = train_curve(str(d / "run"), GLOBAL_BATCH, save_model=str(d / "model"))
    return curve, load_safetensors(d / "model")


def _close(got, want, rtol):
    assert sorted(got, key=int) == sorted(want, key=int)
    assert [got[k] for k in want] == pytest.approx([want[k] for k in want], rel=rtol)


def test_ddp_matches_single_process(tmp_path, single):
    curve, sharded = run_processes(train_curve, 2, tmp_path, outdir=str(tmp_path / "run"),
                                   per_device=GLOBAL_BATCH // 2)[0]
    _close(curve, single[0], 1e-4)
    assert sharded == 0


def test_fsdp2_matches_single_process_and_saves_a_plain_model(tmp_path, single):
    curve, sharded = run_processes(train_curve, 2, tmp_path, outdir=str(tmp_path / "run"),
                                   per_device=GLOBAL_BATCH // 2, fsdp="full_shard", save_model=str(tmp_path / "model"))[0]
    _close(curve, single[0], 1e-4)
    assert sharded == len(list(ToyLM().parameters()))  # every parameter sharded
    saved = load_safetensors(tmp_path / "model")
    assert saved.keys() == single[1].keys()
    for k, v in single[1].items():
        torch.testing.assert_close(saved[k], v, rtol=1e-3, atol=1e-4, msg=k)


def test_fsdp2_sharded_checkpoint_resumes(tmp_path):
    out = str(tmp_path / "run")
    full, _ = run_processes(train_curve, 2, tmp_path, outdir=out, per_device=2, fsdp="full_shard",
                            save_strategy="steps", save_steps=4)[0]
    assert os.path.isdir(os.path.join(out, "checkpoint-4", "distcp"))
    resumed_dir = str(tmp_path / "resumed")
    resumed, _ = run_processes(train_curve, 2, tmp_path, outdir=resumed_dir, per_device=2, fsdp="full_shard",
                               resume=os.path.join(out, "checkpoint-4"))[0]
    assert sorted(resumed, key=int) == [str(s) for s in range(5, STEPS + 1)]
    assert [resumed[k] for k in resumed] == pytest.approx([full[k] for k in resumed], rel=1e-6)


def test_tensor_parallel_matches_single_process(tmp_path, single):
    curve, sharded = run_processes(train_curve, 2, tmp_path, outdir=str(tmp_path / "run"), per_device=GLOBAL_BATCH,
                                   tp_size=2, save_model=str(tmp_path / "model"))[0]
    _close(curve, single[0], 1e-4)
    assert sharded == 7 * 2  # q/k/v/o/gate/up/down in each of the 2 blocks
    saved = load_safetensors(tmp_path / "model")
    for k, v in single[1].items():
        torch.testing.assert_close(saved[k], v, rtol=1e-3, atol=1e-4, msg=k)


def qwen3_curve(outdir, **kw):
    """A tiny Qwen3 (q/k norms inside the sharded attention) trained 4 steps; rank 0 returns the losses."""
    import tiny
    from cudaformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), dtype=torch.float32)
    a = TrainingArguments(output_dir=outdir, per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
                          logging_steps=1, save_strategy="no", disable_tqdm=True, optim="adamw_torch", **kw)
    Trainer(model, a, train_dataset=token_dataset(16, seed=6, min_len=4, max_len=20, vocab=211)).train()
    if int(os.environ.get("RANK", "0")):
        return None
    rows = [json.loads(line) for line in open(os.path.join(outdir, "log.jsonl"))]
    return {str(r["step"]): r["loss"] for r in rows if "loss" in r}


def test_tensor_parallel_qwen3_matches_single_process(tmp_path):
    want = qwen3_curve(str(tmp_path / "single"))
    got = run_processes(qwen3_curve, 2, tmp_path, outdir=str(tmp_path / "tp"), tp_size=2)[0]
    _close(got, want, 1e-4)


def qwen3_logits(ids):
    import tiny
    from cudaformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), dtype=torch.float32, tp_plan="auto")
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids)).logits
    return {"logits": out.tolist(), "tp_size": getattr(model, "tp_size", None),
            "heads": model.model.layers[0].self_attn.num_heads}


def qwen3_generate(ids):
    import tiny
    from cudaformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), dtype=torch.float32, tp_plan="auto")
    out = model.generate(torch.tensor(ids), max_new_tokens=8, do_sample=False, eos_token_id=None)
    return {"tokens": out.tolist()}


def test_tp_plan_auto_generate_matches_single_process(tmp_path):
    """generate() sizes its KV cache for the key/value heads each process holds after the split."""
    ids = [[5, 9, 33, 100, 7, 2]]
    want = qwen3_generate(ids)["tokens"]
    for r in run_processes(qwen3_generate, 2, tmp_path, ids=ids):
        assert r["tokens"] == want


def test_tp_plan_auto_inference_matches_single_process(tmp_path):
    ids = [[5, 9, 33, 100, 7, 2], [1, 2, 3, 4, 5, 6]]
    want = torch.tensor(qwen3_logits(ids)["logits"])
    got = run_processes(qwen3_logits, 2, tmp_path, ids=ids)
    for r in got:
        assert r["tp_size"] == 2 and r["heads"] == 2
        torch.testing.assert_close(torch.tensor(r["logits"]), want, rtol=1e-4, atol=1e-4)


def test_model_output_shows_its_loss_to_fsdp():
    """FSDP2 before torch 2.13 finds the tensors a module returns with tree_flatten, and hooks those
    that need gradients to gather the module's parameters again before its backward. An output type
    that flattens to itself hides the loss: the resharded root's final norm and lm_head weights were
    read freed in backward (an illegal address on an H200)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    import tiny
    from cudaformers import AutoModelForCausalLM
    from cudaformers.models.outputs import CausalLMOutput

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"))
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    leaves, spec = tree_flatten(out)
    assert any(leaf is out.loss for leaf in leaves) and out.loss.requires_grad
    back = tree_unflatten(leaves, spec)
    assert isinstance(back, CausalLMOutput) and back.loss is out.loss and back.logits is out.logits


def test_sharded_outputs_reach_kernels_as_plain_settled_tensors():
    """Row-wise outputs come back from torch's parallel styles as AsyncCollectiveTensors, whose memory
    a Triton kernel would read before the all-reduce wrote it: the hook hands on a plain tensor."""
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from cudaformers.distributed.tp import _settled_output

    y = torch.randn(3, 5)
    out = _settled_output(None, (), AsyncCollectiveTensor(y))
    assert type(out) is torch.Tensor and torch.equal(out, y)
    assert _settled_output(None, (), y) is y  # plain outputs pass untouched
