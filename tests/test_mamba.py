"""Mamba against transformers on tiny random checkpoints: logits, loss, greedy generation, kernels."""

import functools
import os
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers import AutoModelForCausalLM, KernelConfig  # noqa: E402

CONFIGS = {
    "mamba": dict(hidden_size=32, num_hidden_layers=2, vocab_size=211, state_size=8, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0),
    "mamba_untied_k3": dict(hidden_size=48, num_hidden_layers=2, vocab_size=211, state_size=5, conv_kernel=3,
                            tie_word_embeddings=False, residual_in_fp32=False, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0),
}


@functools.lru_cache(maxsize=None)
def checkpoint(name: str) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.MambaConfig(**CONFIGS[name]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif n.endswith("D") or "conv1d.bias" in n:
                p.normal_(0, 0.5)
    folder = Path(tempfile.mkdtemp(prefix=f"cf-{name}-"))
    model.save_pretrained(folder)
    return folder


def hf_model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    folder = checkpoint(name)
    ours, ref = AutoModelForCausalLM.from_pretrained(folder), hf_model(folder)
    ids = torch.randint(3, 211, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)


def test_left_padded_rows_equal_rows_alone():
    ours = AutoModelForCausalLM.from_pretrained(checkpoint("mamba"))
    ids = torch.randint(3, 211, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        both = ours(ids, attention_mask=mask).logits
        alone = ours(ids[1:, 4:]).logits
    torch.testing.assert_close(both[1, 4:], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.all(both[1, :4] == 0)


def test_loss_and_gradients_match_transformers():
    folder = checkpoint("mamba_untied_k3")
    ours, ref = AutoModelForCausalLM.from_pretrained(folder).train(), hf_model(folder).train()
    ids = torch.randint(3, 211, (2, 12), generator=torch.Generator().manual_seed(2))
    loss, ref_loss = ours(ids, labels=ids).loss, ref(ids, labels=ids).loss
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    loss.backward(), ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[n].grad, atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("use_kernels", [False, True])
def test_greedy_generation_matches_transformers(use_kernels):
    folder = checkpoint("mamba")
    mapping = {"selective_scan_fn": "cudaformers:selective_scan", "causal_conv1d_fn": "cudaformers:causal_conv1d"}
    ours = AutoModelForCausalLM.from_pretrained(
        folder, kernel_config=KernelConfig(mapping, inherit_mapping=False) if use_kernels else None)
    ref = hf_model(folder)
    ids = torch.randint(3, 211, (2, 6), generator=torch.Generator().manual_seed(3))
    got = ours.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
    want = ref.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got.tolist() == want.tolist()


MAMBA_KERNELS = {"selective_scan_fn": "cudaformers:selective_scan", "causal_conv1d_fn": "cudaformers:causal_conv1d"}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_gradients_with_kernels_equal_reference_path(name):
    """Training mode with the scan and conv kernels (their Triton backward) against the PyTorch layers."""
    folder = checkpoint(name)
    plain = AutoModelForCausalLM.from_pretrained(folder).train()
    fast = AutoModelForCausalLM.from_pretrained(folder, kernel_config=KernelConfig(MAMBA_KERNELS)).train()
    assert "selective_scan_fn -> cudaformers:selective_scan" in fast._choices["kernels"]
    assert "causal_conv1d_fn -> cudaformers:causal_conv1d" in fast._choices["kernels"]
    ids = torch.randint(3, 211, (2, 11), generator=torch.Generator().manual_seed(4))
    losses = []
    for model in (plain, fast):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    ref_params = dict(plain.named_parameters())
    for n, p in fast.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[n].grad, atol=1e-5, rtol=1e-4, msg=n)
