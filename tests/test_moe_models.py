"""Qwen3-MoE and Mixtral against transformers on tiny random checkpoints written by transformers."""

import functools
import os
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # interpret the kernels on CPU; set before triton.jit reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from cudaformers import AutoModelForCausalLM, KernelConfig  # noqa: E402

MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=211,
           max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_experts_per_tok=2)
VARIANTS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=6, moe_intermediate_size=40, intermediate_size=96,
                                         head_dim=32, norm_topk_prob=True, tie_word_embeddings=False)),
    "qwen3_moe_mixed": ("Qwen3MoeConfig", dict(num_experts=5, moe_intermediate_size=24, intermediate_size=72,
                                               norm_topk_prob=False, mlp_only_layers=[0], num_experts_per_tok=3)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, intermediate_size=80)),
}


@functools.lru_cache(maxsize=None)
def checkpoint(name: str) -> Path:
    import transformers

    cls, extra = VARIANTS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**MOE, **extra}))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif "gate" in n and "proj" not in n:  # sharper routing: top-k choices far from ties
                p.mul_(20)
    folder = Path(tempfile.mkdtemp(prefix=f"cf-{name}-"))
    model.save_pretrained(folder)
    return folder


def hf_model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name):
    folder = checkpoint(name)
    ours, ref = AutoModelForCausalLM.from_pretrained(folder), hf_model(folder)
    ids = torch.randint(3, 211, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_greedy_generation_matches_transformers(name):
    folder = checkpoint(name)
    ours, ref = AutoModelForCausalLM.from_pretrained(folder), hf_model(folder)
    ids = torch.randint(3, 211, (1, 7), generator=torch.Generator().manual_seed(1))
    got = ours.generate(ids, max_new_tokens=32, do_sample=False)
    want = ref.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours_again = ours.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
    assert ours_again[0].tolist() == want[0].tolist()
    assert got[0].tolist() == want[0, :got.shape[1]].tolist()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_loss_and_gradients_match_transformers(name):
    folder = checkpoint(name)
    ours, ref = AutoModelForCausalLM.from_pretrained(folder).train(), hf_model(folder).train()
    ids = torch.randint(3, 211, (2, 16), generator=torch.Generator().manual_seed(2))
    loss, ref_loss = ours(ids, labels=ids).loss, ref(ids, labels=ids).loss
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    loss.backward(), ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        ref_name = n.replace("block_sparse_moe", "mlp")  # transformers 5 renames Mixtral's block in memory
        torch.testing.assert_close(p.grad, ref_params[ref_name].grad, atol=1e-5, rtol=1e-4, msg=n)


def test_save_writes_the_per_expert_layout_transformers_reads(tmp_path):
    ours = AutoModelForCausalLM.from_pretrained(checkpoint("mixtral"))
    ours.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)
    ids = torch.randint(3, 211, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tmp_path)(ids).logits, ours(ids).logits, atol=1e-4, rtol=1e-4)


def test_grouped_gemm_kernels_inside_the_model():
    folder = checkpoint("qwen3_moe")
    mapping = {"MoeExperts": "cudaformers:grouped_gemm", "MoeRouter": "cudaformers:topk_softmax"}
    ours = AutoModelForCausalLM.from_pretrained(folder, kernel_config=KernelConfig(mapping, inherit_mapping=False))
    ref = hf_model(folder)
    ids = torch.randint(3, 211, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)


def test_plain_experts_block_graph_capture_until_a_kernel_replaces_them():
    """The plain expert loop reads the device from the host, so generate() and the engine must not
    capture it in a CUDA graph; the grouped-GEMM kernel lifts that."""
    folder = checkpoint("qwen3_moe")
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    assert plain.graph_blockers() == ["MoeExperts without use_kernels=True"]
    eager = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    assert "attention backend 'eager'" in eager.graph_blockers()
    mapping = {"MoeExperts": "cudaformers:grouped_gemm"}
    fused = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa",
                                                 kernel_config=KernelConfig(mapping, inherit_mapping=False))
    assert fused.graph_blockers() == []
