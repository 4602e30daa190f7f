"""Our dense decoder against transformers on tiny random checkpoints: logits, loss, gradients."""

import pytest
import torch

import tiny
from cudaformers import AutoConfig, AutoModelForCausalLM

VARIANTS = list(tiny.VARIANTS)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_logits_match_transformers(name, attn):
    folder = tiny.checkpoint(name)
    ours = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn)
    ref = tiny.hf_model(folder)
    ids = torch.randint(3, 211, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours(ids).logits, ref(ids).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_right_padded_rows_match_transformers():
    folder = tiny.checkpoint("qwen3")
    ours = AutoModelForCausalLM.from_pretrained(folder)
    ref = tiny.hf_model(folder)
    ids = torch.randint(3, 211, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    mask[2, 4:] = 0
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)
    assert torch.all(got[~valid] == 0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3_tied"])
def test_loss_and_gradients_match_transformers(name):
    folder = tiny.checkpoint(name)
    ours = AutoModelForCausalLM.from_pretrained(folder).train()
    ref = tiny.hf_model(folder).train()
    ids = torch.randint(3, 211, (2, 24), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :5] = -100
    loss = ours(ids, labels=labels).loss
    ref_loss = ref(ids, labels=labels).loss
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    loss.backward()
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n].grad, atol=1e-5, rtol=1e-4, msg=n)


def test_packed_sequences_equal_separate_forwards():
    from cudaformers.attention.metadata import AttentionBatch

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"))
    a = torch.randint(3, 211, (9,))
    b = torch.randint(3, 211, (14,))
    batch = AttentionBatch.from_seqlens([9, 14], "cpu")
    positions = torch.cat([torch.arange(9), torch.arange(14)])
    with torch.no_grad():
        packed = model(torch.cat([a, b]), positions=positions, batch=batch).logits
        sep = torch.cat([model(a[None]).logits[0], model(b[None]).logits[0]])
    torch.testing.assert_close(packed, sep, atol=1e-5, rtol=1e-5)


def test_packed_loss_never_crosses_documents():
    from cudaformers.attention.metadata import AttentionBatch

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"))
    a, b = torch.randint(3, 211, (8,)), torch.randint(3, 211, (12,))
    batch = AttentionBatch.from_seqlens([8, 12], "cpu")
    positions = torch.cat([torch.arange(8), torch.arange(12)])
    ids = torch.cat([a, b])
    with torch.no_grad():
        packed = model(ids, positions=positions, batch=batch, labels=ids).loss
        la = model(a[None], labels=a[None]).loss
        lb = model(b[None], labels=b[None]).loss
    torch.testing.assert_close(packed, (la * 7 + lb * 11) / 18, atol=1e-5, rtol=1e-5)


def test_config_attributes_and_explain():
    folder = tiny.checkpoint("qwen3")
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == "qwen3" and config.head_dim == 32 and config.num_key_value_heads == 2
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    assert model.config.hidden_size == 64
    text = model.explain()
    assert "attention: sdpa" in text and "bfloat16" in text


def test_gradient_checkpointing_gives_same_gradients():
    folder = tiny.checkpoint("llama")
    ids = torch.randint(3, 211, (2, 16), generator=torch.Generator().manual_seed(3))
    grads = []
    for ckpt in (False, True):
        model = AutoModelForCausalLM.from_pretrained(folder).train()
        if ckpt:
            model.gradient_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append(model.model.layers[0].mlp.up_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_each_forward_starts_with_a_fresh_batch_memo():
    # Backends memoize per-step tensors (slots, masks) on the batch; a batch refilled in place
    # between forwards (warm-up then CUDA-graph capture) must not see the previous step's values.
    from cudaformers.attention.metadata import AttentionBatch

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"))
    batch = AttentionBatch.from_seqlens([5], "cpu")
    batch.memo("stale", lambda: "old")
    with torch.no_grad():
        model(torch.randint(3, 211, (5,)), positions=torch.arange(5), batch=batch)
    assert batch.memo("stale", lambda: "new") == "new"
