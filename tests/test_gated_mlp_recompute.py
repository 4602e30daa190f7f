"""The training gated MLP that recomputes act(gate) * up in the backward: the same outputs and
gradients as plain autograd (fp32, bias or not, under bf16 autocast over fp32 weights), fewer saved
tensors, and the hub's training default on CUDA with the decode kernel kept for inference."""

import torch
from torch import nn

import tiny
from cudaformers import AutoModelForCausalLM
from cudaformers.kernels.gated_mlp import recomputed_gated_mlp
from cudaformers.kernels.hub import KernelConfig, resolve
from cudaformers.layers.mlp import GatedMLP

import pytest


def _mlp(hidden, inter, act, bias, seed=0):
    torch.manual_seed(seed)
    mlp = GatedMLP(hidden, inter, act, bias)
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.2)
    return mlp


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("shape", [(2, 7, 24), (16, 32)])  # odd and power-of-two, batched and flat
def test_outputs_and_gradients_equal_plain_autograd(shape, act, bias):
    mlp = _mlp(shape[-1], 40 if bias else 37, act, bias)
    x = torch.randn(*shape, requires_grad=True)
    dy = torch.randn(*shape[:-1], shape[-1])
    want = mlp(x)
    want_grads = torch.autograd.grad(want, [x, *mlp.parameters()], dy)
    got = recomputed_gated_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
    got_grads = torch.autograd.grad(got, [x, *mlp.parameters()], dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (name, _), g, w in zip([("x", None), *mlp.named_parameters()], got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)


def test_under_autocast_fp32_weights_get_fp32_gradients_like_plain_autograd():
    mlp = _mlp(32, 48, "silu", False)
    x = torch.randn(20, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = mlp(x)
        got = recomputed_gated_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    dy = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x, *mlp.parameters()], dy)
    got_grads = torch.autograd.grad(got, [x, *mlp.parameters()], dy)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)


def test_saves_no_activation_output():
    mlp = _mlp(16, 64, "silu", False)
    x = torch.randn(50, 16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        recomputed_gated_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
    n_plain = len(saved)
    activations = [s for s in saved if s == (50, 64)]
    assert len(activations) == 2, saved  # gate and up; h = act(gate) * up is not kept
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    assert len([s for s in saved if s == (50, 64)]) >= 3 and n_plain < len(saved)


def test_hub_maps_it_for_training_and_keeps_the_decode_kernel_for_inference():
    assert resolve("GatedMLP", "cuda", "training", None)[0] == "cudaformers:gated_mlp_recompute"
    assert resolve("GatedMLP", "cuda", "inference", None)[0] == "cudaformers:fused_mlp_decode"
    folder = tiny.checkpoint("qwen3")
    plain = AutoModelForCausalLM.from_pretrained(folder).train()
    fast = AutoModelForCausalLM.from_pretrained(
        folder, kernel_config=KernelConfig({"GatedMLP": {"cpu": {"training": "cudaformers:gated_mlp_recompute",
                                                                 "inference": ""}}})).train()
    assert "GatedMLP -> cudaformers:gated_mlp_recompute" in fast.explain()
    ids = torch.randint(3, 211, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, ref = fast(ids, labels=ids).loss, plain(ids, labels=ids).loss
    torch.testing.assert_close(loss, ref)
    loss.backward(), ref.backward()
    ref_grads = dict(plain.named_parameters())
    for name, p in fast.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    fast.eval()
    assert "GatedMLP -> plain (mapped to" in fast.explain()
